"""Bad input gives one line and a non-zero exit; a failing rank brings every rank down in bounded time."""

import os
import shutil
import time

import pytest
from click.testing import CliRunner

from kvrunahead.cli.prefill import main
from tests.helpers import kvr_prefill

TINY = ["--model", "tiny-llama", "--max-new-tokens", "1"]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--nproc", "2", "--ctx", "64", "--partition", "0,10,20,64"], "3 parts but the world size is 2"),
        (["--nproc", "2", "--ctx", "64", "--partition", "0,0,64"], "part 0 is empty"),
        (["--nproc", "2", "--ctx", "64", "--partition", "0,10,50"], "must end at the context length 64"),
        (["--nproc", "3", "--ctx", "2"], "smaller than the 3 ranks"),
        (["--nproc", "2", "--ctx", "64", "--partition", "0.7,0.7"], "ratios must sum to 1"),
        (["--nproc", "2", "--ctx", "64", "--partition", "half"], "cannot parse partition"),
        (["--ctx", "33k"], "exceeds 32768 positions, the most YaRN x4"),
        (["--model", "tiny-bigcode", "--ctx", "9k"], "cannot be extended by YaRN"),
        (["--ctx", "64", "--threads", "0"], "--threads must be at least 1"),
        (["--nproc", "2", "--ctx", "64", "--threads", "0"], "--threads must be at least 1"),
        (["--model", "tiny-falcon", "--ctx", "64", "--kvr-attention", "split"], "use masked"),
        (["--ctx", "lots"], "cannot parse token count"),
    ],
)
def test_bad_input_is_one_line_error(args, message):
    result = CliRunner().invoke(main, TINY + args)
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvr-prefill: error:"), result.output
    assert message in lines[0]


@pytest.mark.parametrize("content, message", [
    (b"", "is empty"),
    (b"  \n\t\n", "is empty"),
    (b"caf\xe9 au lait", "is not UTF-8 text (byte 3"),
])
@pytest.mark.parametrize("nproc", ["1", "2"])
def test_an_unusable_prompt_file_is_one_line_error_before_any_rank_starts(tmp_path, content, message, nproc):
    path = tmp_path / "prompt.txt"
    path.write_bytes(content)
    result = CliRunner().invoke(main, TINY + ["--nproc", nproc, "--prompt-file", str(path)])
    lines = result.output.strip().splitlines()
    assert result.exit_code == 2 and len(lines) == 1 and lines[0].startswith("kvr-prefill: error:"), result.output
    assert message in lines[0]


def test_unknown_model_is_one_line_error():
    result = CliRunner().invoke(main, ["--model", "no-such-model", "--ctx", "64"])
    assert result.exit_code == 2
    assert "unknown model 'no-such-model'" in result.output


def test_long_context_runs_when_allowed():
    result = CliRunner().invoke(main, TINY + ["--ctx", "8200", "--allow-long-context", "--json"])
    assert result.exit_code == 0, result.output
    assert '"context_len": 8200' in result.output


def test_missing_mpi4py_under_mpirun_names_the_install(tmp_path):
    shadow = tmp_path / "mpi4py"
    shadow.mkdir()
    (shadow / "__init__.py").write_text("raise ImportError('No module named mpi4py')\n")
    env = dict(os.environ, OMPI_COMM_WORLD_SIZE="2", OMPI_COMM_WORLD_RANK="0", PYTHONPATH=str(tmp_path))
    proc = kvr_prefill(*TINY, "--ctx", "64", env=env, timeout_s=120)
    assert proc.returncode == 2
    assert "pip install mpi4py" in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr


def test_a_rank_that_raises_brings_all_ranks_down_within_the_timeout():
    env = dict(os.environ, KVRUNAHEAD_INJECT_FAULT="1:2")  # rank 1 raises in layer 2
    t = time.monotonic()
    proc = kvr_prefill(*TINY, "--nproc", "3", "--ctx", "64", "--timeout", "30", env=env, timeout_s=180)
    elapsed = time.monotonic() - t
    assert proc.returncode != 0
    assert "rank 1 failed: InjectedFault" in proc.stderr
    assert elapsed < 90, f"ranks took {elapsed:.0f} s to exit"


@pytest.mark.skipif(shutil.which("torchrun") is None, reason="torchrun not on PATH")
def test_torchrun_rank_failure_exits_nonzero():
    env = dict(os.environ, KVRUNAHEAD_INJECT_FAULT="0:1")
    t = time.monotonic()
    import subprocess

    proc = subprocess.run(
        ["torchrun", "--nproc-per-node", "2", "--no-python", "kvr-prefill", *TINY, "--ctx", "64", "--timeout", "30"],
        capture_output=True, text=True, timeout=180, env=env,
    )
    assert proc.returncode != 0
    assert "rank 0 failed: InjectedFault" in proc.stderr
    assert time.monotonic() - t < 90
