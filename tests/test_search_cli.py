"""kvr-search on real ranks with a tiny model: a table comes out, interpolation uses it, resume works."""

import json
import re
import statistics
import subprocess

import pytest

from tests.helpers import kvr_prefill


def _search(*args, timeout_s=400):
    return subprocess.run(["kvr-search", "--model", "tiny-llama", "--nproc", "2", "--min-stride", "16",
                           "--repeats", "1", "--warmup", "0", *args], capture_output=True, text=True, timeout=timeout_s)


def test_search_writes_a_table_that_kvr_prefill_interpolates(tmp_path):
    table = tmp_path / "tiny_p2.json"
    proc = _search("--ctx", "256,512", "--out", str(table))
    assert proc.returncode == 0, proc.stderr
    data = json.loads(table.read_text())
    assert [e["context_len"] for e in data["entries"]] == [256, 512]
    assert data["meta"]["world_size"] == 2 and data["meta"]["model"] == "tiny-llama"
    assert data["entries"][1]["seeded"] and not data["entries"][0]["seeded"]
    assert "level 1" in proc.stderr and "candidate" in proc.stderr  # progress
    run = kvr_prefill("--model", "tiny-llama", "--nproc", "2", "--ctx", "384", "--table", str(table), "--verify",
                      "--json")
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    assert "interpolated between entries 256 and 512" in out["partition_source"]
    r = [e["ratios"][0] for e in data["entries"]]
    assert abs(out["ratios"][0] - (r[0] + r[1]) / 2) < 2 / 384


def test_resume_reuses_the_checkpoint(tmp_path):
    table = tmp_path / "t.json"
    first = _search("--ctx", "256", "--out", str(table))
    assert first.returncode == 0, first.stderr
    n = json.loads(table.read_text())["entries"][0]["evaluations"]
    table.unlink()  # the table is gone, the checkpoint stays: a resumed search measures nothing again
    again = _search("--ctx", "256", "--out", str(table), "--resume")
    assert again.returncode == 0, again.stderr
    assert re.search(r"candidate +\d+ ", first.stderr) and not re.search(r"candidate +\d+ ", again.stderr)
    assert json.loads(table.read_text())["entries"][0]["evaluations"] == n
    kept = _search("--ctx", "256", "--out", str(table), "--resume")  # a length the table has is kept as it is
    assert kept.returncode == 0 and "[ctx 256] already in" in kept.stderr, kept.stderr
    assert not re.search(r"candidate +\d+ ", kept.stderr)


def test_the_table_records_its_attention_and_kvr_prefill_refuses_it_for_the_other(tmp_path):
    table = tmp_path / "t.json"
    proc = _search("--ctx", "256", "--out", str(table), "--kvr-attention", "masked")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(table.read_text())["meta"]["kvr_attention"] == "masked"
    split = kvr_prefill("--model", "tiny-llama", "--nproc", "2", "--ctx", "256", "--table", str(table))
    assert split.returncode == 2 and "attention masked, not split" in split.stderr, split.stderr
    masked = kvr_prefill("--model", "tiny-llama", "--nproc", "2", "--ctx", "256", "--table", str(table),
                         "--kvr-attention", "masked", "--json")
    assert masked.returncode == 0 and '"kvr_attention": "masked (as asked)"' in masked.stdout, masked.stderr
    # Searching on into a table of the other attention would mix two settings in one table.
    other = _search("--ctx", "512", "--out", str(table), "--kvr-attention", "split")
    assert other.returncode == 2 and "attention masked, not split" in other.stderr


@pytest.mark.parametrize("args, message", [
    (["--threads", "0"], "--threads must be at least 1"),
    (["--repeats", "0"], "--repeats must be at least 1"),
    (["--min-stride", "0"], "--min-stride must be at least 1"),
    (["--criterion", "balance", "--confirm-rounds", "0"], "--confirm-rounds must be at least 1"),
    (["--ctx", "16"], "too short for 2 ranks at --min-stride 16"),
    (["--ctx", "lots"], "cannot parse token count"),
    (["--nproc", "1", "--criterion", "balance"], "one rank has no partition to balance"),
])
def test_bad_input_is_one_line_error(tmp_path, args, message):
    proc = _search("--ctx", "256", "--out", str(tmp_path / "t.json"), *args, timeout_s=120)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("kvr-search: error:"), proc.stderr
    assert message in lines[0]


