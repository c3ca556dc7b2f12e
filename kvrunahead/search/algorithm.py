"""Offline partition search (paper section 4.2, fig. 6; appendix D).

Knows nothing of torch: it is given ``measure(boundaries) -> seconds`` and looks for the boundaries that
minimise it. For two ranks a golden-section search over rank 0's extra tokens (fig. 6a); for more, the
hierarchical grid search of fig. 6 b-d over the offsets (delta_1 .. delta_{p-1}) of the inner boundaries
from the even ones: a coarse grid, then the cell around the best point with half the stride, down to a
minimum stride. Every candidate is measured at most once, logged, and checkpointed.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from kvrunahead.partition import Partition

log = logging.getLogger(__name__)

Boundaries = tuple[int, ...]


@dataclass
class Evaluator:
    """``measure`` with memory: a candidate is never measured twice; optionally checkpointed to JSON."""

    measure: Callable[[Boundaries], float]
    checkpoint: Path | None = None
    on_measure: Callable[[Boundaries, float], None] | None = None
    results: dict[Boundaries, float] = field(default_factory=dict)
    order: list[Boundaries] = field(default_factory=list)
    measured: int = 0  # measure calls made by this process (resumed results excluded)

    def __post_init__(self) -> None:
        if self.checkpoint is not None and Path(self.checkpoint).exists():
            self.preload(json.loads(Path(self.checkpoint).read_text()))
            log.info("resumed %d evaluations from %s", len(self.order), self.checkpoint)

    def preload(self, data: dict) -> None:
        """Take earlier evaluations (a checkpoint's content) as measured."""
        for b, t in data.get("evaluations", []):
            if tuple(b) not in self.results:
                self.results[tuple(b)] = t
                self.order.append(tuple(b))

    def __call__(self, b: Boundaries) -> float:
        b = tuple(int(x) for x in b)
        if b not in self.results:
            t = self.measure(b)
            self.measured += 1
            self.results[b] = t
            self.order.append(b)
            if self.checkpoint is not None:
                self._save()
            if self.on_measure is not None:
                self.on_measure(b, t)
        return self.results[b]

    def _save(self) -> None:
        path = Path(self.checkpoint)
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(json.dumps({"evaluations": [[list(b), self.results[b]] for b in self.order]}))
        tmp.replace(path)

    def best(self) -> tuple[Boundaries, float]:
        b = min(self.results, key=self.results.get)
        return b, self.results[b]


@dataclass
class SearchResult:
    boundaries: Boundaries
    ttft_s: float
    evaluations: int  # distinct candidates measured (including resumed ones)
    search_s: float
    levels: int
    all: dict[Boundaries, float] = field(default_factory=dict)  # every candidate measured, with its TTFT


def _feasible(b: Boundaries) -> bool:
    return all(hi > lo for lo, hi in zip(b, b[1:]))


def _from_deltas(base: Boundaries, deltas: tuple[int, ...]) -> Boundaries:
    return (0, *(x + d for x, d in zip(base[1:-1], deltas)), base[-1])


def golden_section(ev: Evaluator, context_len: int, lo: int, hi: int, stride: int) -> int:
    """Minimise over rank 0's extra tokens delta in [lo, hi] on a grid of ``stride`` (TTFT assumed unimodal)."""
    base = Partition.even(context_len, 2).boundaries

    def f(k: int) -> float:
        return ev(_from_deltas(base, (lo + k * stride,)))

    a, b = 0, (hi - lo) // stride
    inv_phi = (math.sqrt(5) - 1) / 2
    while b - a > 3:
        c = b - round((b - a) * inv_phi)
        d = a + round((b - a) * inv_phi)
        if c == d:
            d += 1
        if f(c) <= f(d):
            b = d
        else:
            a = c
    k = min(range(a, b + 1), key=f)
    return lo + k * stride


def grid_search(ev: Evaluator, context_len: int, world_size: int, center: tuple[int, ...], half_width: int,
                stride: int, min_stride: int, on_level: Callable[[int, int, int], None] | None = None) -> int:
    """Hierarchical grid search (fig. 6 b-d); returns the number of levels. ``center`` are deltas."""
    base = Partition.even(context_len, world_size).boundaries
    level = 0
    while True:
        level += 1
        steps = range(-(half_width // stride), half_width // stride + 1)
        grid = []
        for ks in itertools.product(steps, repeat=world_size - 1):
            b = _from_deltas(base, tuple(c + k * stride for c, k in zip(center, ks)))
            if _feasible(b):
                grid.append(b)
        if on_level is not None:
            on_level(level, stride, len(grid))
        best = min(grid, key=ev)
        center = tuple(x - y for x, y in zip(best[1:-1], base[1:-1]))
        if stride <= min_stride:
            return level
        # Zoom into the cell around the best point with half the stride.
        half_width, stride = stride, max(min_stride, stride // 2)


MAX_SLIDES = 4
MAX_POLISH_STEPS = 8


def polish(ev: Evaluator, min_stride: int, max_steps: int = MAX_POLISH_STEPS) -> int:
    """Hill-climb from the best candidate measured: measure its neighbours one ``min_stride`` away on every
    inner boundary and move while one is better. Golden-section and grid steps decide on differences that
    the noise of real runs can reverse, and can leave the region next to the best point unmeasured (a
    search whose best point is the even partition, with no candidate between it and the next one tried);
    this ends every search on a point whose neighbours were measured and found no better. Returns the
    candidates it measured."""
    before = len(ev.results)
    for _ in range(max_steps):
        best = ev.best()[0]
        for i in range(1, len(best) - 1):
            for step in (-min_stride, min_stride):
                b = (*best[:i], best[i] + step, *best[i + 1:])
                if _feasible(b):
                    ev(b)
        if ev.best()[0] == best:
            break
    return len(ev.results) - before


def _search_window(ev: Evaluator, context_len: int, world_size: int, center: tuple[int, ...] | None, half: int,
                   min_stride: int, on_level: Callable[[int, int, int], None] | None) -> int:
    """One search of the deltas within ``half`` tokens of ``center`` (None: the whole range); returns levels."""
    base = Partition.even(context_len, world_size).boundaries
    if world_size == 2:
        if center is None:
            # Rank 1 also attends to rank 0's tokens, so rank 0 never needs fewer than half (fig. 6a):
            # search rank 0's share over [1/2, 7/8].
            lo, hi = 0, 3 * context_len // 8
        else:
            lo, hi = center[0] - half, center[0] + half
        lo = max(lo, -(base[1] - 1))
        hi = min(hi, context_len - base[1] - 1)
        if on_level is not None:
            on_level(1, min_stride, (hi - lo) // min_stride + 1)
        golden_section(ev, context_len, lo, hi, min_stride)
        return 1
    # Coarsest level: at most 5 points per boundary (fig. 6b), strides a power of two times the minimum.
    stride = min_stride
    while stride * 2 < half:
        stride *= 2
    return grid_search(ev, context_len, world_size, center or (0,) * (world_size - 1), half, stride, min_stride,
                       on_level)


def search(
    measure: Callable[[Boundaries], float],
    context_len: int,
    world_size: int,
    min_stride: int = 64,
    seed: Boundaries | None = None,
    window: int | None = None,
    checkpoint: Path | None = None,
    on_measure: Callable[[Boundaries, float], None] | None = None,
    on_level: Callable[[int, int, int], None] | None = None,
    preload: dict | None = None,
    polish_best: bool = True,
) -> SearchResult:
    """Find TTFT-minimising boundaries for ``context_len`` tokens over ``world_size`` ranks.

    Without ``seed`` the whole range is searched: for p = 2 rank 0's share over [1/2, 7/8] of the
    context; for p > 2 each inner boundary within half a part of the even one. With ``seed``
    (boundaries interpolated from a table) only ``window`` tokens either side of it are searched, and the
    window slides when the best point lies on its edge. The even partition is always measured first;
    ``SearchResult.all`` holds its TTFT. With ``polish_best`` the best point found is then hill-climbed at
    ``min_stride`` (see ``polish``).
    """
    if world_size < 1:
        raise ValueError("a search needs at least one rank")
    if context_len < world_size * min_stride and world_size > 1:
        raise ValueError(f"context of {context_len} tokens is too short for {world_size} ranks at stride {min_stride}")
    t0 = time.perf_counter()
    ev = Evaluator(measure, checkpoint, on_measure)
    if preload:
        ev.preload(preload)
    if world_size == 1:  # nothing to search: the one-rank TTFT, measured (what the degree policy compares)
        best, ttft = (0, context_len), ev((0, context_len))
        return SearchResult(best, ttft, len(ev.results), time.perf_counter() - t0, 0, dict(ev.results))
    base = Partition.even(context_len, world_size).boundaries
    ev(base)  # the reference every table entry records (TTFT of KVR-E), and a candidate like any other
    if seed is None:
        levels = _search_window(ev, context_len, world_size, None, context_len // (2 * world_size), min_stride,
                                on_level)
    else:
        # A seeded window is slid while its best point lies on its edge (the seed was off by more than the
        # window), up to MAX_SLIDES times; points measured before are not measured again.
        half = window or 4 * min_stride
        center = tuple(s - b for s, b in zip(seed[1:-1], base[1:-1]))
        levels = 0
        for _ in range(1 + MAX_SLIDES):
            levels += _search_window(ev, context_len, world_size, center, half, min_stride, on_level)
            best = tuple(x - y for x, y in zip(ev.best()[0][1:-1], base[1:-1]))
            if all(abs(x - c) < half - min_stride for x, c in zip(best, center)) or best == center:
                break
            center = best
    if polish_best:
        polish(ev, min_stride)
    best, ttft = ev.best()
    return SearchResult(best, ttft, len(ev.results), time.perf_counter() - t0, levels, dict(ev.results))


def refine(measure: Callable[[Boundaries], float], seed: Boundaries, min_stride: int = 64,
           checkpoint: Path | None = None, on_measure: Callable[[Boundaries, float], None] | None = None,
           preload: dict | None = None) -> SearchResult:
    """Measure only around a predicted partition (``kvr-search --backend model --refine``): the seed, then
    ``polish`` (its neighbours one ``min_stride`` away, moving while one is better). At least 1 + 2(p-1)
    candidates; the even partition is not measured (``SearchResult.all`` lacks it)."""
    t0 = time.perf_counter()
    ev = Evaluator(measure, checkpoint, on_measure)
    if preload:
        ev.preload(preload)
    ev(tuple(seed))
    polish(ev, min_stride)
    best, ttft = ev.best()
    return SearchResult(best, ttft, len(ev.results), time.perf_counter() - t0, 1, dict(ev.results))
