"""A rank's K,V in blocks: the pool of blocks with reference counts and a table per holder (``KVPool``: vLLM's
``BlockPool``, nano-vllm's ``BlockManager``), and the tensors those blocks index (``PagedKV``).

``PagedKV`` holds, per layer, one tensor of ``num_blocks * block_tokens`` slots ``[slots, kv_heads, head_dim]``,
allocated once (its pages are touched only as blocks are written). A holder's K,V is its table of blocks and nowhere
else: position ``p`` lives in slot ``block * block_tokens + offset``. Writes take one ``index_copy_`` per layer for
every row of a step (vLLM's ``reshape_and_cache`` by slot mapping); reads hand our attention kernel the runs of
consecutive slots as pieces of a ``[1, kv_heads, slots, head_dim]`` view (nothing gathered), or gather a row's
slots for torch's attention.

A holder may start with another holder's first blocks by reference (``share``: the prefix cache's entry over the
prompt of the request that prefilled it, the ``n`` choices of a cached prompt over the entry), its own tokens in
blocks after them: nothing is copied, on sharing or on write. Where a shared prompt is another rank's tensors (a TP
peer's prefix cache), ``fork`` writes it once for all its forks.

On the front, the server's K,V budget (serve/kv_pool.KVRoom) and this rank's blocks are one ``KVPool``: a request
admitted holds the very blocks its K,V are then written into.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

import torch

from kvrunahead.model.layout import KVLayout

BLOCK_TOKENS = 16  # vLLM's default block size
GIB = 1 << 30


@dataclass
class Table:
    blocks: list[int] = field(default_factory=list)
    shared_tokens: int = 0  # the positions its first blocks hold by reference (a fork's prompt); its own come after


class OutOfBlocks(RuntimeError):
    """A holder needs more blocks than are free."""


class KVPool:
    def __init__(self, num_blocks: int, block_bytes: int, block_tokens: int = BLOCK_TOKENS) -> None:
        if num_blocks < 1:
            raise ValueError(f"a K,V pool needs at least one block, got {num_blocks}")
        self.num_blocks, self.block_bytes, self.block_tokens = num_blocks, block_bytes, block_tokens
        self._free: deque[int] = deque(range(num_blocks))
        self._refs = [0] * num_blocks
        self.tables: dict[str, Table] = {}

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    @property
    def used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def usage(self) -> float:
        """The share of the blocks held (vLLM's ``kv_cache_usage_perc``: 1 is all of them)."""
        return self.used_blocks / self.num_blocks

    @property
    def tokens(self) -> int:
        """The most positions the pool holds."""
        return self.num_blocks * self.block_tokens

    def blocks_for(self, tokens: int) -> int:
        return math.ceil(max(0, tokens) / self.block_tokens)

    def needs(self, owner: str, tokens: int) -> int:
        """The blocks ``owner`` must take to hold ``tokens`` positions (0 where it holds them already)."""
        table = self.tables.get(owner)
        if table is None:
            return self.blocks_for(tokens)
        shared = self.blocks_for(table.shared_tokens)
        return max(0, shared + self.blocks_for(tokens - table.shared_tokens) - len(table.blocks))

    def hold(self, owner: str, tokens: int) -> None:
        """Grow ``owner``'s table to hold ``tokens`` positions; raises OutOfBlocks, taking none, where too few are
        free."""
        need = self.needs(owner, tokens)
        if need > len(self._free):
            raise OutOfBlocks(f"{owner} needs {need} blocks of K,V, {len(self._free)} are free")
        table = self.tables.setdefault(owner, Table())
        for _ in range(need):
            block = self._free.popleft()
            self._refs[block] = 1
            table.blocks.append(block)

    def share(self, owner: str, source: str, tokens: int) -> None:
        """Start ``owner``'s table with the blocks of ``source`` that hold its first ``tokens`` positions, by
        reference (a fork of a cached prompt); its own positions go into blocks of its own after them."""
        if owner in self.tables:
            raise ValueError(f"{owner} holds blocks already")
        if not self.shareable(source, tokens):
            raise ValueError(f"{source}'s first {tokens} positions are not its first blocks")
        blocks = self.tables[source].blocks[:self.blocks_for(tokens)]
        for block in blocks:
            self._refs[block] += 1
        self.tables[owner] = Table(list(blocks), tokens)

    def shareable(self, owner: str, tokens: int) -> bool:
        """Whether ``owner``'s first ``tokens`` positions are its first blocks, in order (a fork's own positions
        start in a block after its shared ones)."""
        table = self.tables.get(owner)
        return table is not None and (not table.shared_tokens or tokens <= table.shared_tokens)

    def sole(self, owner: str) -> int:
        """The blocks ``owner`` alone holds: what releasing it would free."""
        table = self.tables.get(owner)
        return sum(self._refs[b] == 1 for b in table.blocks) if table is not None else 0

    def release(self, owner: str) -> int:
        """Drop ``owner``'s table; the blocks no other holder refers to are free again, first in line and in their
        order (the next holder takes memory already touched, in runs of consecutive blocks). How many were freed."""
        table = self.tables.pop(owner, None)
        freed = 0
        for block in reversed(table.blocks) if table is not None else ():
            self._refs[block] -= 1
            if not self._refs[block]:
                self._free.appendleft(block)
                freed += 1
        return freed

    def blocks_of(self, owners) -> int:
        """The blocks any of ``owners`` holds, each counted once."""
        tables = [self.tables.get(owner) for owner in owners]
        return len({b for table in tables if table is not None for b in table.blocks})

    def describe(self) -> str:
        return (f"{self.num_blocks * self.block_bytes / GIB:.3g} GiB of K,V: {self.num_blocks} blocks of "
                f"{self.block_tokens} positions ({self.tokens} positions)")




class PagedKV:
    """One rank's decode K,V over ``layout``'s layers in ``num_blocks`` blocks (see the module's docstring). Holders
    are named by strings (request ids); ``length(owner)`` positions each, from position 0."""

    def __init__(self, layout: KVLayout, num_blocks: int, dtype: torch.dtype, device: torch.device | str = "cpu",
                 block_tokens: int = BLOCK_TOKENS, pool: KVPool | None = None) -> None:
        """``pool``: the blocks' accounting where another holds it too (the front's budget); else a pool of its
        own of ``num_blocks``."""
        per_token = sum(2 * h * d for h, d in zip(layout.heads, layout.head_dim)) * dtype.itemsize
        self.pool = pool or KVPool(num_blocks, per_token * block_tokens, block_tokens)
        slots = self.pool.num_blocks * self.pool.block_tokens
        self.layout, self.dtype, self.device = layout, dtype, torch.device(device)
        self.keys = [torch.empty(slots, h, d, dtype=dtype, device=device)
                     for h, d in zip(layout.heads, layout.head_dim)]
        self.values = [torch.empty_like(k) for k in self.keys]
        self.lengths: dict[str, int] = {}
        self.runs: dict[str, list[list[int]]] = {}  # owner -> [slot_lo, slot_hi, position_lo] of consecutive slots
        self._entries: dict[tuple, list] = {}  # a shared prompt -> [its holder's name, its tensor (kept), forks]
        self._fork_of: dict[str, tuple] = {}
        self._named = 0

    def __contains__(self, owner: str) -> bool:
        return owner in self.lengths

    def length(self, owner: str) -> int:
        return self.lengths[owner]

    def add(self, owner: str, kv: list[tuple[torch.Tensor, torch.Tensor]], tokens: int | None = None) -> None:
        """``owner``'s ``tokens`` positions (default: the most any layer of ``kv`` holds) from ``kv`` (per layer:
        keys, values ``[1, heads, n, head_dim]``, the last ``n`` of them: a sliding layer's window), written into
        blocks of its own. A sliding layer's slots before its window stay unwritten: no query can see them."""
        tokens = max(k.shape[-2] for k, _ in kv) if tokens is None else tokens
        table = self.pool.tables.get(owner)
        if table is not None and table.shared_tokens:
            raise ValueError(f"{owner} starts with shared blocks: its prompt is not written again")
        self.pool.hold(owner, tokens)  # nothing taken where its budget holds them already (the front's admission)
        self.lengths[owner], self.runs[owner] = 0, []
        slots = self._extend(owner, tokens)
        for layer, (k, v) in enumerate(kv):
            self.write(layer, slots[tokens - k.shape[-2]:], k, v)

    def fork(self, owner: str, kv: list[tuple[torch.Tensor, torch.Tensor]], tokens: int | None = None) -> None:
        """``owner`` starts with the shared prompt ``kv`` (another holder's tensors, read and never written; its
        ``tokens`` as ``add`` takes them): its blocks written once for every fork of the same tensors and held by
        reference."""
        key = (kv[0][0].data_ptr(), tuple(kv[0][0].shape), tuple(kv[0][0].stride()))
        entry = self._entries.get(key)
        if entry is None:
            self._named += 1
            entry = self._entries[key] = [f"shared-{self._named}", kv[0][0], 0]
            self.add(entry[0], kv, tokens)
        tokens = self.lengths[entry[0]]
        self.pool.share(owner, entry[0], tokens)
        self.lengths[owner], self.runs[owner] = tokens, [list(r) for r in self.runs[entry[0]]]
        entry[2] += 1
        self._fork_of[owner] = key

    def share(self, owner: str, source: str, tokens: int | None = None) -> None:
        """``owner`` starts with the first ``tokens`` positions of ``source`` (default: all it holds) by reference:
        its table shares ``source``'s blocks (taken here, or already where the front's admission took them) and reads
        their slots; its own positions go into blocks of its own after them."""
        tokens = self.lengths[source] if tokens is None else tokens
        table = self.pool.tables.get(owner)
        if table is None:
            self.pool.share(owner, source, tokens)
        elif table.shared_tokens != tokens or table.blocks[:1] != self.pool.tables[source].blocks[:1]:
            raise ValueError(f"{owner} holds blocks other than {source}'s first {tokens} positions")
        self.lengths[owner], self.runs[owner] = tokens, [list(r) for r in self.runs[source]]
        self.truncate(owner, tokens)

    def shareable(self, owner: str, tokens: int) -> bool:
        """Whether another holder can start with ``owner``'s first ``tokens`` positions by reference (written)."""
        return owner in self.lengths and self.lengths[owner] >= tokens and self.pool.shareable(owner, tokens)

    def grow(self, owner: str) -> int:
        """One more position for ``owner``: its slot (a block taken where its last is full)."""
        return int(self._extend(owner, 1)[0])

    def write(self, layer: int, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Positions ``keys``/``values`` (``[1, heads, n, head_dim]``) into ``slots`` ``[n]`` of ``layer``."""
        self.write_rows(layer, slots, keys[0].transpose(0, 1), values[0].transpose(0, 1))

    def write_rows(self, layer: int, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """``write`` of ``keys``/``values`` laid out ``[n, heads, head_dim]``."""
        self.keys[layer].index_copy_(0, slots, keys)
        self.values[layer].index_copy_(0, slots, values)

    def truncate(self, owner: str, tokens: int) -> None:
        """Cut ``owner`` back to its first ``tokens`` positions (its blocks kept for the positions to come)."""
        runs = self.runs[owner]
        while runs and runs[-1][2] >= tokens:
            runs.pop()
        if runs:
            runs[-1][1] = min(runs[-1][1], runs[-1][0] + tokens - runs[-1][2])
        self.lengths[owner] = min(self.lengths[owner], tokens)

    def release(self, owner: str) -> None:
        """Free ``owner``'s blocks (those no fork still shares); a shared prompt's when its last fork goes."""
        if self.lengths.pop(owner, None) is None:
            return
        self.runs.pop(owner)
        self.pool.release(owner)
        key = self._fork_of.pop(owner, None)
        if key is not None:
            entry = self._entries[key]
            entry[2] -= 1
            if not entry[2]:
                del self._entries[key]
                self.release(entry[0])

    def slots(self, owner: str) -> torch.Tensor:
        """``owner``'s slots in position order ``[length]``."""
        return torch.cat([torch.arange(lo, hi) for lo, hi, _ in self.runs[owner]]).to(self.device)

    def gather(self, owner: str, layer: int, last: int | None = None, first: int | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """``owner``'s keys and values of ``layer`` (its ``last`` or its ``first`` positions only, where given),
        copied out ``[1, heads, n, head_dim]`` (for torch's attention, and whoever needs a prompt's K,V whole)."""
        slots = self.slots(owner)
        slots = slots[-last:] if last else slots[:first] if first is not None else slots
        return tuple(t[layer].index_select(0, slots).transpose(0, 1).unsqueeze(0) for t in (self.keys, self.values))

    def gathered(self, owner: str, first: int | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``gather`` of every layer: ``owner``'s K,V (its ``first`` positions only, where given), copied out."""
        return [self.gather(owner, layer, first=first) for layer in range(len(self.keys))]

    def kernel_views(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``layer``'s keys and values as our kernel reads them: ``[1, heads, slots, head_dim]``, not copied."""
        return self.keys[layer].permute(1, 0, 2).unsqueeze(0), self.values[layer].permute(1, 0, 2).unsqueeze(0)

    def tables(self, owners: list[str], q_lo: int = 0, tensor: int = 0, piece: int = 0
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Our kernel's row and piece tables (kernels/attention.py) for one query per owner, row ``j`` at query
        index ``q_lo + j`` and position ``length - 1``, its keys every position it holds: the runs of its slots as
        pieces of tensor ``tensor`` (``kernel_views``), numbered from ``piece``."""
        rows, pieces = [], []
        for j, owner in enumerate(owners):
            first = piece + len(pieces)
            pieces += [(tensor, 0, lo, hi, position) for lo, hi, position in self.runs[owner]]
            rows.append((0, q_lo + j, q_lo + j + 1, self.lengths[owner] - 1, first, piece + len(pieces)))
        return (torch.tensor(rows, dtype=torch.long).reshape(-1, 6),
                torch.tensor(pieces, dtype=torch.long).reshape(-1, 5))

    def _extend(self, owner: str, tokens: int) -> torch.Tensor:
        """Take positions ``[length, length + tokens)`` for ``owner``: their slots ``[tokens]``, its runs extended."""
        start = self.lengths[owner]
        self.pool.hold(owner, start + tokens)
        table, bt = self.pool.tables[owner], self.pool.block_tokens
        shared = table.shared_tokens
        runs, out = self.runs[owner], []
        p = start
        while p < start + tokens:
            if p < shared:
                block, offset = table.blocks[p // bt], p % bt
            else:
                own = p - shared
                block, offset = table.blocks[math.ceil(shared / bt) + own // bt], own % bt
            n = min(bt - offset, start + tokens - p, (shared - p) if p < shared else start + tokens - p)
            lo = block * bt + offset
            if runs and runs[-1][1] == lo:
                runs[-1][1] += n
            else:
                runs.append([lo, lo + n, p])
            out.append(torch.arange(lo, lo + n))
            p += n
        self.lengths[owner] = start + tokens
        return torch.cat(out).to(self.device) if len(out) > 1 else out[0].to(self.device)
