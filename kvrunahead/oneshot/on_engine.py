"""The one-shot tools as requests to the serving engine: ``kvr-prefill`` (one prompt), ``kvr-prefill --prompts`` (a
batch) and ``kvr-ask`` (a shared context and its questions) start an engine on ranks that have joined, submit their
requests, step it until every one has ended and report what the engine recorded. A served request and a one-shot
run share their planning (policy.choose_partition: a one-shot prompt's plan is made once by ``prepare`` and handed
to the engine), their steps (serve/step/executor.py) and their decode (step/batch_decode.py); only the report differs.

``kvr-prefill --mode kvr|spp|tsp|ring|cp-allgather`` runs its prompt through the engine's step (serve/step/executor.py
``WAYS``), over TP groups too; the single process, the no-communication bound and TP (``--mode tp``) keep the
runner's path (``runner.prefill_on_world``), which kvr-bench and the search use to time every mode's prefill alike;
transformers' padded batch (``--batching padded``) is the one-process baseline of a batch and runs in that process
(oneshot/batch.py).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import TypeVar

from kvrunahead.config import RunConfig
from kvrunahead.decide.policy import prepare
from kvrunahead.errors import InputError
from kvrunahead.model.device import oversubscribed, peak_memory_bytes, resolve_device, weight_bytes
from kvrunahead.model.layout import probe_kv_layout
from kvrunahead.model.load import resolve_config
from kvrunahead.model.rope import ContextError, plan_extension
from kvrunahead.modes import MODES
from kvrunahead.modes.packing import EDGE_SLACK, PackedStep, ffd_bins
from kvrunahead.net import liveness
from kvrunahead.oneshot.ask import AskJob, AskResult, QuestionResult, verify_answers
from kvrunahead.oneshot.batch import (
    DEFAULT_STEP_TOKENS,
    BatchResult,
    PromptResult,
    RankReport,
    StepReport,
    check_batch,
    padded_on_world,
    verify_prompts,
)
from kvrunahead.oneshot.runner import Ran, RunResult, finish_result, leave_world, prefill_on_world
from kvrunahead.ranks.launcher import World, init_world, local_rank_hint, pick_backend
from kvrunahead.ranks.mesh import chain_world
from kvrunahead.serve import asking
from kvrunahead.serve.config import EngineConfig
from kvrunahead.serve.engine import Engine
from kvrunahead.serve.sequence import Answered, EngineDead, Event, Finished, Request, SamplingParams, TokenEvent
from kvrunahead.serve.step.plans import PEERS, question_id

T = TypeVar("T")


def on_engine(config: EngineConfig, world: World, job: Callable[[Engine], T],
              before: Callable[[Engine], None] | None = None) -> T | None:
    """An engine on ranks that have joined: the front runs ``job(engine)``, which ends the workers' loops when it
    needs them no more (``engine.shutdown()``; at the latest when it returns). ``before`` runs on every rank once
    the engine is up. The ranks leave together; the front returns the job's result, the others None."""
    engine = Engine(config, world, record=True)
    if before is not None:
        before(engine)
    result = None
    if not engine.is_front:
        engine.worker_loop()
    else:
        try:
            result = job(engine)
        finally:
            engine.shutdown()
    if world.world_size * world.tp > 1:  # together: a worker taking the Shutdown must not find rank 0's store gone
        liveness.patient_barrier("every rank to leave the engine")
    return result


def until_ended(engine: Engine, ids: set[str]) -> dict[str, list[Event]]:
    """Step the engine until every request in ``ids`` has ended; each one's events. A request that failed raises
    (InputError for its own bad input, RuntimeError for a failed rank)."""
    events: dict[str, list[Event]] = {rid: [] for rid in ids}
    left = set(ids)
    while left:
        if not engine.has_work():
            raise RuntimeError(f"the engine went idle before {', '.join(sorted(left))} ended")
        for e in engine.step():
            if e.request_id in events:
                events[e.request_id].append(e)
                if isinstance(e, (Finished, Answered)):
                    left.discard(e.request_id)
                    if e.finish_reason == "error":
                        raise (InputError if e.bad_input else RuntimeError)(e.error)
    return events


def _submit(add: Callable[[], None]) -> None:
    """Queue a request; what the engine says is wrong with it is the user's input error."""
    try:
        add()
    except (ValueError, EngineDead) as e:
        raise InputError(str(e)) from None


ENGINE_MODES = {"kvr": "chain", "spp": "spp", **{peer: peer for peer in PEERS}}
"""The modes ``kvr-prefill`` runs as a request to the engine, and the engine's way over the ranks for each."""


