"""Decode with the K,V left where the chain made it: KV-cache parallelism (KVP, medha.txt section 4).

After a KV-Runahead prefill rank r holds the K,V of its own part of the prompt, positions [b_r, b_r+1), besides the
prefix it received; KVP keeps only its own part (the last rank does not need the whole prompt). Every rank runs the
unmodified model on each new token (the weights are on every rank): the token's query, key and value are computed
everywhere, its K,V are kept on the last rank only (the owner, whose part it continues), and in every attention
layer each rank attends its own shard; the partial outputs and their log-sum-exps are all-gathered and merged, so
every rank goes on with the same output. Per layer and token the ranks exchange heads x (head_dim + 1) floats
each, never K,V. The last rank chooses each token and tells the others. The owner's shard grows in place
(kvrunahead/model/growing.py), so a token costs no copy of the shard.

A sliding-window layer keeps, on each rank, what of its part a later token's window can still reach, and its
attention masks keys by position; the owner trims its window as it grows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from kvrunahead.model.attention import attention_mode, current_state, register
from kvrunahead.model.forward import fill_cache, last_token_logits
from kvrunahead.model.growing import GrowingKV
from kvrunahead.model.layout import KVLayout
from kvrunahead.modes.attention import (
    attend_with_lse,
    positional_attention_with_lse,
    refuse_softcap,
    why_not_inserted,
)
from kvrunahead.ranks.transport import Transport

IMPLEMENTATION = "kvrunahead_kvp"


def why_not_kvp(config) -> str | None:
    """Why the KVP decode cannot run the model exactly, or None."""
    return why_not_inserted(config, "the KVP decode")


def check_kvp(config) -> None:
    """NotImplementedError with one line where the KVP decode cannot run the model exactly."""
    why = why_not_kvp(config)
    if why:
        raise NotImplementedError(why)


class ShardLayer(DynamicLayer):
    """One layer's K,V on this rank: the positions [start, start + tokens), contiguous. The owner appends every new
    token; another rank's shard stays as the prefill left it."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, start: int, owner: bool, window: int | None,
                 cache: ShardCache) -> None:
        super().__init__()
        self.keys, self.values, self.start = keys, values, start
        self.dtype, self.device = keys.dtype, keys.device
        self.is_initialized = True
        self.owner, self.window, self.cache = owner, window, cache
        self.held: GrowingKV | None = None  # the owner's K,V once it appends: grown in place, not concatenated

    def get_seq_length(self) -> int:
        return self.cache.seen  # every position of the sequence so far, wherever its K,V are

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if self.owner:
            held = self.held
            if held is None or not held.holds(self.keys):
                held = self.held = GrowingKV(self.keys, self.values)  # first append, or the levelling moved them
            held.append(key_states, value_states)
            if self.window is not None:  # the next token's window starts at seen + n - window + 1
                drop = max(0, held.hi - held.lo - (self.window - 1) - key_states.shape[-2])
                held.drop_front(drop)
                self.start += drop
            self.keys, self.values = held.keys, held.values
        return self.keys, self.values


class ShardCache(DynamicCache):
    def __init__(self, layers: list[ShardLayer] | None, seen: int) -> None:
        self.seen = seen
        super(DynamicCache, self).__init__(layers=layers or [])

    def own(self, owner: bool) -> None:
        """Whether this rank keeps the next tokens' K,V (a KV-parallel prefill passes its chunks from rank to
        rank). A shard still empty starts at the next position; a held one must end there (the chunks of one
        rank are consecutive)."""
        for layer in self.layers:
            if owner and not layer.keys.shape[-2]:
                layer.start = self.seen
            layer.owner = owner


def empty_shards(layout: KVLayout, device: torch.device) -> ShardCache:
    """A request's shard on a rank that holds none of its positions yet (a KV-parallel prefill's first chunk)."""
    out = ShardCache(None, 0)
    for i in range(layout.num_layers):
        kv = torch.empty(layout.kv_shape(i, 0), dtype=layout.dtype, device=device)
        out.layers.append(ShardLayer(kv[0], kv[1], 0, False, layout.window(i), out))
    return out


