"""Tensor/sequence-parallel prefill with K,V all-gather (TSP; paper section 4.1, fig. 4): the baseline.

Even partition. In every layer each rank all-gathers K,V (a global synchronisation point) and attends
its queries to the whole gathered K,V under the causal mask, i.e. it computes its rows of the full
C x C score matrix, masked, with the same SDPA kernel as every other mode.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from kvrunahead.model.forward import forward_part
from kvrunahead.model.layout import layer_windows
from kvrunahead.partition import last_rank
from kvrunahead.ranks.transport import Transport


class GatherLayer(DynamicLayer):
    """First update: all-gather every rank's K,V and return them in position order."""

    def __init__(self, transport: Transport, ranges: list[list[tuple[int, int]]]) -> None:
        super().__init__()
        self.transport = transport
        self.ranges = ranges  # every rank's token ranges, in rank order

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if self.is_initialized:
            return super().update(key_states, value_states, *args, **kwargs)
        self.dtype, self.device = key_states.dtype, key_states.device
        local = torch.stack((key_states, value_states))
        # all-gather wants equal blocks: pad to the largest rank's token count.
        sizes = [sum(e - a for a, e in r) for r in self.ranges]
        width = max(sizes)
        if local.shape[-2] < width:
            pad = local.new_zeros((*local.shape[:-2], width - local.shape[-2], local.shape[-1]))
            local = torch.cat((local, pad), dim=-2)
        gathered = self.transport.all_gather(local)  # [p, 2, 1, heads, width, head_dim]
        pieces = []
        for rank, rank_ranges in enumerate(self.ranges):
            offset = 0
            for a, e in rank_ranges:
                pieces.append((a, gathered[rank, ..., offset : offset + e - a, :]))
                offset += e - a
        kv = torch.cat([t for _, t in sorted(pieces, key=lambda x: x[0])], dim=-2)
        self.keys, self.values = kv[0], kv[1]
        self.is_initialized = True
        return self.keys, self.values


class GatherCache(DynamicCache):
    def __init__(self, num_layers: int, transport: Transport, ranges: list[list[tuple[int, int]]]) -> None:
        super(DynamicCache, self).__init__(layers=[GatherLayer(transport, ranges) for _ in range(num_layers)])


def sliding_window(windows: list[int | None]) -> int | None:
    """The one window of the model's sliding layers (None without any); tsp builds one sliding mask, so a model
    whose windows differ is refused with one line."""
    sliding = {w for w in windows if w is not None}
    if len(sliding) > 1:
        raise NotImplementedError(f"tsp builds one sliding mask, but this model's windows differ: {sorted(sliding)}")
    return sliding.pop() if sliding else None


def full_row_masks(config, pos: torch.Tensor, context_len: int):
    """Rows of the full C x C causal score matrix: every key is computed, future ones masked (fig. 4); sliding
    layers also mask the keys beyond their window. One 4D mask where all layers are alike, else one per layer
    type, as transformers' hybrid models take it."""
    windows = layer_windows(config)
    window = sliding_window(windows)
    keys = torch.arange(context_len, device=pos.device)[None, :]
    full = (keys <= pos[:, None])[None, None]
    if window is None:
        return full
    windowed = full & (keys > pos[:, None] - window)[None, None]
    if all(w is not None for w in windows):
        return windowed
    return {"full_attention": full, "sliding_attention": windowed}


def _additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, torch.finfo(dtype).min)


def positions(ranges: list[tuple[int, int]], device) -> torch.Tensor:
    return torch.cat([torch.arange(a, e, device=device) for a, e in ranges]).unsqueeze(0)


@torch.no_grad()
def prefill(model, input_ids, transport: Transport, num_layers: int, ranges, context_len: int):
    """This rank's TSP prefill; ``input_ids`` are its tokens. Returns (logits on the emitter, cache)."""
    mine = ranges[transport.rank]
    pos = positions(mine, input_ids.device)
    cache = GatherCache(num_layers, transport, ranges)
    mask = full_row_masks(model.config, pos[0], context_len)
    if model.config._attn_implementation == "eager":  # eager attention adds its mask: 0 visible, min hidden
        dtype = next(model.parameters()).dtype
        mask = ({k: _additive(m, dtype) for k, m in mask.items()} if isinstance(mask, dict)
                else _additive(mask, dtype))
    logits = forward_part(
        model, input_ids, transport.rank == last_rank(transport.world_size),
        position_ids=pos, cache=cache, attention_mask=mask,
    )
    return logits, cache

