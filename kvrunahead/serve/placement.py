"""Where a prefill runs: on the front alone or over the chain, with what partition, and what the prefix cache
spares of it. The engine asks; the executor runs what is decided here.

With ``--decode kvp`` a prompt prefilled over the chain leaves each rank its own part of the cache to decode on
(kvrunahead/decode/kvp.py); packed, prefix-cached and one-rank prefills end with the whole cache on the front.

With ``--prefill spp`` a prompt (or chunk) over the ranks runs through the stream pipeline instead of the chain
(modes/spp.py): each rank its stage of layers, the stages' K,V sent to the front at the prompt's end. Prompts
packed together and the new tokens after a cached prefix still run over the chain; a prompt whose log-probabilities
are asked too (a stage has no LM head to score with).

A prompt whose start the prefix cache holds prefills only its new tokens: on the front alone where the degree
policy puts that many tokens on one rank, else over the chain, the new tokens cut so that every rank has the same
share of their work with the cached prefix they attend to priced in (``modes.packing.cuts_after_cached``); the front
sends the cached K,V to rank 0 as its prefix, and the chain carries it on as it carries any prefix.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass

from kvrunahead.config import RunConfig
from kvrunahead.decide.policy import plan_stages
from kvrunahead.decode.kvp import why_not_kvp
from kvrunahead.errors import InputError
from kvrunahead.modes import MODES, check_model
from kvrunahead.modes.packing import EDGE_SLACK, cuts_after_cached, packed_cuts
from kvrunahead.serve.config import EngineConfig
from kvrunahead.serve.degree import DegreeChoice, DegreePolicy, layout_learner, step_end, step_ends
from kvrunahead.serve.partitions import ChainPartitions
from kvrunahead.serve.prefix_cache import CachedPrompt, PrefixCache
from kvrunahead.serve.sequence import RequestFigures
from kvrunahead.serve.step import workers
from kvrunahead.serve.step.executor import PrefillOutcome
from kvrunahead.serve.step.plans import (
    FRONT,
    NOWHERE,
    PEERS,
    RANKS,
    SHARDED,
    STAGED,
    Alone,
    Chain,
    KvParallel,
    Packed,
    Peer,
    Pipeline,
    Prompt,
    over,
)
from kvrunahead.serve.step.rank import RankContext
from kvrunahead.sim.costmodel import CostModel

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Placed:
    """Where a prefill ran: the degree, the boundaries, where the partition came from, why that degree, and the
    prompt's first tokens taken from the prefix cache."""

    degree: int
    boundaries: tuple[int, ...]
    source: str
    degree_source: str
    cached_tokens: int = 0
    decode: str = "gathered"  # kvp: every rank keeps its own part of the cache and decodes on it
    basis: str = "prior"  # what chose the degree (DegreeChoice.basis)

    def figures(self, arrival_s: float, start_s: float, **extra) -> RequestFigures:
        """The response's figures of a prefill placed here that started at ``start_s`` (its TTFT set later)."""
        return RequestFigures(0.0, start_s - arrival_s, self.degree, list(self.boundaries), self.source,
                              self.degree_source, cached_tokens=self.cached_tokens, decode=self.decode,
                              layout_basis=self.basis, **extra)


def kvp_predicted_faster(chain: CostModel, solo: CostModel, n: int, world_size: int) -> bool:
    """Whether an ``n``-token context should decode KV-cache parallel over the chain's ranks (``chain``: a rank's
    threads) rather than on the front with every core (``solo``): where reading its K,V outweighs reading the
    weights in a decode step on the front (attention dominates; below that a gathered request joins the front's
    batch, which reads the weights once for all, while each KVP request runs a forward of its own), and the KVP
    step is predicted faster than the front's."""
    attention_dominates = solo.decode_attention_s(n) >= solo.decode_linear_s(1)
    return attention_dominates and chain.decode_step_s([n], world_size) < solo.decode_step_s([n])


