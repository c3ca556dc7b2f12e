"""The serving engine: owns the world, the model (loaded once per rank), the scheduler and the caches in flight.

``Engine.step()`` is nano-vllm's three lines, schedule -> execute -> postprocess, and returns the events of the
step. The front (last) rank steps; every other rank runs ``Engine.worker_loop()``. Other threads (the HTTP side)
only ``add`` and ``cancel``: both go into an inbox that the step drains first (vLLM v1's input queue), so the
scheduler and the caches are the stepping thread's alone and no lock is shared. The one-shot tools submit their
requests to it too (oneshot/on_engine.py); ``Engine.run_one(request)`` is one request to its end.
"""

from __future__ import annotations

import logging
import queue
import time

import torch

from kvrunahead.decide.policy import resolve_attention
from kvrunahead.errors import InputError
from kvrunahead.model.load import resolve_config
from kvrunahead.model.rope import ContextError, plan_extension
from kvrunahead.modes import check_model
from kvrunahead.modes.packed import why_not_packable
from kvrunahead.ranks.launcher import World
from kvrunahead.ranks.recovery import RecoveryDir
from kvrunahead.ranks.setup import set_up_rank
from kvrunahead.ranks.stats import RankStats
from kvrunahead.serve import asking, warm
from kvrunahead.serve.chunking import chunk_planner, lars_slack, pack_limit
from kvrunahead.serve.config import EngineConfig, model_len_limit
from kvrunahead.serve.kv_pool import Held, kv_room, rank_kv
from kvrunahead.serve.placement import Placement, peer_request, pipeline_run
from kvrunahead.serve.planner import StepPlanner
from kvrunahead.serve.recovery import Recovery
from kvrunahead.serve.sampling import Sampler
from kvrunahead.serve.scheduler import Scheduler, Step
from kvrunahead.serve.sequence import (
    EngineDead,
    Event,
    Finished,
    QueueFull,
    Request,
    RequestFigures,
    Sequence,
    TokenEvent,
)
from kvrunahead.serve.step import executor, workers
from kvrunahead.serve.step.batch_decode import BatchDecoder, VariantDecoders
from kvrunahead.serve.step.executor import PrefillOutcome, PrefillRecord, StepOutcome
from kvrunahead.serve.step.plans import PEERS, Drop, Scorable, Shutdown, StepPlan
from kvrunahead.serve.step.rank import RankContext, solo_threads
from kvrunahead.sim.flops import prompt_work

log = logging.getLogger(__name__)


