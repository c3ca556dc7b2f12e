"""The library's front door: one prefill over local ranks started here, its result returned to the caller.

Under torchrun or mpirun, where the ranks already exist, call ``kvrunahead.run_on_world`` on each rank instead.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

import torch

from kvrunahead.cli import common
from kvrunahead.config import RunConfig
from kvrunahead.decide.policy import network_spec, prepare
from kvrunahead.errors import LaunchError
from kvrunahead.oneshot import on_engine
from kvrunahead.oneshot.runner import RunResult, run
from kvrunahead.ranks.launcher import spawn


def prefill(cfg: RunConfig, nproc: int = 1) -> RunResult:
    """Prefill ``cfg``'s prompt over ``nproc`` local ranks (spawned here, on ``cfg.net``'s network) and return the
    emitting rank's result: TTFT, partition, per-rank compute and wait, first and generated tokens, logits.

    Bad input raises ``InputError`` before any rank starts; a failed rank raises ``LaunchError`` naming its exit
    code (the rank's own one-line error is on stderr).
    """
    prepare(cfg, nproc)  # one clear error here rather than one per rank
    if nproc == 1:
        return run(cfg, "single", 1, on_engine.run_on_world)
    with tempfile.TemporaryDirectory(prefix="kvrunahead-") as tmp:
        plan, out = Path(tmp) / "config.json", Path(tmp) / "result.pt"
        plan.write_text(json.dumps(asdict(cfg)))
        code = spawn(nproc, [str(plan), str(out)], module=__name__, net=network_spec(cfg))
        if code != 0 or not out.exists():
            raise LaunchError(f"the prefill over {nproc} ranks failed (exit code {code}); the ranks' errors are above")
        return torch.load(out, weights_only=False)


def _rank_main(plan: str, out: str) -> None:
    """One spawned rank of ``prefill``: the emitting rank saves the result where the caller reads it."""
    with common.failure_ending("kvrunahead", rank=os.environ["RANK"]):
        result = run(RunConfig(**json.loads(Path(plan).read_text())), "spawn", int(os.environ["WORLD_SIZE"]),
                     on_engine.run_on_world)
        if result is not None:
            torch.save(result, out)


if __name__ == "__main__":
    _rank_main(*sys.argv[1:3])