def shard_cache(cache: DynamicCache, layout: KVLayout, part: tuple[int, int], total: int, owner: bool) -> ShardCache:
    """This rank's shard of a chain prefill's cache (whose layers end at ``part[1]``): the K,V of its own part
    [part[0], part[1]) of a ``total``-token prompt, copied so that what it received dies; a sliding layer keeps only
    the positions a token after the prompt can reach."""
    out = ShardCache(None, total)
    begin, end = part
    for i, layer in enumerate(cache.layers):
        window = layout.window(i)
        lo = begin if window is None else max(begin, total - window + 1)
        held = layer.keys.shape[-2]  # the layer holds [end - held, end)
        a = min(max(lo, end - held), end) - (end - held)
        out.layers.append(ShardLayer(layer.keys[:, :, a:].clone(), layer.values[:, :, a:].clone(),
                                     end - held + a, owner, window, out))
    return out


def level_shards(cache: ShardCache, bounds: tuple[int, ...], transport: Transport) -> tuple[int, ...]:
    """Even out the full-attention layers' shards after ``shard_cache``: rank r held the chain's part [bounds[r],
    bounds[r+1]) and ends with [r * n / p, (r + 1) * n / p) of the ``n = bounds[-1]`` positions. The chain gives the
    first ranks more tokens (a later token attends to more keys), so without this the largest shard sets both the
    decode's peak memory per rank and its step time, every rank waiting in each layer's merge for the one that
    reads the most keys. Neighbours pass the positions between their old and new boundary, once per layer
    (forward moves left to right, then backward ones right to left: each rank holds what it passes on); sliding
    layers keep their windows. Returns the new bounds."""
    p, rank = transport.world_size, transport.rank
    n = bounds[-1]
    even = tuple(round(r * n / p) for r in range(p + 1))
    if p == 1 or tuple(bounds) == even:
        return tuple(bounds)
    full = [(i, layer) for i, layer in enumerate(cache.layers) if layer.window is None]
    forward = [r for r in range(1, p) if even[r] < bounds[r]]  # rank r-1 passes [even[r], bounds[r]) to rank r
    backward = [r for r in range(p - 1, 0, -1) if even[r] > bounds[r]]  # rank r passes [bounds[r], even[r]) back
    for r in forward + backward:
        lo, hi = sorted((even[r], bounds[r]))
        ahead = even[r] < bounds[r]  # the positions go to the later rank, before what it holds
        giver, taker = (r - 1, r) if ahead else (r, r - 1)
        if rank == giver:
            for i, layer in full:
                a, b = lo - layer.start, hi - layer.start
                transport.isend(torch.stack((layer.keys[:, :, a:b], layer.values[:, :, a:b])).contiguous(),
                                taker, tag=i)
                keep = slice(0, a) if ahead else slice(b, None)
                layer.keys, layer.values = layer.keys[:, :, keep].clone(), layer.values[:, :, keep].clone()
                layer.start = layer.start if ahead else hi
            transport.drain()
        elif rank == taker:
            for i, layer in full:
                k = layer.keys
                got = k.new_empty((2, k.shape[0], k.shape[1], hi - lo, k.shape[3]))
                transport.wait(transport.irecv(got, giver, tag=i),
                               f"the K,V of positions [{lo}, {hi}) from rank {giver}")
                layer.keys, layer.values = ((torch.cat((new, held) if ahead else (held, new), dim=-2)
                                             for new, held in zip(got, (layer.keys, layer.values))))
                layer.start = lo if ahead else layer.start
    return even


@dataclass
class _Step:
    cache: ShardCache
    transport: Transport


