"""Context-parallel prefill with K,V all-gather and the zigzag layout (Llama 3 style long-context inference).

The sequence is cut into 2p chunks and rank i holds chunks i and 2p-1-i, so every rank gets the same
share of the causal triangle. Every layer all-gathers K,V; each local query chunk [a, e) then attends
only to the keys it can see, [0, e) (a sliding-window layer: [a - window + 1, e)), masked on its diagonal block.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvrunahead.model.attention import attention_mode, current_state, expand_kv, register
from kvrunahead.model.forward import forward_part
from kvrunahead.modes.attention import attend, causal_mask, refuse_softcap
from kvrunahead.modes.tsp import GatherCache, positions
from kvrunahead.partition import zigzag_emitter
from kvrunahead.ranks.transport import Transport

IMPLEMENTATION = "kvrunahead_cp_allgather"


@dataclass
class _State:
    query_ranges: list[tuple[int, int]]


def cp_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Registered attention function: ``key``/``value`` hold all C positions in order."""
    refuse_softcap(kwargs, "cp-allgather")
    state: _State = current_state()
    key, value = expand_kv(key, query.shape[1]), expand_kv(value, query.shape[1])
    window = kwargs.get("sliding_window")  # a sliding-window layer: only the keys its window reaches
    outs, offset = [], 0
    for a, e in state.query_ranges:
        q = query[:, :, offset : offset + e - a]
        offset += e - a
        lo = max(0, a - window + 1) if window else 0
        mask = causal_mask(a, e - a, lo, e - lo, query.device, window)
        outs.append(attend(q, key[:, :, lo:e], value[:, :, lo:e], mask, scaling))
    return torch.cat(outs, dim=2).transpose(1, 2).contiguous(), None


register(IMPLEMENTATION, cp_attention)


@torch.no_grad()
def prefill(model, input_ids, transport: Transport, num_layers: int, ranges, context_len: int):
    mine = ranges[transport.rank]
    cache = GatherCache(num_layers, transport, ranges)
    with attention_mode(model, IMPLEMENTATION, _State(mine)):
        logits = forward_part(
            model, input_ids, transport.rank == zigzag_emitter(transport.world_size),
            position_ids=positions(mine, input_ids.device), cache=cache,
        )
    return logits, cache

