"""Decode caches that grow in place: a token's K,V is written into room kept after the positions held, not
concatenated onto a copy of them.

transformers' ``DynamicLayer`` appends by ``torch.cat``, which copies every position the layer holds, on every
token: at 32k positions SmolLM2's 30 layers move 1.4 GiB per token, more than its attention reads. Here a layer's
K and V live in buffers with room after them; a token is written into the room, and only when the room is used up
are the positions copied, once, into buffers with room for an eighth more (an eighth more memory at most, a copy
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
    """One layer's K and V ``[batch, heads, tokens, head_dim]`` in buffers with room after them."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        n = keys.shape[-2]
        self._k = keys.new_empty((*keys.shape[:-2], room_for(n), keys.shape[-1]))
        self._v = values.new_empty(self._k.shape[:-1] + values.shape[-1:])
        self._k[..., :n, :], self._v[..., :n, :] = keys, values
        self.lo, self.hi = 0, n  # the positions held are buffer rows [lo, hi)

    @classmethod
    def left_padded(cls, rows: list[tuple[torch.Tensor, torch.Tensor]]) -> GrowingKV:
        """Requests' K,V ``[1, heads, n_i, head_dim]`` as the rows of one batch, each padded on the left with zeros
        to the longest (an attention mask hides the pads; zeros keep them finite)."""
        total = max(k.shape[-2] for k, _ in rows)
        k0, v0 = rows[0]
        self = cls.__new__(cls)
        self._k = k0.new_zeros((len(rows), k0.shape[1], room_for(total), k0.shape[-1]))
        self._v = v0.new_zeros(self._k.shape[:-1] + v0.shape[-1:])
        for b, (k, v) in enumerate(rows):
            self._k[b:b + 1, :, total - k.shape[-2]:total], self._v[b:b + 1, :, total - v.shape[-2]:total] = k, v
        self.lo, self.hi = 0, total
        return self

    @property
    def keys(self) -> torch.Tensor:
        return self._k[..., self.lo:self.hi, :]

    @property
    def values(self) -> torch.Tensor:
        return self._v[..., self.lo:self.hi, :]

    def holds(self, keys: torch.Tensor) -> bool:
        """Whether ``keys`` is still the view of the positions held (not replaced from outside since)."""
        ours = self.keys
        return keys.data_ptr() == ours.data_ptr() and keys.shape == ours.shape

    @property
    def capacity_bytes(self) -> int:
        return self._k.nbytes + self._v.nbytes

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``keys``, ``values`` after the positions held; the positions now held (views)."""
        t = keys.shape[-2]
        if self.hi + t > self._k.shape[-2]:
            self._regrow(self.hi - self.lo + t)
        self._k[..., self.hi:self.hi + t, :], self._v[..., self.hi:self.hi + t, :] = keys, values
        self.hi += t
        return self.keys, self.values

    def drop_front(self, tokens: int) -> None:
        """Forget the first ``tokens`` positions held (a sliding window moving on); their rows are reused when the
        buffer is next copied."""
        self.lo = min(self.hi, self.lo + tokens)

    def truncate(self, tokens: int) -> None:
        """Keep the first ``tokens`` positions held (a crop); later appends write over the rest."""
        self.hi = self.lo + max(0, min(tokens, self.hi - self.lo))

    def _regrow(self, need: int) -> None:
        k, v = self.keys, self.values
        self._k = k.new_empty((*k.shape[:-2], room_for(need), k.shape[-1]))
        self._v = v.new_empty(self._k.shape[:-1] + v.shape[-1:])
        n = self.hi - self.lo
        self._k[..., :n, :], self._v[..., :n, :] = k, v
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


def grow_in_place(cache: DynamicCache) -> DynamicCache:
    """Give ``cache``'s full-attention layers room to grow in place (the same object, its layers replaced; the
    K,V held are copied once, the ones given stay untouched): transformers' ``DynamicLayer`` and the layers that
    are one once filled (``plain_after_prefill``: the chain's). Sliding-window layers keep their type (their
    window bounds what a concatenation copies), and so do layers with a decode of their own (the KVP shards)."""
    for i, layer in enumerate(cache.layers):
        plain = type(layer) is DynamicLayer or getattr(layer, "plain_after_prefill", False)
        if plain and layer.is_initialized and layer.keys.numel():
            cache.layers[i] = GrowingLayer(GrowingKV(layer.keys, layer.values))
    return cache
