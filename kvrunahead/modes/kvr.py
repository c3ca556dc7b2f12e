"""KV-Runahead prefill (paper section 4.1, 4.3): the KV cache interface, dual-purposed.

Each rank runs the unmodified transformers model over its own tokens. The cache handed to the
model receives the prefix K,V from the predecessor inside ``update`` (the call every attention
layer already makes), concatenates the local K,V, forwards the result to the successor and
returns it, so attention sees the whole [0, end) cache under a causal mask offset by ``start``.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from kvrunahead.kernels import attention as kernel
from kvrunahead.model.attention import attention_mode, expand_kv, register, require_attention_interface
from kvrunahead.model.forward import Scoring, fill_cache, forward_part
from kvrunahead.model.layout import KVLayout
from kvrunahead.modes.attention import attend, attend_with_lse, causal_mask, merge_lse, refuse_softcap
from kvrunahead.net.faults import Fault, fault_from_env, maybe_inject
from kvrunahead.ranks.transport import Transport, nbytes


@dataclass
class ChainLink:
    """This rank's place in the KV chain: receives [0, prefix_len) from rank-1, sends [0, end) to rank+1.

    A sliding-window layer hands on only what its cache keeps, the last ``window - 1`` positions of the prefix
    ([max(0, b - window + 1), b)), so its traffic stops growing with the context. A layer's K and V travel as one
    contiguous ``[2, 1, heads, tokens, head_dim]`` tensor: one message per layer and hop.

    What a server adds to the chain (a prefix held by another rank, positions every rank holds already, a rank's
    own part kept as its shard) lives in subclasses that override the hooks: ``prev`` (where the prefix comes
    from), ``held_len`` (the first positions this rank holds already, which the chain does not carry), ``join``
    (how the received prefix and the rank's own K,V become the layer's K,V) and ``keep`` (what the rank's cache
    keeps of them once the layer has attended).
    """

    transport: Transport
    prefix_len: int
    layout: KVLayout
    device: torch.device
    lookahead: int = 1
    _pending: dict = field(default_factory=dict)
    bytes_sent_by_kind: dict[str, int] = field(default_factory=dict)  # "full" / "sliding" layers

    @property
    def rank(self) -> int:
        return self.transport.rank

    @property
    def prev(self) -> int:
        """Where this rank's prefix comes from."""
        return self.rank - 1

    @property
    def held_len(self) -> int:
        """The first positions of the prefix this rank holds already: the chain carries only those after them."""
        return 0

    @property
    def has_prev(self) -> bool:
        return self.rank > 0 and self.prefix_len > self.held_len

    @property
    def has_next(self) -> bool:
        return self.rank < self.transport.world_size - 1

    def start(self) -> None:
        """Post the first receives; called before the forward starts."""
        for layer in range(min(self.lookahead, self.layout.num_layers)):
            self._post_recv(layer)

    def _post_recv(self, layer: int) -> None:
        if not self.has_prev or layer >= self.layout.num_layers or layer in self._pending:
            return
        # The buffer shape follows from the partition and the window alone: no per-layer shape handshake.
        tokens = self.layout.kept(layer, self.prefix_len) - self.held_len
        buf = torch.empty(self.layout.kv_shape(layer, tokens), dtype=self.layout.dtype, device=self.device)
        self._pending[layer] = (self.transport.irecv(buf, self.prev, tag=layer), buf)

    def prefix(self, layer: int) -> torch.Tensor:
        """The predecessor's K,V of [0, prefix_len) for ``layer`` (its window's part for a sliding layer); posts
        the next layer's receive."""
        self._post_recv(layer)  # no-op when posted ahead, as it normally is
        req, buf = self._pending.pop(layer)
        self.transport.wait(req, f"the K,V of layer {layer} from rank {self.prev}")
        self._post_recv(layer + self.lookahead)
        return buf

    @torch.compiler.disable  # runs eagerly inside a compiled layer: its branches read the link's integers,
    # which dynamo may hold symbolic and guard by relation (seen: a front alone waiting on a prefix it has not);
    # its transfers break the graph anyway
    def exchange(self, layer: int, local_kv: torch.Tensor) -> torch.Tensor:
        """Prepend the predecessor's prefix to ``local_kv``, forward what the successor's cache keeps of the
        result, return the result."""
        kv = self.join(layer, [self.prefix(layer)] if self.has_prev else [], local_kv)
        if self.has_next:
            handed = self.layout.kept(layer, self.handed_on(local_kv.shape[-2])) - self.held_len
            out = kv[..., kv.shape[-2] - handed:, :].contiguous()
            self.transport.isend(out, self.rank + 1, tag=layer)
            kind = self.layout.kind(layer)
            self.bytes_sent_by_kind[kind] = self.bytes_sent_by_kind.get(kind, 0) + nbytes(out)
        return kv

    def join(self, layer: int, received: list[torch.Tensor], local_kv: torch.Tensor) -> torch.Tensor:
        """The layer's K,V: the received prefix (if any), then this rank's own."""
        return torch.cat((*received, local_kv), dim=-2) if received else local_kv.contiguous()

    def keep(self, layer: int, kv: torch.Tensor) -> torch.Tensor:
        """What this rank's cache keeps of a full layer's K,V of [0, end) after its attention: all of it."""
        return kv

    def handed_on(self, local_tokens: int) -> int:
        """Positions of the successor's prefix that end this rank's K,V: the whole [0, end)."""
        return self.prefix_len + local_tokens

    def finish(self) -> None:
        """Wait for the sends still in flight (their buffers must outlive them)."""
        self.transport.drain()


