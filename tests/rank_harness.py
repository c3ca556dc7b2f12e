"""Runs many prefills on one set of ranks (started by tests/helpers.py) and writes the last rank's results.

Usage: python -m tests.rank_harness P CASES.json OUT.json  (P ranks, started as kvr-prefill starts them)
       python -m tests.rank_harness CASES.json OUT.json  (one rank, with RANK/WORLD_SIZE/MASTER_* in the env)
"""

import json
import os
import sys

from kvrunahead.config import RunConfig
from kvrunahead.oneshot.on_engine import batch_on_world, run_on_world
from kvrunahead.ranks.launcher import init_world


def main() -> None:
    cases = json.load(open(sys.argv[1]))
    world = init_world("torchrun", "gloo", timeout_s=60)
    results = {}
    for case in cases:
        if "prompts" in case:  # a batch of prompts (kvrunahead/modes/packing.py)
            batch = batch_on_world(RunConfig(**case["config"]), world, case["prompts"], **case["batch"])
            if batch is not None:
                results[case["name"]] = batch.to_dict()
            continue
        try:
            result = run_on_world(RunConfig(**case["config"]), world)
        except Exception as e:  # noqa: BLE001 - one rank alone: the case fails, the next ones still run
            if world.world_size > 1:  # the other ranks would wait for this one: the whole run fails
                raise
            results[case["name"]] = {"error": f"{type(e).__name__}: {e}"}
            continue
        if result is not None:
            d = result.to_dict()
            results[case["name"]] = {
                "first_token": d["first_token"],
                "generated_tokens": d["generated_tokens"],
                "boundaries": d["boundaries"],
                "bytes_sent": [r["bytes_sent"] for r in d["ranks"]],
                "bytes_sent_by_kind": [r["bytes_sent_by_kind"] for r in d["ranks"]],
                "full_chain_bytes": d["full_chain_bytes"],
                "tokens": [r["tokens"] for r in d["ranks"]],
                "verification": d["verification"],
                "rope_extension": d["rope_extension"],
                "kvr_attention": d["kvr_attention"],
                "attention_kernel": d["attention_kernel"],
                "partition_source": d["partition_source"],
                "stages": d["stages"],
                "chunk_tokens": d["chunk_tokens"],
                "peak_mem_bytes": [r["peak_mem_bytes"] for r in d["ranks"]],
                "compiled": d["compiled"],
                "dtype": d["dtype"],
            }
    # Whichever rank emitted the first token of a case holds its result (the last rank, or rank 0 for
    # the zigzag modes): each rank writes its own file.
    json.dump(results, open(f"{sys.argv[2]}.{world.rank}", "w"))
    os._exit(0)


if __name__ == "__main__":
    if len(sys.argv) == 4:
        from kvrunahead.ranks.launcher import spawn

        sys.exit(spawn(int(sys.argv[1]), sys.argv[2:], module="tests.rank_harness", fork=True))
    main()
