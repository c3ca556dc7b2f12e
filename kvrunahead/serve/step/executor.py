"""Runs a step on every rank (nano-vllm's model runner): the front sends a plan, every rank executes its part.

The front is the LAST rank (p - 1): the KV chain leaves the full cache and the first token there (section 4.1), so
decode needs no transfer. With ``--tp`` the ranks here are TP groups (mesh.py): the front is the first TP rank of
the last group, and its TP peers run every step it runs (serve/step/workers.py). A step's prompt runs the way its
segment's class says (serve/step/plans.py), through this module's ``WAYS``: alone or over the chain (modes/kvr.py),
through the pipeline or KV-parallel (serve/step/segments.py), packed (modes/packing.py), or as one of the peers
(tsp, ring, cp-allgather: their ``modes.MODES`` entries). ``kvr-prefill`` runs its prompt as a request to the engine
(oneshot/on_engine.py), so a served prompt and a one-shot one take the same step. Non-front ranks run
``workers.worker_loop``: receive a plan, run their part, drop their cache, repeat.

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
import time
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from kvrunahead.decode.kvp import kvp_forward, level_shards, shard_cache
from kvrunahead.model.device import reset_peak_memory, synchronize
from kvrunahead.model.forward import Scoring
from kvrunahead.model.growing import GrowingKV
from kvrunahead.model.layout import KVLayout
from kvrunahead.modes import MODES
from kvrunahead.modes.kvr import kvr_prefill, send_held_prefix
from kvrunahead.modes.packed import PackedLink, packed_link, packed_prefill
from kvrunahead.modes.packing import PackedStep
from kvrunahead.net import liveness
from kvrunahead.partition import Partition
from kvrunahead.ranks.stats import RankStats, rank_stats
from kvrunahead.serve.sequence import TokenLogprob
from kvrunahead.serve.step import plans
from kvrunahead.serve.step.links import SegmentLink
from kvrunahead.serve.step.plans import FRONT, NOWHERE, RANKS, SHARDED, Scorable, StepPlan, question_id
from kvrunahead.serve.step.rank import RankContext
from kvrunahead.serve.step.rows import can_mix, mixed_forward
from kvrunahead.serve.step.segments import kv_parallel, pipelined

log = logging.getLogger(__name__)


@dataclass
class PrefillOutcome:
    logits: torch.Tensor  # [vocab], on the model's device
    cache: DynamicCache | None  # None: the prefix cache's entry in the front's pool (``shared``) answers it
    ranks: list[RankStats] = field(default_factory=list)
    # the prefix cache's K,V, read and never written, which the decode forks: True, the cache's tensors (a TP peer's
    # entry); a name, its entry's blocks in the front's pool
    shared: bool | str = False


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
        return cls(tuple(s.request_id for s in seqs), tuple(s.prefill_len for s in seqs),
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
    seconds: float = 0.0  # the step on the front, the workers told included (the engine's clock)

    def prefill(self, request_id: str) -> PrefillOutcome:
        return PrefillOutcome(self.logits[request_id], self.caches.get(request_id), self.ranks)


@dataclass
class Sent:
    """The bytes a way sent, by kind (stats.rank_stats reads ``bytes_sent_by_kind`` off a link)."""

    bytes_sent_by_kind: dict[str, int]


@dataclass
class Part:
    """What a way leaves of this rank's part of a step: the link it ran (its bytes by layer kind), its positions,
    the decode rows that rode along in its forward (front)."""

    link: object = None
    ranges: list[tuple[int, int]] = field(default_factory=lambda: [(0, 0)])
    riders: dict = field(default_factory=dict)


def run_step(ctx: RankContext, plan: StepPlan, held: list[torch.Tensor] | None = None, decoder=None
             ) -> StepOutcome | None:
    """This rank's part of a step (every rank where ``plan.needs_workers``, else the front alone): the KV-parallel
    rows on every rank's shard, then the prompt, chunk or packed prompts the way they run (``WAYS``), with the
    front's decode rows in the same forward where they can share it (serve/step/rows.py), then a shared context's
    questions packed behind it on the front, then the rows that cannot share the prompt's forward (another RoPE
    variant, a sliding-window model, a question's, no prompt in the step) in the decoder's own batch. The front
    gets the outcome.

    ``held`` (front): the K,V of a prompt's positions held on the front (the prefix cache's, per layer, stacked);
    ``decoder`` (front): the decode batch (serve/step/batch_decode.py) whose requests the rows are."""
    front, way, seg = ctx.rank == ctx.front, plan.way, plan.prompt
    together = plan.needs_workers and ctx.world_size > 1
    ctx.use_threads(solo=not plan.sharded and (way in (None, plans.Alone) or (way is plans.Packed and not together)))
    ctx.transport.reset_stats()
    for rope in {s.rope for s in plan.prompts}:  # a model variant first used here loads untimed
        ctx.model(rope)
    if way is plans.Pipeline:
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
    part = WAYS[way](ctx, plan, held, decoder if front else None, out) if way is not None else Part()
    synchronize(ctx.device)
    total_s = time.perf_counter() - t0
    if together:  # every rank's figures and scores, the first-token logits of prompts emitted off the front
        sent = {k: v.float().cpu() for k, v in out.logits.items()} if not front else {}
        stats = rank_stats(ctx.rank, part.ranges, total_s, ctx.transport, part.link, ctx.device)
        everyone = liveness.gather_objects((stats, sent, out.scores), "the other ranks to finish the step")
        everyone = everyone[::ctx.tp]  # with --tp, each group's first rank speaks for it
        out.ranks = [s for s, _, _ in everyone]
        out.scores = {}
        for _, theirs, scores in everyone:  # in rank order: the parts' positions in order
            out.logits.update(theirs)
            for request_id, positions in scores.items():
                out.scores.setdefault(request_id, []).extend(positions)
    else:
        out.ranks = [RankStats.alone(ctx.rank, sum(e - a for a, e in part.ranges), total_s)]
    if way is plans.Chain and seg.keep == SHARDED:  # after the prefill's figures: an even share each
        level_shards(ctx.shards[seg.request_id][0], seg.cuts, ctx.transport)
    if front and seg is not None and seg.questions:  # behind the whole cache, they join the decode
        ctx.use_threads(solo=True)
        t1 = time.perf_counter()
        logits = decoder.add_questions(seg.request_id, ctx.model(seg.rope)[0].model, out.caches[seg.request_id],
                                       [list(q) for q in seg.questions])
        out.logits.update((question_id(seg.request_id, i), row) for i, row in enumerate(logits))
        synchronize(ctx.device)
        out.questions_s = time.perf_counter() - t1
    rows = tuple(r for r in plan.rows if r.request_id not in part.riders) if front else ()
    if rows:
        ctx.use_threads(solo=True)
        out.logits.update(decoder.step({r.request_id: r.tokens[0] for r in rows},
                                       {r.request_id: r.start for r in rows}))
    return out if front else None


def _chain(ctx: RankContext, plan: StepPlan, held, decoder, out: StepOutcome) -> Part:
    """A prompt or chunk alone on the front or over the chain (KV-Runahead, modes/kvr.py): this rank's cut after
    the K,V its predecessor hands on (or held: the prefix cache's on the front, a chunked prefill's earlier
    positions on every rank), the front's decode rows riding in the same forward where they can."""
    seg, front, alone = plan.prompt, ctx.rank == ctx.front, plan.way is plans.Alone
    lm, layout = ctx.model(seg.rope)
    start, end = seg.part(ctx.rank, ctx.world_size)
    base = None
    if seg.held == RANKS:
        base = ctx.partial.pop(seg.request_id, None)
    elif seg.held == FRONT and alone and front:
        base = [GrowingKV.stacked(kv) for kv in held]
    holder = ctx.front if seg.held == FRONT and not alone and ctx.rank == 0 else None
    link = SegmentLink(ctx.transport, start, layout, ctx.device, holder=holder, base=base,
                       keep_whole=seg.keep == RANKS, own_part=seg.keep == SHARDED)
    if front and holder is None and seg.held == FRONT and not alone:
        send_held_prefix(ctx.transport, held, layout)
    # The front alone on a whole prompt computes what one process computes (the model's own attention).
    attention = "masked" if alone and seg.held == NOWHERE else plan.attention
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
    return Part(link, [(start, end)], riders)


