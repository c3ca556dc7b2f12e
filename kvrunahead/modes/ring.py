"""Ring attention with pass-KV and the zigzag layout (ring-flash-attention, Megatron's p2p context parallel).

Rank i holds chunks i and 2p-1-i. In every layer the K,V blocks travel around the ring: at each of the
p steps a rank sends the block in hand to rank i+1 and receives the next one from rank i-1 while it
attends to the block in hand; partial results are merged exactly with their log-sum-exp. A query chunk
sees a key chunk fully when the key chunk lies before it, causally when it is the same chunk, and not at
all when it lies after it, so no masked work is done.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache

from kvrunahead.model.attention import attention_mode, current_state, register
from kvrunahead.model.forward import forward_part
from kvrunahead.modes.attention import attend_with_lse, merge_lse, refuse_softcap
from kvrunahead.modes.tsp import positions
from kvrunahead.partition import zigzag_emitter
from kvrunahead.ranks.transport import Transport

IMPLEMENTATION = "kvrunahead_ring"


@dataclass
class _State:
    transport: Transport
    ranges: list[list[tuple[int, int]]]


def _chunk_attention(q, q_range, k, v, k_ranges, scale, out, lse):
    qa, qe = q_range
    offset = 0
    for ka, ke in k_ranges:
        kb, vb = k[:, :, offset : offset + ke - ka], v[:, :, offset : offset + ke - ka]
        offset += ke - ka
        if ka >= qe:
            continue  # keys after every query: fully masked, skipped
        block_out, block_lse = attend_with_lse(q, kb, vb, causal=ka == qa, scale=scale)
        out, lse = merge_lse(out, lse, block_out, block_lse)
    return out, lse


def ring_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Registered attention function: ``key``/``value`` are this rank's own chunks only."""
    refuse_softcap(kwargs, "ring")
    state: _State = current_state()
    t, ranges = state.transport, state.ranges
    p, rank = t.world_size, t.rank
    tag_base = module.layer_idx * p
    block = torch.stack((key, value)).contiguous()
    mine = ranges[rank]
    outs: list = [None] * len(mine)
    lses: list = [None] * len(mine)
    for step in range(p):
        src = (rank - step) % p
        if step < p - 1:
            nxt = (rank - step - 1) % p
            n = sum(e - a for a, e in ranges[nxt])
            buf = block.new_empty((*block.shape[:-2], n, block.shape[-1]))
            req = t.exchange(block, (rank + 1) % p, buf, (rank - 1) % p, tag=tag_base + step)
        k, v = block[0], block[1]  # K,V heads as the model has them: attend_with_lse repeats where it must
        offset = 0
        for i, (a, e) in enumerate(mine):
            q = query[:, :, offset : offset + e - a]
            offset += e - a
            outs[i], lses[i] = _chunk_attention(q, (a, e), k, v, ranges[src], scaling, outs[i], lses[i])
        if step < p - 1:
            t.wait(req, f"ring step {step}'s K,V block from rank {(rank - 1) % p}")
            block = buf
    out = torch.cat(outs, dim=2).to(query.dtype)
    return out.transpose(1, 2).contiguous(), None


register(IMPLEMENTATION, ring_attention)


@torch.no_grad()
def prefill(model, input_ids, transport: Transport, num_layers: int, ranges, context_len: int):
    mine = ranges[transport.rank]
    cache = DynamicCache()  # holds this rank's own chunks only
    with attention_mode(model, IMPLEMENTATION, _State(transport, ranges)):
        logits = forward_part(
            model, input_ids, transport.rank == zigzag_emitter(transport.world_size),
            position_ids=positions(mine, input_ids.device), cache=cache,
        )
    transport.drain()
    return logits, cache

