"""Starting real rank processes from tests: free ports, a timeout on every launch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from functools import lru_cache
from pathlib import Path

from kvrunahead.ranks.launcher import rank_env as launcher_rank_env

HERE = Path(__file__).parent
# KVR_TEST_COMPILE=1 runs the serve tests with every model compiled (docs/testing.md): each compiles its shapes
# first (minutes on 2 cores), so every time limit is this many times its own (tests/conftest.py)
COMPILE_SLOWDOWN = 8 if os.environ.get("KVR_TEST_COMPILE") else 1


def rank_env(rank: int, world_size: int, port: int, **extra: str) -> dict[str, str]:
    return launcher_rank_env(rank, world_size, port, OMP_NUM_THREADS="1", **extra)


def skewed_ratios(p: int) -> list[float]:
    """Rank i takes twice the share of rank i + 1, like the paper's searched partitions."""
    w = [2.0 ** -(i) for i in range(p)]
    total = sum(w)
    r = [round(x / total, 4) for x in w]
    r[-1] = round(1 - sum(r[:-1]), 4)
    return r


def run_cases(world_size: int, cases: list[dict], tmp: Path, timeout_s: float = 240) -> dict:
    """Run ``cases`` (RunConfig kwargs by name) on ``world_size`` real ranks; the last rank's results."""
    cases_file, out_file = tmp / "cases.json", tmp / "out.json"
    cases_file.write_text(json.dumps(cases))
    # one launcher: the ranks are forked from it with its imports done (kvrunahead/ranks/fork.py)
    proc = subprocess.Popen([sys.executable, "-m", "tests.rank_harness", str(world_size), str(cases_file),
                             str(out_file)], cwd=HERE.parent, env=dict(os.environ, OMP_NUM_THREADS="1"),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    (output,) = wait_all([proc], timeout_s)
    assert proc.returncode == 0, f"the ranks' exit code {proc.returncode}\n{output}"
    results: dict = {}
    for r in range(world_size):
        results.update(json.loads(Path(f"{out_file}.{r}").read_text()))
    return results


def wait_all(procs: list[subprocess.Popen], timeout_s: float) -> list[str]:
    timeout_s *= COMPILE_SLOWDOWN
    deadline = time.monotonic() + timeout_s
    outputs = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise AssertionError(f"ranks still running after {timeout_s} s") from None
        outputs.append(out or "")
    return outputs


def kvr_prefill(*args: str, env: dict | None = None, timeout_s: float = 240) -> subprocess.CompletedProcess:
    """Run the ``kvr-prefill`` console script as a user would."""
    return subprocess.run(
        ["kvr-prefill", *args], capture_output=True, text=True, timeout=timeout_s, env=env or dict(os.environ)
    )


def world_runs(cases, tmp_path_factory, prefix: str):
    """A function of the world size p giving ``cases(p)``'s results on p real ranks, run once per p whichever
    tests ask for them (the body of a module-scoped fixture)."""
    runs: dict[int, dict] = {}

    def run(p: int) -> dict:
        if p not in runs:
            runs[p] = run_cases(p, cases(p), tmp_path_factory.mktemp(f"{prefix}{p}"))
        return runs[p]

    return run


@lru_cache(maxsize=2)
def _model(name: str):
    import torch

    from kvrunahead.model.load import load_model

    torch.set_num_threads(1)
    return load_model(name, torch.float32, torch.device("cpu"))


def greedy_text(name: str, ids: list[int], k: int) -> str:
    """One process's greedy continuation of ``ids`` by ``k`` tokens (end tokens ignored), as the server decodes
    it."""
    import torch

    lm = _model(name)
    with torch.no_grad():
        out = lm.model.generate(torch.tensor([ids]), max_new_tokens=k, min_new_tokens=k, do_sample=False,
                                pad_token_id=0, eos_token_id=None)
    return lm.decode(out[0, len(ids):].tolist(), skip_special_tokens=True)
