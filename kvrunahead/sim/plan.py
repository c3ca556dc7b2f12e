"""Rank count, mode and partition for a context length on a profile (appendix B's question, for any length).

Every rank count from one to ``max_ranks`` (powers of two and the maximum) and every mode is simulated;
KV-Runahead with the partition the cost model finds for that count, the stream pipeline (spp) with its balanced
stages and the chunk the cost model finds best. The fastest option is recommended.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvrunahead.sim.costmodel import CostModel
from kvrunahead.sim.links import NoiseModel
from kvrunahead.sim.optimize import plan_pipeline, search_partition
from kvrunahead.sim.simulate import SimResult, simulate

PARALLEL_MODES = ("kvr", "tsp", "cp-allgather", "ring", "spp")


@dataclass
class Option:
    ranks: int
    mode: str
    boundaries: tuple[int, ...]  # kvr: the partition; spp: the stages' layer boundaries
    ttft_s: float
    result: SimResult
    chunk_tokens: int | None = None  # spp: the chunk pipelined through the stages

    @property
    def label(self) -> str:
        return "single" if self.ranks == 1 else f"{self.mode} x{self.ranks}"


def rank_counts(max_ranks: int) -> list[int]:
    counts, p = [], 1
    while p <= max_ranks:
        counts.append(p)
        p *= 2
    return counts if counts[-1] == max_ranks else [*counts, max_ranks]


def plan(model: CostModel, context_len: int, max_ranks: int, modes: tuple[str, ...] = PARALLEL_MODES,
         attention: str = "split", noise: NoiseModel | None = None, ranks: list[int] | None = None,
         record: bool = False) -> list[Option]:
    """Every option, fastest first."""
    one = simulate(model, "single", context_len, 1, record=record)
    options = [Option(1, "single", (0, context_len), one.ttft_s, one)]
    stride = max(16, context_len // 1024)
    for p in ranks or rank_counts(max_ranks):
        if p < 2 or context_len < 2 * p:
            continue
        for mode in modes:
            boundaries = None
            if mode == "spp":
                if p > model.layers:
                    continue
                pipe = plan_pipeline(model, context_len, p, attention=attention)
                r = simulate(model, "spp", context_len, p, attention=attention, noise=noise, record=record,
                             stages=pipe.stages, chunk_tokens=pipe.chunk_tokens)
                options.append(Option(p, mode, r.boundaries, r.ttft_s, r, pipe.chunk_tokens))
                continue
            if mode == "kvr":
                boundaries = search_partition(model, context_len, p, attention, noise,
                                              min_stride=min(stride, context_len // (2 * p))).boundaries
            r = simulate(model, mode, context_len, p, boundaries, attention, noise, record=record)
            options.append(Option(p, mode, r.boundaries, r.ttft_s, r))
    return sorted(options, key=lambda o: o.ttft_s)