def test_one_rank_measures_its_ttft_into_a_degree_one_table(tmp_path):
    """--nproc 1: nothing to search, each length's one-rank TTFT measured (what the serving degree policy
    compares with the chain's table)."""
    table = tmp_path / "tiny_p1.json"
    proc = _search("--ctx", "256,512", "--out", str(table), "--nproc", "1", "--threads", "2")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(table.read_text())
    assert data["meta"]["world_size"] == 1 and data["meta"]["threads_per_rank"] == 2
    assert [(e["context_len"], e["boundaries"], e["evaluations"]) for e in data["entries"]] == [
        (256, [0, 256], 1), (512, [0, 512], 1)]
    assert all(e["ttft_s"] > 0 for e in data["entries"])


def test_the_balance_criterion_writes_entries_with_their_balance_and_resumes(tmp_path):
    table = tmp_path / "t.json"
    proc = _search("--ctx", "256,512", "--out", str(table), "--criterion", "balance", "--confirm-rounds", "2")
    assert proc.returncode == 0, proc.stderr
    entries = json.loads(table.read_text())["entries"]
    for entry in entries:
        assert entry["criterion"] == "balance" and entry["balance"] >= 1.0 and entry["even_ttft_s"] is None
        # balance and busy come from the chosen partition's own runs, which the checkpoint keeps: the median of
        # the runs' balances, and per rank the median busy (the two differ where runs disagree)
        runs = json.loads((tmp_path / "t.search" / f"{entry['context_len']}.balance.json").read_text())["runs"]
        mine = [r["busy_s"] for r in runs if r["boundaries"] == entry["boundaries"]]
        assert mine and min(min(r) for r in mine) > 0
        assert entry["balance"] == pytest.approx(statistics.median(max(r) / min(r) for r in mine), abs=1e-4)
        assert entry["busy_s"] == pytest.approx([statistics.median(r[i] for r in mine) for i in range(2)], abs=1e-4)
    # 512 starts where the rates measured at 256 balance it, not at the FLOP estimate
    seed = re.search(r"\[ctx 512\] seeded by the ranks' rates at 256 \(([\d,]+)\): ([\d,]+)", proc.stderr)
    assert seed and seed.group(1) == ",".join(map(str, entries[0]["boundaries"])), proc.stderr
    part = proc.stderr[proc.stderr.index("[ctx 512]"):]
    steps = re.findall(r"balance +(\d+(?:,\d+)+) ", part)
    confirms = re.findall(r"confirm +(\d+(?:,\d+)+) ", part)
    assert steps[0] == seed.group(2)
    assert len(confirms) == 2 * 2  # the balanced point and the neighbour its imbalance points to, 2 rounds
    assert entries[1]["evaluations"] == len(set(steps) | set(confirms))
    assert ",".join(map(str, entries[1]["boundaries"])) in confirms
    table.unlink()  # the checkpoints stay: a resumed search runs nothing again
    again = _search("--ctx", "256,512", "--out", str(table), "--criterion", "balance", "--confirm-rounds", "2",
                    "--resume")
    assert again.returncode == 0 and not re.search(r"(balance|confirm) +\d+,", again.stderr), again.stderr
    assert [e["boundaries"] for e in json.loads(table.read_text())["entries"]] == [e["boundaries"] for e in entries]


def test_the_balance_criterion_is_measured_on_the_ranks(tmp_path):
    proc = _search("--ctx", "512", "--out", str(tmp_path / "t.json"), "--criterion", "balance", "--backend",
                   "model", timeout_s=120)
    assert proc.returncode == 2 and "reads the balance of runs on the ranks" in proc.stderr, proc.stderr


def test_the_table_records_the_kernels_it_was_searched_on_and_a_run_on_others_calls_it_stale(tmp_path):
    table = tmp_path / "t.json"
    proc = _search("--ctx", "256", "--out", str(table), "--attention-kernel", "ours", "--linears", "torch")
    assert proc.returncode == 0, proc.stderr
    meta = json.loads(table.read_text())["meta"]
    assert meta["attention_kernel"].startswith("ours (") and meta["linears"] == "torch", meta
    same = kvr_prefill("--model", "tiny-llama", "--nproc", "2", "--ctx", "256", "--table", str(table),
                       "--attention-kernel", "ours", "--linears", "torch", "--json")
    assert same.returncode == 0 and "stale" not in same.stdout + same.stderr, same.stderr
    other = kvr_prefill("--model", "tiny-llama", "--nproc", "2", "--ctx", "256", "--table", str(table),
                        "--attention-kernel", "torch", "--linears", "torch", "--json")
    assert other.returncode == 0, other.stderr
    out = json.loads(other.stdout)
    assert f"searched with attention kernel {meta['attention_kernel']} (this run: torch)" in out["partition_warning"]
    assert "stale: re-weighted by the cost model for torch attention" in out["partition_source"]