class Engine:
    """``record``: keep a PrefillRecord of every step that prefilled (``kvr-prefill``, ``--prompts`` and
    ``kvr-ask`` report them; a server does not keep them)."""

    def __init__(self, config: EngineConfig, world: World, record: bool = False) -> None:
        cfg, self.config, self.world = config.run, config, world
        model_config = resolve_config(cfg.model)
        self.max_model_len = model_len_limit(cfg, model_config, config.max_model_len)
        self.attention, _ = resolve_attention(cfg, model_config)
        check_model("kvr", model_config, self.attention)
        rs = self.rank_setup = set_up_rank(cfg, world)
        threads = rs.threads
        solo = solo_threads(threads, world.local_world_size) if rs.device.type == "cpu" else threads
        self.ctx = RankContext(rs.lm, rs.layout, rs.transport, rs.device, world.rank, world.world_size,
                               load=lambda rope: rs.load(cfg, rope), threads=threads, solo_threads=solo,
                               tp=world.tp, tp_rank=world.tp_rank)
        workers.open_plan_routes(self.ctx, world, rs.collective is not None and rs.collective.name == "shm")
        self.model_config, self.threads = model_config, threads
        if (why := why_not_packable(model_config)) and config.pack_tokens:
            log.warning("%s: %s; prompts are prefilled one at a time", cfg.model, why)
        self.decoder = VariantDecoders(self._decoder_for, record=world.tp > 1 and self.is_front)
        self.heartbeat = workers.Heartbeat(self.ctx, config.heartbeat_s)
        self.placement = Placement(self.ctx, cfg, model_config, self.attention, config.degree, threads,
                                   world.local_world_size, prompt_work(model_config), config.prefix_cache_tokens,
                                   self.heartbeat, config.pack_edge_slack, pipeline_run(config, model_config),
                                   config.learn, config.prefill if config.prefill in PEERS else None)
        self.placement.prefixes.record = self.decoder.ops  # a TP front's peers replay its cache's changes in order
        self.chunks = chunk_planner(config, self.placement, model_config)
        pack = pack_limit(self.chunks, 0 if why else config.pack_tokens, self.max_model_len)
        self.scheduler = Scheduler(config.max_queue, pack, config.schedule,
                                   lars_slack(self.chunks, config) if config.schedule == "lars" else None,
                                   mixed=config.mixed_steps, prefill_first=config.prefill_first,
                                   cached=self.placement.holds_start, answered=self.placement.answers,
                                   chunks=self.chunks)
        self.samplers: dict[str, Sampler] = {}
        self.healthy, self.error = True, None  # the error: why it failed (str), once it has
        self.last_prefill_logits: torch.Tensor | None = None  # float32 CPU, for one-shot checks (--verify, tests)
        self.prefills: list[PrefillRecord] | None = [] if record else None
        self._arrivals: queue.SimpleQueue[Sequence] = queue.SimpleQueue()  # added, not yet taken by a step
        self._cancels: queue.SimpleQueue[str] = queue.SimpleQueue()  # request ids cancelled, not yet freed
        self._unfreed: list[str] = []  # requests ended whose KVP shards, chunks or stages the workers still hold
        self.planner = StepPlanner(self.ctx, self.placement, self.chunks, self.decoder, self.attention)
        self.held = Held(self.scheduler, self.decoder, self.heartbeat, self.samplers, self._finish)
        self.kv = self.scheduler.kv = kv_room(config, self.model_config, self.max_model_len, rs.dtype, self.ctx,
                                              self.placement.prefixes, self.held) if self.is_front else None
        self.ctx.kv = rank_kv(self.kv, config, self.model_config, rs.dtype, self.ctx)
        folder = RecoveryDir.for_front(self.is_front, world.tp, world.world_size)  # None: no worker is brought back
        self.recovery = folder and Recovery(folder, self.ctx, cfg, world, rs, self.held)
        warm.warm_up(self.placement, self.attention, self.max_model_len)  # every length's layout; compiled shapes

    def _decoder_for(self, rope) -> BatchDecoder:
        lm, layout = self.ctx.model(rope)
        return BatchDecoder(lm.model, batched=not layout.windows, layout=layout, kv=self.ctx.kv)

    @property
    def is_front(self) -> bool:
        return self.ctx.is_front

    @property
    def tokenizer(self):
        return self.ctx.lm.tokenizer

    @property
    def in_flight(self) -> int:
        """The requests added and not yet ended (waiting, prefilling or decoding)."""
        return self._arrivals.qsize() + self.scheduler.in_flight

    @property
    def waiting(self) -> int:
        """The requests waiting for their prefill (read from any thread: the metrics)."""
        return self._arrivals.qsize() + len(self.scheduler.waiting)

    def has_work(self) -> bool:
        return bool(self.in_flight or not self._cancels.empty())

    def add(self, request: Request) -> None:
        """Queue a request (one carrying questions ends with Answered, any other with Finished); raises QueueFull,
        EngineDead, or ValueError naming what is wrong with it."""
        if not self.healthy:
            raise EngineDead(f"the engine has failed: {self.error}")
        if self.recovery is not None:
            self.recovery.check_open()
        request.params.check()
        n, cfg = len(request.prompt_ids), self.config.run
        if request.questions:
            asking.check_ask(request, self.model_config, cfg, self.max_model_len)
        elif not 0 < n <= self.max_model_len:
            raise ValueError(f"the prompt has {n} tokens; this server takes 1 to {self.max_model_len}")
        if self.kv is not None:
            self.kv.check_fits(request)
        if self.placement.peer is not None:
            peer_request(self.placement.peer, request)
        try:
            rope = (asking.ask_rope(request, self.model_config, cfg) if request.questions
                    else plan_extension(self.model_config, n, cfg.allow_long_context, cfg.model))
        except ContextError as e:
            raise ValueError(str(e)) from None
        # the arrivals read first: one that the step takes meanwhile counts twice, never none
        self.scheduler.check_room(self._arrivals.qsize() + self.scheduler.queued)
        self._arrivals.put(Sequence(request, rope=rope))

    def cancel(self, request_id: str) -> None:
        """Free the request (waiting or decoding) at the next step; it ends with Finished('cancelled')."""
        self._cancels.put(request_id)

    def step(self) -> list[Event]:
        """inbox -> schedule -> execute -> update: the requests added and cancelled since the last step taken in,
        the scheduler's pick, its segments run on every rank that takes part (the workers told first), the outcome
        taken into the requests. An idle step keeps the workers' heartbeat."""
        events = self._take_inbox() + (self.recovery.tick() if self.recovery else [])  # after a loss: joined again?
        if self.kv is not None and self.healthy:
            self.kv.make_room()  # each decode's next block held, or the last to arrive preempted
        step = self.scheduler.schedule() if self.healthy else None
        if step is not None:  # planning is the front's alone: what fails there fails its request, not the engine
            drafted = self.planner.plan(step)
            step, plan, held, ready = drafted.step, drafted.plan, drafted.held, drafted.ready
            events += [self._refuse(seq, e) for seq, e in drafted.refused]
        try:
            self._free_shards()
            if step is None or not (plan.segments or ready):
                self.heartbeat.maybe_ping()
                return events
            t0 = time.monotonic()
            workers.tell(self.ctx, plan, self.decoder, self.heartbeat)
            outcome = executor.run_step(self.ctx, plan, held, self.decoder)
            outcome.seconds = time.monotonic() - t0
        except InputError as e:  # this request's own problem, found before any other rank took part
            return events + [self._finish(seq, "error", str(e), bad_input=True) for seq in step.prefills]
        except Exception as e:  # noqa: BLE001 - a rank that died or stopped: every request in flight must end, unless
            self._unfreed = []  # the front outlives it (serve/recovery.py)
            return events + (self.recovery.lose_workers(e, step) if self.recovery else self._fail(e, step))
        return events + self.update_from_output(step, plan, outcome, ready)

    def _refuse(self, seq: Sequence, e: Exception) -> Event:
        """End a request that could not be planned: a 400 for its own input, else a 500 naming the cause."""
        if isinstance(e, InputError):
            return self._finish(seq, "error", str(e), bad_input=True)
        return self._finish(seq, "error", f"the server could not plan the request: {type(e).__name__}: {e}")

    def update_from_output(self, step: Step, plan: StepPlan, outcome: StepOutcome,
                           ready: dict[str, PrefillOutcome] | None = None) -> list[Event]:
        """The step's outcome into its requests: every decode row's token; a chunk's progress (the rest of its
        prompt back in the queue); a prompt's first token, after which it decodes; a context's questions' first
        tokens. ``ready``: the outcomes of the prompts that needed no prefill."""
        ready = ready or {}
        events: list[Event] = []
        for seq in step.decodes:
            if seq.answers is not None:
                events += self._taking(seq, lambda seq=seq: self._took_answers(seq, outcome))
            else:
                events += self._taking(seq, lambda seq=seq: self._advance(
                    seq, seq.next_token(self.samplers[seq.request_id], outcome.logits[seq.request_id])))
        seqs = step.prefills
        if not seqs:
            return events
        if len(seqs) == 1 and seqs[0].request.questions:
            return events + self._taking(seqs[0], lambda: self._asked(seqs[0], outcome))
        prompts = [seq for seq in seqs if seq.request_id not in ready]
        if len(prompts) == 1:
            seq = prompts[0]
            seq.prompt_logprobs += outcome.scores.get(seq.request_id, [])
            try:
                if seq.chunked and not self._chunk_done(seq, plan.prompt, outcome.seconds, step):
                    prompts = []  # the rest waits for its turn
            except Exception as e:  # noqa: BLE001 - one request's output, not a fault of the ranks
                events.append(self._failed_taking(seq, e))
                prompts = []
        outcomes = {seq.request_id: outcome.prefill(seq.request_id) for seq in prompts}
        if prompts:
            self._record(prompts, list(outcomes.values()), outcome.ranks)
        outcomes.update(ready)
        return events + [e for seq in seqs if seq.request_id in outcomes
                         for e in self._taking(seq, lambda seq=seq: self._after_prefill(seq, outcomes[seq.request_id]))]

    def _taking(self, seq: Sequence, take) -> list:
        """``take()``'s result, one request's output taken in on the front after every rank has done its part;
        where that raises, that request alone ends (a 500 naming the cause) and the step goes on with the
        others."""
        try:
            return take()
        except Exception as e:  # noqa: BLE001 - one request's output, not a fault of the ranks
            return [self._failed_taking(seq, e)]

    def _failed_taking(self, seq: Sequence, e: Exception) -> Event:
        log.exception("taking the step's output into %s failed", seq.request_id, exc_info=e)
        return self._finish(seq, "error", f"the server failed the request: {type(e).__name__}: {e}")

    def _took_answers(self, seq: Sequence, outcome: StepOutcome) -> list[Event]:
        asking.take_tokens(seq, outcome, self.ctx.lm.eos_token_ids)
        return self._answered(seq)

    def _chunk_done(self, seq: Sequence, seg: Scorable, seconds: float, step: Step) -> bool:
        """A chunk's record in the response (its time teaches the chunk planner); whether it was the prompt's last
        (else the rest waits for its turn, every rank holding its positions so far)."""
        n = seq.prefill_len
        seq.figures.chunks.append(self.chunks.record(seg.bounds, seconds, step.budget_s,
                                                     learn=0 < seg.start and seg.end < n,
                                                     beside=[s.next_position + 1 for s in step.decodes
                                                             if self.config.mixed_steps]))
        seq.prefilled = seg.end
        if seg.end < n:
            self.scheduler.resume(seq)
            return False
        return True

    def _asked(self, seq: Sequence, outcome: StepOutcome) -> list[Event]:
        """A request carrying questions after its step: its context cached, its questions' first tokens taken
        (serve/asking.py); it decodes them from the next step."""
        ask = seq.request
        asking.started(seq, outcome, seq.prefill_start_s, seq.figures.degree, seq.figures.boundaries)
        if self.placement.cacheable(seq.rope):
            self.placement.prefixes.put(ask.prompt_ids, outcome.caches[ask.request_id], owner=ask.request_id)
        if self.prefills is not None:
            self.prefills.append(PrefillRecord((ask.request_id,), (len(ask.prompt_ids),),
                                               tuple(seq.figures.boundaries), outcome.ranks,
                                               asking.first_logits(ask, outcome)))
        self.scheduler.start_decoding(seq)
        return self._answered(seq)

    def _answered(self, seq: Sequence) -> list[Event]:
        """The request's Answered once every question has ended (EOS or max_tokens), its questions freed."""
        if asking.going(seq, self.ctx.lm.eos_token_ids):
            return []
        self.scheduler.finish(seq)
        self.decoder.remove(seq.request_id)
        return [asking.answered(seq)]

    def _record(self, seqs: list[Sequence], outcomes: list[PrefillOutcome], ranks: list[RankStats]) -> None:
        if self.prefills is not None:
            self.prefills.append(PrefillRecord.of(seqs, outcomes, ranks))

    def _after_prefill(self, seq: Sequence, outcome: PrefillOutcome) -> list[Event]:
        self.last_prefill_logits = outcome.logits.float().cpu()
        n, sampler = seq.prefill_len, Sampler(seq.request.params, seq.request.prompt_ids, self.ctx.lm.eos_token_ids)
        self.samplers[seq.request_id], sent = sampler, seq.recomputed()
        for old in sent:  # running again: the tokens its stream sent, in this prefill, taken silently
            self._advance(seq, sampler.retake(old))
        token = seq.next_token(sampler, outcome.logits)
        seq.figures.ttft_s = time.monotonic() - seq.request.arrival_s
        seq.figures.ranks = [{"rank": r.rank, "compute_s": r.compute_s, "wait_s": r.wait_s,
                              "bytes_sent": r.bytes_sent} for r in outcome.ranks]
        self.placement.timed(seq.figures, n, time.monotonic() - seq.prefill_start_s,
                             seq.request.params.prompt_logprobs is not None)
        if (outcome.cache is not None or outcome.shared) and seq.request_id not in self.ctx.shards:  # KVP: spread
            # the cache's answers fork its entry; a prefill's K,V is the request's, its prompt's blocks the entry's too
            self.decoder.add(seq.request_id, outcome.cache, seq.rope, fork=outcome.shared)
            if self.placement.cacheable(seq.rope) and not outcome.shared:  # its prompt's (the logits: of no re-run)
                self.placement.prefixes.put(seq.request.prompt_ids, outcome.cache, None if sent else outcome.logits,
                                            seq.request_id)
        self.scheduler.start_decoding(seq)
        return self._advance(seq, token)

    def _advance(self, seq: Sequence, token: int) -> list[Event]:
        """Take ``token`` into ``seq``; its text delta and, when it ends (EOS, a stop string, max_tokens), its
        Finished. A token its stream sent before it ran again is taken silently (``seq.replaying``)."""
        lm, params = self.ctx.lm, seq.request.params
        ends = (token in lm.eos_token_ids and not params.ignore_eos) or token in params.stop_token_ids
        delta, reason = seq.take(token, ends, lambda ids: lm.decode(ids, params.skip_special_tokens))
        if seq.replaying and reason is None:
            return []
        first = len(seq.output_ids) == 1 and params.prompt_logprobs is not None
        events: list[Event] = [TokenEvent(seq.request_id, token, delta, self.samplers[seq.request_id].last,
                                          seq.prompt_logprobs if first else None)]
        if reason is not None:
            events.append(self._finish(seq, reason))
        return events

    def _finish(self, seq: Sequence, reason: str, error: str | None = None, bad_input: bool = False) -> Event:
        """The request ended early or as it should: its Finished (Answered for one carrying questions), its state
        freed here and, with the next plan, on the workers."""
        self.scheduler.finish(seq)
        self.decoder.remove(seq.request_id)
        if seq.request.questions:
            return asking.answered(seq, error or reason, bad_input)
        if self.ctx.forget(seq.request_id) and self.ctx.has_peers:
            self._unfreed.append(seq.request_id)  # the workers drop theirs with the next plan they get
        self.samplers.pop(seq.request_id, None)
        return seq.finished(reason, error, bad_input)

    def _free_shards(self) -> None:
        """Tell the workers which requests holding state on them ended (KVP shards, chunked prefills' positions),
        before the next plan that needs every rank."""
        if self._unfreed and self.healthy:  # (after a worker's loss, nothing is left on the workers to free)
            workers.send_plan(self.ctx, Drop(tuple(self._unfreed)))
            self.heartbeat.sent()
        self._unfreed = []

    def _take_inbox(self) -> list[Event]:
        """The requests added since the last step into the scheduler's queue (where it has no room after all, or
        the engine has failed, they end here), then those cancelled out of it, ended."""
        events = []
        for seq in _drained(self._arrivals):
            try:
                if not self.healthy:
                    raise EngineDead(f"the engine has failed: {self.error}")
                self.scheduler.add(seq)
            except (QueueFull, EngineDead) as e:
                events.append(self._finish(seq, "error", str(e)))
        for request_id in _drained(self._cancels):
            if (seq := self.scheduler.remove(request_id)) is not None:
                events.append(self._finish(seq, "cancelled"))
        return events

    def _fail(self, e: Exception, step: Step | None, level: int = logging.ERROR) -> list[Event]:
        """A step failed (a rank died, stopped or cut off): the engine is dead, every request in flight errs."""
        self.healthy = False
        self.error = f"{type(e).__name__}: {e}"
        log.log(level, "engine step failed: %s", self.error)
        seqs = [*_drained(self._arrivals), *self.scheduler.drain_all()]
        seqs += [seq for seq in (step.prefills if step is not None else []) if seq not in seqs]
        return [self._finish(seq, "error", self.error) for seq in seqs]

    def fail_all(self, why: str, on_purpose: bool = False) -> list[Event]:
        """End every request in flight with an error (the client's loop broke, or it is stopping: ``on_purpose``,
        no error to log)."""
        return self._fail(RuntimeError(why), None, logging.INFO if on_purpose else logging.ERROR)

    def run_one(self, request: Request) -> tuple[list[Event], RequestFigures | None]:
        """One request to its end through the same steps as a served one (``kvr-prefill``-style use)."""
        self.add(request)
        mine: list[Event] = []
        while not (mine and isinstance(mine[-1], Finished)):  # a request's Finished is its last event
            mine += [e for e in self.step() if e.request_id == request.request_id]
        return mine, mine[-1].figures

    def worker_loop(self) -> None:
        """A non-front rank: run the front's plans until it shuts the engine down."""
        workers.worker_loop(self.ctx, self.decoder, self.placement.prefixes, self.model_config)

    def shutdown(self) -> None:
        """End the workers' loops (front only; best effort when a rank has already gone)."""
        if self.ctx.has_peers and self.error is None and getattr(self.recovery, "lost", None) is None:
            try:
                workers.send_plan(self.ctx, Shutdown())
            except Exception as e:  # noqa: BLE001
                log.warning("could not tell the workers to shut down: %s", e)
        self.healthy = False
        self.error = self.error or "shut down"
        self.placement.flush()


def _drained(inbox: queue.SimpleQueue) -> list:
    """What ``inbox`` holds now, taken out in order (the stepping thread alone takes from it: what is there stays)."""
    return [inbox.get_nowait() for _ in range(inbox.qsize())]
