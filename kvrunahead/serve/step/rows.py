"""Decode rows on the front: alone, or riding along a prompt's forward (Sarathi's and Medha's mixed batches).

A step's prompt segment (a whole prompt or a chunk, the front's part of it where it runs over the chain) and the
running requests' next tokens go through the model as one sequence: the part's tokens, then one token per decode
row, each with its own position. Every layer's K,V are split by segment as the cache receives them: the part's go
through the KV chain's exchange (``modes.kvr.ChainLink``, exactly as ``kvr_prefill`` does), the rows' are written
into their requests' blocks of the rank's K,V pool (model/paged.py), one write per layer for every row. Attention
then runs once per layer: the part's queries against its keys with the split attention of the chain
(``split_block``), each row's query against its request's blocks, the rows' tables built once for the step. So the
weights are read once for the whole step and every row attends exactly what it would alone (greedy output alone ==
beside a chunk, tests/test_mixed_steps.py).

A model with sliding-window layers decodes its rows here too (the window is the kernel's parameter, every position
kept in the pool); a prompt's part rides with full-attention models only (the chain keeps a sliding layer's window,
not its positions from 0).
"""

from __future__ import annotations

from dataclasses import dataclass

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
from kvrunahead.model.paged import PagedKV
from kvrunahead.modes.attention import refuse_softcap
from kvrunahead.modes.kvr import ChainLink, RunaheadCache, split_block


@dataclass
class Row:
    """A request decoding on the front: the token to compute now, its position (the request's next in ``kv``), and
    the pool its K,V are in."""

    token: int
    position: int
    request_id: str
    kv: PagedKV


class _State:
    """A mixed forward's: the part's length and K,V (the layer being run), the rows' slots and tables (the step's)."""

    def __init__(self, part_tokens: int, rows: list[Row]) -> None:
        self.part_tokens, self.rows, self.layer, self.part_kv = part_tokens, rows, 0, None
        self.kv = rows[0].kv if rows else None
        if rows:
            owners = [r.request_id for r in rows]
            for r in rows:
                if r.kv.length(r.request_id) != r.position:
                    raise RuntimeError(f"{r.request_id}: its next position is {r.position} but its K,V hold "
                                       f"{r.kv.length(r.request_id)}")
            self.slots = torch.tensor([self.kv.grow(o) for o in owners], device=self.kv.device)
            self.tables = self.kv.tables(owners, q_lo=part_tokens)


class _RowsLayer(DynamicLayer):
    """One layer's cache in a mixed forward: the part's K,V through the chain layer, the rows' into their blocks."""

    def __init__(self, part_layer, index: int, state: _State) -> None:
        super().__init__()
        self.part_layer, self.index, self.state = part_layer, index, state

    def get_seq_length(self) -> int:
        return self.part_layer.get_seq_length()

    def get_mask_sizes(self, *args, **kwargs):
        return self.part_layer.get_mask_sizes(*args, **kwargs)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        n, state = self.state.part_tokens, self.state
        state.layer = self.index
        state.part_kv = self.part_layer.update(key_states[:, :, :n], value_states[:, :, :n], *args, **kwargs) \
            if n else None
        if state.rows:
            state.kv.write(self.index, state.slots, key_states[:, :, n:], value_states[:, :, n:])
        return key_states, value_states  # the attention reads the part's K,V and the pool, not these


class RowsCache(DynamicCache):
    """The cache a mixed forward hands the model: the chain cache of the part, the rows' blocks beside it."""

    def __init__(self, part: RunaheadCache, state: _State) -> None:
        layers = [_RowsLayer(layer, i, state) for i, layer in enumerate(part.layers)]
        super(DynamicCache, self).__init__(layers=layers)


def can_mix(model: torch.nn.Module) -> bool:
    """Whether decode rows can share ``model``'s forward: its attention goes through transformers' interface (where
    the segment attention goes in) and its forward keeps the logits of chosen positions only."""
    return uses_attention_interface(model) and forward_takes(model, "logits_to_keep")


MIXED = "kvrunahead_mixed_rows"


def mixed_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The part's queries against its keys, causally at their end, then each row's against its request's blocks."""
    refuse_softcap(kwargs, "a mixed step")
    state: _State = current_state()
    n, part = state.part_tokens, state.part_kv
    window = state.kv.layout.window(state.layer) if state.kv is not None else None
    if kernel.usable(query):  # the CPU's: the part and every row in one call, the blocks read in place
        rows = [kernel.Row(0, 0, n, part[0].shape[2] - n, [kernel.Piece(*part, 0)])] if n else []
        paged = (*state.kv.kernel_views(state.layer), *state.tables) if state.rows else None
        return kernel.varlen(query, rows, causal=True, window=window, scale=scaling, out_float=False,
                             paged=paged)[0], None
    outs = [split_block(query[:, :, :n], *part, scaling)] if n else []
    for j, row in enumerate(state.rows):  # torch's attention: each row's blocks gathered first
        keys, values = state.kv.gather(row.request_id, state.layer, last=window)  # a window's positions only
        outs.append(split_block(query[:, :, n + j:n + j + 1], keys, values, scaling, window=window))
    return torch.cat(outs, dim=1), None


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
    state = _State(n, rows)
    keep = ([n - 1] if emit and n else []) + [n + j for j in range(len(rows))]
    link.start()
    with attention_mode(model, MIXED, state):
        out = model(input_ids=ids, position_ids=positions, **with_cache(model, RowsCache(part, state)),
                    use_cache=True, logits_to_keep=torch.tensor(keep, device=device))
    link.finish()
    logits = out.logits[0]
    first = logits[0] if emit and n else None
    return first, list(logits[len(keep) - len(rows):]), part
