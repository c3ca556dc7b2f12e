"""Runs a step on every rank (nano-vllm's model runner): the front sends a plan, every rank executes its part.

The front is the LAST rank (p - 1): the KV chain leaves the full cache and the first token there (section 4.1), so
decode needs no transfer. With ``--tp`` the ranks here are TP groups (mesh.py): the front is the first TP rank of
the last group, and its TP peers run every step it runs (serve/workers.py). A chain prefill goes through exactly the
runner's code (``MODES["kvr"]``, the same ``Step``, ``timed_prefill`` and ``rank_stats``), so a served prompt gets
the logits and tokens ``kvr-prefill`` gives. Non-front ranks run ``workers.worker_loop``: receive a plan, run their
part, drop their cache, repeat.

Plans travel as pickled bytes broadcast from the front on the patient gloo group, and every wait for one is
bounded by the peers' heartbeats (net/liveness.py), not by a fixed timeout: a worker may wait minutes while the
front decodes or prefills alone, and still notices a front that died or froze within ``--timeout``. While idle or
decoding, the front broadcasts a ``Ping`` every ``heartbeat_s``, so that it notices a dead worker at once, not at
the next long prompt.

A waiting worker sleeps between polls (net/liveness.py), so while the front works alone (a decode step, a prefill on
one rank) the node's other cores are free: the front then runs with ``solo_threads``, the threads of every rank on
its node, and goes back to its own share for a chain prefill.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from kvrunahead.kvp import kvp_forward, level_shards, shard_cache
from kvrunahead.model.device import reset_peak_memory, synchronize
from kvrunahead.model.forward import Scoring
from kvrunahead.model.growing import GrowingKV
from kvrunahead.model.layout import KVLayout, probe_kv_layout
from kvrunahead.model.load import LoadedModel
from kvrunahead.model.rope import RopeExtension
from kvrunahead.model.stage import StageSpec, stage_view
from kvrunahead.modes.kvr import kvr_prefill, send_held_prefix
from kvrunahead.net import liveness
from kvrunahead.pack.chain import PackedLink, packed_link, packed_prefill
from kvrunahead.pack.plan import PackedStep
from kvrunahead.runner import RankStats, rank_stats
from kvrunahead.serve.links import SegmentLink
from kvrunahead.serve.plans import (
    FRONT,
    NOWHERE,
    RANKS,
    SHARDED,
    Segment,
    StepPlan,
    question_id,
)
from kvrunahead.serve.rows import can_mix, mixed_forward
from kvrunahead.serve.segments import kv_parallel, pipelined
from kvrunahead.serve.sequence import TokenLogprob
from kvrunahead.transport import Transport

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

    def use_threads(self, solo: bool) -> None:
        n = self.solo_threads if solo else self.threads
        if torch.get_num_threads() != n:
            torch.set_num_threads(n)

    @property
    def front(self) -> int:
        return self.world_size - 1

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


@dataclass
class PrefillOutcome:
    logits: torch.Tensor  # [vocab], on the model's device
    cache: DynamicCache
    ranks: list[RankStats] = field(default_factory=list)


@dataclass
class PrefillRecord:
    """A step that gave prompts their first tokens, as the one-shot tools report it (kept with ``record``): the
    prompts (request ids), their lengths as packed, the rank boundaries, every rank's figures, each prompt's
    first-token logits (float32, CPU; for a shared context, each question's, keyed by its ``plans.question_id``)."""

    request_ids: tuple[str, ...]
    lengths: tuple[int, ...]
    boundaries: tuple[int, ...]
    ranks: list[RankStats]
    first_logits: dict[str, torch.Tensor]

    @classmethod
    def of(cls, seqs: list, outcomes: list[PrefillOutcome], ranks: list[RankStats]) -> PrefillRecord:
        """The record of prompts (serve/sequence.Sequence) prefilled in one step."""
        return cls(tuple(s.request_id for s in seqs), tuple(s.prompt_len for s in seqs),
                   tuple(seqs[0].figures.boundaries), ranks,
                   {s.request_id: o.logits.float().cpu() for s, o in zip(seqs, outcomes)})


@dataclass
class StepOutcome:
    """What a step leaves on the front: the next-token logits of every segment that emits (the prompt's where it
    ends, every decode row's), the prompt segment's cache where the front keeps it, every rank's figures."""

    logits: dict[str, torch.Tensor] = field(default_factory=dict)
    caches: dict[str, DynamicCache] = field(default_factory=dict)
    ranks: list[RankStats] = field(default_factory=list)
    questions_s: float = 0.0  # the front's seconds prefilling a shared context's questions
    scores: dict[str, list[TokenLogprob]] = field(default_factory=dict)  # a scored segment's, in position order

    def prefill(self, request_id: str) -> PrefillOutcome:
        return PrefillOutcome(self.logits[request_id], self.caches.get(request_id), self.ranks)


def run_step(ctx: RankContext, plan: StepPlan, held: list[torch.Tensor] | None = None, decoder=None
             ) -> StepOutcome | None:
    """This rank's part of a step (every rank where ``plan.needs_workers``, else the front alone): the KV-parallel
    rows on every rank's shard, then the prompt segment over the chain (or on the front alone) with the front's
    decode rows in the same forward where they can share it (serve/rows.py), then a shared context's questions
    packed behind it on the front, then the rows that cannot share the prompt's forward (another RoPE variant, a
    sliding-window model, a question's, no prompt in the step) in the decoder's own batch. The front gets the
    outcome.

    ``held`` (front): the K,V of a prompt's positions held on the front (the prefix cache's, per layer, stacked);
    ``decoder`` (front): the decode batch (serve/decode.py) whose requests the rows are."""
    front = ctx.rank == ctx.front
    seg = plan.prompt
    together = plan.needs_workers and ctx.world_size > 1
    ctx.use_threads(solo=not plan.sharded and (seg is None or seg.alone) and (plan.packed is None or not together))
    ctx.transport.reset_stats()
    for rope in {s.rope for s in plan.segments if not s.is_row}:  # a model variant first used here loads untimed
        ctx.model(rope)
    if seg is not None and seg.stages is not None:
        ctx.stage(seg.rope, seg.stages)
    if together:
        liveness.patient_barrier("the other ranks to start the step")
    reset_peak_memory(ctx.device)
    synchronize(ctx.device)  # the clock reads work done, not work queued on a GPU
    t0 = time.perf_counter()
    out = StepOutcome()
    for row in plan.sharded:  # every rank: the token through the model on its shard
        shard, rope = ctx.shards[row.request_id]
        logits = kvp_forward(ctx.model(rope)[0].model, shard, ctx.transport, [row.tokens[0]], owner=front)
        if front:
            out.logits[row.request_id] = logits
    rows = plan.rows if front else ()
    link, mine = None, (0, 0)
    if seg is not None:
        link, mine, riders = _prompt(ctx, plan, seg, held, decoder if front else None, out)
        rows = tuple(r for r in rows if r.request_id not in riders)
    elif plan.packed is not None:
        link, mine = _packed(ctx, plan, out)
    synchronize(ctx.device)
    total_s = time.perf_counter() - t0
    if together:  # every rank's figures and scores, the first-token logits of packed prompts ending off the front
        sent = {k: v.float().cpu() for k, v in out.logits.items()} if not front else {}
        stats = rank_stats(ctx.rank, [mine], total_s, ctx.transport, link, ctx.device)
        everyone = liveness.gather_objects((stats, sent, out.scores), "the other ranks to finish the step")
        everyone = everyone[::ctx.tp]  # with --tp, each group's first rank speaks for it
        out.ranks = [s for s, _, _ in everyone]
        out.scores = {}
        for _, theirs, scores in everyone:  # in rank order: the parts' positions in order
            out.logits.update(theirs)
            for request_id, part in scores.items():
                out.scores.setdefault(request_id, []).extend(part)
    else:
        out.ranks = [_solo_stats(ctx, mine[1] - mine[0], total_s)]
    if seg is not None and seg.keep == SHARDED and seg.cuts:  # after the prefill's figures: an even share each
        level_shards(ctx.shards[seg.request_id][0], seg.cuts, ctx.transport)
    if front and seg is not None and seg.questions:  # behind the whole cache, they join the decode
        ctx.use_threads(solo=True)
        t1 = time.perf_counter()
        logits = decoder.add_questions(seg.request_id, ctx.model(seg.rope)[0].model, out.caches[seg.request_id],
                                       [list(q) for q in seg.questions])
        out.logits.update((question_id(seg.request_id, i), row) for i, row in enumerate(logits))
        synchronize(ctx.device)
        out.questions_s = time.perf_counter() - t1
    if rows:
        ctx.use_threads(solo=True)
        out.logits.update(decoder.step({r.request_id: r.tokens[0] for r in rows},
                                       {r.request_id: r.start for r in rows}))
    return out if front else None


def _prompt(ctx: RankContext, plan: StepPlan, seg: Segment, held, decoder, out: StepOutcome):
    """The prompt segment's part on this rank: its link, its positions and the rows that rode along (front)."""
    if seg.stages is not None or seg.owner is not None:  # every rank all the positions (serve/segments.py)
        logits, cache = (pipelined if seg.stages is not None else kv_parallel)(ctx, seg, plan.attention)
        if ctx.rank == ctx.front:
            out.logits[seg.request_id], out.caches[seg.request_id] = logits, cache
        return None, (seg.start, seg.end), {}
    front = ctx.rank == ctx.front
    lm, layout = ctx.model(seg.rope)
    start, end = seg.part(ctx.rank, ctx.world_size)
    base = None
    if seg.held == RANKS:
        base = ctx.partial.pop(seg.request_id, None)
    elif seg.held == FRONT and seg.alone and front:
        base = [GrowingKV.stacked(kv) for kv in held]
    holder = ctx.front if seg.held == FRONT and not seg.alone and ctx.rank == 0 else None
    link = SegmentLink(ctx.transport, start, layout, ctx.device, holder=holder, base=base,
                       keep_whole=seg.keep == RANKS, own_part=seg.keep == SHARDED)
    if front and holder is None and seg.held == FRONT and not seg.alone:
        send_held_prefix(ctx.transport, held, layout)
    # The front alone on a whole prompt computes what one process computes (the model's own attention).
    attention = "masked" if seg.alone and seg.held == NOWHERE else plan.attention
    mixes = decoder is not None and end > start and seg.score is None and can_mix(lm.model)
    riders = decoder.riders(plan.rows, seg.rope) if mixes else {}
    logits, cache = None, None
    ids = list(seg.tokens[start - seg.start:end - seg.start])
    score = Scoring(seg.targets(start, end), seg.score) if seg.score is not None and end > start else None
    if riders:
        logits, row_logits, cache = mixed_forward(lm.model, ids, link, list(riders.values()), emit=True)
        out.logits.update(zip(riders, row_logits))
    elif end > start:
        logits, cache = kvr_prefill(lm.model, torch.tensor([ids], device=ctx.device), link, attention, score)
    if score is not None:
        out.scores[seg.request_id] = scored(score)
    if seg.keep == RANKS:
        whole = [link.whole[i] for i in range(layout.num_layers)] if end > start else base
        ctx.partial[seg.request_id] = _catch_up(ctx, seg, layout, whole, end)
    elif seg.keep == SHARDED:  # this rank's own part stays here for the decode; what it received dies
        cache = shard_cache(cache, layout, (start, end), seg.end, owner=front)
        ctx.shards[seg.request_id] = (cache, seg.rope)
    if front:
        out.logits[seg.request_id] = logits
        out.caches[seg.request_id] = cache
    return link, (start, end), riders


def scored(score: Scoring) -> list[TokenLogprob]:
    """A part's scores as each target token's log-probability and alternatives."""
    top_ids, top_logprobs = score.top_ids.tolist(), score.top_logprobs.tolist()
    return [TokenLogprob(t, lp, tuple(zip(ids, lps)))
            for t, lp, ids, lps in zip(score.targets, score.logprobs.tolist(), top_ids, top_logprobs)]


def _catch_up(ctx: RankContext, seg: Segment, layout: KVLayout, whole: list[GrowingKV] | None, held: int
              ) -> list[GrowingKV]:
    """The front sends each worker the segment's positions after those it holds ([held, end), every layer);
    every rank returns its K,V of [0, end) per layer, appended in place to what it held."""
    end = seg.end
    if ctx.rank == ctx.front:
        for worker in range(ctx.world_size - 1):
            theirs = seg.part(worker, ctx.world_size)[1]
            for layer, kv in enumerate(whole):
                ctx.transport.isend(kv.kv[..., theirs:end, :].contiguous(), worker, tag=layer)
        ctx.transport.drain()
        return whole
    received = []
    for layer in range(layout.num_layers):
        buf = torch.empty(layout.kv_shape(layer, end - held), dtype=layout.dtype, device=ctx.device)
        received.append((ctx.transport.irecv(buf, ctx.front, tag=layer), buf))
    out = []
    for layer, (req, buf) in enumerate(received):
        ctx.transport.wait(req, f"the segment's K,V of layer {layer} from the front")
        if whole is None:
            out.append(GrowingKV.stacked(buf))
        else:
            whole[layer].extend(buf)
            out.append(whole[layer])
    return out


def _solo_stats(ctx: RankContext, tokens: int, total_s: float) -> RankStats:
    """The figures of a step the front ran alone: all compute, nothing sent or waited for."""
    return RankStats(rank=ctx.rank, tokens=tokens, total_s=total_s, compute_s=total_s, wait_s=0.0, send_s=0.0,
                     bytes_sent=0, bytes_received=0, peak_mem_bytes=0)


def _packed(ctx: RankContext, plan: StepPlan, out: StepOutcome):
    """This rank's part of several prompts packed end to end (kvrunahead/pack): over the chain every rank hands on
    all it holds (a relaying chain), so the front ends with every prompt's cache; prompts kept nowhere (each ends at
    its first token) hand on only the prompt cut at the rank's end, and the ranks their prompts' logits. On the front
    alone a chain of one. Returns the link and this rank's positions of the packed sequence."""
    lm, layout = ctx.model(None)
    step = plan.packed_step
    prompts = plan.prompts
    front = ctx.rank == ctx.front
    keep = prompts[0].keep == FRONT
    ids = [t for p in prompts for t in p.tokens]
    if plan.needs_workers:
        rank, link = ctx.rank, packed_link(step, ctx.rank, ctx.transport, layout, ctx.device, relay=keep)
    else:  # on the front alone: the whole packed sequence is its part, nothing to receive or send
        step = PackedStep(step.prompts, step.lengths, (0, step.total))
        rank, link = 0, PackedLink(ctx.transport, 0, layout, ctx.device)
    part = packed_prefill(lm.model, step, ids, link, rank, every_cache=front and keep, caches=keep)
    for k, logits in part.logits.items():
        out.logits[prompts[k].request_id] = logits
    if front and keep:
        out.caches.update((prompts[k].request_id, cache) for k, cache in part.caches.items())
    return link, (step.boundaries[rank], step.boundaries[rank + 1])
