"""Context partitions: boundaries 0 = b0 < b1 < ... < bp = C, one part per rank."""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass


class PartitionError(ValueError):
    """A partition that cannot be used for the given context and world size."""


@dataclass(frozen=True)
class Partition:
    """Boundaries of a context cut into one contiguous part per rank."""

    boundaries: tuple[int, ...]

    def __post_init__(self) -> None:
        b = self.boundaries
        if len(b) < 2:
            raise PartitionError("a partition needs at least two boundaries (0 and C)")
        if b[0] != 0:
            raise PartitionError(f"boundaries must start at 0, got {b[0]}")
        for i, (lo, hi) in enumerate(zip(b, b[1:])):
            if hi <= lo:
                raise PartitionError(f"part {i} is empty: boundaries {lo} and {hi} (every rank needs >= 1 token)")

    @property
    def world_size(self) -> int:
        return len(self.boundaries) - 1

    @property
    def context_len(self) -> int:
        return self.boundaries[-1]

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(hi - lo for lo, hi in zip(self.boundaries, self.boundaries[1:]))

    @property
    def ratios(self) -> tuple[float, ...]:
        return tuple(s / self.context_len for s in self.sizes)

    def part(self, rank: int) -> tuple[int, int]:
        """Token range [start, end) of ``rank``."""
        return self.boundaries[rank], self.boundaries[rank + 1]

    def ranges(self) -> list[list[tuple[int, int]]]:
        """Every rank's token ranges: one contiguous range each (single, kvr and tsp lay the prompt out so)."""
        return [[self.part(r)] for r in range(self.world_size)]

    def zigzag(self) -> list[list[tuple[int, int]]]:
        """Every rank's token ranges in the zigzag layout (ring attention, cp-allgather): the partition's context
        cut evenly into 2p chunks, rank i holding chunks i and 2p-1-i."""
        return zigzag_ranges(self.context_len, self.world_size)

    def __str__(self) -> str:
        return ",".join(str(b) for b in self.boundaries)

    @classmethod
    def even(cls, context_len: int, world_size: int) -> Partition:
        check_fits(context_len, world_size)
        return cls(tuple(round(i * context_len / world_size) for i in range(world_size + 1)))

    @classmethod
    def from_ratios(cls, ratios: list[float] | tuple[float, ...], context_len: int) -> Partition:
        """Round shares to whole tokens so that they sum to C and no part is empty.

        Largest-remainder rounding keeps every part within one token of its exact share; parts
        that would round to zero are raised to one token, taken from the largest parts.
        """
        p = len(ratios)
        check_fits(context_len, p)
        if any(r <= 0 for r in ratios):
            raise PartitionError(f"ratios must be positive, got {list(ratios)}")
        total = sum(ratios)
        exact = [r / total * context_len for r in ratios]
        sizes = [int(x) for x in exact]
        order = sorted(range(p), key=lambda i: exact[i] - sizes[i], reverse=True)
        for i in order[: context_len - sum(sizes)]:
            sizes[i] += 1
        for i in range(p):
            if sizes[i] == 0:
                donor = max(range(p), key=lambda j: sizes[j])
                sizes[donor] -= 1
                sizes[i] = 1
        bounds = [0]
        for s in sizes:
            bounds.append(bounds[-1] + s)
        return cls(tuple(bounds))


def zigzag_ranges(context_len: int, world_size: int) -> list[list[tuple[int, int]]]:
    """Rank i holds chunks i and 2p-1-i of 2p (load-balanced under the causal mask)."""
    chunks = Partition.even(context_len, 2 * world_size)
    return [[chunks.part(i), chunks.part(2 * world_size - 1 - i)] for i in range(world_size)]


def zigzag_emitter(world_size: int) -> int:
    """The rank that emits the first token in the zigzag layout: rank 0 holds chunk 2p-1, the end of the prompt."""
    return 0


def last_rank(world_size: int) -> int:
    """The rank that emits the first token where the parts are contiguous: the one holding the prompt's end."""
    return world_size - 1


def check_fits(context_len: int, world_size: int) -> None:
    if world_size < 1:
        raise PartitionError(f"world size must be >= 1, got {world_size}")
    if context_len < world_size:
        raise PartitionError(
            f"context of {context_len} tokens is smaller than the {world_size} ranks (each needs >= 1 token)"
        )


_NUMBER = re.compile(r"^\s*\d+(\.\d*)?\s*$")


