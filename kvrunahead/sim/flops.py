"""A profile-free estimate of each rank's prefill work: the partition where no table and no profile applies.

Per layer, rank i with n_i tokens after a prefix of b_i tokens does work linear in n_i (QKV and output
projections, MLP: two FLOPs per matrix parameter per token) and attention work proportional to the
query-key pairs it scores (four FLOPs per pair per query head and head dimension: QK^T and AV):

- split attention: n_i * b_i pairs against the prefix plus n_i (n_i + 1) / 2 in its own causal block;
- masked attention: n_i * (b_i + n_i) pairs, since the offset causal mask is applied to a full score matrix;
  except on rank 0, whose mask is the plain causal one that SDPA's causal kernels skip in half, as in split.

Sliding-window layers (window w) score only the keys their window reaches: split attention works band by
band, w queries against at most 2w - 1 keys, so about n_i * min(b_i + n_i, 2w - 1) pairs; masked attention
applies the model's window mask to n_i * (min(b_i, w - 1) + n_i) pairs.

The chain hands K,V down layer by layer, so after the first layers every layer waits on the slowest rank
(the paper's section 3, eq. 4-6): the estimate gives every rank the same work. It counts FLOPs only, at
equal efficiency for matrix products and attention; a measured table, or the cost model on a measured
profile (``kvrunahead.sim``), replaces it where one exists.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvrunahead.partition import Partition, equal_level_sizes
from kvrunahead.sim.shape import config_hash, shape_from_config


@dataclass(frozen=True)
class LayerCost:
    """FLOPs of one decoder layer: per token (linear work) and per visible query-key pair (attention)."""

    flops_per_token: float
    flops_per_pair: float
    sliding_share: float = 0.0  # the share of layers with a sliding window
    window: int | None = None

    def rank_flops(self, prefix: float, tokens: float, attention: str) -> float:
        own = tokens * (tokens + 1) / 2 if attention == "split" or prefix == 0 else tokens * tokens
        pairs = tokens * prefix + own
        if self.window:
            w = self.window
            band = (tokens * min(prefix + min(tokens, w), 2 * w - 1) if attention == "split"
                    else tokens * (min(prefix, w - 1) + tokens))
            pairs = (1 - self.sliding_share) * pairs + self.sliding_share * band
        return self.flops_per_token * tokens + self.flops_per_pair * pairs


_COSTS: dict[str, LayerCost] = {}


def prompt_work(config) -> Callable[[int], float]:
    """The FLOP estimate of a prompt's first t tokens (split attention: no masked pair), what packed cuts balance."""
    cost = layer_cost(config)
    return lambda t: cost.rank_flops(0, t, "split")


def layer_cost(config) -> LayerCost:
    """Per-layer FLOPs from a transformers config, counting the decoder layers' parameters on the meta
    device (no memory, any architecture); remembered per architecture."""

    key = config_hash(config)
    if key not in _COSTS:
        _COSTS[key] = _count_layer_cost(config)
    return _COSTS[key]


def _count_layer_cost(config) -> LayerCost:
    from kvrunahead.model.layout import layer_windows  # torch: kvr-plan's import stays torch-free

    shape = shape_from_config(config, "float32")
    windows = [w for w in layer_windows(config) if w is not None]
    return LayerCost(flops_per_token=shape.qkv_flops_per_token + shape.other_flops_per_token,
                     flops_per_pair=shape.flops_per_pair, sliding_share=len(windows) / shape.layers,
                     window=max(windows) if windows else None)


def equal_work_sizes(work, context_len: int, world_size: int) -> list[float]:
    """Part sizes (continuous, summing to the context) that give every rank the same ``work(prefix, tokens)``,
    for any work increasing in both (search.balance's bisection, one work for every rank)."""
    return equal_level_sizes([work] * world_size, context_len)


def balanced_partition(cost: LayerCost, context_len: int, world_size: int, attention: str) -> Partition:
    """Boundaries that give every rank the same estimated work."""
    if attention not in ("masked", "split"):
        raise ValueError(f"unknown attention {attention!r}")
    sizes = equal_work_sizes(lambda prefix, n: cost.rank_flops(prefix, n, attention), context_len, world_size)
    return Partition.from_ratios([s / context_len for s in sizes], context_len)


def estimated_partition(config, context_len: int, world_size: int, attention: str) -> Partition:
    return balanced_partition(layer_cost(config), context_len, world_size, attention)


def part_flops(config, prefix: int, tokens: int, attention: str = "split", lm_head_rows: int = 0) -> float:
    """FLOPs of one rank's part of a prefill: ``tokens`` positions after ``prefix`` through every decoder layer
    (projections, MLP, and attention over the pairs the attention computes), and the LM head on
    ``lm_head_rows`` positions (1 on the rank that emits the first token)."""
    from kvrunahead.sim.shape import shape_from_config

    cost, shape = layer_cost(config), shape_from_config(config, "float32")
    return shape.layers * cost.rank_flops(prefix, tokens, attention) + 2.0 * lm_head_rows * shape.hidden * shape.vocab
