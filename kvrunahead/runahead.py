"""KV-Runahead prefill (paper section 4.1, 4.3): the KV cache interface, dual-purposed.

Each rank runs the unmodified transformers model over its own tokens. The cache handed to the
model receives the prefix K,V from the predecessor inside ``update`` (the call every attention
layer already makes), concatenates the local K,V, forwards the result to the successor and
returns it, so attention sees the whole [0, end) cache under a causal mask offset by ``start``.
"""

from __future__ import annotations

import contextlib
import inspect

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer, get_layer_types_and_kwargs

from kvrunahead.attention import (
    attend,
    attend_with_lse,
    attention_mode,
    causal_mask,
    expand_kv,
    merge_lse,
    register,
    require_attention_interface,
)
from kvrunahead.net.faults import Fault, fault_from_env, maybe_inject
from kvrunahead.transport import ChainLink, KVLayout


class RunaheadLayer(DynamicLayer):
    """A cache layer whose first update is the KV-Runahead exchange; later updates grow it as usual."""

    def __init__(self, layer_idx: int, link: ChainLink, fault: Fault | None = None) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.link = link
        self.fault = fault

    def get_seq_length(self) -> int:
        # Before the prefill the cache "holds" the predecessor's prefix: the model derives the
        # causal-mask offset from this length, exactly as in the extension phase.
        if not self.is_initialized:
            return self.link.prefix_len
        return super().get_seq_length()

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if self.is_initialized:
            return super().update(key_states, value_states, *args, **kwargs)
        maybe_inject(self.fault, self.link.rank, self.layer_idx)
        self.dtype, self.device = key_states.dtype, key_states.device
        kv = self.link.exchange(self.layer_idx, torch.stack((key_states, value_states)))
        self.keys, self.values = kv[0], kv[1]
        self.is_initialized = True
        return self.keys, self.values


class RunaheadSlidingLayer(DynamicSlidingWindowLayer):
    """A sliding-window cache layer whose first update is the KV-Runahead exchange of the window only.

    Before it, the layer stands where the single-process cache stands after ``prefix_len`` tokens: that many seen,
    the last ``window - 1`` of them kept, so the unmodified model builds its sliding mask at the right offset.
    The exchange receives those kept positions, appends the rank's own and hands on the last ``window - 1``.
    """

    def __init__(self, layer_idx: int, link: ChainLink, window: int, fault: Fault | None = None) -> None:
        super().__init__(sliding_window=window)
        self.layer_idx = layer_idx
        self.link = link
        self.fault = fault
        self.cumulative_length = link.prefix_len

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if self.is_initialized:
            return super().update(key_states, value_states, *args, **kwargs)
        maybe_inject(self.fault, self.link.rank, self.layer_idx)
        self.lazy_initialization(key_states, value_states)
        kv = self.link.exchange(self.layer_idx, torch.stack((key_states, value_states)))
        self.cumulative_length += key_states.shape[-2]
        kept = self.link.layout.kept(self.layer_idx, self.cumulative_length)
        self.keys, self.values = kv[0, ..., kv.shape[-2] - kept:, :], kv[1, ..., kv.shape[-2] - kept:, :]
        return kv[0], kv[1]


class RunaheadCache(DynamicCache):
    """A ``DynamicCache`` whose layers take part in the KV chain during the prefill: full-attention layers hand on
    the whole prefix, sliding-window layers their window."""

    def __init__(self, link: ChainLink) -> None:
        fault = fault_from_env()
        layout = link.layout
        layers = [RunaheadLayer(i, link, fault) if layout.window(i) is None
                  else RunaheadSlidingLayer(i, link, layout.window(i), fault) for i in range(layout.num_layers)]
        super(DynamicCache, self).__init__(layers=layers)


class LocalPrefixLink(ChainLink):
    """The practical lower bound of section 5: the same partition, but each rank already holds its prefix
    K,V locally, so nothing is received, sent or waited for."""

    prefixes: list[torch.Tensor] | None = None

    @property
    def has_next(self) -> bool:
        return False

    def start(self) -> None:
        pass

    def prefix(self, layer: int) -> torch.Tensor:
        kv = self.prefixes[layer]
        return kv[..., kv.shape[-2] - self.layout.kept(layer, self.prefix_len):, :]


