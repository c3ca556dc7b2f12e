"""Decode rows riding along a prompt's forward on the front (Sarathi's and Medha's mixed batches).

A step's prompt segment (a whole prompt or a chunk, the front's part of it where it runs over the chain) and the
running requests' next tokens go through the model as one sequence: the part's tokens, then one token per decode
row, each with its own position. Every layer's K,V are split by segment as the cache receives them: the part's go
through the KV chain's exchange (``modes.kvr.ChainLink``, exactly as ``kvr_prefill`` does), each row's are appended
in place to that request's own K,V (model/growing.py). Attention then runs segment by segment: the part's queries
against its keys with the split attention of the chain (``split_block``), each row's query against its request's
keys. So the weights are read once for the whole step and every row attends exactly what it would alone (greedy
output alone == beside a chunk, tests/test_mixed_steps.py).

Full-attention models only: a sliding layer's window would have to be trimmed per row.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from kvrunahead.kernels import attention as kernel
from kvrunahead.model.attention import (
    attention_mode,
    current_state,
    register,
    require_attention_interface,
    uses_attention_interface,
)
from kvrunahead.model.compiled import eager
from kvrunahead.model.forward import forward_takes, with_cache
from kvrunahead.model.growing import GrowingKV
from kvrunahead.modes.attention import attend_with_lse, merge_lse, refuse_softcap
from kvrunahead.modes.kvr import ChainLink, RunaheadCache, split_block


class ForkedKV:
    """One layer's K,V of a request decoding after a prompt it shares (the prefix cache's entry: ``prefix``, read
    and never copied or written) and its own tokens after it (``own``, grown in place). The requests forked from
    one entry (``n`` choices of a prompt) attend it in one product per step, their queries stacked (PAT's decode
    attention, kvrunahead/decode/shared_prefix.py), each its own tokens apart, the two merged by their log-sum-exp."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        self.prefix = keys, values
        self.own: GrowingKV | None = None

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> ForkedKV:
        """Write ``keys``, ``values`` after its own tokens; itself, which the attention reads (prefix and own)."""
        if self.own is None:
            self.own = GrowingKV(keys, values)
        else:
            self.own.append(keys, values)
        return self


@dataclass
class Row:
    """A request decoding on the front: the token to compute now, its position, its K,V per layer (grown in
    place by this step; forked: after the prompt it shares)."""

    token: int
    position: int
    kv: list[GrowingKV | ForkedKV]


@dataclass
class _State:
    part_tokens: int
    blocks: list = field(default_factory=list)  # the layer being run: (q_lo, q_hi, (keys, values) or ForkedKV)


class _RowsLayer(DynamicLayer):
    """One layer's cache in a mixed forward: the part's K,V through the chain layer, each row's appended to its own."""

    def __init__(self, part_layer, rows: list[Row], index: int, state: _State) -> None:
        super().__init__()
        self.part_layer, self.rows, self.index, self.state = part_layer, rows, index, state

    def get_seq_length(self) -> int:
        return self.part_layer.get_seq_length()

    def get_mask_sizes(self, *args, **kwargs):
        return self.part_layer.get_mask_sizes(*args, **kwargs)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        n = self.state.part_tokens
        blocks = []
        if n:
            blocks.append((0, n, self.part_layer.update(key_states[:, :, :n], value_states[:, :, :n], *args, **kwargs)))
        for j, row in enumerate(self.rows):
            held = row.kv[self.index].append(key_states[:, :, n + j:n + j + 1], value_states[:, :, n + j:n + j + 1])
            blocks.append((n + j, n + j + 1, held))  # (keys, values), or a ForkedKV
        self.state.blocks = blocks
        return key_states, value_states  # the attention reads the blocks, not these


class RowsCache(DynamicCache):
    """The cache a mixed forward hands the model: the chain cache of the part, the rows' own K,V beside it."""

    def __init__(self, part: RunaheadCache, rows: list[Row], state: _State) -> None:
        layers = [_RowsLayer(layer, rows, i, state) for i, layer in enumerate(part.layers)]
        super(DynamicCache, self).__init__(layers=layers)


def can_mix(model: torch.nn.Module) -> bool:
    """Whether decode rows can share ``model``'s forward: its attention goes through transformers' interface (where
    the segment attention goes in) and its forward keeps the logits of chosen positions only."""
    return uses_attention_interface(model) and forward_takes(model, "logits_to_keep")


MIXED = "kvrunahead_mixed_rows"


