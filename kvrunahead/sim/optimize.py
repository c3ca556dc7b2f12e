"""Partitions from the cost model: the measured search's question (section 4.2) answered by simulation.

First the balanced partition of eq. 4-6: every rank's per-layer time (projections, concatenation, attention,
MLP, as ``CostModel.rank_layer_s`` prices them) equal, found by bisection on the common level. Then the
simulated TTFT is hill-climbed boundary by boundary with halving strides down to ``min_stride``, which adds
what the balance leaves out: the pipeline's fill, the transfers and the LM head.

spp's plan the same way: stages whose layers take equal time, then the chunk whose simulated pipeline is fastest.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

from kvrunahead.partition import Partition, balanced_cut
from kvrunahead.sim.costmodel import CostModel
from kvrunahead.sim.flops import equal_work_sizes
from kvrunahead.sim.links import NoiseModel
from kvrunahead.sim.profile import resolve_profile
from kvrunahead.sim.shape import shape_from_config
from kvrunahead.sim.simulate import simulate, simulate_spp

MAX_SIMULATIONS = 300  # hill-climbing budget: a 64-rank, million-token search stays within seconds


@dataclass
class ModelSearch:
    boundaries: tuple[int, ...]
    ttft_s: float
    even_ttft_s: float
    balanced: tuple[int, ...]
    simulations: int
    search_s: float


def balanced_boundaries(model: CostModel, context_len: int, world_size: int, attention: str) -> tuple[int, ...]:
    """Boundaries with equal per-layer compute on every rank (continuous solution, rounded to tokens)."""
    # a layer's cost depends on its window alone: one layer of each window, times the layers that have it
    kinds: dict = {}
    for i in range(model.layers) if model.shape.sliding else (0,):
        kinds.setdefault(model.shape.window(i), [i, 0])[1] += 1
    layers = list(kinds.values())
    sizes = equal_work_sizes(lambda prefix, n: sum(k * model.rank_layer_s(attention, n, prefix, i) for i, k in layers),
                             context_len, world_size)
    bounds = [0]
    for s in sizes[:-1]:
        # At least one token per part, and room left for the parts after it.
        bounds.append(min(max(round(bounds[-1] + s), bounds[-1] + 1), context_len - (world_size - len(bounds))))
    return (*bounds, context_len)


def search_partition(model: CostModel, context_len: int, world_size: int, attention: str = "split",
                     noise: NoiseModel | None = None, min_stride: int = 1,
                     max_simulations: int = MAX_SIMULATIONS) -> ModelSearch:
    """The TTFT-minimising kvr partition under the model."""
    t0 = time.perf_counter()
    p = world_size
    count = {"n": 0}
    memo: dict[tuple[int, ...], float] = {}

    # Under noise, the mean over a few draws of the loaded pairs, so that no one pattern is tuned to.
    noises = [noise] if noise is None else [dataclasses.replace(noise, seed=noise.seed + k) for k in range(3)]

    def ttft(b: tuple[int, ...]) -> float:
        if b not in memo:
            count["n"] += 1
            memo[b] = sum(simulate(model, "kvr", context_len, p, b, attention, n).ttft_s for n in noises) / len(noises)
        return memo[b]

    even = Partition.even(context_len, p).boundaries
    if p == 1:
        t = ttft(even)
        return ModelSearch(even, t, t, even, count["n"], time.perf_counter() - t0)
    balanced = balanced_boundaries(model, context_len, p, attention)
    # Candidates stay on the measured search's grid: the even boundaries plus multiples of min_stride.
    snapped = tuple(e + round((x - e) / min_stride) * min_stride for x, e in zip(balanced, even))
    if any(y <= x for x, y in zip(snapped, snapped[1:])):
        snapped = even
    best = min((even, snapped), key=ttft)
    stride = min_stride
    while stride * 2 <= context_len // (4 * p):
        stride *= 2
    while count["n"] < max_simulations:
        moved = False
        for i in range(1, p):
            for step in (-stride, stride):
                b = (*best[:i], best[i] + step, *best[i + 1:])
                if b[i - 1] < b[i] < b[i + 1] and ttft(b) < ttft(best):
                    best, moved = b, True
            if count["n"] >= max_simulations:
                break
        if not moved:
            if stride <= min_stride:
                break
            stride = max(min_stride, stride // 2)
    return ModelSearch(best, ttft(best), ttft(even), balanced, count["n"], time.perf_counter() - t0)


Scale = tuple[float, float]  # the attention's and the linears' rates over the profile's (torch's kernels on CPU)


def rescaled_profile(profile, scale: Scale):
    """``profile`` with its attention's and its linears' rates times ``scale``."""
    attention_scale, linear_scale = scale
    if scale == (1.0, 1.0):
        return profile
    return dataclasses.replace(
        profile, matmul_flops_per_s=profile.matmul_flops_per_s * linear_scale,
        attention={k: dataclasses.replace(v, flops_per_s=v.flops_per_s * attention_scale)
                   for k, v in profile.attention.items()})


def _model_partition(config, dtype: str, threads: int, context_len: int, world_size: int, attention: str,
                     link: str | None, tp: int, scale: Scale) -> tuple[ModelSearch, str]:
    profile, which = resolve_profile(None, threads)
    profile, used, link_note = profile.for_network(link)
    cost = CostModel(shape_from_config(config, dtype), rescaled_profile(profile, scale), used)
    if tp > 1:
        cost = cost.over_tp(tp, used)
    stride = max(1, min(64, context_len // (8 * world_size)))
    rates = "" if scale == (1.0, 1.0) else (f", scaled to the ranks' kernels (attention {scale[0]:.2f}x, linears "
                                            f"{scale[1]:.2f}x)")
    return search_partition(cost, context_len, world_size, attention, min_stride=stride), f"{which}{rates}, {link_note}"


def predicted_partition(config, dtype: str, threads: int, context_len: int, world_size: int, attention: str,
                        link: str | None = None, tp: int = 1, scale: Scale = (1.0, 1.0)):
    """``--partition auto`` where no table covers the context: the cost model's partition on this machine's
    profile (``kvr-calibrate``, else the shipped CPU profile), its rates ``scale``d to the kernels the ranks run
    (the profile times torch's), for a chain of TP groups of ``tp`` ranks where ``tp`` > 1 (their all-reduces on the
    same link). Returns the partition and a line saying so."""
    r, where = _model_partition(config, dtype, threads, context_len, world_size, attention, link, tp, scale)
    return Partition(r.boundaries), f"cost model on {where}: predicted TTFT {r.ttft_s:.2f} s"


def reweighted_partition(config, dtype: str, threads: int, context_len: int, world_size: int, attention: str,
                         ratios: list[float], searched: Scale, run: Scale, link: str | None = None,
                         tp: int = 1) -> Partition:
    """A stale table's partition moved as far as the cost model says the change of compute rates moves it: the
    table's ratios times the model's partition at the run's rates over the model's at the rates the table was
    searched at (``searched``, ``run``: the attention's and the linears' rates over the profile's), renormalised.
    Where the attention got faster than the linears, a later rank's longer prefix costs it less and the cuts move
    earlier."""
    at_run, at_search = (
        Partition(_model_partition(config, dtype, threads, context_len, world_size, attention, link, tp,
                                   scale)[0].boundaries).ratios for scale in (run, searched))
    moved = [r * a / b for r, a, b in zip(ratios, at_run, at_search)]
    return Partition.from_ratios([r / sum(moved) for r in moved], context_len)


CHUNK_CHOICES = tuple(2 ** k for k in range(7, 17))  # 128 to 64k tokens
MAX_CHUNKS = 1024  # chunks per prompt at most: a million tokens in chunks of 1k and more


@dataclass(frozen=True)
class PipelinePlan:
    """spp's layer stages and chunk for one prompt, with the predicted TTFT."""

    stages: tuple[int, ...]
    chunk_tokens: int
    ttft_s: float


def balanced_stages(model: CostModel, context_len: int, world_size: int, attention: str = "split"
                    ) -> tuple[int, ...]:
    """Layer boundaries whose stages take equal time over the whole prompt: equal layer counts for a uniform model;
    more of the cheaper sliding-window layers per stage in a hybrid one."""
    costs = [model.spp_layer_s(attention, context_len, 0, layer) for layer in range(model.layers)]
    return balanced_cut(costs, world_size).boundaries


def plan_pipeline(model: CostModel, context_len: int, world_size: int, stages: tuple[int, ...] | None = None,
                  chunk_tokens: int | None = None, attention: str = "split") -> PipelinePlan:
    """spp's stages (balanced by the cost model unless given) and chunk (the one of ``CHUNK_CHOICES`` below the
    prompt, at most ``MAX_CHUNKS`` to it, with the least predicted TTFT unless given): small chunks shorten the
    pipeline's fill and drain, large ones run the projections and MLP at a better rate and send fewer messages."""
    stages = tuple(stages) if stages else balanced_stages(model, context_len, world_size, attention)
    choices = [chunk_tokens] if chunk_tokens else [
        c for c in CHUNK_CHOICES if c < context_len and context_len / c <= MAX_CHUNKS] or [context_len]
    timed = [(simulate_spp(model, context_len, stages, c, attention=attention).ttft_s, c) for c in choices]
    ttft, chunk = min(timed)
    return PipelinePlan(stages, chunk, ttft)


def predicted_pipeline(config, dtype: str, threads: int, context_len: int, world_size: int,
                       link: str | None = None, stages: tuple[int, ...] | None = None,
                       chunk_tokens: int | None = None, attention: str = "split") -> tuple[PipelinePlan, str]:
    """spp's plan on this machine's profile (``kvr-calibrate``, else the shipped CPU profile), and a line saying
    so."""
    profile, which = resolve_profile(None, threads)
    profile, used, link_note = profile.for_network(link)
    cost = CostModel(shape_from_config(config, dtype), profile, used)
    plan = plan_pipeline(cost, context_len, world_size, stages, chunk_tokens, attention)
    return plan, f"cost model on {which}, {link_note}: predicted TTFT {plan.ttft_s:.2f} s"