def _every_rank(run):
    """A way in which every rank runs all the segment's positions (step/segments.py: the pipeline, KV-parallel)."""
    def way(ctx: RankContext, plan: StepPlan, held, decoder, out: StepOutcome) -> Part:
        seg = plan.prompt
        logits, cache, kinds = run(ctx, seg, plan.attention)
        if ctx.rank == ctx.front:
            out.logits[seg.request_id], out.caches[seg.request_id] = logits, cache
        return Part(Sent(kinds), [(seg.start, seg.end)])
    return way


def _peer(ctx: RankContext, plan: StepPlan, held, decoder, out: StepOutcome) -> Part:
    """A peer's prefill of a whole prompt (tsp, ring, cp-allgather: modes/), every rank its mode's token ranges of
    the partition at ``cuts``, through the same ``MODES`` entry as the one-shot runner's. The emitting rank's
    logits come to the front (run_step gathers them); the front keeps the whole K,V where the mode leaves it there
    (not ring)."""
    seg = plan.prompt
    mode = MODES[seg.peer]
    lm, layout = ctx.model(seg.rope)
    step = mode.step(lm.model, list(seg.tokens), Partition(seg.cuts), ctx.transport, layout, plan.attention)
    logits, cache = mode.prefill(step, mode.setup(step))
    if ctx.rank == mode.emitter(ctx.world_size):
        out.logits[seg.request_id] = logits
    if ctx.rank == ctx.front and seg.keep == FRONT:
        out.caches[seg.request_id] = cache
    return Part(None, list(step.ranges[ctx.rank]))


def scored(score: Scoring) -> list[TokenLogprob]:
    """A part's scores as each target token's log-probability and alternatives."""
    top_ids, top_logprobs = score.top_ids.tolist(), score.top_logprobs.tolist()
    return [TokenLogprob(t, lp, tuple(zip(ids, lps)))
            for t, lp, ids, lps in zip(score.targets, score.logprobs.tolist(), top_ids, top_logprobs)]


def _catch_up(ctx: RankContext, seg: Scorable, layout: KVLayout, whole: list[GrowingKV] | None, held: int
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


def _packed(ctx: RankContext, plan: StepPlan, held, decoder, out: StepOutcome) -> Part:
    """This rank's part of several prompts packed end to end (modes/packing.py): over the chain every rank hands on
    all it holds (a relaying chain), so the front ends with every prompt's cache; prompts kept nowhere (each ends at
    its first token) hand on only the prompt cut at the rank's end, and the ranks their prompts' logits. On the front
    alone a chain of one."""
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
    return Part(link, [(step.boundaries[rank], step.boundaries[rank + 1])])


WAYS = {plans.Alone: _chain, plans.Chain: _chain, plans.KvParallel: _every_rank(kv_parallel),
        plans.Pipeline: _every_rank(pipelined), plans.Packed: _packed, plans.Peer: _peer}
"""How each way of a segment (its class, serve/step/plans.py) runs on a rank: a prompt's, a chunk's, packed
prompts'."""