def mixed_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Each block's queries (the part's, then one per row) against that segment's keys, causally at their end; the
    rows forked from one shared prompt against it together (``forked_attention``)."""
    refuse_softcap(kwargs, "a mixed step")
    blocks = current_state().blocks
    if kernel.usable(query):  # the CPU's: every block in one call, a fork's shared prompt read in place
        return kernel.varlen(query, [_kernel_row(lo, hi, kv) for lo, hi, kv in blocks], causal=True, scale=scaling,
                             out_float=False)[0], None
    outs, forks = [None] * len(blocks), {}
    for b, (lo, hi, kv) in enumerate(blocks):
        if isinstance(kv, ForkedKV):
            forks.setdefault((kv.prefix[0].data_ptr(), kv.prefix[0].shape), []).append(b)  # one prompt's forks
        else:
            outs[b] = split_block(query[:, :, lo:hi], *kv, scaling)
    for members in forks.values():
        for b, out in zip(members, forked_attention(query, [blocks[b] for b in members], scaling)):
            outs[b] = out
    return torch.cat(outs, dim=1), None


def _kernel_row(lo: int, hi: int, kv) -> kernel.Row:
    """A block's queries (the last ``hi - lo`` positions of its keys) and its K,V pieces: a fork's shared prompt
    then its own tokens, or the block's keys."""
    if isinstance(kv, ForkedKV):
        keys, values = kv.prefix
        shared = keys.shape[2]
        pieces = [kernel.Piece(keys, values, 0), kernel.Piece(kv.own.keys, kv.own.values, shared)]
        return kernel.Row(0, lo, hi, shared + kv.own.keys.shape[2] - (hi - lo), pieces)
    keys, values = kv
    return kernel.Row(0, lo, hi, keys.shape[2] - (hi - lo), [kernel.Piece(keys, values, 0)])


def forked_attention(query, rows, scale) -> list[torch.Tensor]:
    """One query per row (``(q, q + 1, ForkedKV)`` each, the same prefix): every query against the shared prefix in
    one product, each against its own tokens, merged by log-sum-exp. Each row's ``[1, 1, heads, head_dim]``."""
    keys, values = rows[0][2].prefix
    stacked = torch.cat([query[:, :, lo:hi] for lo, hi, _ in rows], dim=2)
    out, lse = attend_with_lse(stacked, keys, values, causal=False, scale=scale)
    outs = []
    for i, (lo, hi, kv) in enumerate(rows):
        own_out, own_lse = attend_with_lse(query[:, :, lo:hi], kv.own.keys, kv.own.values, causal=False, scale=scale)
        merged, _ = merge_lse(out[:, :, i:i + 1], lse[:, :, i:i + 1], own_out, own_lse)
        outs.append(merged.to(query.dtype).transpose(1, 2).contiguous())
    return outs


register(MIXED, mixed_attention)


@torch.no_grad()
@eager()
def mixed_forward(model: torch.nn.Module, part_ids: list[int], link: ChainLink, rows: list[Row], emit: bool
                  ) -> tuple[torch.Tensor | None, list[torch.Tensor], RunaheadCache]:
    """The front's part of a prompt segment (``part_ids`` at positions from ``link.prefix_len``) and ``rows`` in
    one forward. Returns the part's last-token logits (``emit``), each row's next-token logits, and the part's
    cache (as ``kvr_prefill`` leaves it).

    Eager under ``--compile`` too: compiled, a step of rows ran slower than eager (one row 80 against 70 ms, eight
    of unequal contexts 304 against 194 ms, experiments/fast_forward/decode_step.jsonl: dynamo's guards and graph
    breaks at every layer's per-row attention cost more than the fused kernels save at a few tokens), and its
    shape families took minutes to compile at start."""
    require_attention_interface(model, "a mixed step")
    device = link.device
    n = len(part_ids)
    ids = torch.tensor([[*part_ids, *(r.token for r in rows)]], device=device)
    positions = torch.tensor([[*range(link.prefix_len, link.prefix_len + n), *(r.position for r in rows)]],
                             device=device)
    part = RunaheadCache(link)
    state = _State(n)
    keep = ([n - 1] if emit and n else []) + [n + j for j in range(len(rows))]
    link.start()
    with attention_mode(model, MIXED, state):
        out = model(input_ids=ids, position_ids=positions, **with_cache(model, RowsCache(part, rows, state)),
                    use_cache=True, logits_to_keep=torch.tensor(keep, device=device))
    link.finish()
    logits = out.logits[0]
    first = logits[0] if emit and n else None
    return first, list(logits[len(keep) - len(rows):]), part
