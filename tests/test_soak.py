"""The soak's short profile (kvrunahead/bench/soak.py) against ``kvr-serve --nproc 2`` as a user starts it (its
defaults; tiny-llama): a minute of mixed ShareGPT load near capacity with cancels, disconnects and hostile inputs.
No 5xx, every hostile input a 4xx, every rank's descriptors and /dev/shm flat, the rows written and plotted, the
server healthy at the end. (Memory and TTFT over a minute are warm-up: the 30-minute run grades them,
experiments/soak.)"""

from __future__ import annotations

import json

import httpx
import pytest

from kvrunahead.bench import soak
from tests.test_serve_cli import MODEL, serving

pytestmark = pytest.mark.timeout(400)


def test_the_short_soak_leaves_no_5xx_and_flat_descriptors_and_shared_memory(tmp_path):
    prompts = soak.sharegpt_prompts(200, soak.SHORT.max_prompt_tokens)
    assert len(prompts) >= 100
    out = tmp_path / "rows.jsonl"
    with serving() as server:
        url = server.url()
        rows = soak.run(url, MODEL, server.proc.pid, prompts, soak.SHORT, out, {"test": True})
        assert httpx.get(f"{url}/health").json()["status"] == "ok"
    summary = rows[-1]
    print(json.dumps(summary))
    assert [json.loads(line)["kind"] for line in out.read_text().splitlines()][-1] == "summary"
    assert all(summary["by_type"][kind] > 0 for kind in soak.KINDS), summary["by_type"]
    assert summary["server_errors_ok"] and summary["hostile_4xx_ok"], summary
    assert summary["fds_ok"] and summary["shm_ok"], summary
    assert summary["kv_ok"] and summary["kv_usage_peak"] > 0, summary  # the pool used, and nothing left held
    assert all(len(s["ranks"]) == 2 for s in rows if s["kind"] == "sample")
    soak.plot(rows, tmp_path / "soak.png")
    assert (tmp_path / "soak.png").stat().st_size > 10_000
