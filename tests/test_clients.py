"""The tools people point at ``vllm serve``, as they come, against ``kvr-serve --nproc 2 --degree 2`` serving the
real SmolLM2-135M (every prompt prefilled over the chain): lm-eval's ``local-completions`` on a multiple-choice
(loglikelihood: echo with logprobs) and a generation task shipped in tests/data/lm_eval, each item's score equal
to lm-eval's own ``hf`` model scoring it in one process; guidellm's ``run`` with its default streaming chat
requests (``stream_options.continuous_usage_stats``, ``ignore_eos``) completing and reporting TTFT; LangChain's
streamed usage equal to ``invoke``'s (the ``openai`` client's n, logprobs and echo: tests/test_serve_cli.py).
Bounded: a few dozen short requests, every process killed at the end."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_serve_cli import ROOT, serving

pytestmark = pytest.mark.timeout(600)

MODEL = "smollm2-135m"
TASKS = ROOT / "tests" / "data" / "lm_eval"
OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def served():
    """The server's URL and the converted model's directory (its HF tokenizer, for the clients)."""
    from kvrunahead.model.load import converted_model_dir

    model_dir = converted_model_dir(MODEL)
    with serving("--degree", "2", "--threads", "1", model=MODEL) as server:
        yield server.url(timeout_s=300), model_dir


def _lm_eval(tmp: Path, model: str, model_args: str) -> dict[str, list[dict]]:
    """lm-eval's CLI on both tasks; each task's logged samples by task name."""
    out = tmp / model
    r = subprocess.run([sys.executable, "-m", "lm_eval", "--model", model, "--model_args", model_args,
                        "--device", "cpu", "--tasks", "kvr_choice,kvr_answer", "--include_path", str(TASKS),
                        "--output_path", str(out), "--log_samples"],
                       capture_output=True, text=True, timeout=400, cwd=ROOT,
                       env=dict(os.environ, HF_DATASETS_CACHE=str(tmp / "datasets"), **OFFLINE))
    assert r.returncode == 0, r.stderr[-3000:]
    samples = {}
    for task in ("kvr_choice", "kvr_answer"):
        (path,) = out.glob(f"*/samples_{task}_*.jsonl")
        samples[task] = sorted((json.loads(line) for line in path.read_text().splitlines()), key=lambda s: s["doc_id"])
    return samples


def test_lm_eval_local_completions_scores_equal_one_process_scoring(served, tmp_path):
    url, model_dir = served
    remote = _lm_eval(tmp_path, "local-completions",
                      f"model={MODEL},base_url={url}/v1/completions,tokenizer={model_dir},num_concurrent=1,"
                      "max_retries=1")
    local = _lm_eval(tmp_path, "hf", f"pretrained={model_dir},dtype=float32")
    choice, ref = remote["kvr_choice"], local["kvr_choice"]
    assert len(choice) == len(ref) == 6
    for got, want in zip(choice, ref):  # each choice's (log-likelihood, whether greedy)
        got_ll = [(float(r[0][0]), r[0][1]) for r in got["resps"]]
        want_ll = [(float(r[0][0]), r[0][1]) for r in want["resps"]]
        assert [g for _, g in got_ll] == [g for _, g in want_ll], (got_ll, want_ll)
        assert max(abs(a - b) for (a, _), (b, _) in zip(got_ll, want_ll)) <= 1e-3, (got_ll, want_ll)
        assert got["acc"] == want["acc"]
    assert {float(r[0][0]) for s in choice for r in s["resps"]} != {0.0}  # scored, not zeros
    answers = [s["resps"] for s in remote["kvr_answer"]]
    assert answers == [s["resps"] for s in local["kvr_answer"]] and any(a[0][0].strip() for a in answers)


def test_guidellm_run_with_its_default_streaming_requests_reports_ttft(served, tmp_path):
    url, model_dir = served
    report = tmp_path / "guidellm.json"
    r = subprocess.run(["guidellm", "run", "--backend", f"kind=openai_http,target={url},model={MODEL}",
                        "--profile", "kind=synchronous", "--constraint", "kind=max_requests,count=3",
                        "--data", "kind=synthetic_text,prompt_tokens=64,output_tokens=8",
                        "--tokenizer", f"kind=hf_auto,model={model_dir}",
                        "--output", f"kind=json,path={report}", "--disable-progress"],
                       capture_output=True, text=True, timeout=300, cwd=tmp_path, env=dict(os.environ, **OFFLINE))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    metrics = json.loads(report.read_text())["benchmarks"][0]["metrics"]
    assert metrics["request_totals"] == {"successful": 3, "errored": 0, "incomplete": 0, "total": 3}
    ttft = metrics["time_to_first_token_ms"]["successful"]
    assert ttft["count"] == 3 and ttft["min"] > 0
    outputs = metrics["output_token_count"]["successful"]
    assert outputs["min"] == outputs["max"] == 8  # ignore_eos: every request its 8 tokens
    assert metrics["request_streaming_iterations_count"]["successful"]["min"] > 1  # streamed, token by token


def test_langchain_streamed_usage_equals_invoke_on_real_ranks(served):
    """``ChatOpenAI(stream_usage=True).stream()`` sums every chunk's usage: it equals ``invoke``'s (the usage on the
    final chunk only), and so does the text (greedy), through the model's chat template."""
    from langchain_openai import ChatOpenAI

    url, _ = served
    llm = ChatOpenAI(model=MODEL, base_url=f"{url}/v1", api_key="any", temperature=0, max_tokens=6, max_retries=0,
                     timeout=120, stream_usage=True)
    whole = llm.invoke("Name a colour.")
    streamed = None
    for chunk in llm.stream("Name a colour."):
        streamed = chunk if streamed is None else streamed + chunk
    keys = ("input_tokens", "output_tokens", "total_tokens")
    assert streamed.content == whole.content and whole.content
    assert {k: streamed.usage_metadata[k] for k in keys} == {k: whole.usage_metadata[k] for k in keys}
    assert whole.usage_metadata["input_tokens"] > 5 and 0 < whole.usage_metadata["output_tokens"] <= 6
