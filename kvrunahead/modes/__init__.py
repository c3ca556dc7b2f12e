"""The prefill modes, one module each, behind one small interface.

A mode says which token positions each rank holds, which rank emits the first token, and runs one
rank's prefill given its tokens and a transport.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from kvrunahead.model.attention import require_attention_interface
from kvrunahead.model.forward import last_token_logits
from kvrunahead.model.layout import KVLayout, layer_windows, soft_caps
from kvrunahead.model.stage import check_stageable
from kvrunahead.modes import cp_allgather, ring, tsp
from kvrunahead.modes.kvr import ChainLink, LocalPrefixLink, OwnPartLink, kvr_prefill, local_prefixes
from kvrunahead.modes.spp import spp_prefill
from kvrunahead.partition import Partition, last_rank, zigzag_emitter
from kvrunahead.ranks.transport import Transport


@dataclass(frozen=True)
class Step:
    """What one rank needs for its prefill; built before the timed region."""

    model: torch.nn.Module
    input_ids: torch.Tensor  # this rank's tokens, in the order of its ranges
    all_ids: list[int]
    ranges: list[list[tuple[int, int]]]  # every rank's token ranges
    transport: Transport
    layout: KVLayout
    context_len: int
    kvr_attention: str = "masked"
    own_kv_only: bool = False  # kvr: keep only this rank's own part of each full layer (the KVP decode's shard)
    chunk_tokens: int | None = None  # spp: the chunk that moves through the stages at a time


@dataclass(frozen=True)
class Mode:
    name: str
    summary: str
    own_partition: bool  # True: the mode fixes its own layout; --partition must be 'auto' or 'even'
    decodes: bool  # the emitting rank ends with the full K,V and can keep generating
    token_ranges: Callable[[Partition], list[list[tuple[int, int]]]]
    emitter: Callable[[int], int]
    setup: Callable[[Step], object]  # untimed
    prefill: Callable[[Step, object], tuple[torch.Tensor | None, DynamicCache | None]]  # timed

    def step(self, model: torch.nn.Module, ids: list[int], partition: Partition, transport: Transport,
             layout: KVLayout, kvr_attention: str = "masked", **kw) -> Step:
        """This rank's ``Step`` of the prompt ``ids`` cut by ``partition``: its token ranges (the mode's), its
        tokens in their order (on the model's device)."""
        ranges = self.token_ranges(partition)
        mine = [t for a, e in ranges[transport.rank] for t in ids[a:e]]
        device = next(model.parameters()).device
        return Step(model, torch.tensor([mine], device=device), ids, ranges, transport, layout, len(ids),
                    kvr_attention, **kw)


def check_model(mode: str, config, kvr_attention: str = "masked") -> None:
    """Raise NotImplementedError with one line when ``mode`` cannot run the model of ``config`` exactly: layers
    whose cache is no K,V prefix (every mode but single), sliding-window layers in ring, windows of more than one
    size in tsp, attention-logit soft-capping in the modes that insert their own attention."""
    if mode == "single":
        return
    if mode == "spp":  # every stage runs the model's own layers: the cut must fit the model
        check_stageable(config)
    windows = layer_windows(config)
    if mode == "ring" and any(w is not None for w in windows):
        raise NotImplementedError("ring attends every K,V block that passes it in full; it has no sliding-window "
                                  "masking, so models with sliding-window layers run with kvr, tsp or cp-allgather")
    if mode == "tsp":
        tsp.sliding_window(windows)
    if soft_caps(config):
        if mode in ("ring", "cp-allgather") or (mode.startswith(("kvr", "spp")) and kvr_attention == "split"):
            what = (f"{'spp' if mode == 'spp' else 'kvr'} --kvr-attention {kvr_attention}"
                    if mode.startswith(("kvr", "spp")) else mode)
            raise NotImplementedError(f"this model soft-caps its attention logits, which {what} does not do; use "
                                      "kvr --kvr-attention masked or tsp")


def _chain(step: Step, nocomm: bool = False) -> ChainLink:
    start = step.ranges[step.transport.rank][0][0]
    device = step.input_ids.device
    if not nocomm:
        link = OwnPartLink if step.own_kv_only else ChainLink
        return link(step.transport, start, step.layout, device)
    link = LocalPrefixLink(step.transport, start, step.layout, device)
    link.prefixes = local_prefixes(step.model, torch.tensor([step.all_ids[:start]], device=device))
    return link


def _kvr(step: Step, link: ChainLink):
    return kvr_prefill(step.model, step.input_ids, link, step.kvr_attention)


def _single(step: Step, _):
    cache = DynamicCache(config=step.model.config)
    return last_token_logits(step.model, step.input_ids, cache=cache), cache


def _spp(step: Step, _):
    return spp_prefill(step.model, step.input_ids, step.transport, step.chunk_tokens or step.context_len,
                       attention=step.kvr_attention)


def whole_prompt(partition: Partition) -> list[list[tuple[int, int]]]:
    """spp: every stage runs every position (the ranks split the layers, not the prompt)."""
    return [[(0, partition.context_len)] for _ in range(partition.world_size)]


def _gathering(module):
    def run(step: Step, _):
        return module.prefill(step.model, step.input_ids, step.transport, step.layout.num_layers, step.ranges,
                              step.context_len)
    return run


_CONTIGUOUS = {"token_ranges": Partition.ranges, "emitter": last_rank}
_ZIGZAG = {"token_ranges": Partition.zigzag, "emitter": zigzag_emitter}

MODES: dict[str, Mode] = {
    m.name: m
    for m in [
        Mode(name="single", summary="one process, the reference", own_partition=True, decodes=True,
             setup=lambda step: None, prefill=_single, **_CONTIGUOUS),
        Mode(name="tp", summary="Megatron tensor parallelism: every rank a shard of every layer's heads and MLP, two "
             "all-reduces per layer (--tp = --nproc)", own_partition=True, decodes=True,
             setup=lambda step: None, prefill=_single, **_CONTIGUOUS),
        Mode(name="kvr", summary="KV-Runahead: KV cache handed down a chain of ranks, any partition",
             own_partition=False, decodes=True, setup=_chain, prefill=_kvr, **_CONTIGUOUS),
        Mode(name="kvr-nocomm", summary="KV-Runahead with its communication removed (prefix K,V given locally): "
             "the practical bound", own_partition=False, decodes=True,
             setup=lambda step: _chain(step, nocomm=True), prefill=_kvr, **_CONTIGUOUS),
        Mode(name="tsp", summary="tensor/sequence parallel: even parts, K,V all-gather, full masked score rows",
             own_partition=True, decodes=True, setup=lambda step: None, prefill=_gathering(tsp), **_CONTIGUOUS),
        Mode(name="cp-allgather", summary="context parallel, zigzag chunks, K,V all-gather, visible keys only",
             own_partition=True, decodes=True,
             setup=lambda step: require_attention_interface(step.model, "cp-allgather"),
             prefill=_gathering(cp_allgather), **_ZIGZAG),
        Mode(name="ring", summary="ring attention, zigzag chunks, K,V passed around the ring, log-sum-exp merge",
             own_partition=True, decodes=False, setup=lambda step: require_attention_interface(step.model, "ring"),
             prefill=_gathering(ring), **_ZIGZAG),
        Mode(name="spp", summary="stream pipeline parallel (Medha): layers cut into stages, the prompt's chunks "
             "pipelined through them, hidden states passed on", own_partition=True, decodes=True,
             setup=lambda step: None, prefill=_spp, token_ranges=whole_prompt, emitter=last_rank),
    ]
}