def pipeline_run(config: EngineConfig, model_config) -> RunConfig | None:
    """With ``--prefill spp``, the run as ``kvr-prefill --mode spp`` would make it (its stages and chunk as asked),
    which the placement plans each prompt's pipeline with; else None. Raises InputError where the model cannot be
    cut into stages or the pipeline cannot decode as asked."""
    if config.prefill == "chain" or config.prefill in PEERS:
        return None
    if config.prefill != "spp":
        raise InputError(f"unknown prefill {config.prefill!r}: chain, spp or a peer ({', '.join(PEERS)})")
    if config.run.decode == "kvp":
        raise InputError("--prefill spp gathers every stage's K,V on the front: --decode kvp needs the chain")
    try:
        check_model("spp", model_config)
    except NotImplementedError as e:
        raise InputError(str(e)) from None
    return dataclasses.replace(config.run, mode="spp", stages=config.stages,
                               chunk_tokens=config.spp_chunk_tokens or None)


def peer_request(peer: str, request) -> None:
    """Raise ValueError for a request a peer's engine cannot serve: the peers prefill whole prompts and score none;
    ring attention leaves no rank the whole cache, so it answers the first token only."""
    if request.questions or request.params.prompt_logprobs is not None:
        raise ValueError(f"{peer} prefills a whole prompt: no questions, no prompt log-probabilities")
    if not MODES[peer].decodes and request.params.max_tokens > 1:
        raise ValueError(f"{peer} leaves no rank the whole K,V cache: it gives the first token only (max_tokens 1)")