# The cache layer types the chain can hand on: transformers' types whose cache is a K,V prefix (all of it, or a
# sliding window's last positions). Chunked attention (Llama 4) keeps a window too, but masks by chunk: refused
# until tested; linear attention and state-space layers keep a state that is no K,V prefix at all.
CHAINABLE = ("full_attention", "sliding_attention")


def layer_windows(config) -> tuple[int | None, ...]:
    """Per decoder layer, its sliding window (None: full attention), read from the model's config the way
    transformers' own ``DynamicCache(config=...)`` reads it; raises NotImplementedError for other layer types."""
    types, kwargs = get_layer_types_and_kwargs(config.get_text_config(decoder=True))
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
    device = next(model.parameters()).device
    cache = DynamicCache()
    one_token = torch.zeros((1, 1), dtype=torch.long, device=device)
    model.base_model(input_ids=one_token, past_key_values=cache, use_cache=True)
    if len(cache.layers) != len(windows):
        raise NotImplementedError(f"{type(model).__name__} caches {len(cache.layers)} layers but its config lists "
                                  f"{len(windows)}; layers that share or skip a cache are not supported")
    heads = tuple(layer.keys.shape[1] for layer in cache.layers)
    head_dim = tuple(layer.keys.shape[-1] for layer in cache.layers)
    if any(layer.keys.shape != layer.values.shape for layer in cache.layers):
        raise NotImplementedError("models whose K and V differ in shape are not supported")
    return KVLayout(heads=heads, head_dim=head_dim, dtype=cache.layers[0].keys.dtype,
                    windows=windows if any(w is not None for w in windows) else None)


def _accepts_logits_to_keep(model: torch.nn.Module) -> bool:
    return "logits_to_keep" in inspect.signature(model.forward).parameters


@torch.no_grad()
def last_token_logits(model: torch.nn.Module, input_ids: torch.Tensor, **kwargs) -> torch.Tensor:
    """Run the causal-LM head on the last position only; returns ``[vocab]`` logits."""
    if _accepts_logits_to_keep(model):
        out = model(input_ids=input_ids, logits_to_keep=1, use_cache=True, **kwargs)
    else:
        out = model(input_ids=input_ids, use_cache=True, **kwargs)
    return out.logits[0, -1]


@torch.no_grad()
def forward_part(model: torch.nn.Module, input_ids: torch.Tensor, emit: bool, **kwargs) -> torch.Tensor | None:
    """This rank's forward: the last token's logits when it emits the first token, else no LM head at all."""
    if emit:
        return last_token_logits(model, input_ids, **kwargs)
    model.base_model(input_ids=input_ids, use_cache=True, **kwargs)
    return None


SPLIT = "kvrunahead_kvr_split"
ATTENTION = ("masked", "split")


def split_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """KV-Runahead attention without the masked waste of fig. 5 (the custom kernel of section 4.1): the
    prefix block is attended in full, the rank's own diagonal block causally, merged by log-sum-exp. A
    sliding-window layer attends band by band, each block of queries to the keys its window reaches."""
    refuse_softcap(kwargs, "kvr --kvr-attention split")
    n, heads = query.shape[2], query.shape[1]
    start = key.shape[2] - n
    k, v = expand_kv(key, heads), expand_kv(value, heads)
    if kwargs.get("sliding_window"):
        return window_attention(query, k, v, start, kwargs["sliding_window"], scaling), None
    out, lse = attend_with_lse(query, k[:, :, start:], v[:, :, start:], causal=True, scale=scaling)
    if start > 0:
        prefix_out, prefix_lse = attend_with_lse(query, k[:, :, :start], v[:, :, :start], causal=False, scale=scaling)
        out, lse = merge_lse(out, lse, prefix_out, prefix_lse)
    return out.to(query.dtype).transpose(1, 2).contiguous(), None


