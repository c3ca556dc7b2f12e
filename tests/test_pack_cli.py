"""``kvr-prefill --prompts`` as a user runs it: a JSON-lines batch packed over the chain, every prompt checked against
the single process, and one-line errors (exit 2) for input it cannot take."""

import json
import subprocess

import pytest

PROMPTS = ["the miller kept bees", "x", "where does the river run past the old mill and who sold honey " * 9,
           "a short one", "travellers"]


def kvr_prefill(*args, cwd, timeout_s=300):
    return subprocess.run(["kvr-prefill", *args], capture_output=True, text=True, timeout=timeout_s, cwd=cwd)


@pytest.fixture
def files(tmp_path):
    lines = [json.dumps({"prompt": p}) for p in PROMPTS]
    (tmp_path / "prompts.jsonl").write_text("\n".join(lines[:2]) + "\n\n" + "\n".join(lines[2:]) + "\n")
    return tmp_path


@pytest.mark.parametrize("nproc, batching", [("2", "packed"), ("2", "sequential"), ("1", "padded")])
def test_every_prompt_of_a_batch_matches_the_single_process(files, nproc, batching):
    out = kvr_prefill("--model", "tiny-llama", "--prompts", "prompts.jsonl", "--nproc", nproc, "--batching",
                      batching, "--max-new-tokens", "4", "--step-tokens", "300", "--verify", "--json", cwd=files)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["batching"] == batching and result["world_size"] == int(nproc)
    assert [p["index"] for p in result["prompts"]] == list(range(len(PROMPTS)))
    assert result["verified"] is True and result["mismatches"] == 0
    if batching == "packed":
        assert sum(len(s["prompts"]) for s in result["steps"]) == len(PROMPTS)


def test_the_text_report_lists_every_prompt_and_the_verdict(files):
    out = kvr_prefill("--model", "tiny-llama", "--prompts", "prompts.jsonl", "--max-new-tokens", "2", "--verify",
                      cwd=files)
    assert out.returncode == 0, out.stderr
    assert "verify       OK: 5/5 prompts" in out.stdout and "batching     packed" in out.stdout


@pytest.mark.parametrize("args, message", [
    (["--prompts", "bad.jsonl"], "bad.jsonl:2: not JSON"),
    (["--prompts", "noprompt.jsonl"], 'noprompt.jsonl:1: expected {"prompt": "<non-empty text>"}'),
    (["--prompts", "prompts.jsonl", "--ctx", "2k"], "--ctx and --prompt-file do not apply"),
    (["--prompts", "prompts.jsonl", "--batching", "padded", "--nproc", "2"], "batched forward in one process"),
    (["--prompts", "prompts.jsonl", "--mode", "tsp"], "not tsp"),
    (["--prompts", "prompts.jsonl", "--partition", "even"], "--partition and --table do not apply"),
    (["--batching", "padded"], "give --prompts"),
    (["--prompts", "prompts.jsonl", "--model", "tiny-falcon"], "AttentionInterface"),
])
def test_bad_batches_are_one_line_and_exit_2(files, args, message):
    (files / "bad.jsonl").write_text('{"prompt": "a"}\n{"prompt": \n')
    (files / "noprompt.jsonl").write_text('{"text": "a"}\n')
    out = kvr_prefill("--model", "tiny-llama", *args, cwd=files) if "--model" not in args else \
        kvr_prefill(*args, cwd=files)
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvr-prefill: error: ") and message in lines[0], out.stderr
