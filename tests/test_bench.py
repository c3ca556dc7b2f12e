"""kvr-bench: rows per run, medians per point, the bounds arithmetic, and one real (tiny) sweep."""

import csv
import json
import re
import subprocess
from pathlib import Path

import pytest

import kvrunahead
from kvrunahead.bench.plan import build_jobs
from kvrunahead.bench.report import add_bounds, markdown_table, summarize
from kvrunahead.decide.tables import TABLES_DIR

PACKAGE = Path(kvrunahead.__file__).parent  # the checkout kvr-bench runs from, as provenance.environment asks git


def _row(ctx, label, ttft, p=2, kind="timed", transport="torch", compute=(1.0, 1.0)):
    return {"context_len": ctx, "world_size": p, "label": label, "kind": kind, "transport": transport,
            "ttft_s": ttft, "threads_per_rank": 1, "boundaries": [0, ctx // 2, ctx],
            "ranks": [{"wait_s": 0.1, "bytes_sent": 10, "compute_s": compute[0]},
                      {"wait_s": 0.3, "bytes_sent": 0, "compute_s": compute[1]}]}


def test_summary_takes_median_min_max_of_timed_runs_only():
    rows = [_row(1024, "tsp", t) for t in (3.0, 1.0, 2.0)] + [_row(1024, "tsp", 9.0, kind="warmup")]
    (s,) = summarize(rows)
    assert (s.runs, s.ttft_median_s, s.ttft_min_s, s.ttft_max_s) == (3, 2.0, 1.0, 3.0)


def test_bounds_follow_eq_3_and_the_no_communication_run():
    rows = [_row(1024, "single-1t", 8.0, p=1, transport="local"), _row(1024, "tsp", 6.0),
            _row(1024, "kvr-best", 4.0), _row(1024, "kvr-nocomm", 3.2, compute=(3.6, 3.2))]
    summary = summarize(rows)
    add_bounds(summary)
    best = next(s for s in summary if s.label == "kvr-best")
    assert best.ttft_star_s == pytest.approx(8.0 / 2 * (1 / 2 + 1 / 4))  # TTFT(1)/2 (1/p + 1/p^2)
    assert best.speedup_over_tsp == pytest.approx(1.5)
    assert best.over_nocomm_bound == pytest.approx(0.25)
    assert best.over_nocomm_slowest == pytest.approx(4.0 / 3.6 - 1)  # rank 0 is the slowest without comm
    assert "| 1024 | 2 | kvr-best | torch | 4.000 |" in markdown_table(summary)


def test_the_no_communication_bound_is_compared_on_its_own_partition_only():
    rows = [_row(1024, "kvr-best", 4.0), _row(1024, "kvr-nocomm", 3.2, compute=(3.6, 3.2)),
            dict(_row(1024, "kvr-even", 5.0), boundaries=[0, 600, 1024])]
    summary = summarize(rows)
    add_bounds(summary)
    by = {s.label: s for s in summary}
    assert by["kvr-best"].over_nocomm_bound == pytest.approx(0.25)
    assert by["kvr-even"].over_nocomm_bound is None


def test_markdown_leaves_the_speedup_empty_without_tsp():
    summary = summarize([_row(1024, "kvr-default", 4.0), _row(1024, "kvr-S", 3.9)])
    add_bounds(summary)
    assert "| 4.000 | 4.000 | 4.000 |  |" in markdown_table(summary)
    assert "x |" not in markdown_table(summary).split("\n", 2)[2]


def test_jobs_sweep_only_kvr_best_and_bound_it_on_its_partition():
    jobs = build_jobs([1024], ["tsp", "kvr", "kvr-best", "kvr-nocomm"], 3, 1, [0.5, 0.6], 2)
    assert [j.label for j in jobs] == ["tsp", "kvr-even", "kvr-best", "kvr-nocomm"]
    assert jobs[2].sweep == [0.5, 0.6] and jobs[3].partition == "@best"


def _checkout_commit() -> str:
    """What a row should record as its commit: the short HEAD of the checkout kvrunahead runs from, with "-dirty"
    where tracked files differ from it (untracked ones do not count)."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], capture_output=True, text=True, cwd=PACKAGE, check=True).stdout.strip()

    dirty = git("status", "--porcelain", "--untracked-files=no")
    return git("rev-parse", "--short", "HEAD") + ("-dirty" if dirty else "")


def test_tiny_sweep_writes_rows_summary_and_plot(tmp_path):
    before = _checkout_commit()
    proc = subprocess.run(
        ["kvr-bench", "--model", "tiny-llama", "--ctx", "128", "--repeats", "2", "--warmup", "1",
         "--modes", "single,tsp,ring,kvr,kvr-best,kvr-nocomm", "--shares", "0.5,0.6", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(line) for line in (tmp_path / "runs.jsonl").read_text().splitlines()]
    # p=2: 5 modes x (1 warm-up + 2 timed) + 2 sweep runs; single at 1 and 2 threads: 2 x 3
    assert len(rows) == 5 * 3 + 2 + 2 * 3
    # Every row names the commit it was measured at. Should the checkout change during the sweep (other work in
    # it), the state before and the state after are both right; anything else (none, unknown, another) is not.
    recorded = {r["commit"] for r in rows}
    assert recorded <= {before, _checkout_commit()}, recorded
    assert all(r["torch"] and r["cpu"] for r in rows)
    command = (f"kvr-bench --model tiny-llama --ctx 128 --repeats 2 --warmup 1 --modes "
               f"single,tsp,ring,kvr,kvr-best,kvr-nocomm --shares 0.5,0.6 --out {tmp_path}")
    assert {r["command"] for r in rows} == {command}
    summary = list(csv.DictReader(open(tmp_path / "summary.csv")))
    assert {s["label"] for s in summary} == {"single-1t", "single-2t", "tsp", "ring", "kvr-even", "kvr-best",
                                             "kvr-nocomm"}
    assert (tmp_path / "ttft_torch.png").stat().st_size > 10_000
    assert "[1/17] ctx    128" in proc.stderr  # progress, one line per run


def test_resume_measures_only_the_missing_runs(tmp_path):
    args = ["kvr-bench", "--model", "tiny-llama", "--ctx", "128", "--repeats", "2", "--warmup", "1",
            "--modes", "tsp,kvr", "--out", str(tmp_path)]
    first = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr
    rows = [json.loads(line) for line in (tmp_path / "runs.jsonl").read_text().splitlines()]
    assert len(rows) == 6
    # An interrupted sweep: the last timed kvr-even run is missing and the line before it is torn.
    kept = [r for r in rows if not (r["label"] == "kvr-even" and r["index"] == 1 and r["kind"] == "timed")]
    (tmp_path / "rows_p2_t1_torch.1.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in kept) + '{"context_len": 128, "lab')
    again = subprocess.run(args + ["--resume"], capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr
    assert "5 of 6 runs already recorded" in again.stderr
    assert again.stderr.count("[6/6]") == 1 and "[1/6]" not in again.stderr  # only the missing run is measured
    resumed = [json.loads(line) for line in (tmp_path / "runs.jsonl").read_text().splitlines()]
    assert len(resumed) == 6
    assert sorted(r["ttft_s"] for r in kept) == sorted(r["ttft_s"] for r in resumed if r in kept)
    assert {(r["label"], r["kind"], r["index"]) for r in resumed} == {(r["label"], r["kind"], r["index"]) for r in rows}


def test_kvr_attention_applies_to_every_kvr_job():
    jobs = build_jobs([1024], ["tsp", "kvr", "kvr-best", "kvr-nocomm"], 3, 1, [0.5], 2, {"P": "t.json"}, "split")
    assert {j.label: j.kvr_attention for j in jobs} == {
        "kvr-P": "split", "tsp": "auto", "kvr-even": "split", "kvr-best": "split", "kvr-nocomm": "split"}


def test_kvr_default_keeps_the_defaults_of_kvr_prefill_whatever_the_attention_of_the_others():
    jobs = build_jobs([1024], ["kvr-default", "kvr"], 3, 1, [0.5], 2, None, "masked")
    assert [(j.label, j.partition, j.kvr_attention) for j in jobs] == [
        ("kvr-default", "auto", "auto"), ("kvr-even", "even", "masked")]


def _interleaved_sweep(out, ctx: str, modes: str) -> tuple[subprocess.CompletedProcess, list[dict]]:
    proc = subprocess.run(
        ["kvr-bench", "--model", "tiny-llama", "--ctx", ctx, "--repeats", "2", "--warmup", "1",
         "--modes", modes, "--interleave", "--out", str(out)],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    return proc, [json.loads(line) for line in (out / "runs.jsonl").read_text().splitlines()]


def test_interleaved_singles_run_among_the_ranks_at_one_and_p_threads(tmp_path):
    proc, rows = _interleaved_sweep(tmp_path, "128", "single,kvr-default")
    timed = {(r["label"], r["index"]): (r["world_size"], r["threads_per_rank"]) for r in rows if r["kind"] == "timed"}
    assert timed == {("single-1t", i): (1, 1) for i in (0, 1)} | {("single-2t", i): (1, 2) for i in (0, 1)} | {
        ("kvr-default", i): (2, 1) for i in (0, 1)}
    # Progress lines come in the order the runs were made (each by the rank that emitted it): alternating, the
    # second round starting one mode later.
    order = re.findall(r"ctx +128 (\S+) +timed", proc.stderr)
    assert order == ["single-1t", "single-2t", "kvr-default", "single-2t", "kvr-default", "single-1t"]
    default = next(r for r in rows if r["label"] == "kvr-default")
    assert default["kvr_attention"] == "split" and default["partition_source"].startswith("cost model")
    assert "single process" not in proc.stderr  # no separate world for the singles


@pytest.mark.parametrize("args, message", [
    (["--threads", "0"], "--threads must be at least 1"),
    (["--repeats", "0"], "--repeats must be at least 1"),
    (["--warmup", "-1"], "--warmup must be at least 0"),
    (["--ctx", "lots"], "cannot parse token count"),
    (["--modes", "kvr,fast"], "unknown modes ['fast']"),
    (["--table", "P"], "--table takes LABEL=PATH"),
    (["--table", "P=/no/such.json"], "no such file"),
    (["--table", f"P={TABLES_DIR / 'smollm2-135m_p2_float32_cpu_masked.json'}"], "was made for model smollm2-135m"),
    (["--ctx", "33k"], "exceeds 32768 positions"),
])
def test_bad_input_is_one_line_error(tmp_path, args, message):
    proc = subprocess.run(["kvr-bench", "--model", "tiny-llama", "--out", str(tmp_path), *args], capture_output=True,
                          text=True, timeout=120)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("kvr-bench: error:"), proc.stderr
    assert message in lines[0]


def test_replot_rebuilds_the_summary_from_the_runs(tmp_path):
    rows = [_row(1024, "tsp", t) for t in (3.0, 1.0, 2.0)]
    (tmp_path / "runs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    proc = subprocess.run(["kvr-bench", "--replot", "--out", str(tmp_path)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "| 1024 | 2 | tsp | torch | 2.000 | 1.000 | 3.000 |" in (tmp_path / "summary.md").read_text()
    missing = subprocess.run(["kvr-bench", "--replot", "--out", str(tmp_path / "none")], capture_output=True,
                             text=True, timeout=120)
    assert missing.returncode == 2 and "no " in missing.stderr


def test_interleave_alternates_the_timed_runs_of_one_context_rotating_by_round(tmp_path):
    _, rows = _interleaved_sweep(tmp_path, "64,128", "tsp,kvr")
    order = [(r["context_len"], r["label"], r["kind"], r["index"]) for r in rows]
    assert order == [
        (64, "tsp", "warmup", 0), (64, "kvr-even", "warmup", 0),
        (64, "tsp", "timed", 0), (64, "kvr-even", "timed", 0), (64, "kvr-even", "timed", 1), (64, "tsp", "timed", 1),
        (128, "tsp", "warmup", 0), (128, "kvr-even", "warmup", 0),
        (128, "tsp", "timed", 0), (128, "kvr-even", "timed", 0), (128, "kvr-even", "timed", 1),
        (128, "tsp", "timed", 1),
    ]  # each round starts one mode later than the one before
    assert all(r["interleaved"] for r in rows)


def test_a_world_whose_runs_are_all_recorded_is_not_started_again(tmp_path, monkeypatch):
    """A sweep over several networks stopped in a later world: on --resume the finished world starts no ranks, no
    emulation and no sidecar, returns its rows, and keeps the noise report it wrote."""
    import kvrunahead.net.session as session
    from kvrunahead.bench.orchestrate import run_world
    from kvrunahead.bench.plan import Job

    monkeypatch.setattr(session, "network", lambda *a, **k: pytest.fail("the finished world was started again"))
    net = "cap=50MB/s,noise"
    jobs = [Job("kvr-even", "kvr", 128, "even", repeats=2, warmup=0, net=net)]
    rows = [{"context_len": 128, "label": "kvr-even", "kind": "timed", "index": i, "network": net, "ttft_s": 1.0 + i}
            for i in range(2)]
    for rank in range(2):
        (tmp_path / f"rows_p2_t1_torch_cap50MBs.{rank}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    report = tmp_path / "noise_p2_t1_torch_cap50MBs.json"
    report.write_text('{"bytes_sent": 123}')
    out = run_world(2, 1, "torch", jobs, {}, {}, tmp_path, 60.0, resume=True, net="cap=50MB/s")
    assert sorted(r["ttft_s"] for r in out) == [1.0, 1.0, 2.0, 2.0]
    assert report.read_text() == '{"bytes_sent": 123}'
