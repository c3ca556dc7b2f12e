"""The three launchers start the same program and agree; the default model decodes like generate(); a rank forked
from the launcher runs as a started one would."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import kvr_prefill

ROOT = Path(__file__).parent.parent

ARGS = ["--model", "tiny-neox", "--ctx", "200", "--partition", "0,130,200", "--max-new-tokens", "5", "--verify",
        "--json"]


def _result(proc: subprocess.CompletedProcess) -> dict:
    assert proc.returncode == 0, proc.stderr
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    assert len(lines) == 1, proc.stdout  # only the last rank prints
    return json.loads(lines[0])


def _same_outcome(a: dict, b: dict) -> None:
    for key in ("first_token", "generated_tokens", "boundaries", "world_size"):
        assert a[key] == b[key], key
    assert a["verification"]["ok"] and b["verification"]["ok"]


@pytest.fixture(scope="module")
def spawned():
    r = _result(kvr_prefill("--nproc", "2", *ARGS))
    assert r["launcher"] == "spawn"
    return r


@pytest.mark.skipif(shutil.which("torchrun") is None, reason="torchrun not on PATH")
def test_torchrun_matches_spawned_ranks(spawned):
    proc = subprocess.run(["torchrun", "--nproc-per-node", "2", "--no-python", "kvr-prefill", *ARGS],
                          capture_output=True, text=True, timeout=240)
    r = _result(proc)
    assert r["launcher"] == "torchrun"
    _same_outcome(r, spawned)


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="mpirun not installed (apt-get install openmpi-bin)")
def test_mpirun_matches_spawned_ranks(spawned):
    pytest.importorskip("mpi4py")
    proc = subprocess.run(["mpirun", "--allow-run-as-root", "-n", "2", "kvr-prefill", *ARGS],
                          capture_output=True, text=True, timeout=240)
    r = _result(proc)
    assert r["launcher"] == "mpi"
    _same_outcome(r, spawned)


def test_default_model_decodes_like_transformers_generate():
    """Greedy tokens after a 2-rank KV-Runahead prefill equal transformers' generate() on the full prompt."""
    from transformers import AutoModelForCausalLM

    from kvrunahead.model.load import default_model_dir, load_tokenizer
    from kvrunahead.prompt import build_prompt

    n_new = 12
    r = _result(kvr_prefill("--nproc", "2", "--ctx", "160", "--partition", "0,100,160", "--max-new-tokens",
                            str(n_new), "--json"))
    ids = build_prompt(load_tokenizer("smollm2-135m"), 160)
    model = AutoModelForCausalLM.from_pretrained(default_model_dir(), dtype=torch.float32)
    out = model.generate(torch.tensor([ids]), max_new_tokens=n_new, do_sample=False)
    expected = out[0, len(ids):].tolist()
    assert r["generated_tokens"] == expected
    assert len(expected) >= 4 and any(c.isalpha() for c in r["generated_text"])


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="mpirun not installed (apt-get install openmpi-bin)")
@pytest.mark.parametrize("mode", ["kvr", "tsp", "cp-allgather", "ring"])
def test_mpi_transport_matches_single_process(mode):
    pytest.importorskip("mpi4py")
    args = ["--model", "tiny-llama", "--ctx", "100", "--partition", "even", "--mode", mode, "--transport", "mpi",
            "--verify", "--json", "--max-new-tokens", "3"]
    proc = subprocess.run(["mpirun", "--allow-run-as-root", "-n", "2", "kvr-prefill", *args],
                          capture_output=True, text=True, timeout=240)
    r = _result(proc)
    assert r["transport"] == "mpi" and r["verification"]["ok"]
    assert all(s["bytes_sent"] > 0 for s in r["ranks"][: 1 if mode == "kvr" else 2])


def test_mpi_transport_outside_mpirun_is_refused():
    proc = kvr_prefill("--model", "tiny-llama", "--ctx", "64", "--nproc", "2", "--transport", "mpi")
    assert proc.returncode != 0
    assert "needs the ranks to be started by mpirun" in proc.stderr


FORKING_LAUNCHER = """
import json, os, sys, tempfile, threading, time
import numpy  # noqa: F401  (its BLAS pool of threads ends itself at a fork)
from kvrunahead.ranks.fork import can_fork, fork_rank
out = sys.argv[1]
owned = tempfile.TemporaryDirectory()  # the launcher's to remove at its exit, never a rank's
first = can_fork()
rank = fork_rank("tests.fork_probe", [out, "3"], dict(os.environ, RANK="5"), lambda: None)
code = rank.wait(timeout=60)
threading.Thread(target=time.sleep, args=(30,), daemon=True).start()
print(json.dumps(dict(first=first, code=code, kept=os.path.isdir(owned.name), me=os.getpid(),
                      with_a_thread=can_fork())))
"""


def test_a_forked_rank_runs_its_module_with_its_environment_and_none_of_the_launchers_exit_work(tmp_path):
    """What spawn(fork=True) relies on: the child runs ``python -m MODULE ARGV`` as ``__main__`` with the rank's
    environment, its exit code and its own atexit work reach the launcher, the launcher's temporary folder
    outlives it; and a launcher with a thread of its own does not fork."""
    out = tmp_path / "rank.json"
    r = subprocess.run([sys.executable, "-c", FORKING_LAUNCHER, str(out)], capture_output=True, text=True,
                       timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    launcher = json.loads(r.stdout)
    rank = json.loads(out.read_text())
    assert launcher["first"] and launcher["code"] == 3 and launcher["kept"], launcher
    assert rank == {"argv": [str(out), "3"], "rank": "5", "ppid": launcher["me"], "main": "__main__",
                    "name": "kvr-rank-5"}
    assert (tmp_path / "rank.json.atexit").read_text() == "ran"
    assert launcher["with_a_thread"] is False