def run_on_world(cfg: RunConfig, world: World) -> RunResult | None:
    """One prefill (and its greedy continuation) on ranks that have joined; the emitting rank returns the result.
    KV-Runahead, the pipeline and the peers (over TP groups too) run as one request to the engine, through the step
    a served prompt takes (serve/step/executor.py); the single process, the no-communication bound and TP keep the
    runner's path."""
    if cfg.mode not in ENGINE_MODES:
        return prefill_on_world(cfg, world)
    prepared = prepare(cfg, world.world_size, world.local_world_size)
    if world.world_size == 1:  # a whole prompt on one rank runs the model's own forward: nothing to split
        prepared = dataclasses.replace(prepared, kvr_attention="masked",
                                       attention_source="one rank: the model's own attention")
    new_tokens = cfg.max_new_tokens if MODES[cfg.mode].decodes else 1

    def job(engine: Engine) -> RunResult:
        start = time.monotonic()
        request = Request("kvr-prefill", prepared.ids, SamplingParams(max_tokens=new_tokens), arrival_s=start)
        _submit(lambda: engine.add(request))
        events = until_ended(engine, {request.request_id})[request.request_id]
        done = next(e for e in events if isinstance(e, Finished))
        decode_s = time.monotonic() - start - done.figures.ttft_s
        engine.shutdown()  # the workers are done; the report (and --verify) is the front's alone
        record = engine.prefills[-1]
        lm, layout = engine.ctx.model(prepared.rope)
        weights = weight_bytes(lm.model) if world.tp > 1 else None
        if world.tp > 1 and cfg.verify:  # a TP rank holds a shard: the reference's whole model, on the front alone
            lm = engine.rank_setup.whole(cfg, prepared.rope)
            layout = probe_kv_layout(lm.model)
        ran = Ran(world, prepared, lm, layout, engine.ctx.transport, next(lm.model.parameters()).dtype,
                  engine.ctx.threads, weights)
        tokens = [e.token_id for e in events if isinstance(e, TokenEvent)]
        result = finish_result(cfg, ran, record.ranks[-1].total_s, record.ranks,
                               record.first_logits[request.request_id], tokens, decode_s)
        return dataclasses.replace(result, decode=done.figures.decode)  # what the engine ran, not what was asked

    def plan(engine: Engine) -> None:  # the plan ``prepare`` made, used as it is: not chosen a second time
        engine.placement.use_partition(len(prepared.ids), prepared.partition, prepared.partition_source)
        if prepared.stages is not None:
            engine.placement.use_stages(len(prepared.ids), prepared.stages, prepared.chunk_tokens or 0,
                                        prepared.pipeline_source)

    config = _one_shot(cfg, world, len(prepared.ids) + new_tokens, prefill=ENGINE_MODES[cfg.mode])
    return on_engine(config, world, job, before=plan)


def ask_on_world(cfg: RunConfig, world: World, job: AskJob, verify: bool = False) -> AskResult | None:
    """``kvr-ask``'s job on ranks that have joined: one shared-context request to the engine (the context over the
    chain at the world's degree, the questions after it on the front); the front returns the result."""

    request = asking.asking("kvr-ask", job.context_ids, job.questions, job.max_new_tokens)

    def ask(engine: Engine) -> AskResult:
        _submit(lambda: engine.add(request))
        answered = until_ended(engine, {request.request_id})[request.request_id][-1]
        engine.shutdown()
        f, record = answered.figures, engine.prefills[-1]
        result = AskResult(cfg.model, world.world_size, len(job.context_ids), list(f.boundaries), f.context_s,
                           f.questions_s, f.decode_s, max(map(len, answered.answers)) - 1)
        first_logits = [record.first_logits[question_id(request.request_id, i)] for i in range(len(job.questions))]
        lm = engine.ctx.model(asking.ask_rope(request, engine.model_config, cfg))[0]  # the variant the engine ran
        for text, tokens in zip(job.question_texts, answered.answers):
            result.answers.append(QuestionResult(text, tokens, lm.decode(tokens)))
        if verify:
            verify_answers(lm, job, first_logits, result, next(lm.model.parameters()).dtype)
        return result

    return on_engine(_one_shot(cfg, world, asking.longest(request)), world, ask)


def _one_shot(cfg: RunConfig, world: World, longest: int, **kw) -> EngineConfig:
    """A one-shot tool's engine: every prompt at the world's degree, no prefix cache (each prompt prefilled as
    asked), no chunking, requests of up to ``longest`` tokens (prompt and new tokens)."""
    _rope(cfg, longest)  # one line for a context the model cannot run
    return EngineConfig(run=cfg, degree=str(world.world_size), prefix_cache_tokens=0, max_model_len=max(longest, 2),
                        **kw)


def _rope(cfg: RunConfig, n: int):
    try:
        return plan_extension(resolve_config(cfg.model), n, cfg.allow_long_context, cfg.model)
    except ContextError as e:
        raise InputError(str(e)) from None


