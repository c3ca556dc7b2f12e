"""Where a packed batch is cut: the bins of one step each (first-fit decreasing) and the rank boundaries of a
step, balanced over the packed work and moved to a prompt edge where that costs little balance.

Torch-free: the work of a prompt's first t tokens is any increasing function (the FLOP estimate of
``kvrunahead.sim.flops`` in practice), so the planning is tested on plain numbers.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import accumulate

EDGE_SLACK = 0.1  # a cut moves to a prompt edge when that shifts its part's work by at most this share of a part


@dataclass(frozen=True)
class PackedStep:
    """One packed sequence: the prompts (indices into the batch) laid end to end, and the rank boundaries."""

    prompts: tuple[int, ...]
    lengths: tuple[int, ...]
    boundaries: tuple[int, ...]  # 0 = b_0 <= b_1 <= ... <= b_p = total; an empty part sits on a prompt edge

    @property
    def edges(self) -> tuple[int, ...]:
        """Packed start of every prompt, then the total: prompt k is [edges[k], edges[k + 1])."""
        return (0, *accumulate(self.lengths))

    @property
    def total(self) -> int:
        return self.edges[-1]

    def prompt_at(self, position: int) -> int:
        """The packed prompt (its place in this step) holding ``position``."""
        return bisect.bisect_right(self.edges, position) - 1

    def handed_on(self, boundary: int) -> int:
        """Tokens of the prompt cut by ``boundary`` that lie before it: what the rank ending there hands on (0 at
        a prompt edge: the next rank needs nothing from it)."""
        if boundary in (0, self.total):
            return 0
        return boundary - self.edges[self.prompt_at(boundary)]

    def positions(self, start: int, end: int) -> list[int]:
        """Position ids of [start, end): each prompt's own, restarting at 0."""
        edges = self.edges
        return [x - edges[self.prompt_at(x)] for x in range(start, end)]

    def segments(self, start: int, end: int) -> list[tuple[int, int, int]]:
        """The prompts that [start, end) touches: ``(k, lo, hi)``, prompt k's packed part [lo, hi) inside it."""
        if start == end:
            return []
        edges = self.edges
        out = []
        for k in range(self.prompt_at(start), self.prompt_at(end - 1) + 1):
            out.append((k, max(start, edges[k]), min(end, edges[k + 1])))
        return out

    def ending_in(self, start: int, end: int) -> list[int]:
        """The prompts (places in this step) whose last token lies in [start, end): their first token is this
        part's to emit."""
        return [k for k, _, hi in self.segments(start, end) if hi == self.edges[k + 1]]


def ffd_bins(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """First-fit decreasing (Prepacking's bin packing): prompt indices, longest first, each into the first bin it
    fits; a prompt longer than ``max_tokens`` gets a bin of its own. Bins keep their prompts in that order."""
    if max_tokens < 1:
        raise ValueError("the packed step needs room for at least one token")
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        at = next((b for b, r in enumerate(room) if lengths[i] <= r), None)
        if at is None:
            bins.append([i])
            room.append(max_tokens - lengths[i])
        else:
            bins[at].append(i)
            room[at] -= lengths[i]
    return bins


def packed_cuts(lengths: Sequence[int], world_size: int, work: Callable[[int], float],
                edge_slack: float = EDGE_SLACK) -> tuple[int, ...]:
    """Rank boundaries of prompts of ``lengths`` packed end to end: every part the same share of the packed work
    (``work(t)``: a prompt's first t tokens; additive, so a part cutting a prompt at t0..t1 costs work(t1) -
    work(t0)), each cut moved to the nearest prompt edge when that shifts it by at most ``edge_slack`` of a part's
    work. A prompt wholly inside one rank needs nothing from the predecessor.

    Parts are non-empty while there are tokens for every rank; with fewer tokens than ranks the first ranks get
    empty parts at position 0 (an edge)."""
    edges = [0, *accumulate(lengths)]
    total = edges[-1]
    if total < world_size:
        return (0,) * (world_size - total) + tuple(range(total + 1))
    done = [0.0, *accumulate(work(n) for n in lengths)]  # the packed work up to each edge

    def F(x: int) -> float:  # the packed work of [0, x)
        k = bisect.bisect_right(edges, x) - 1
        return done[k] if x == edges[k] else done[k] + work(x - edges[k])

    share = done[-1] / world_size
    cuts = [0]
    for r in range(1, world_size):
        target = r * share
        lo, hi = cuts[-1] + 1, total - (world_size - r)  # room for one token on every later rank
        x = _first_reaching(F, target, lo, hi)
        if x > lo and abs(F(x - 1) - target) < abs(F(x) - target):
            x -= 1
        k = bisect.bisect_left(edges, x)
        near = [e for e in (edges[k - 1] if k > 0 else None, edges[k] if k < len(edges) else None)
                if e is not None and lo <= e <= hi]
        best = min(near, key=lambda e: abs(F(e) - target), default=None)
        if best is not None and abs(F(best) - target) <= edge_slack * share:
            x = best
        cuts.append(x)
    return (*cuts, total)


def cuts_after_cached(cached: int, total: int, world_size: int, work: Callable[[int], float]) -> tuple[int, ...]:
    """Rank boundaries of a prompt of ``total`` tokens whose first ``cached`` are held already (a cached prefix):
    the new tokens [cached, total) cut so that every part has the same share of their work, each token priced with
    the cached prefix it attends to (``work(t)``: a whole prompt's first t tokens). Starts at ``cached``."""
    if not 0 <= cached < total:
        raise ValueError(f"a cached prefix of {cached} tokens leaves nothing of a {total}-token prompt to prefill")
    cuts = packed_cuts([total - cached], world_size, lambda t: work(cached + t) - work(cached), edge_slack=0.0)
    return tuple(cached + c for c in cuts)


def _first_reaching(F: Callable[[int], float], target: float, lo: int, hi: int) -> int:
    """The least x in [lo, hi] with F(x) >= target (hi if none): F is non-decreasing."""
    while lo < hi:
        mid = (lo + hi) // 2
        if F(mid) >= target:
            hi = mid
        else:
            lo = mid + 1
    return lo