@dataclass
class OwnPartLink(ChainLink):
    """A link whose full layers keep only this rank's own positions once attended (the KVP decode's shard,
    kvrunahead/decode/kvp.py): the prefix received dies with the layer's attention, so the last rank never holds the
    whole prompt's K,V at once."""

    def keep(self, layer: int, kv: torch.Tensor) -> torch.Tensor:
        return kv[..., self.prefix_len:, :].clone() if self.prefix_len else kv


def send_held_prefix(transport: Transport, kv: list[torch.Tensor], layout: KVLayout, to: int = 0) -> None:
    """The holder's side of a prefix held on another rank (a server's cached prefix): every layer's K,V of the held
    positions, ``[2, 1, heads, P, head_dim]``, to rank ``to`` as that layer's chain message, in the background (the
    sends are drained with the prefill's own)."""
    for layer, t in enumerate(kv):
        transport.isend(t[..., t.shape[-2] - layout.kept(layer, t.shape[-2]):, :].contiguous(), to, tag=layer)


class RunaheadLayer(DynamicLayer):
    """A cache layer whose first update is the KV-Runahead exchange; later updates grow it as usual."""

    plain_after_prefill = True  # once filled, a DynamicLayer: a decode may grow it in place (model/growing.py)

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
        kept = self.link.keep(self.layer_idx, kv)
        self.keys, self.values = kept[0], kept[1]
        self.is_initialized = True
        return kv[0], kv[1]


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


SPLIT = "kvrunahead_kvr_split"


def split_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """KV-Runahead attention without the masked waste of fig. 5 (the custom kernel of section 4.1): the
    prefix block is attended in full, the rank's own diagonal block causally, merged by log-sum-exp. A
    sliding-window layer attends band by band, each block of queries to the keys its window reaches."""
    refuse_softcap(kwargs, "kvr --kvr-attention split")
    return split_block(query, key, value, scaling, kwargs.get("sliding_window")), None


def split_block(query, key, value, scale, window: int | None = None) -> torch.Tensor:
    """Queries that are the last ``n`` of the keys' positions, attended causally without scoring a masked pair;
    returns ``[batch, n, heads, head_dim]``."""
    n, heads = query.shape[2], query.shape[1]
    start = key.shape[2] - n
    if kernel.usable(query):  # the CPU's: prefix and diagonal in one pass, masked pairs never scored
        return kernel.block(query, key, value, start, 0, causal=True, window=window, scale=scale, out_float=False)[0]
    if window:
        return window_attention(query, expand_kv(key, heads), expand_kv(value, heads), start, window, scale)
    if n == 1:  # one query (a decode row) sees every key: one kernel, nothing to merge
        out, _ = attend_with_lse(query, key, value, causal=False, scale=scale)
        return out.to(query.dtype).transpose(1, 2).contiguous()
    # Peak memory is that of one block at a time: the diagonal block's K,V repeated to the query heads die with
    # its call, before the prefix block (attended per K,V head, never repeated) adds its output to be merged.
    out, lse = attend_with_lse(query, key[:, :, start:], value[:, :, start:], causal=True, scale=scale)
    if start > 0:
        prefix_out, prefix_lse = attend_with_lse(query, key[:, :, :start], value[:, :, :start], causal=False,
                                                 scale=scale)
        out, lse = merge_lse(out, lse, prefix_out, prefix_lse)
    return out.to(query.dtype).transpose(1, 2).contiguous()


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


register(SPLIT, split_attention)


@torch.no_grad()
def kvr_prefill(
    model: torch.nn.Module, input_ids: torch.Tensor, link: ChainLink, attention: str = "masked",
    score: Scoring | None = None,
) -> tuple[torch.Tensor | None, RunaheadCache]:
    """Run this rank's part of a KV-Runahead prefill.

    ``input_ids`` are this rank's tokens ``[1, end - start]``; ``link.prefix_len`` is ``start``.
    Returns the last token's logits on the last rank (``None`` elsewhere: no logits are computed)
    and the cache, which holds K,V for [0, end). ``attention="masked"`` is the paper's: the model's own
    SDPA over all [0, end) keys under the offset causal mask; ``"split"`` skips the masked half of the
    rank's diagonal block (models that use transformers' attention interface only). ``score``: this rank's
    positions scored too (model/forward.py), while its last layer's K,V are still on their way.
    """
    start = link.prefix_len
    position_ids = torch.arange(start, start + input_ids.shape[1], device=input_ids.device).unsqueeze(0)
    cache = RunaheadCache(link)
    last = link.rank == link.transport.world_size - 1
    if attention == "split":
        require_attention_interface(model, "kvr --kvr-attention split")
    link.start()
    with attention_mode(model, SPLIT, None) if attention == "split" else contextlib.nullcontext():
        logits = forward_part(model, input_ids, last, position_ids=position_ids, cache=cache, score=score)
    link.finish()
    return logits, cache


@torch.no_grad()
def local_prefixes(model: torch.nn.Module, prefix_ids: torch.Tensor) -> list[torch.Tensor]:
    """K,V of a prefix computed in this process (set-up of the no-communication bound; not timed)."""
    if prefix_ids.shape[1] == 0:
        return []
    cache = DynamicCache(config=model.config)
    fill_cache(model, prefix_ids, cache)
    return [torch.stack((layer.keys, layer.values)).contiguous() for layer in cache.layers]
