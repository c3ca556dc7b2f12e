"""The compiled forward (``--compile``): every model family and mode on real ranks with the decoder stack through
torch.compile, against the eager single-process model (the reference stays eager); ``--dtype auto``."""

from __future__ import annotations

import json
import os

import pytest

from kvrunahead.model.device import fast_dtype
from tests.helpers import kvr_prefill, run_cases, skewed_ratios

CONTEXT = 61
NEW_TOKENS = 4
FAMILIES = ["tiny-llama", "tiny-neox", "tiny-falcon", "tiny-bigcode", "tiny-gemma3", "tiny-mistral"]
# Every case compiles its own shape families on 2 cores (about a minute each): p = 2 by default,
# KVR_COMPILED_WORLDS=2,3,4 for more.
WORLDS = [int(p) for p in os.environ.get("KVR_COMPILED_WORLDS", "2").split(",")]
pytestmark = pytest.mark.timeout(2700)  # the module's ranks compile every case before its first test


def _config(model: str, dtype: str = "float32", **kw) -> dict:
    return dict(model=model, context_len=CONTEXT, dtype=dtype, device="cpu", max_new_tokens=NEW_TOKENS,
                verify=True, threads=1, compile=True, atol=1e-4 if dtype == "float32" else None, **kw)


def _cases(p: int) -> list[dict]:
    skew = ",".join(f"{x:.4f}" for x in skewed_ratios(p))
    cases = [{"name": f"kvr/{m}", "config": _config(m, partition=skew)} for m in FAMILIES]
    cases += [{"name": f"{mode}/tiny-llama", "config": _config("tiny-llama", mode=mode)}
              for mode in ("tsp", "cp-allgather", "ring", "spp")]
    cases += [
        {"name": "kvr-masked/tiny-llama", "config": _config("tiny-llama", partition=skew, kvr_attention="masked")},
        {"name": "kvr-kvp/tiny-llama", "config": _config("tiny-llama", partition=skew, decode="kvp")},
        {"name": "kvr/tiny-llama/bfloat16", "config": _config("tiny-llama", "bfloat16", partition=skew)},
    ]
    return cases


# The matrix takes 10+ minutes on 2 cores; it runs with KVR_COMPILED_MATRIX=1.
matrix = pytest.mark.skipif(not os.environ.get("KVR_COMPILED_MATRIX"), reason="KVR_COMPILED_MATRIX=1 runs it")


@pytest.fixture(scope="module", params=WORLDS)
def compiled_world(request, tmp_path_factory):
    p = request.param
    return p, run_cases(p, _cases(p), tmp_path_factory.mktemp(f"compiled{p}"), timeout_s=2400)


@matrix
@pytest.mark.parametrize("name", [c["name"] for c in _cases(2)])
def test_every_family_and_mode_compiled_matches_the_eager_single_process(compiled_world, name):
    p, results = compiled_world
    r = results[name]
    v = r["verification"]
    assert r["compiled"] and len(r["tokens"]) == p
    assert v["ok"], v  # logits within the dtype's tolerance, first token and greedy continuation equal
    if r["dtype"] == "float32":
        assert v["max_abs_logit_diff"] <= 1e-4, v


def test_kvr_prefill_compiled_with_dtype_auto_runs_in_the_fast_dtype_and_verifies():
    done = kvr_prefill("--nproc", "2", "--threads", "1", "--model", "tiny-llama", "--ctx", "61", "--compile",
                       "--dtype", "auto", "--verify", "--max-new-tokens", "4", "--json", timeout_s=900)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    assert result["compiled"] and result["dtype"] == fast_dtype("cpu")
    assert result["verification"]["ok"], result["verification"]


def test_a_bad_dtype_is_one_line_and_exit_2_before_any_rank_starts():
    done = kvr_prefill("--nproc", "2", "--model", "tiny-llama", "--ctx", "61", "--dtype", "float64")
    assert done.returncode == 2 and "float64" in done.stderr and "auto" in done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) <= 3 and lines[-1].startswith("Error:")  # click's usage line, its hint and the error
