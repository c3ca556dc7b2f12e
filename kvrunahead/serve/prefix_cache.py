"""Prompts' K,V kept after their prefill, so that a later prompt that starts the same way (a system prompt, a
document asked about again) prefills only its new tokens.

On the front, an entry is a holder of the rank's K,V pool (``kv``, model/paged.PagedKV): the blocks of the request
that prefilled the prompt, by reference (nothing copied, counted once; the request's own tokens go into its blocks
after the prompt's, which the entry never reads), or, where that request's K,V are not in the pool (a shared
context's), a copy written into blocks of its own. An entry is kept only where the pool has room for it, the pool
evicts entries, least recently used first, when requests need their blocks, and the choices that the cache answers
share the entry's blocks in turn. Bounded by tokens held, least recently used first out.

Without a pool (a TP peer, below), the entries hold the prefill's own tensors, not copies: the cache a request
decodes into grows by concatenation, never in place, so the prompt's K,V stay as they were.

Over a TP group (``--tp``) every rank of the front's group keeps its own cache of its own heads: the front's
changes to its entries and their order (``put``, ``longest``, ``whole``) are recorded (``record``) and its TP peers
replay them in the same order (``replay``), so the peers' entries, evictions and lookups stay the front's.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch
from transformers import DynamicCache

MIN_MATCH = 64  # a shorter common prefix saves less than looking it up and copying it costs


@dataclass
class CachedPrompt:
    ids: tuple[int, ...]
    kv: list[tuple[torch.Tensor, torch.Tensor]] | None  # per layer: K, V [1, heads, tokens, head_dim]; None: in blocks
    logits: torch.Tensor | None = None  # its last position's (the first token's), float32 [vocab]; None: not kept
    owner: str = ""  # its holder's name in the K,V pool ("": no pool)


class PrefixCache:
    def __init__(self, max_tokens: int, min_match: int = MIN_MATCH) -> None:
        self.max_tokens, self.min_match = max_tokens, min_match
        self.entries: OrderedDict[tuple[int, ...], CachedPrompt] = OrderedDict()
        self.tokens = 0
        self.bytes = 0  # the entries' K,V (read by /metrics from another thread: a number, never the entries)
        self.record: list | None = None  # a TP front's: (what, request id, prompt ids) of every change, in order
        self.kv = None  # the front's K,V pool (model/paged.PagedKV), where it has one: the entries are its holders
        self._kept = 0  # entries kept so far: each one's pool name is its number

    @property
    def pool(self):
        """The blocks' accounting of ``kv`` (serve/kv_pool.KVPool); None without a pool."""
        return self.kv.pool if self.kv is not None else None

    def _note(self, what: str, owner: str | None, ids) -> None:
        if self.record is not None and self.max_tokens:
            self.record.append((f"prefix-{what}", owner, tuple(ids)))

    def put(self, ids: list[int], cache: DynamicCache, logits: torch.Tensor | None = None,
            owner: str | None = None) -> None:
        """Keep the K,V of the prompt ``ids`` (the first ``len(ids)`` positions of ``cache``, the prefill of request
        ``owner``; with a pool, that request's blocks where it holds them) and its first-token ``logits``, where
        given; not where the pool has no room for it."""
        key = tuple(ids)
        if not self.max_tokens or len(key) > self.max_tokens or len(key) < self.min_match:
            self._note("put", owner, ids)
            return
        entry = self.entries.get(key)
        if entry is None:
            n = len(key)
            if self.kv is not None:
                holder, self._kept = f"prefix-{self._kept}", self._kept + 1
                if not self._keep(n, holder, cache, owner):
                    return  # (not recorded: a TP peer keeps no entry the front does not)
                entry = CachedPrompt(key, None, owner=holder)
            else:
                entry = CachedPrompt(key, [_own(layer.keys[:, :, :n], layer.values[:, :, :n])
                                           for layer in cache.layers])
            self._note("put", owner, ids)
            self.entries[key] = entry
            self.tokens += n
            self.bytes += self._nbytes(entry)
        else:
            self._note("put", owner, ids)
            self.entries.move_to_end(key)
        if entry.logits is None and logits is not None:
            entry.logits = logits.detach().float().cpu().clone()
        while self.tokens > self.max_tokens:
            self._drop(next(iter(self.entries)))

    def _keep(self, tokens: int, holder: str, cache, owner: str | None) -> bool:
        """The pool's holder ``holder`` over the first ``tokens`` positions: request ``owner``'s blocks by reference
        where it holds them, else blocks of its own written from ``cache``, older entries evicted as far as needed;
        False, evicting none, where even evicting every entry would leave too few (the requests hold the rest)."""
        kv, pool = self.kv, self.pool
        if owner is not None and kv.shareable(owner, tokens):
            kv.share(holder, owner, tokens)
            return True
        need = pool.blocks_for(tokens)
        if pool.free_blocks + sum(pool.sole(e.owner) for e in self.entries.values()) < need:
            return False
        while pool.free_blocks < need:
            self.evict_oldest(skip=())
        kv.add(holder, [(layer.keys[:, :, :tokens], layer.values[:, :, :tokens]) for layer in cache.layers], tokens)
        return True

    def evict_oldest(self, skip) -> bool:
        """Drop the least recently used entry whose pool name is not in ``skip``; False where there is none."""
        key = next((k for k, e in self.entries.items() if e.owner not in skip), None)
        if key is None:
            return False
        self._note("evict", None, key)
        self._drop(key)
        return True

    def _drop(self, key: tuple[int, ...]) -> None:
        old = self.entries.pop(key)
        self.tokens -= len(old.ids)
        self.bytes -= self._nbytes(old)
        if self.kv is not None:
            self.kv.release(old.owner)  # its blocks stay held where a request or a fork still reads them

    def entry(self, ids: list[int]) -> CachedPrompt | None:
        """The entry of exactly this prompt (the entries' order untouched)."""
        return self.entries.get(tuple(ids))

    def _best(self, ids: list[int]) -> tuple[int, CachedPrompt | None]:
        """The entry sharing the longest prefix with ``ids`` and that prefix's length (at least ``min_match``, and
        short of the whole prompt by one token at least: its last token's logits are still to compute)."""
        best, found = 0, None
        for entry in self.entries.values():
            n = _common(entry.ids, ids)
            if n > best:
                best, found = n, entry
        best = min(best, len(ids) - 1)
        return (best, found) if best >= self.min_match else (0, None)

    def holds(self, ids: list[int]) -> bool:
        """Whether ``longest`` would find an entry for ``ids`` (without touching the entries' order)."""
        return self._best(ids)[1] is not None

    def longest(self, ids: list[int]) -> tuple[int, CachedPrompt | None]:
        """``_best``'s entry and length, the entry marked as the most recently used."""
        best, found = self._best(ids)
        if found is not None:
            self._note("longest", None, ids)
            self.entries.move_to_end(found.ids)
        return best, found

    def answers(self, ids: list[int]) -> bool:
        """Whether ``whole`` would find the prompt with its first-token logits (the entries' order untouched)."""
        entry = self.entries.get(tuple(ids))
        return entry is not None and entry.logits is not None

    def whole(self, ids: list[int], owner: str | None = None) -> CachedPrompt | None:
        """The entry of exactly this prompt with its first-token logits (nothing left to compute), marked as the
        most recently used (asked for request ``owner``)."""
        if not self.answers(ids):
            return None
        self._note("whole", owner, ids)
        entry = self.entries[tuple(ids)]
        self.entries.move_to_end(entry.ids)
        return entry

    def layers(self, entry: CachedPrompt, tokens: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The first ``tokens`` positions of ``entry``, per layer: views of its tensors, or gathered from its blocks
        (a copy)."""
        if entry.kv is None:
            return self.kv.gathered(entry.owner, tokens)
        return [(k[:, :, :tokens], v[:, :, :tokens]) for k, v in entry.kv]

    def cache_of(self, entry: CachedPrompt, tokens: int, config) -> DynamicCache:
        """A cache over the first ``tokens`` positions of ``entry`` (``layers``). Whoever holds it reads it and
        never writes it: a decode writes it into its pool once for its forks (model/paged.PagedKV.fork), a
        transformers append copies it. (A decode in the pool shares the entry's blocks instead.)"""
        cache = DynamicCache(config=config)
        for layer, (k, v) in zip(cache.layers, self.layers(entry, tokens)):
            layer.lazy_initialization(k, v)
            layer.keys, layer.values = k, v
        return cache

    def held(self, entry: CachedPrompt, tokens: int) -> list[torch.Tensor]:
        """The first ``tokens`` positions of ``entry`` as the chain hands a prefix on: ``[2, 1, heads, tokens,
        head_dim]`` per layer (what the front sends rank 0 when the new tokens run over the chain)."""
        return [torch.stack(kv) for kv in self.layers(entry, tokens)]

    def _nbytes(self, entry: CachedPrompt) -> int:
        """What ``entry`` holds: its tensors, or its blocks (shared with requests or not)."""
        if entry.kv is None:
            return self.pool.blocks_for(len(entry.ids)) * self.pool.block_bytes
        return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in entry.kv)


    def replay(self, op: tuple, caches: dict, config) -> tuple[str, object] | None:
        """A TP peer's part of one change the front recorded: the same entries kept and ordered, from this rank's
        own K,V (``caches``: its last step's prompts' caches). What the front took from the cache comes back: ("held",
        the K,V a prompt's new tokens run after) or ("cache", the request's cache over a whole entry)."""
        what, owner, ids = op
        if what == "prefix-put":
            self.put(list(ids), caches[owner])
        elif what == "prefix-longest":
            cached, entry = self.longest(list(ids))
            return "held", self.held(entry, cached)
        elif what == "prefix-evict":
            self._drop(ids)
        elif what == "prefix-whole":
            entry = self.entries[ids]  # the front's entry has its logits; this rank's needs none
            self.entries.move_to_end(ids)
            return "cache", self.cache_of(entry, len(ids), config)
        return None


def _common(a: tuple[int, ...], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def _own(keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's K and V pinning no more memory than they hold: a view into more (a chunked prefill's cache keeps
    room for appends) is copied, so an entry, bounded in tokens, pins no more than its tokens. K and V that share
    one storage of their size (the chain's stacked K,V) are kept as they are."""
    held = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in (keys, values)}
    if sum(held.values()) == (keys.numel() + values.numel()) * keys.element_size():
        return keys, values
    return keys.clone(), values.clone()
