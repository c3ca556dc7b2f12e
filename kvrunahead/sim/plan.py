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
    tp: int = 1  # ranks per TP group: ``ranks`` ranks are ranks / tp groups (mode tp: one group of them all)
    weight_bytes: float = 0.0  # the weights one rank holds

    @property
    def label(self) -> str:
        if self.mode == "tp":
            return f"tp x{self.ranks}"
        groups = self.ranks // self.tp
        return ("single" if self.ranks == 1 else f"{self.mode} x{groups}") + (f" of tp{self.tp}" if self.tp > 1 else "")


def weight_bytes(model: CostModel) -> float:
    """One rank's weights: its layers' share, the embedding and the LM head whole."""
    s = model.shape
    return (s.layers * s.layer_params + 2 * s.vocab * s.hidden) * s.dtype_bytes


def rank_counts(max_ranks: int) -> list[int]:
    counts, p = [], 1
    while p <= max_ranks:
        counts.append(p)
        p *= 2
    return counts if counts[-1] == max_ranks else [*counts, max_ranks]


def plan(model: CostModel, context_len: int, max_ranks: int, modes: tuple[str, ...] = PARALLEL_MODES,
         attention: str = "split", noise: NoiseModel | None = None, ranks: list[int] | None = None,
         record: bool = False, tp: int = 1, tp_link: str | None = None) -> list[Option]:
    """Every option, fastest first. With ``tp`` > 1 the modes run over groups of ``tp`` ranks (their all-reduces
    on ``tp_link``, the chain between groups on the model's link), and Megatron TP over all the ranks rides along
    (its all-reduces on ``tp_link`` within a group's size, else across the groups' slower link)."""
    one = simulate(model, "single", context_len, 1, record=record)
    options = [Option(1, "single", (0, context_len), one.ttft_s, one, weight_bytes=weight_bytes(model))]
    whole, stride = model, max(16, context_len // 1024)
    if tp > 1:
        model = whole.over_tp(tp, tp_link)
    for total in ranks or rank_counts(max_ranks):
        if tp > 1 and total >= tp and total % tp == 0:
            alone = whole.over_tp(total, tp_link if total <= tp else whole.link_label)
            r = simulate(alone, "single", context_len, 1, record=record)
            options.append(Option(total, "tp", (0, context_len), r.ttft_s, r, tp=total,
                                  weight_bytes=weight_bytes(alone)))
        p = total // tp if total % tp == 0 else 0
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
                options.append(Option(total, mode, r.boundaries, r.ttft_s, r, pipe.chunk_tokens, tp,
                                      weight_bytes(model) / p))
                continue
            if mode == "kvr":
                boundaries = search_partition(model, context_len, p, attention, noise,
                                              min_stride=min(stride, context_len // (2 * p))).boundaries
            r = simulate(model, mode, context_len, p, boundaries, attention, noise, record=record)
            options.append(Option(total, mode, r.boundaries, r.ttft_s, r, tp=tp, weight_bytes=weight_bytes(model)))
    return sorted(options, key=lambda o: o.ttft_s)
