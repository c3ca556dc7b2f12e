"""One rank's part of a packed step: the KV chain carries only the prompt a boundary cuts, and attention runs
prompt segment by prompt segment.

A rank whose part starts on a prompt edge receives nothing and a rank whose part ends on one sends nothing: the
chain's messages shrink to the tokens of the cut prompt that lie before the boundary (its window's last part in a
sliding-window layer). Inside a part, each prompt's queries attend to that prompt's keys only, causally (the
split attention of ``modes.kvr`` per segment), so no packed C x C mask is built or scored.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from kvrunahead.model.attention import attention_mode, current_state, register, require_attention_interface
from kvrunahead.model.forward import fill_cache, with_cache
from kvrunahead.model.layout import KVLayout
from kvrunahead.modes.attention import refuse_softcap, why_not_inserted
from kvrunahead.modes.kvr import ChainLink, RunaheadLayer, split_block
from kvrunahead.modes.packing import PackedStep
from kvrunahead.net.faults import fault_from_env


def why_not_packable(config) -> str | None:
    """Why the packed attention cannot run this model, or None."""
    return why_not_inserted(config, "the packed attention")


@dataclass
class PackedLink(ChainLink):
    """A chain link of a packed step: receives the ``prefix_len`` tokens of the prompt cut at this part's start
    (none at a prompt edge) and hands on the ``send_tokens`` of the prompt cut at its end."""

    send_tokens: int = 0

    @property
    def has_prev(self) -> bool:
        return self.rank > 0 and self.prefix_len > 0

    @property
    def has_next(self) -> bool:
        return self.rank < self.transport.world_size - 1 and self.send_tokens > 0

    def handed_on(self, local_tokens: int) -> int:
        return self.send_tokens


def packed_link(step: PackedStep, rank: int, transport, layout: KVLayout, device: torch.device,
                relay: bool = False) -> PackedLink:
    """This rank's link in ``step``. ``relay``: hand on every prompt's K,V, every layer's in full, as the core
    chain does, so that the last rank ends with every prompt's cache (the server decodes there); else only the
    cut prompt's, so each prompt's cache ends on the rank that emits its first token."""
    start, end = step.boundaries[rank], step.boundaries[rank + 1]
    if start == end:
        return PackedLink(transport, 0, layout, device)
    if relay:
        return PackedLink(transport, start, dataclasses.replace(layout, windows=None), device, send_tokens=end)
    return PackedLink(transport, step.handed_on(start), layout, device, send_tokens=step.handed_on(end))


class PackedCache(DynamicCache):
    """The cache of a rank's part of a packed step: every layer, sliding ones included, keeps all it saw in the
    exchange (the cut prompt's received part and the whole part), from which each prompt's own cache is cut."""

    def __init__(self, link: PackedLink) -> None:
        fault = fault_from_env()
        layers = [RunaheadLayer(i, link, fault) for i in range(link.layout.num_layers)]
        super(DynamicCache, self).__init__(layers=layers)


@dataclass(frozen=True)
class Segments:
    """The prompt segments of this part, in its own query coordinates: ``(q_lo, q_hi, prompt_start)`` with
    prompt_start the prompt's first packed position relative to the part's start (negative when it began on an
    earlier rank)."""

    parts: tuple[tuple[int, int, int], ...]


PACKED = "kvrunahead_packed"


def packed_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Each prompt segment's queries against that prompt's keys only, causally: the keys cover the last
    ``key_len`` packed positions before the part's end (the cut prompt's received part, or its window's, then the
    part's own tokens)."""
    refuse_softcap(kwargs, "a packed prefill")
    window = kwargs.get("sliding_window")
    n, key_len = query.shape[2], key.shape[2]
    first_key = n - key_len  # the packed position of key 0, relative to the part's start
    outs = []
    for q_lo, q_hi, prompt_start in current_state().parts:
        k_lo = max(prompt_start, first_key) - first_key
        k_hi = q_hi - first_key
        outs.append(split_block(query[:, :, q_lo:q_hi], key[:, :, k_lo:k_hi], value[:, :, k_lo:k_hi], scaling,
                                window))
    return torch.cat(outs, dim=1), None


register(PACKED, packed_attention)


@dataclass
class PartOutput:
    """What one rank's part of a packed step leaves: the first-token logits of the prompts ending in it (places in
    the step) and each such prompt's own cache."""

    logits: dict[int, torch.Tensor]
    caches: dict[int, DynamicCache]


@torch.no_grad()
def packed_prefill(model: torch.nn.Module, step: PackedStep, step_ids: list[int], link: PackedLink,
                   rank: int, every_cache: bool = False, caches: bool = True) -> PartOutput:
    """Run this rank's part of a packed step (``step_ids``: the step's packed tokens) over the chain.
    ``every_cache`` (the last rank of a relaying chain): cut the cache of every prompt of the step, not only of
    those ending in this part; ``caches`` False: cut none (prompts that end at their first token)."""
    start, end = step.boundaries[rank], step.boundaries[rank + 1]
    if start == end:
        return PartOutput({}, {})
    require_attention_interface(model, "a packed prefill")
    device = link.device
    ids = torch.tensor([step_ids[start:end]], device=device)
    positions = torch.tensor([step.positions(start, end)], device=device)
    segments = step.segments(start, end)
    state = Segments(tuple((lo - start, hi - start, step.edges[k] - start) for k, lo, hi in segments))
    ending = step.ending_in(start, end)
    keep = torch.tensor([step.edges[k + 1] - 1 - start for k in ending], device=device)
    cache = PackedCache(link)
    link.start()
    with attention_mode(model, PACKED, state):
        if ending:
            logits = model(input_ids=ids, position_ids=positions, **with_cache(model, cache), use_cache=True,
                           logits_to_keep=keep).logits[0]
        else:
            fill_cache(model, ids, cache, position_ids=positions)
    link.finish()
    cached = range(len(step.lengths)) if every_cache else ending if caches else ()
    caches = {k: prompt_cache(model, cache, link.layout, end - step.edges[k + 1], step.lengths[k]) for k in cached}
    return PartOutput({k: logits[i] for i, k in enumerate(ending)}, caches)


def prompt_cache(model: torch.nn.Module, packed: PackedCache, layout: KVLayout, before_end: int,
                 length: int) -> DynamicCache:
    """The cache a single process holds after prefilling one prompt of ``length`` tokens alone, cut from the
    part's packed cache, whose keys end at the part's end: the prompt ends ``before_end`` positions before it."""
    cache = DynamicCache(config=model.config)
    for i, (src, dst) in enumerate(zip(packed.layers, cache.layers)):
        hi = src.keys.shape[2] - before_end
        lo = hi - layout.kept(i, length)
        dst.update(src.keys[:, :, lo:hi].clone(), src.values[:, :, lo:hi].clone())
        if layout.window(i) is not None:
            dst.cumulative_length = length
    return cache
