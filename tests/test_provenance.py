"""Every results file under experiments/ says where it came from: the host's CPU (its name, not the architecture),
the command that made it and the commit the code was at, in its rows or in its experiment's PROVENANCE.md."""

from __future__ import annotations

import csv
import fnmatch
import json
import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
EXPERIMENTS = REPO / "experiments"
CPU = re.compile(r"intel|xeon|amd|epyc|ryzen|arm|neoverse|graviton|apple|nvidia|h100|h200|a100", re.I)
COMMIT = re.compile(r"\b[0-9a-f]{7,40}\b")


def _results() -> list[Path]:
    listed = subprocess.run(["git", "ls-files", "experiments"], cwd=REPO, capture_output=True, text=True).stdout
    return [REPO / f for f in listed.split() if f.endswith((".jsonl", ".csv"))]


def _rows(path: Path) -> list[dict]:
    text = path.read_text()
    if path.suffix == ".csv":
        return list(csv.DictReader(text.splitlines()))
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def _named(row: dict, keys: tuple[str, ...]) -> str:
    """The first of ``keys`` the row holds, looked for in its nested ``machine`` or ``environment`` too."""
    for where in (row, row.get("machine"), row.get("environment")):
        if isinstance(where, dict):
            for key in keys:
                if where.get(key):
                    return json.dumps(where[key]) if not isinstance(where[key], str) else where[key]
    return ""


def _entries(text: str) -> list[str]:
    """PROVENANCE.md cut into its entries: table rows, list items and paragraphs."""
    entries, current = [], []
    for line in text.splitlines():
        if not line.strip() or line.startswith(("|", "- ", "#")):
            entries.append("\n".join(current))
            current = [line] if line.strip() else []
        else:
            current.append(line)
    return [e for e in entries + ["\n".join(current)] if e.strip()]


def _provenance(path: Path, experiments: Path) -> tuple[str, list[str]]:
    """The experiment's PROVENANCE.md: its host lines, and its entries that name ``path`` or a folder above it (in
    backticks, a glob allowed: `rows/*_r1/`)."""
    top = experiments / path.relative_to(experiments).parts[0]
    doc = top / "PROVENANCE.md"
    if not doc.exists():
        return "", []
    text = doc.read_text()
    host = "\n".join(line for line in text.splitlines() if re.match(r"\W*(host|machine)\b", line, re.I))
    inner = path.relative_to(top)
    names = {inner.as_posix(), *(q.as_posix() + "/" for q in inner.parents if q.as_posix() != ".")}
    named = []
    for entry in _entries(text):
        quoted = re.findall(r"`([^`]+)`", entry)
        if any(fnmatch.fnmatch(n, q.removeprefix(f"experiments/{top.name}/")) for q in quoted for n in names):
            named.append(entry)
    return host, named


def _missing(path: Path, experiments: Path = EXPERIMENTS) -> list[str]:
    if path.name == "summary.csv" and (path.parent / "runs.jsonl").exists():
        path = path.parent / "runs.jsonl"  # a summary is its rows' medians: it comes from where they do
    rows = _rows(path)
    host, provenance = _provenance(path, experiments)
    missing = []
    if not all(CPU.search(_named(r, ("cpu", "machine", "host", "device_name"))) for r in rows) and not CPU.search(host):
        missing.append("the host's CPU")
    if not all(_named(r, ("command", "cmd")) for r in rows) and not provenance:
        missing.append("the command")
    if not all(COMMIT.search(_named(r, ("commit",))) for r in rows) and not any(COMMIT.search(p) for p in provenance):
        missing.append("the commit")
    return missing


@pytest.mark.parametrize("path", _results(), ids=lambda p: str(p.relative_to(EXPERIMENTS)))
def test_a_results_file_names_its_host_command_and_commit(path):
    assert not (missing := _missing(path)), f"{path.relative_to(REPO)} does not name {', '.join(missing)}"


def test_a_file_that_does_not_say_is_named_until_its_provenance_does(tmp_path):
    rows = tmp_path / "trial" / "rows.jsonl"
    rows.parent.mkdir()
    rows.write_text(json.dumps({"machine": "x86_64", "ttft_s": 1.0}) + "\n")
    assert _missing(rows, tmp_path) == ["the host's CPU", "the command", "the commit"]
    (rows.parent / "PROVENANCE.md").write_text("Host: 2-vCPU AMD EPYC, 24 GiB\n\n| file | made by | commit |\n"
                                               "|---|---|---|\n| `other.jsonl` | `python other.py` | 1234abc |\n")
    assert _missing(rows, tmp_path) == ["the command", "the commit"]  # the host line holds; no entry names it
    with (rows.parent / "PROVENANCE.md").open("a") as f:
        f.write("| `rows.jsonl` | `python trial/run.py` | 5678def |\n")
    assert _missing(rows, tmp_path) == []
