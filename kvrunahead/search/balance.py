"""A partition search that reads the ranks' balance from each run, not the TTFT of runs minutes apart.

The golden-section search compares TTFTs measured one after another on a machine whose speed drifts by more than
the differences it decides on. One run's per-rank figures are immune to that drift: every rank ran at the same
time. So each step measures a candidate, reads every rank's busy time (its compute, without waiting for its
predecessor or on its sends), turns it into that rank's rate against the FLOP model of its part
(``rate_i = busy_i / work(prefix_i, tokens_i)``), and moves every boundary to where the rates predict equal busy
times: a root-finding (Newton-like) step on the balance, which for p > 2 moves each boundary by its neighbours'
imbalance at once. It stops when the measured balance (max busy / min busy) is within ``tolerance`` or a step
moves no boundary by a ``quantum``. The balanced point and, per boundary, its neighbour one ``stride`` away on
the side the measured imbalance points to (or both neighbours) are then timed in ``confirm_rounds`` interleaved
rounds (one run of each per round, so the drift hits all alike); a neighbour replaces the balanced point only
where its median TTFT is lower by more than ``confirm_margin`` (1%: interleaved medians of three runs differ by
about that with nothing changed, and within it the balance, read free of the drift, is the better witness).

The rates one length measured also place the next: ``balanced_boundaries(..., length=n)`` carries them to
another context, where a search over several lengths starts (kvrunahead/search/ranks.py), so that most lengths
balance at their first run.

Knows nothing of torch: it is given ``measure(boundaries) -> Measurement`` and the work model.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kvrunahead.partition import Work, balanced_boundaries

Boundaries = tuple[int, ...]
CONFIRM = ("toward", "both")  # the neighbours confirmed: the one the imbalance points to per boundary, or both


@dataclass(frozen=True)
class Measurement:
    ttft_s: float
    busy_s: tuple[float, ...]  # per rank: compute only (no waits for the predecessor, no blocked sends)

    @property
    def balance(self) -> float:
        """max busy / min busy: 1.0 is perfect balance."""
        return max(self.busy_s) / max(min(self.busy_s), 1e-9)


@dataclass
class BalanceResult:
    boundaries: Boundaries
    ttft_s: float  # the median of its confirmation runs
    balance: float  # of the chosen candidate: the median over all its runs (one run's reading varies by ~5%)
    candidates: int  # distinct partitions measured
    runs: int  # prefills run (balancing steps and confirmation runs)
    search_s: float
    steps: list[dict] = field(default_factory=list)  # the balancing steps: boundaries, TTFT, busy, balance
    confirmation: dict[str, list[float]] = field(default_factory=dict)  # "b0,b1,..." -> its TTFTs
    busy_s: tuple[float, ...] = ()  # of the chosen candidate, per rank: the median over all its runs


def _key(b: Boundaries) -> str:
    return ",".join(map(str, b))


def neighbours(b: Boundaries, stride: int) -> list[Boundaries]:
    """``b`` with one inner boundary moved ``stride`` either way (those that leave every part non-empty)."""
    out = []
    for i in range(1, len(b) - 1):
        for step in (-stride, stride):
            c = (*b[:i], b[i] + step, *b[i + 1:])
            if all(hi > lo for lo, hi in zip(c, c[1:])):
                out.append(c)
    return out


def toward_balance(b: Boundaries, busy: Sequence[float], stride: int) -> list[Boundaries]:
    """``b`` with one inner boundary moved ``stride`` away from the busier of the two ranks beside it: the one
    neighbour per boundary that the measured imbalance says may be faster (those that leave every part
    non-empty)."""
    out = []
    for i in range(1, len(b) - 1):
        step = -stride if busy[i - 1] > busy[i] else stride
        c = (*b[:i], b[i] + step, *b[i + 1:])
        if all(hi > lo for lo, hi in zip(c, c[1:])):
            out.append(c)
    return out


@dataclass
class _Log:
    """The runs so far, checkpointed after each one. A resumed search makes the same calls in the same order (it
    is deterministic given the figures), so the k-th call takes the k-th saved run while they agree."""

    path: Path | None
    runs: list[dict] = field(default_factory=list)  # {"phase", "boundaries", "ttft_s", "busy_s"}
    calls: int = 0

    def __post_init__(self) -> None:
        if not self.runs and self.path is not None and Path(self.path).exists():
            self.runs = json.loads(Path(self.path).read_text()).get("runs", [])

    def run(self, phase: str, b: Boundaries, measure: Callable[[Boundaries], Measurement],
            on_measure: Callable[[str, Boundaries, Measurement], None] | None) -> Measurement:
        k, self.calls = self.calls, self.calls + 1
        if k < len(self.runs):
            done = self.runs[k]
            if done["phase"] == phase and tuple(done["boundaries"]) == b:
                return Measurement(done["ttft_s"], tuple(done["busy_s"]))
            del self.runs[k:]  # the search took another way than the saved one: measure from here
        m = measure(b)
        self.runs.append({"phase": phase, "boundaries": list(b), "ttft_s": m.ttft_s, "busy_s": list(m.busy_s)})
        if self.path is not None:
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
            Path(self.path).write_text(json.dumps({"runs": self.runs}, indent=1))
        if on_measure is not None:
            on_measure(phase, b, m)
        return m


def _confirmed(best: Boundaries, pool: list[Boundaries], confirmation: dict[str, list[float]],
               margin: float) -> Boundaries:
    """The balanced point, unless a neighbour's median TTFT is more than ``margin`` lower (then the fastest)."""
    median = {c: statistics.median(confirmation[_key(c)]) for c in pool}
    fastest = min(pool, key=lambda c: (median[c], c != best))
    return fastest if median[fastest] < median[best] * (1 - margin) else best


