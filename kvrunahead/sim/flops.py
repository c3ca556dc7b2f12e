"""A profile-free estimate of each rank's prefill work: the partition where no table and no profile applies.

Per layer, rank i with n_i tokens after a prefix of b_i tokens does work linear in n_i (QKV and output
projections, MLP: two FLOPs per matrix parameter per token) and attention work proportional to the
query-key pairs it scores (four FLOPs per pair per query head and head dimension: QK^T and AV):

- split attention: n_i * b_i pairs against the prefix plus n_i (n_i + 1) / 2 in its own causal block;
- masked attention: n_i * (b_i + n_i) pairs, since the offset causal mask is applied to a full score matrix;
  except on rank 0, whose mask is the plain causal one that SDPA's causal kernels skip in half, as in split.

The chain hands K,V down layer by layer, so after the first layers every layer waits on the slowest rank
(the paper's section 3, eq. 4-6): the estimate gives every rank the same work. It counts FLOPs only, at
equal efficiency for matrix products and attention; a measured table, or the cost model on a measured
profile (``kvrunahead.sim``), replaces it where one exists.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvrunahead.partition import Partition


@dataclass(frozen=True)
class LayerCost:
    """FLOPs of one decoder layer: per token (linear work) and per visible query-key pair (attention)."""

    flops_per_token: float
    flops_per_pair: float

    def rank_flops(self, prefix: float, tokens: float, attention: str) -> float:
        own = tokens * (tokens + 1) / 2 if attention == "split" or prefix == 0 else tokens * tokens
        return self.flops_per_token * tokens + self.flops_per_pair * (tokens * prefix + own)


_COSTS: dict[str, LayerCost] = {}


def layer_cost(config) -> LayerCost:
    """Per-layer FLOPs from a transformers config, counting the decoder layers' parameters on the meta
    device (no memory, any architecture); remembered per architecture."""
    from kvrunahead.tables import config_hash

    key = config_hash(config)
    if key not in _COSTS:
        _COSTS[key] = _count_layer_cost(config)
    return _COSTS[key]


def _count_layer_cost(config) -> LayerCost:
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    total = sum(p.numel() for p in model.parameters())
    embeddings = {id(m.weight): m.weight.numel() for m in (model.get_input_embeddings(), model.get_output_embeddings())
                  if m is not None and getattr(m, "weight", None) is not None}
    # Learned absolute position embeddings (GPT-2 style) are no per-token layer work either.
    for name, p in model.named_parameters():
        if name.endswith(("wpe.weight", "embed_positions.weight")):
            embeddings[id(p)] = p.numel()
    layers = config.num_hidden_layers
    per_layer = (total - sum(embeddings.values())) / layers
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return LayerCost(flops_per_token=2.0 * per_layer, flops_per_pair=4.0 * heads * head_dim)


def balanced_partition(cost: LayerCost, context_len: int, world_size: int, attention: str) -> Partition:
    """Boundaries that give every rank the same estimated work (bisection on the common work level)."""
    if attention not in ("masked", "split"):
        raise ValueError(f"unknown attention {attention!r}")

    def tokens_within(prefix: float, level: float) -> float:
        # The largest n with rank_flops(prefix, n) <= level: the positive root of a n^2 + b n - level.
        causal = attention == "split" or prefix == 0
        a = cost.flops_per_pair * (0.5 if causal else 1.0)
        b = cost.flops_per_token + cost.flops_per_pair * (prefix + (0.5 if causal else 0.0))
        return (2 * level) / (b + (b * b + 4 * a * level) ** 0.5)

    def covered(level: float) -> tuple[float, list[float]]:
        prefix, sizes = 0.0, []
        for _ in range(world_size):
            n = tokens_within(prefix, level)
            sizes.append(n)
            prefix += n
        return prefix, sizes

    lo, hi = 0.0, cost.rank_flops(0, context_len, attention)
    for _ in range(100):
        mid = (lo + hi) / 2
        if covered(mid)[0] < context_len:
            lo = mid
        else:
            hi = mid
    sizes = covered(hi)[1]
    return Partition.from_ratios([s / sum(sizes) for s in sizes], context_len)


def estimated_partition(config, context_len: int, world_size: int, attention: str) -> Partition:
    return balanced_partition(layer_cost(config), context_len, world_size, attention)