def run_batch(cfg: RunConfig, launcher: str, world_size: int, prompts: list[list[int]], batching: str = "packed",
              step_tokens: int = DEFAULT_STEP_TOKENS) -> BatchResult | None:
    """Join the ranks, run the batch, leave together; the last rank returns the result."""
    check_batch(cfg, batching, world_size)
    device = resolve_device(cfg.device, local_rank_hint())
    world = chain_world(init_world(launcher, pick_backend(device), cfg.timeout_s, device), cfg.tp)  # TP groups
    try:
        return batch_on_world(cfg, world, prompts, batching, step_tokens)  # its engine's ranks leave together
    finally:
        leave_world()


def batch_on_world(cfg: RunConfig, world: World, prompts: list[list[int]], batching: str = "packed",
                   step_tokens: int = DEFAULT_STEP_TOKENS, edge_slack: float = EDGE_SLACK) -> BatchResult | None:
    """A batch of prompts on ranks that have joined, as requests to the engine: packed (Prepacking: submitted in
    first-fit-decreasing bins of ``step_tokens``, which the engine's packing takes whole, each bin one step cut at
    prompt edges within ``edge_slack``) or one at a time (sequential); once every prompt has its first token, their
    greedy continuations decode on the front in one batch. The last rank returns the result, the others None."""
    check_batch(cfg, batching, world.world_size)
    if not prompts or any(not p for p in prompts):
        raise InputError("every prompt needs at least one token")
    if step_tokens < 1:
        raise InputError("--step-tokens must be at least 1")
    if batching == "padded":
        return padded_on_world(cfg, world, prompts)
    packed = batching == "packed"
    order = [i for b in ffd_bins([len(x) for x in prompts], step_tokens) for i in b] if packed else \
        list(range(len(prompts)))
    config = _one_shot(cfg, world, max(map(len, prompts)) + cfg.max_new_tokens, max_queue=len(prompts),
                       pack_tokens=step_tokens if packed else 0, pack_edge_slack=edge_slack, prefill_first=True)
    return on_engine(config, world, lambda engine: _batch(cfg, engine, prompts, order, batching, step_tokens))


def _batch(cfg: RunConfig, engine: Engine, prompts: list[list[int]], order: list[int], batching: str,
           step_tokens: int) -> BatchResult:
    start = time.monotonic()
    for i in order:
        request = Request(f"prompt-{i}", prompts[i], SamplingParams(max_tokens=cfg.max_new_tokens), arrival_s=start)
        _submit(lambda r=request: engine.add(r))
    events = until_ended(engine, {f"prompt-{i}" for i in order})
    engine.shutdown()
    ctx, p = engine.ctx, engine.ctx.world_size
    steps, first_logits, ranks = [], {}, {}
    emitted: dict[int, tuple[int, int]] = {}  # prompt -> (step, the rank whose part held its last token)
    for s, record in enumerate(engine.prefills):
        members = [int(rid.removeprefix("prompt-")) for rid in record.request_ids]
        bounds = record.boundaries if len(record.boundaries) == p + 1 else (0,) * p + (sum(record.lengths),)
        step = PackedStep(tuple(members), record.lengths, tuple(bounds))
        steps.append(StepReport(members, list(bounds), [step.handed_on(b) for b in bounds[1:-1]]))
        end = 0
        for i, n in zip(members, record.lengths):
            end += n
            emitted[i] = s, max(r for r in range(p) if bounds[r] < end)
        first_logits.update(record.first_logits)
        for r in record.ranks:
            total, sent, peak = ranks.get(r.rank, (0.0, 0, 0))
            ranks[r.rank] = total + r.total_s, sent + r.bytes_sent, max(peak, r.peak_mem_bytes)
    ranks[ctx.rank] = ranks[ctx.rank][0], ranks[ctx.rank][1], max(ranks[ctx.rank][2], peak_memory_bytes(ctx.device))
    results = []
    for i in range(len(prompts)):
        got = events[f"prompt-{i}"]
        tokens = [e.token_id for e in got if isinstance(e, TokenEvent)]
        done = next(e for e in got if isinstance(e, Finished))
        s, rank = emitted[i]
        results.append(PromptResult(i, len(prompts[i]), s, rank, done.figures.ttft_s, tokens,
                                    ctx.lm.decode(tokens), first_logits[f"prompt-{i}"]))
    atol = None
    if cfg.verify:
        # the reference: the model as one process runs it (with --tp the whole model, on the front alone)
        reference = (lambda n: engine.rank_setup.whole(cfg, _rope(cfg, n))) if ctx.tp > 1 else \
            (lambda n: ctx.model(_rope(cfg, n))[0])
        atol = verify_prompts(reference, prompts, results, cfg.max_new_tokens)
    dtype = next(ctx.lm.model.parameters()).dtype
    return BatchResult(cfg.model, batching, p, str(ctx.device), str(dtype).removeprefix("torch."), ctx.threads,
                       oversubscribed(ctx.threads, engine.world.local_world_size), step_tokens, steps,
                       [RankReport(r, *ranks[r]) for r in sorted(ranks)], results, atol)