def parse_partition(spec: str, context_len: int, world_size: int) -> Partition:
    """Parse ``even``, explicit boundaries (``0,9728,16384``) or ratios (``0.6,0.4``)."""
    spec = spec.strip()
    check_fits(context_len, world_size)
    if spec == "even":
        return Partition.even(context_len, world_size)
    items = [s for s in spec.split(",")]
    if not items or not all(_NUMBER.match(s) for s in items):
        raise PartitionError(
            f"cannot parse partition {spec!r}: use 'even', boundaries like 0,900,2048 or ratios like 0.6,0.4"
        )
    if any("." in s for s in items):
        ratios = [float(s) for s in items]
        if len(ratios) != world_size:
            raise PartitionError(f"partition has {len(ratios)} ratios but the world size is {world_size}")
        if abs(sum(ratios) - 1.0) > 0.01:
            raise PartitionError(f"ratios must sum to 1, got {sum(ratios):.4f}")
        return Partition.from_ratios(ratios, context_len)
    bounds = tuple(int(s) for s in items)
    if len(bounds) - 1 != world_size:
        raise PartitionError(
            f"partition has {len(bounds) - 1} parts but the world size is {world_size} "
            f"({world_size} ranks need {world_size + 1} boundaries from 0 to {context_len}, "
            f"e.g. {','.join(map(str, Partition.even(context_len, world_size).boundaries))})")
    if bounds[-1] != context_len:
        raise PartitionError(f"boundaries must end at the context length {context_len}, got {bounds[-1]}")
    return Partition(bounds)


def equal_level_sizes(works: list[Callable[[float, float], float]], n: int) -> list[float]:
    """Continuous part sizes, summing to ``n``, at which every rank's ``works[i](prefix, size)`` is equal (each work
    increasing in both): bisection on the common level, each part the most tokens within it."""

    def within(i: int, prefix: float, level: float) -> float:
        lo, hi = 0.0, float(n)
        while hi - lo > 1e-6:  # a millionth of a token: the sizes are rounded to tokens
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if works[i](prefix, mid) <= level else (lo, mid)
        return lo

    def covered(level: float) -> list[float]:
        prefix, sizes = 0.0, []
        for i in range(len(works)):
            sizes.append(within(i, prefix, level))
            prefix += sizes[-1]
        return sizes

    lo, hi = 0.0, max(w(0.0, float(n)) for w in works)  # at that level rank 0 alone covers everything
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if sum(covered(mid)) < n else (lo, mid)
        if hi - lo <= 1e-12 * hi:
            break
    sizes = covered(hi)
    return [x * n / sum(sizes) for x in sizes]


def balanced_cut(costs: list[float], parts: int) -> Partition:
    """``costs`` (one per item: a pipeline stage's layers) cut into ``parts`` contiguous non-empty runs whose
    largest sum is the least possible (the pipeline moves at its slowest stage): exact, by dynamic programming."""
    n = len(costs)
    check_fits(n, parts)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(parts + 1)]  # best[k][i]: the first i items in k runs
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0.0
    for k in range(1, parts + 1):
        for i in range(k, n - (parts - k) + 1):
            for j in range(k - 1, i):
                worst = max(best[k - 1][j], prefix[i] - prefix[j])
                if worst < best[k][i]:
                    best[k][i], cut[k][i] = worst, j
    bounds = [n]
    for k in range(parts, 0, -1):
        bounds.append(cut[k][bounds[-1]])
    return Partition(tuple(reversed(bounds)))


Work = Callable[[float, float], float]  # (prefix tokens, own tokens) -> modelled work of one rank


def rank_rates(boundaries: Sequence[int], busy: Sequence[float], work: Work) -> list[float]:
    """Each rank's seconds per unit of modelled work in one run: ``busy[i] / work(prefix_i, tokens_i)``."""
    rates = []
    for i in range(len(boundaries) - 1):
        w = work(float(boundaries[i]), float(boundaries[i + 1] - boundaries[i]))
        rates.append(busy[i] / w if w > 0 else 0.0)
    if min(rates) <= 0:
        raise ValueError(f"a rank reported no busy time: {list(busy)}")
    return rates


def balanced_boundaries(boundaries: Sequence[int], busy: Sequence[float], work: Work, quantum: int = 1,
                        length: int | None = None) -> tuple[int, ...]:
    """Where every rank's busy time would be equal, if each kept the rate it showed at ``boundaries``: rank i's
    predicted busy for a part of n tokens after a prefix of b is ``rate_i * work(b, n)``. Boundaries are rounded
    to ``quantum`` tokens and every part keeps at least one quantum. ``length``: balance another context than
    the measured one with the same rates (a search seeded by the rates a shorter length measured)."""
    return boundaries_at_rates(rank_rates(boundaries, busy, work), work, length or boundaries[-1], quantum)


def boundaries_at_rates(rates: Sequence[float], work: Work, n: int, quantum: int = 1) -> tuple[int, ...]:
    """The boundaries of ``n`` tokens at which ranks of these ``rates`` are equally busy (balanced_boundaries),
    a valid partition of ``n`` by construction: the quantum shrinks to what ``n`` leaves each rank (a 5-token
    prompt over 2 ranks is cut to the token, not to 8: a quantum wider than a part once put a cut at -3)."""
    p = len(rates)
    check_fits(n, p)
    quantum = max(1, min(quantum, n // p))
    sizes = equal_level_sizes([lambda b, t, r=r: r * work(b, t) for r in rates], n)
    cuts, prefix = [0], 0.0
    for s in sizes[:-1]:
        prefix += s
        cuts.append(round(prefix / quantum) * quantum)
    cuts.append(n)
    for i in range(1, p):  # every part at least one quantum; the last at least what is left (n - (p-1) quanta)
        cuts[i] = min(max(cuts[i], cuts[i - 1] + quantum), n - (p - i) * quantum)
    return Partition(tuple(cuts)).boundaries