def balance_search(measure: Callable[[Boundaries], Measurement], seed: Boundaries, work: Work, stride: int = 64,
                   quantum: int = 8, tolerance: float = 0.02, max_steps: int = 6, confirm_rounds: int = 3,
                   checkpoint: Path | None = None, preload: list[dict] | None = None,
                   on_measure: Callable[[str, Boundaries, Measurement], None] | None = None,
                   confirm: str = "toward", confirm_margin: float = 0.01) -> BalanceResult:
    """Balance from ``seed``, then confirm against the neighbours ``stride`` away (see the module's text):
    ``confirm="toward"`` those the measured imbalance points to (one per boundary), ``"both"`` either way; a
    neighbour is chosen only where its median TTFT is more than ``confirm_margin`` below the balanced point's.
    ``preload``: the runs of an interrupted search (a checkpoint's ``runs``, shared by every rank), replayed in
    place of the ``checkpoint`` file's."""
    if len(seed) < 3:
        raise ValueError("a partition search needs at least two ranks")
    if confirm not in CONFIRM:
        raise ValueError(f"confirm must be one of {CONFIRM}, not {confirm!r}")
    t0 = time.perf_counter()
    log = _Log(checkpoint, list(preload or []))
    b, steps, seen = tuple(seed), [], {}
    busies: dict[Boundaries, list[tuple[float, ...]]] = {}
    for _ in range(max_steps):
        m = log.run("balance", b, measure, on_measure)
        seen[b] = m
        busies.setdefault(b, []).append(m.busy_s)
        steps.append({"boundaries": list(b), "ttft_s": m.ttft_s, "busy_s": list(m.busy_s), "balance": m.balance})
        if m.balance <= 1 + tolerance:
            break
        nxt = balanced_boundaries(b, m.busy_s, work, quantum)
        if nxt in seen or max(abs(x - y) for x, y in zip(nxt, b)) < quantum:
            break
        b = nxt
    best = min(seen, key=lambda c: seen[c].balance)
    others = toward_balance(best, seen[best].busy_s, stride) if confirm == "toward" else neighbours(best, stride)
    pool = [best, *others]
    confirmation: dict[str, list[float]] = {_key(c): [] for c in pool}
    for _ in range(confirm_rounds):
        for c in pool:
            m = log.run("confirm", c, measure, on_measure)
            confirmation[_key(c)].append(m.ttft_s)
            busies.setdefault(c, []).append(m.busy_s)
    chosen = _confirmed(best, pool, confirmation, confirm_margin)
    runs = busies[chosen]
    balance = statistics.median(Measurement(0.0, r).balance for r in runs)
    busy = tuple(statistics.median(r[i] for r in runs) for i in range(len(chosen) - 1))
    return BalanceResult(chosen, statistics.median(confirmation[_key(chosen)]), balance,
                         len(set(seen) | set(pool)), log.calls, time.perf_counter() - t0, steps, confirmation, busy)
