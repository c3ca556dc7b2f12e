"""``kvr-ask`` as a user runs it: the context over the chain, every answer checked against its standalone prompt,
and one-line errors for input it cannot take."""

import json
import subprocess

import pytest

CONTEXT = "the river runs north past the old mill where the miller kept bees and sold honey to travellers " * 12


def kvr_ask(*args, cwd, timeout_s=300):
    return subprocess.run(["kvr-ask", *args], capture_output=True, text=True, timeout=timeout_s, cwd=cwd)


@pytest.fixture
def files(tmp_path):
    (tmp_path / "context.txt").write_text(CONTEXT)
    (tmp_path / "questions.txt").write_text("Who kept bees?\n\nWhere does the river run?\nWhy?\n")
    return tmp_path


@pytest.mark.parametrize("nproc", ["1", "2"])
def test_every_answer_matches_its_standalone_prompt_on_one_rank_and_over_the_chain(files, nproc):
    out = kvr_ask("--model", "tiny-llama", "--context", "context.txt", "--questions", "questions.txt",
                  "--nproc", nproc, "--max-new-tokens", "5", "--verify", "--json", cwd=files)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["world_size"] == int(nproc) and len(result["boundaries"]) == int(nproc) + 1
    assert [a["question"] for a in result["answers"]] == ["Who kept bees?", "Where does the river run?", "Why?"]
    assert result["verified"] is True
    assert all(a["matches"] and len(a["tokens"]) == 5 for a in result["answers"])


def test_a_questions_file_without_a_question_is_one_line_and_exit_2(files):
    (files / "empty.txt").write_text("\n  \n")
    out = kvr_ask("--model", "tiny-llama", "--context", "context.txt", "--questions", "empty.txt", cwd=files)
    assert out.returncode == 2
    assert out.stderr.splitlines() == ["kvr-ask: error: empty.txt is empty (or only whitespace): nothing to prefill"]


def test_a_model_with_sliding_window_layers_is_one_line_and_exit_2(files):
    out = kvr_ask("--model", "tiny-gemma3", "--context", "context.txt", "--questions", "questions.txt",
                  "--nproc", "2", cwd=files)
    assert out.returncode == 2
    (line,) = out.stderr.splitlines()
    assert line.startswith("kvr-ask: error: shared-context questions run on full-attention models only")
