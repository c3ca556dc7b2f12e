"""``kvr-prefill`` as one request through the serving engine: the one-shot run and a served request share their
planning (policy.choose_partition), their chain prefill (serve/executor.py over the runner's timed mode) and their
decode (serve/decode.py); only the report differs.

A kvr run over two or more ranks goes this way; the peers (tsp, ring, cp-allgather), the single process and the
no-communication bound keep the runner's own path (``runner.run_on_world``), which kvr-bench and the search use to
time every mode alike.
"""

from __future__ import annotations

import time

from kvrunahead.config import RunConfig
from kvrunahead.decide.policy import prepare
from kvrunahead.launcher import World
from kvrunahead.runner import Ran, RunResult, finish_result
from kvrunahead.runner import run_on_world as run_on_runner
from kvrunahead.serve.config import EngineConfig
from kvrunahead.serve.engine import Engine
from kvrunahead.serve.sequence import Finished, Request, SamplingParams, TokenEvent


def run_on_world(cfg: RunConfig, world: World) -> RunResult | None:
    """One prefill (and its greedy continuation) on ranks that have joined; the emitting rank returns the result."""
    if cfg.mode != "kvr" or world.world_size == 1:
        return run_on_runner(cfg, world)
    prepared = prepare(cfg, world.world_size, world.local_world_size)
    engine = Engine(EngineConfig(run=cfg, degree=str(world.world_size)), world)
    if not engine.is_front:
        engine.worker_loop()
        return None
    start = time.monotonic()
    try:
        events, figures = engine.run_one(Request("kvr-prefill", prepared.ids,
                                                 SamplingParams(max_tokens=cfg.max_new_tokens), arrival_s=start))
        decode_s = time.monotonic() - start - figures.ttft_s
    finally:
        engine.shutdown()
    done = next(e for e in events if isinstance(e, Finished))
    if done.finish_reason == "error":
        raise RuntimeError(done.error)
    if tuple(figures.boundaries) != tuple(prepared.partition.boundaries):  # one policy: a difference is a bug
        raise RuntimeError(f"the engine chose {figures.boundaries}, the plan {prepared.partition.boundaries}")
    ranks = engine.last_prefill_ranks
    lm, layout = engine.ctx.model(prepared.rope)
    ran = Ran(world, prepared, lm, layout, engine.ctx.transport, next(lm.model.parameters()).dtype, engine.ctx.threads)
    tokens = [e.token_id for e in events if isinstance(e, TokenEvent)]
    return finish_result(cfg, ran, ranks[-1].total_s, ranks, engine.last_prefill_logits, tokens, decode_s)