def window_attention(query, key, value, start: int, window: int, scale) -> torch.Tensor:
    """Sliding-window attention of ``query`` (key index ``start + i`` is query i's own position) in blocks of
    ``window`` queries, each against the ``2 * window - 1`` keys its window reaches: work linear in the queries
    instead of the masked square. Returns ``[batch, n, heads, head_dim]``."""
    n = query.shape[2]
    outs = []
    for a in range(0, n, window):
        e = min(a + window, n)
        lo = max(0, start + a - window + 1)
        mask = causal_mask(start + a, e - a, lo, start + e - lo, query.device, window)
        outs.append(attend(query[:, :, a:e], key[:, :, lo:start + e], value[:, :, lo:start + e], mask, scale))
    return torch.cat(outs, dim=2).transpose(1, 2).contiguous()


def soft_caps(config) -> bool:
    """Whether the model soft-caps its attention logits (Gemma 2), which the inserted attentions do not do."""
    return getattr(config.get_text_config(decoder=True), "attn_logit_softcapping", None) is not None


def refuse_softcap(kwargs: dict, mode: str) -> None:
    if kwargs.get("softcap") is not None:
        raise NotImplementedError(f"this model soft-caps its attention logits, which {mode} does not do; use "
                                  "--kvr-attention masked (kvr) or another mode")


register(SPLIT, split_attention)


@torch.no_grad()
def kvr_prefill(
    model: torch.nn.Module, input_ids: torch.Tensor, link: ChainLink, attention: str = "masked"
) -> tuple[torch.Tensor | None, RunaheadCache]:
    """Run this rank's part of a KV-Runahead prefill.

    ``input_ids`` are this rank's tokens ``[1, end - start]``; ``link.prefix_len`` is ``start``.
    Returns the last token's logits on the last rank (``None`` elsewhere: no logits are computed)
    and the cache, which holds K,V for [0, end). ``attention="masked"`` is the paper's: the model's own
    SDPA over all [0, end) keys under the offset causal mask; ``"split"`` skips the masked half of the
    rank's diagonal block (models that use transformers' attention interface only).
    """
    start = link.prefix_len
    position_ids = torch.arange(start, start + input_ids.shape[1], device=input_ids.device).unsqueeze(0)
    cache = RunaheadCache(link)
    last = link.rank == link.transport.world_size - 1
    if attention == "split":
        require_attention_interface(model, "kvr --kvr-attention split")
    link.start()
    with attention_mode(model, SPLIT, None) if attention == "split" else contextlib.nullcontext():
        logits = forward_part(model, input_ids, last, position_ids=position_ids, past_key_values=cache)
    link.finish()
    return logits, cache


@torch.no_grad()
def local_prefixes(model: torch.nn.Module, prefix_ids: torch.Tensor) -> list[torch.Tensor]:
    """K,V of a prefix computed in this process (set-up of the no-communication bound; not timed)."""
    if prefix_ids.shape[1] == 0:
        return []
    cache = DynamicCache(config=model.config)
    model.base_model(input_ids=prefix_ids, past_key_values=cache, use_cache=True)
    return [torch.stack((layer.keys, layer.values)).contiguous() for layer in cache.layers]


@torch.no_grad()
def greedy_decode(
    model: torch.nn.Module,
    first_token: int,
    cache: DynamicCache,
    position: int,
    max_new_tokens: int,
    eos_token_ids: set[int],
) -> list[int]:
    """Greedy extension phase from a filled cache; ``position`` is the first token's position."""
    tokens = [first_token]
    device = next(model.parameters()).device
    while len(tokens) < max_new_tokens and tokens[-1] not in eos_token_ids:
        ids = torch.tensor([[tokens[-1]]], device=device)
        pos = torch.tensor([[position + len(tokens) - 1]], device=device)
        logits = last_token_logits(model, ids, position_ids=pos, past_key_values=cache)
        tokens.append(int(logits.argmax()))
    return tokens