def kvp_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Registered attention function: this rank's shard attended, every rank's partial output merged."""
    refuse_softcap(kwargs, "the KVP decode")
    step: _Step = current_state()
    layer: ShardLayer = step.cache.layers[module.layer_idx]
    out, lse = shard_attention(query, key, value, layer.start, step.cache.seen, layer.owner,
                               kwargs.get("sliding_window"), scaling)
    parts = step.transport.all_gather(torch.cat((out, lse.unsqueeze(-1)), dim=-1))  # [p, B, heads, n, d + 1]
    return merge_parts(parts).to(query.dtype).transpose(1, 2).contiguous(), None


register(IMPLEMENTATION, kvp_attention)


def shard_attention(query, key, value, start: int, first: int, owner: bool, window: int | None, scale):
    """The new tokens' queries (positions [first, first + n)) against this rank's keys (positions [start, start +
    keys)): output and log-sum-exp, float32. On the owner the last n keys are the new tokens themselves (causal
    among them); elsewhere every key lies before every query. A row that sees no key has output 0 and
    log-sum-exp -inf (it adds nothing to the merge)."""
    b, heads, n, d = query.shape
    keys = key.shape[-2]
    if keys == 0:
        return query.new_zeros(b, heads, n, d, dtype=torch.float32), \
            query.new_full((b, heads, n), float("-inf"), dtype=torch.float32)
    if window is None and (n == 1 or not owner):  # every query sees every key
        return attend_with_lse(query, key, value, causal=False, scale=scale)
    return positional_attention_with_lse(query, key, value, first, start, window, scale)


def merge_parts(parts: torch.Tensor) -> torch.Tensor:
    """Every rank's ``[..., d + 1]`` (output, log-sum-exp) of one query block merged into the output over all keys;
    the same arithmetic in the same order on every rank."""
    out, lse = parts[..., :-1], parts[..., -1]
    total = torch.logsumexp(lse, dim=0)
    weights = torch.exp(lse - total).nan_to_num(0.0)
    return (weights.unsqueeze(-1) * out).sum(dim=0)


@torch.no_grad()
def kvp_forward(model: torch.nn.Module, cache: ShardCache, transport: Transport, tokens: list[int], owner: bool,
                emit: bool | None = None) -> torch.Tensor | None:
    """New tokens (a decode token, or a prefill chunk: medha.txt section 3, "KVP for prefill") through the model on
    every rank at once, each attending its shard; the ``owner`` keeps their K,V. The last token's logits
    ``[vocab]`` where ``emit`` (default: on the owner), None elsewhere (no LM head there)."""
    device = next(model.parameters()).device
    ids = torch.tensor([tokens], device=device)
    pos = torch.arange(cache.seen, cache.seen + len(tokens), device=device).unsqueeze(0)
    cache.own(owner)
    emit = owner if emit is None else emit
    with attention_mode(model, IMPLEMENTATION, _Step(cache, transport)):
        if emit:
            logits = last_token_logits(model, ids, position_ids=pos, cache=cache)
        else:
            fill_cache(model, ids, cache, position_ids=pos)
            logits = None
    cache.seen += len(tokens)
    return logits


@torch.no_grad()
def kvp_decode(model: torch.nn.Module, cache: ShardCache, transport: Transport, first_token: int | None,
               max_new_tokens: int, eos_token_ids: set[int]) -> list[int] | None:
    """Greedy tokens after a chain prefill, every rank taking part with its shard (``shard_cache``): the owner (the
    last rank) passes ``first_token`` and gets the tokens, first included; the other ranks pass None and get None."""
    owner = transport.rank == transport.world_size - 1
    tokens = [first_token] if owner else []
    while True:
        go = owner and len(tokens) < max_new_tokens and tokens[-1] not in eos_token_ids
        said = torch.tensor([tokens[-1] if owner else -1, int(go)], dtype=torch.int64)
        token, go = transport.all_gather(said)[-1].tolist()  # the owner's word
        if not go:
            return tokens if owner else None
        logits = kvp_forward(model, cache, transport, [token], owner)
        if owner:
            tokens.append(int(logits.argmax()))
