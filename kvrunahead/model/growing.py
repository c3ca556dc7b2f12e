"""Caches that grow in place: a decoded token's K,V (or a chunked prefill's next chunk) is written into room kept
after the positions held, not concatenated onto a copy of them.

transformers' ``DynamicLayer`` appends by ``torch.cat``, which copies every position the layer holds, on every
token: at 32k positions SmolLM2's 30 layers move 1.4 GiB per token, more than its attention reads. Here a layer's
K and V live in one buffer with room after them; a token is written into the room, and only when the room is used up
are the positions copied, once, into a buffer with room for an eighth more (an eighth more memory at most, a copy
every ``n / 8`` tokens instead of every token).

A layer only ever writes into buffers it allocated itself, past the positions it has handed out: the K,V it was
given (a prefill's cache, a prefix cache's entry) and the views it returned stay as they were.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

MIN_ROOM = 64  # tokens of room at least, so that short caches do not regrow every few tokens
ROOM_SHARE = 8  # room for an eighth more positions than held when a buffer is (re)allocated


def room_for(tokens: int) -> int:
    """Positions a buffer gets when it must hold ``tokens``."""
    return tokens + max(MIN_ROOM, tokens // ROOM_SHARE)


class GrowingKV:
    """One layer's K and V, ``[batch, heads, tokens, head_dim]`` each, in one buffer
    ``[2, batch, heads, room, head_dim]`` with room after the positions held: a decode's tokens and a chunked
    prefill's chunks are written into the room (the chain carries a layer's K,V stacked the same way)."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, room: int | None = None) -> None:
        n = keys.shape[-2]
        self._kv = keys.new_empty((2, *keys.shape[:-2], max(room or 0, room_for(n)), keys.shape[-1]))
        self._kv[0, ..., :n, :], self._kv[1, ..., :n, :] = keys, values
        self.lo, self.hi = 0, n  # the positions held are buffer rows [lo, hi)

    @classmethod
    def stacked(cls, kv: torch.Tensor) -> GrowingKV:
        """Hold ``kv`` (``[2, batch, heads, n, head_dim]``) as it is, no copy: it has no room, so the first append
        moves it into a buffer of this object's own and ``kv`` itself is never written."""
        self = cls.__new__(cls)
        self._kv, self.lo, self.hi = kv, 0, kv.shape[-2]
        return self

    @classmethod
    def left_padded(cls, rows: list[tuple[torch.Tensor, torch.Tensor]]) -> GrowingKV:
        """Requests' K,V ``[1, heads, n_i, head_dim]`` as the rows of one batch, each padded on the left with zeros
        to the longest (an attention mask hides the pads; zeros keep them finite)."""
        total = max(k.shape[-2] for k, _ in rows)
        k0 = rows[0][0]
        self = cls.__new__(cls)
        self._kv = k0.new_zeros((2, len(rows), k0.shape[1], room_for(total), k0.shape[-1]))
        for b, (k, v) in enumerate(rows):
            self._kv[0, b:b + 1, :, total - k.shape[-2]:total] = k
            self._kv[1, b:b + 1, :, total - v.shape[-2]:total] = v
        self.lo, self.hi = 0, total
        return self

    @property
    def n(self) -> int:
        return self.hi - self.lo

    @property
    def kv(self) -> torch.Tensor:
        """The positions held, K and V stacked (a view: later appends write past it, never into it)."""
        return self._kv[..., self.lo:self.hi, :]

    @property
    def keys(self) -> torch.Tensor:
        return self._kv[0, ..., self.lo:self.hi, :]

    @property
    def values(self) -> torch.Tensor:
        return self._kv[1, ..., self.lo:self.hi, :]

    def holds(self, keys: torch.Tensor) -> bool:
        """Whether ``keys`` is still the view of the positions held (not replaced from outside since)."""
        ours = self.keys
        return keys.data_ptr() == ours.data_ptr() and keys.shape == ours.shape

    @property
    def capacity_bytes(self) -> int:
        return self._kv.nbytes

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``keys``, ``values`` after the positions held; the positions now held (views)."""
        t = keys.shape[-2]
        self._make_room(t)
        self._kv[0, ..., self.hi:self.hi + t, :], self._kv[1, ..., self.hi:self.hi + t, :] = keys, values
        self.hi += t
        return self.keys, self.values

    def extend(self, *parts: torch.Tensor) -> torch.Tensor:
        """Append stacked ``parts`` (each ``[2, batch, heads, t, head_dim]``) in order; the positions now held."""
        self._make_room(sum(p.shape[-2] for p in parts))
        for part in parts:
            self._kv[..., self.hi:self.hi + part.shape[-2], :] = part
            self.hi += part.shape[-2]
        return self.kv

    def drop_front(self, tokens: int) -> None:
        """Forget the first ``tokens`` positions held (a sliding window moving on); their rows are reused when the
        buffer is next copied."""
        self.lo = min(self.hi, self.lo + tokens)

    def truncate(self, tokens: int) -> None:
        """Keep the first ``tokens`` positions held (a crop); later appends write over the rest."""
        self.hi = self.lo + max(0, min(tokens, self.n))

    def _make_room(self, tokens: int) -> None:
        if self.hi + tokens <= self._kv.shape[-2]:
            return
        held, n = self.kv, self.n
        self._kv = held.new_empty((*held.shape[:-2], room_for(n + tokens), held.shape[-1]))
        self._kv[..., :n, :] = held
        self.lo, self.hi = 0, n


class GrowingLayer(DynamicLayer):
    """A full-attention ``DynamicLayer`` whose appends write into room (``GrowingKV``); ``keys``/``values`` are
    views of the positions held. Where something outside replaced them (transformers' batch selection), the next
    append adopts what they are then, with one copy."""

    def __init__(self, held: GrowingKV) -> None:
        super().__init__()
        self.held = held
        self.keys, self.values = held.keys, held.values
        self.dtype, self.device = self.keys.dtype, self.keys.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.held.holds(self.keys):
            self.held = GrowingKV(self.keys, self.values)
        self.keys, self.values = self.held.append(key_states, value_states)
        return self.keys, self.values

    def crop(self, tokens_to_remove: int) -> None:
        super().crop(tokens_to_remove)
        if self.is_initialized and self.keys.data_ptr() == self.held.keys.data_ptr():
            self.held.truncate(self.keys.shape[-2])  # the cropped rows are written over by the next appends


def grow_in_place(cache: DynamicCache, room: int | None = None) -> DynamicCache:
    """Give ``cache``'s full-attention layers room to grow in place (the same object, its layers replaced; the
    K,V held are copied once, the ones given stay untouched): transformers' ``DynamicLayer`` and the layers that
    are one once filled (``plain_after_prefill``: the chain's). Sliding-window layers keep their type (their
    window bounds what a concatenation copies), and so do layers with a decode of their own (the KVP shards).
    ``room``: positions to make room for at once (a pipelined prefill's whole prompt), not just an eighth more."""
    for i, layer in enumerate(cache.layers):
        plain = type(layer) is DynamicLayer or getattr(layer, "plain_after_prefill", False)
        if plain and layer.is_initialized and layer.keys.numel():
            cache.layers[i] = GrowingLayer(GrowingKV(layer.keys, layer.values, room))
    return cache