class Placement:
    def __init__(self, ctx: RankContext, run: RunConfig, model_config, attention: str, degree: str, threads: int,
                 local_world_size: int, work, prefix_cache_tokens: int, heartbeat: workers.Heartbeat,
                 edge_slack: float = EDGE_SLACK, pipeline: RunConfig | None = None, learn: str = "off",
                 peer: str | None = None) -> None:
        self.ctx, self.run, self.model_config, self.attention = ctx, run, model_config, attention
        self.pipeline = pipeline  # --prefill spp: the run as spp (its stages and chunk as asked)
        self.peer = peer  # a one-shot peer's prompt over the ranks (tsp, ring, cp-allgather), else None
        self._pipelines: dict[int, tuple] = {}  # prompt length -> (stages, chunk, where they come from)
        self.local_world_size, self.work, self.heartbeat = local_world_size, work, heartbeat
        self.edge_slack = edge_slack  # how much of a part's work a packed cut gives up to sit on a prompt edge
        learner = layout_learner(learn if ctx.is_front else "off", run, model_config, ctx.world_size, local_world_size,
                                 attention, threads, ctx.solo_threads, pipeline is not None)
        self.degrees = DegreePolicy(run, model_config, ctx.world_size, local_world_size, attention, threads, degree,
                                    ctx.solo_threads, lambda n: self.partition(n)[0].boundaries, learner)
        # over a TP group each rank keeps its own heads of every entry, the front's changes replayed by its peers
        self.prefixes = PrefixCache(prefix_cache_tokens)
        self.partitions = ChainPartitions(run, model_config, ctx.world_size, local_world_size, attention, ctx.tp,
                                          learner)
        self._kvp: dict[int, bool] = {}  # length step -> whether --decode auto decodes it KV-cache parallel
        self.kvp_possible = why_not_kvp(model_config) is None

    def cacheable(self, rope) -> bool:
        """Full-attention models' prompts within the trained positions (a sliding layer's cache keeps its window
        only, and a YaRN-extended prompt runs on another model variant)."""
        return rope is None and not self.ctx.layout.windows

    def holds_start(self, ids: list[int], rope) -> bool:
        """Whether the prefix cache holds this prompt's start: it prefills alone, its new tokens only (never
        packed with others, which would prefill it whole)."""
        return self.cacheable(rope) and self.prefixes.holds(ids)

    def answers(self, seq) -> bool:
        """Whether the prefix cache answers ``seq`` (a serve.sequence.Sequence) whole, with no prefill."""
        request = seq.request
        return (self.cacheable(seq.rope) and request.params.prompt_logprobs is None and not request.questions
                and self.prefixes.answers(seq.prefill_ids))

    def answered(self, ids: list[int], request_id: str | None = None) -> tuple[Placed, PrefillOutcome]:
        """A prompt the prefix cache answers whole (``answers``: another choice of ``n``, a prompt asked again): no
        prefill, the logits as they were, and the entry's K,V, which the decode forks (its own tokens after them, the
        entry never copied): its blocks in the front's pool by name, else a cache over its tensors."""
        entry = self.prefixes.whole(ids, request_id)
        placed = Placed(1, (0, len(ids)), "prefix cache: the whole prompt",
                        "no prefill: the prefix cache kept its first-token logits", len(ids))
        if entry.kv is None:
            return placed, PrefillOutcome(entry.logits, None, shared=entry.owner)
        return placed, PrefillOutcome(entry.logits, self.prefixes.cache_of(entry, len(ids), self.model_config),
                                      shared=True)

    def prompt(self, request_id: str, ids: list[int], rope, score: int | None = None, explore: bool = True
               ) -> tuple[Prompt, Placed, list | None]:
        """Where one prompt's prefill runs, as a segment: its new tokens only where the prefix cache holds its
        start (the held K,V, per layer, for the front), else on one rank or over the chain as the degree policy
        says. A prompt scored (``score``, plans.Scorable) prefills whole: a cached position has no logits.
        ``explore``: False where decodes wait behind the prefill (the learned layout tries no other then)."""
        cached, entry = self.prefixes.longest(ids) if self.cacheable(rope) and score is None else (0, None)
        if entry is not None:
            return self._after_cached(request_id, ids, cached, entry)
        choice = self.degrees.choose(len(ids), explore)
        cut = choice.degree > 1 and (self.peer is not None or self.pipeline is None or score is not None)
        if cut:  # the chain's or the peer's partition of this very prompt, else the prompt runs on one rank
            try:
                partition, source = self.partition(len(ids))
            except InputError as e:
                choice = dataclasses.replace(choice, degree=1, basis="fixed",
                                             source=f"one rank: the partition cannot cut {len(ids)} tokens ({e})")
        if choice.degree == 1:
            return (*self.alone(request_id, ids, rope, score, choice.source, choice.basis), None)
        if self.peer is not None:  # the partition of the peer's own (policy.prepare: even)
            seg = Peer(request_id, tuple(ids), peer=self.peer, cuts=tuple(partition.boundaries), rope=rope,
                       keep=NOWHERE if not MODES[self.peer].decodes else FRONT)
            return seg, Placed(choice.degree, partition.boundaries, source, choice.source, basis=choice.basis), None
        if self.pipeline is not None and score is None:
            stages, chunk, source = self.stages(len(ids))
            seg = Pipeline(request_id, tuple(ids), rope=rope, stages=stages, pipeline_chunk=chunk)
            return seg, Placed(choice.degree, (0, len(ids)), source, choice.source, basis=choice.basis), None
        kvp = self.decodes_kvp(len(ids))
        seg = Chain(request_id, tuple(ids), cuts=tuple(partition.boundaries), rope=rope,
                    keep=SHARDED if kvp else FRONT, score=score)
        return seg, Placed(choice.degree, partition.boundaries, source, choice.source,
                           decode="kvp" if kvp else "gathered", basis=choice.basis), None

    @staticmethod
    def alone(request_id: str, ids: list[int], rope, score: int | None, why: str, basis: str = "fixed"
              ) -> tuple[Alone, Placed]:
        """A whole prompt on the front alone: what the degree chose, or the safe layout of a prompt whose placement
        failed (``why`` says so in the response)."""
        return (Alone(request_id, tuple(ids), rope=rope, score=score),
                Placed(1, (0, len(ids)), "one rank", why, basis=basis))

    def timed(self, figures: RequestFigures, n: int, seconds: float, scored: bool) -> None:
        """A prompt's prefill as the server timed it, taught to the degree policy where it ran whole (no prefix
        cache, not packed, not chunked, not scored: the pipeline is not asked to score), with a chain's ranks'
        compute seconds for its partition."""
        if figures.chunks or figures.cached_tokens or figures.packed_with > 1 or scored:
            return
        ranks = sorted(figures.ranks, key=lambda r: r["rank"])
        chain = figures.degree > 1 and self.pipeline is None and len(ranks) == figures.degree
        self.degrees.learn(n, figures.degree, seconds, figures.boundaries,
                           tuple(r["compute_s"] for r in ranks) if chain else ())

    def decodes_kvp(self, n: int) -> bool:
        """Whether an ``n``-token prompt prefilled over the chain decodes KV-cache parallel: as ``--decode`` says,
        or with ``auto`` where the cost model predicts its decode step faster so than on the front alone with the
        whole cache (long contexts, where attention dominates the step)."""
        if self.pipeline is not None:  # the pipeline gathers the cache on the front
            return False
        if self.run.decode != "auto":
            return self.run.decode == "kvp"
        if self.ctx.tp > 1:  # the cost model prices KVP's step on ranks that hold the whole model: asked, not chosen
            return False
        edge = step_end(n)  # decided once per length step, at its end (decide_up_to: at the start)
        if edge not in self._kvp:
            chain, _ = self.degrees.cost_model(self.degrees.threads)
            solo, _ = self.degrees.cost_model(self.degrees.solo_threads)
            self._kvp[edge] = (self.kvp_possible and chain is not None and solo is not None
                               and kvp_predicted_faster(chain, solo, edge, self.ctx.world_size))
        return self._kvp[edge]

    def _after_cached(self, request_id: str, ids: list[int], cached: int, entry: CachedPrompt
                      ) -> tuple[Prompt, Placed, list]:
        choice = self.degrees.choose(len(ids) - cached, explore=False)
        what = f"prefix cache: {cached} of {len(ids)} tokens cached"
        why = f"prefix cache; the {len(ids) - cached} new tokens: {choice.source}"
        held = self.prefixes.held(entry, cached)
        new = tuple(ids[cached:])
        if choice.degree == 1:
            return (Alone(request_id, new, cached, held=FRONT),
                    Placed(1, (0, len(ids)), what, why, cached, basis=choice.basis), held)
        boundaries = cuts_after_cached(cached, len(ids), self.ctx.world_size, self.work)
        return (over(boundaries)(request_id, new, cached, held=FRONT, cuts=tuple(boundaries)),
                Placed(choice.degree, boundaries, f"{what}; the new tokens cut by their work", why, cached,
                       basis=choice.basis), held)

    def chunk(self, request_id: str, ids: list[int], cuts: tuple[int, ...], rope, score: int | None = None
              ) -> Prompt:
        """One chunk of a chunked prefill (serve/chunking.py): positions [cuts[0], cuts[-1]) of ``ids`` cut over
        the chain at ``cuts``, every rank holding the positions before them; every rank keeps [0, cuts[-1]) for
        the next chunk, the front alone after the last. A prompt that decodes KV-parallel has its chunks computed
        KV-parallel too (each rank attends its shard); with ``--prefill spp`` they run through the pipeline."""
        start, end = cuts[0], cuts[-1]
        path = self.chunk_path(score is not None)
        if path == "kvp":
            # KVP for prefill chunks: the prompt's K,V fill rank 0's shard first, then the next rank's, an even
            # share each (Medha's progressive scaling), so no rank holds every earlier position
            share = -(-len(ids) // self.ctx.world_size)
            return KvParallel(request_id, tuple(ids[start:end]), start, held=SHARDED if start else NOWHERE,
                              keep=SHARDED, rope=rope, owner=min(start // share, self.ctx.world_size - 1))
        if path == "spp":
            stages, chunk, _ = self.stages(len(ids))
            return Pipeline(request_id, tuple(ids[start:end]), start, held=STAGED if start else NOWHERE,
                            keep=FRONT if end == len(ids) else STAGED, rope=rope, stages=stages,
                            pipeline_chunk=min(chunk, end - start))
        return over(cuts)(request_id, tuple(ids[start:end]), start, held=RANKS if start else NOWHERE,
                          keep=FRONT if end == len(ids) else RANKS, cuts=tuple(cuts), rope=rope, score=score,
                          follows=ids[end] if score is not None and end < len(ids) else None)

    def packed(self, prompts: list[list[int]], request_ids: tuple[str, ...], first_only: bool = False,
               alone: str | None = None) -> tuple[list[Packed], tuple[int, ...], Placed]:
        """Several prompts packed into one prefill: their segments and the packed sequence's cuts, over the chain
        cut by the packed work at prompt edges, or on the front alone where the degree policy puts that many tokens
        on one rank (or ``alone`` says why they must: the safe layout). ``first_only``: every one ends at its first
        token, so none is kept (no K,V relayed to the front, no cache cut)."""
        lengths = [len(x) for x in prompts]
        segments = [Packed(rid, tuple(ids), keep=NOWHERE if first_only else FRONT)
                    for rid, ids in zip(request_ids, prompts)]
        choice = (self.degrees.choose(sum(lengths), explore=False) if alone is None
                  else DegreeChoice(1, alone, "fixed"))
        if choice.degree == 1:
            cuts = (0,) * self.ctx.world_size + (sum(lengths),)
            return segments, cuts, Placed(1, (0, sum(lengths)), "one rank", choice.source, basis=choice.basis)
        boundaries = packed_cuts(lengths, self.ctx.world_size, self.work, self.edge_slack)
        return segments, boundaries, Placed(choice.degree, boundaries,
                                            "packed work, cut at prompt edges where balanced", choice.source,
                                            basis=choice.basis)

    def use_partition(self, n: int, partition, source: str) -> None:
        """The partition already chosen for ``n`` tokens (a one-shot run's plan, policy.prepare)."""
        self.partitions.use(n, partition, source)

    def use_stages(self, n: int, stages: tuple[int, ...], chunk: int, source: str) -> None:
        """The pipeline already planned for ``n`` tokens (a one-shot run's, policy.prepare)."""
        self._pipelines[n] = tuple(stages), chunk, source

    def stages(self, n: int) -> tuple[tuple[int, ...], int, str]:
        """The pipeline's stages and chunk for an ``n``-token prompt (policy.plan_stages, as ``kvr-prefill --mode
        spp`` chooses them), decided once per length; every chunk of one prompt runs through the same stages."""
        if n not in self._pipelines:
            stages, chunk, source = plan_stages(self.pipeline, self.model_config, n, self.ctx.world_size,
                                                self.local_world_size, self.attention)
            self._pipelines[n] = stages, chunk, f"spp: stages {','.join(map(str, stages))}, chunks of {chunk} " \
                                                f"tokens ({source})"
        return self._pipelines[n]

    def chunk_path(self, scored: bool) -> str:
        """How a prompt's chunks run: "spp" through the pipeline (``--prefill spp``), "kvp" KV-parallel
        under ``--decode kvp``, else "chain"; a scored prompt's over the chain. ``--decode auto`` never chunks
        KV-parallel: a KV-parallel chunk all-gathers at every layer, and at a step budget of 500 ms on 2 CPU ranks
        (gloo) that fixed cost left chunks of about 27 tokens: a 16k prompt in 614 of them, 429 s against 24.8 s
        whole (experiments/fast_forward/serving.md)."""
        if scored:
            return "chain"
        if self.pipeline is not None:
            return "spp"
        return "kvp" if self.run.decode == "kvp" else "chain"

    def chunked_source(self, seq) -> str:
        """What a chunked prefill's response says its partition came from (``seq``: a serve.sequence.Sequence)."""
        path = self.chunk_path(seq.request.params.prompt_logprobs is not None)
        if path == "spp":
            return f"chunked prefill; {self.stages(seq.prefill_len)[2]}"
        if path == "kvp":
            return "chunked prefill, KV-parallel: each chunk's K,V kept on one rank, the ranks filled in order"
        return "chunked prefill"

    def chunked_decode(self, seq) -> str:
        """How a chunked prompt decodes: KV-parallel where its chunks were, else gathered."""
        return "kvp" if self.chunk_path(seq.request.params.prompt_logprobs is not None) == "kvp" \
            else "gathered"

    def partition(self, n: int):
        """The chain's partition for ``n`` tokens and where it comes from (serve/partitions.py)."""
        return self.partitions.of(n)

    def flush(self) -> None:
        """Wait until the learned timings are on disk (the server's shutdown)."""
        if self.degrees.learner is not None:
            self.degrees.learner.flush()

    def decide_up_to(self, max_len: int) -> None:
        """At the server's start: the chain's partition and the degree of every length step up to ``max_len``
        tokens, so that no request reads a table, searches a partition or runs the cost model (logged with the
        seconds it took)."""
        p = self.ctx.world_size
        if p == 1 or self.peer is not None:
            return
        t0, said = time.perf_counter(), time.perf_counter()
        edges = step_ends(max_len)
        for i, edge in enumerate(edges):
            if edge >= p:
                try:
                    self.partitions.chosen(edge)
                except InputError:
                    pass  # a request of this length is refused or runs alone, as it would have been
                self.decodes_kvp(edge)
            if time.perf_counter() - said > 5:
                log.warning("deciding the layout of each length: %d of %d steps", i + 1, len(edges))
                said = time.perf_counter()
        priced = self.degrees.decide_up_to(max_len)
        log.warning("decided the partition and the degree of %d length steps, up to %d tokens, in %.1f s",
                    len(edges), max_len, time.perf_counter() - t0)
        log.debug("%d steps priced", priced)
