"""Reading back kvr-serve-bench's runs of a mixed workload (``rateR/POLICY/rows.jsonl`` under one folder): the
rows by rate and policy, the long requests' prefill windows, the short requests' time per output token during a long
prefill and while none ran, and a table cell's figure."""

from __future__ import annotations

import json
from pathlib import Path


def load(out: Path) -> dict[tuple[float, str], list[dict]]:
    """Every run under ``out`` (``rateR/POLICY/rows.jsonl``) by (rate, policy); empty runs left out."""
    runs = {}
    for rows in sorted(out.glob("rate*/*/rows.jsonl")):
        policy = rows.parent.name
        data = [json.loads(line) for line in rows.read_text().splitlines() if line.strip()]
        if data:
            runs[(float(rows.parent.parent.name.removeprefix("rate")), policy)] = data
    return runs


def long_windows(rows: list[dict]) -> list[tuple[float, float]]:
    """Each long request's window from its arrival to its first token."""
    return [(r["arrival_s"], r["arrival_s"] + r["ttft_s"]) for r in rows
            if r["kind"] == "long" and r.get("ttft_s") is not None]


def tpot_split(rows: list[dict]) -> tuple[list[float], list[float]]:
    """TPOT of the short requests decoding during a long prefill, and of those decoding while none ran."""
    windows = long_windows(rows)
    during, idle = [], []
    for r in rows:
        if r["kind"] != "short" or r.get("tpot_s") is None or r.get("error"):
            continue
        a, e = r["arrival_s"] + r["ttft_s"], r["arrival_s"] + r["e2e_s"]
        inside = sum(max(0.0, min(e, we) - max(a, wa)) for wa, we in windows)
        if inside >= 0.5 * (e - a):
            during.append(r["tpot_s"])
        elif inside == 0:
            idle.append(r["tpot_s"])
    return during, idle


def fmt(x, digits: int = 3) -> str:
    """A figure for a table cell: ``digits`` significant digits, whole above 1000, ``-`` for none."""
    return "-" if x is None else f"{x:.{digits}g}" if abs(x) < 1000 else f"{x:.0f}"
