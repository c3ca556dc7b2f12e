"""What the runtime reads off a transformers model: each layer's cached K,V shape and sliding window, and
whether it soft-caps its attention logits."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache
from transformers.cache_utils import get_layer_types_and_kwargs

from kvrunahead.model import tp
from kvrunahead.model.forward import one_position, with_cache


@dataclass(frozen=True)
class KVLayout:
    """Shape of one layer's cached K (and V) apart from the token axis: ``[batch, heads, *, head_dim]``, and how
    much of a prefix the layer keeps: all of it (full attention) or its sliding window's last ``window - 1``."""

    heads: tuple[int, ...]  # per layer: K/V heads (1 for MQA, fewer than query heads for GQA)
    head_dim: tuple[int, ...]
    dtype: torch.dtype
    windows: tuple[int | None, ...] | None = None  # per layer: the sliding window, None for full attention

    @property
    def num_layers(self) -> int:
        return len(self.heads)

    def window(self, layer: int) -> int | None:
        return self.windows[layer] if self.windows else None

    def kind(self, layer: int) -> str:
        return "full" if self.window(layer) is None else "sliding"

    def kept(self, layer: int, tokens: int) -> int:
        """How many of the positions [0, tokens) the layer's cache keeps, as transformers' cache does: all, or
        the last ``window - 1`` (the keys the next query can still see)."""
        window = self.window(layer)
        return tokens if window is None else min(tokens, window - 1)

    def kv_shape(self, layer: int, tokens: int) -> tuple[int, ...]:
        """K and V of ``tokens`` positions stacked: ``[2, 1, heads, tokens, head_dim]``."""
        return (2, 1, self.heads[layer], tokens, self.head_dim[layer])


# The cache layer types the chain can hand on: transformers' types whose cache is a K,V prefix (all of it, or a
# sliding window's last positions). Chunked attention (Llama 4) keeps a window too, but masks by chunk: refused
# until tested; linear attention and state-space layers keep a state that is no K,V prefix at all.
CHAINABLE = ("full_attention", "sliding_attention")


def layer_windows(config) -> tuple[int | None, ...]:
    """Per decoder layer, its sliding window (None: full attention), read from the model's config the way
    transformers' own ``DynamicCache(config=...)`` reads it; raises NotImplementedError for other layer types."""
    types, kwargs = get_layer_types_and_kwargs(config.get_text_config(decoder=True))
    if isinstance(kwargs, dict):  # transformers before 5.2x: one set of keywords for every layer
        kwargs = [kwargs] * len(types)
    odd = sorted({t for t in types if t not in CHAINABLE})
    if odd:
        raise NotImplementedError(
            f"{config.model_type} has {', '.join(odd)} layers, whose cache is not a K,V prefix of the prompt; "
            "KV-Runahead hands on full-attention and sliding-window layers only")
    return tuple(kw.get("sliding_window") if t == "sliding_attention" else None for t, kw in zip(types, kwargs))


@torch.no_grad()
def probe_kv_layout(model: torch.nn.Module) -> KVLayout:
    """Learn each layer's cached K/V shape from a one-token forward (works for GQA, MHA and MQA alike) and its
    sliding window from the config."""
    windows = layer_windows(model.config)  # refuses the layer types whose cache is no K,V prefix
    cache = DynamicCache()
    with tp.alone():  # a TP shard probes without its group: a variant may load on one rank at a time
        model.base_model(**one_position(model), use_cache=True, **with_cache(model.base_model, cache))
    if len(cache.layers) != len(windows):
        raise NotImplementedError(f"{type(model).__name__} caches {len(cache.layers)} layers but its config lists "
                                  f"{len(windows)}; layers that share or skip a cache are not supported")
    heads = tuple(layer.keys.shape[1] for layer in cache.layers)
    head_dim = tuple(layer.keys.shape[-1] for layer in cache.layers)
    if any(layer.keys.shape != layer.values.shape for layer in cache.layers):
        raise NotImplementedError("models whose K and V differ in shape are not supported")
    return KVLayout(heads=heads, head_dim=head_dim, dtype=cache.layers[0].keys.dtype,
                    windows=windows if any(w is not None for w in windows) else None)


def soft_caps(config) -> bool:
    """Whether the model soft-caps its attention logits (Gemma 2), which the inserted attentions do not do."""
    return getattr(config.get_text_config(decoder=True), "attn_logit_softcapping", None) is not None
