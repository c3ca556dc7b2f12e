"""What a rank keeps across the engine's steps (its model per RoPE variant, its pipeline stages, the shards and
positions it holds of requests in flight) and the threads it runs them with."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kvrunahead.model.layout import KVLayout, probe_kv_layout
from kvrunahead.model.load import LoadedModel
from kvrunahead.model.rope import RopeExtension
from kvrunahead.model.stage import StageSpec, stage_view
from kvrunahead.ranks.transport import Transport

log = logging.getLogger(__name__)


@dataclass
class RankContext:
    """What a rank keeps across steps: the model (loaded once per RoPE variant), its KV layout, the transport and
    where it runs.

    A prompt beyond the trained positions runs, as in ``kvr-prefill``, with the rotary embedding extended by the
    smallest YaRN factor that covers it, and a shorter one without: YaRN changes every position's rotation, so one
    model for both would not give what ``kvr-prefill`` gives. The weights are loaded once per factor in use.
    """

    lm: LoadedModel  # the unextended model: tokenizer, EOS, the prompts within the trained positions
    layout: KVLayout
    transport: Transport
    device: torch.device
    rank: int
    world_size: int
    load: Callable[[RopeExtension | None], LoadedModel] | None = None
    variants: dict = field(default_factory=dict)  # RopeExtension -> (LoadedModel, KVLayout)
    threads: int = 1  # intra-op threads in a chain prefill (every rank computes)
    solo_threads: int = 1  # intra-op threads while the front works alone (the node's other ranks idle)
    shards: dict = field(default_factory=dict)  # request id -> (ShardCache, RopeExtension): KVP decodes in flight
    partial: dict = field(default_factory=dict)  # request id -> per layer GrowingKV: a chunked prefill so far
    staged: dict = field(default_factory=dict)  # request id -> this stage's DynamicCache: a pipelined prefill so far
    views: dict = field(default_factory=dict)  # (RopeExtension, stages) -> this rank's stage of the model
    tp: int = 1  # ranks per TP group: ``rank`` and ``world_size`` count groups (mesh.py)
    tp_rank: int = 0
    mailbox: object = None  # the front's group on one host: its plans to its TP peers (mesh.ShmMailbox)
    plan_group: object = None  # the group the front's plans are broadcast on (None: every rank's patient group)
    broadcasts: bool = True  # whether anyone takes the front's broadcasts (not a lone TP group with a mailbox)
    kv: object = None  # model/paged.PagedKV: the decodes' K,V (the front and its TP peers)

    def use_threads(self, solo: bool) -> None:
        n = self.solo_threads if solo else self.threads
        if torch.get_num_threads() != n:
            torch.set_num_threads(n)

    @property
    def front(self) -> int:
        return self.world_size - 1

    @property
    def is_front(self) -> bool:
        """Whether this is the front's first TP rank: the one rank that steps the engine, chooses and times."""
        return self.rank == self.front and self.tp_rank == 0

    @property
    def front_rank(self) -> int:
        """The front's global rank: the first TP rank of the last group."""
        return self.front * self.tp

    @property
    def mirror(self) -> bool:
        """Whether this rank is one of the front's TP peers, which run every step the front runs."""
        return self.rank == self.front and self.tp_rank > 0

    @property
    def has_peers(self) -> bool:
        return self.world_size * self.tp > 1

    def forget(self, request_id: str) -> bool:
        """Drop what this rank holds of a request (KVP shards, a chunked prefill's positions or stages); whether it
        held any."""
        held = [d.pop(request_id, None) for d in (self.shards, self.partial, self.staged)]
        return any(x is not None for x in held)

    def stage(self, rope: RopeExtension | None, stages: tuple[int, ...]) -> torch.nn.Module:
        """This rank's pipeline stage of the model (a view sharing its weights, model/stage.py)."""
        key = (rope, stages)
        if key not in self.views:
            self.views[key] = stage_view(self.model(rope)[0].model, StageSpec.of(stages, self.rank))
        return self.views[key]

    def model(self, rope: RopeExtension | None) -> tuple[LoadedModel, KVLayout]:
        if rope is None:
            return self.lm, self.layout
        if rope not in self.variants:
            log.info("rank %d: loading the model with %s", self.rank, rope.describe())
            lm = self.load(rope)
            self.variants[rope] = (lm, probe_kv_layout(lm.model))
        return self.variants[rope]


def solo_threads(threads: int, local_world_size: int) -> int:
    """The front's threads while it works alone: every local rank's share, within the cores this process may use."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(threads, min(threads * local_world_size, cores))
