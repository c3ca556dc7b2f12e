"""What ``kvr-search`` measures on the ranks: one candidate partition's TTFT, the same figure on every rank.

The ranks stay up for the whole search: the model is loaded once; every rank runs the same search code,
and the emitting rank's measured TTFT is shared with all, so every rank proposes the same next candidate.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable

from kvrunahead.config import RunConfig
from kvrunahead.net.liveness import gather_objects
from kvrunahead.oneshot.runner import prefill_on_world
from kvrunahead.ranks.launcher import World
from kvrunahead.search.algorithm import Boundaries
from kvrunahead.search.balance import Measurement


def share(value, world: World) -> object:
    """The value of whichever rank has one (the emitting rank), on every rank."""
    if world.world_size * world.tp == 1:
        return value
    gathered = gather_objects(value, "the other ranks' measurement")
    return next(v for v in gathered if v is not None)


def ttft_on_ranks(base: RunConfig, world: World, context_len: int, repeats: int,
                  warmup_runs: int) -> Callable[[Boundaries], float]:
    """``measure(boundaries) -> seconds`` for the search: the median TTFT of ``repeats`` prefills of
    ``context_len`` tokens under the boundaries, after ``warmup_runs`` untimed ones before the first candidate."""
    warm = {"runs": warmup_runs}

    def measure(b: Boundaries) -> float:
        # The warm-up runs precede a length's first candidate only: the model stays loaded and warm
        # between candidates, and the median of the repeats absorbs a slower first run of a new shape.
        cfg = dataclasses.replace(base, context_len=context_len, partition=",".join(map(str, b)))
        times = []
        for i in range(warm["runs"] + repeats):
            result = prefill_on_world(cfg, world)
            t = share(result.ttft_s if result is not None else None, world)
            if i >= warm["runs"]:
                times.append(t)
        warm["runs"] = 0
        return statistics.median(times)

    return measure


def busy_on_ranks(base: RunConfig, world: World, context_len: int,
                  warmup_runs: int) -> Callable[[Boundaries], Measurement]:
    """``measure(boundaries) -> Measurement`` for the balance search: one prefill's TTFT and every rank's busy
    time (compute, without its waits and blocked sends), the same on every rank; ``warmup_runs`` untimed runs
    before the first candidate."""
    warm = {"runs": warmup_runs}

    def measure(b: Boundaries) -> Measurement:
        cfg = dataclasses.replace(base, context_len=context_len, partition=",".join(map(str, b)))
        for _ in range(warm["runs"]):
            prefill_on_world(cfg, world)
        warm["runs"] = 0
        result = prefill_on_world(cfg, world)
        mine = Measurement(result.ttft_s, tuple(r.compute_s for r in result.ranks)) if result is not None else None
        return share(mine, world)

    return measure
