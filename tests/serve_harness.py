"""Starts the serving engine on real ranks (started by tests/test_serve_engine.py like tests/helpers.py does) and
writes what the front saw to JSON.

Usage: python tests/serve_harness.py SCENARIO.json OUT.json  (with RANK/WORLD_SIZE/MASTER_* in the env)
Scenarios: "match" (the runner's prefill, then the engine's, same prompt and partition), "serve" (the asyncio
client with long requests in flight; the test kills a rank; exits 3 when the engine is unhealthy at the end),
"packed" (prompts one at a time, then queued together into one packed prefill), "chunked" (prompts in chunks,
over the chain or the pipeline), "learned" (prompts over the chain whose partition learns from
the ranks' timings), "cached" (a prompt, then one
that starts the same way and whose new tokens run over the chain after the cached prefix), "kvp" (prompts decoded
KV-cache parallel, alone and together, one cancelled on the way), "logprobs" and "prompt_logprobs" (against one
process's scores), "contained" (placements that raise, while a request decodes).
"""

import asyncio
import json
import logging
import os
import sys
import time
from pathlib import Path

import torch

from kvrunahead.config import RunConfig
from kvrunahead.decide.policy import prepare
from kvrunahead.model.rope import plan_extension
from kvrunahead.oneshot.runner import prefill_on_world
from kvrunahead.ranks.launcher import init_world, leave_world
from kvrunahead.serve.client import AsyncEngineClient
from kvrunahead.serve.config import EngineConfig
from kvrunahead.serve.engine import Engine
from kvrunahead.serve.sequence import Finished, Request, SamplingParams, TokenEvent


def match(scenario: dict, world, out: dict) -> None:
    cfg = RunConfig(**scenario["run"])
    ref = prefill_on_world(cfg, world)
    engine = Engine(EngineConfig(run=cfg, degree=scenario.get("degree", "auto")), world)
    if not engine.is_front:
        engine.worker_loop()
        return
    ids = prepare(cfg, world.world_size).ids
    events, figures = engine.run_one(Request("r", ids, SamplingParams(max_tokens=cfg.max_new_tokens)))
    engine.shutdown()
    out.update(ref_first=ref.first_token, ref_tokens=ref.generated_tokens, ref_boundaries=list(ref.boundaries),
               tokens=[e.token_id for e in events if not isinstance(e, Finished)],
               max_abs_logit_diff=float((ref.logits - engine.last_prefill_logits).abs().max()),
               degree=figures.degree, boundaries=figures.boundaries, degree_source=figures.degree_source,
               ranks=figures.ranks)


def logprobs(scenario: dict, world, out: dict) -> None:
    """A greedy request asking for log-probabilities, over the ranks; on the front, the same prompt through
    transformers' ``generate(output_scores=True)`` in one process: the tokens and every token's log-probability and
    alternatives."""
    from kvrunahead.model.load import load_model

    cfg = RunConfig(**scenario["run"])
    engine = Engine(EngineConfig(run=cfg, degree=scenario.get("degree", "auto")), world)
    if not engine.is_front:
        engine.worker_loop()
        return
    ids = prepare(cfg, world.world_size).ids
    events, figures = engine.run_one(Request("r", ids, SamplingParams(max_tokens=cfg.max_new_tokens, logprobs=3)))
    engine.shutdown()
    model = load_model(cfg.model, torch.float32, torch.device("cpu")).model
    ref = model.generate(torch.tensor([ids]), max_new_tokens=cfg.max_new_tokens, do_sample=False, min_new_tokens=0,
                         output_scores=True, return_dict_in_generate=True, pad_token_id=0, eos_token_id=None)
    ref_logprobs = [torch.log_softmax(score[0].float(), -1) for score in ref.scores]
    tokens = [e.token_id for e in events if isinstance(e, TokenEvent)]
    lps = [e.logprob for e in events if isinstance(e, TokenEvent)]
    out.update(tokens=tokens, ref_tokens=ref.sequences[0, len(ids):].tolist(), degree=figures.degree,
               chosen_diff=max(abs(lp.logprob - float(r[t])) for lp, r, t in zip(lps, ref_logprobs, tokens)),
               top_diff=max(abs(v - float(r[i])) for lp, r in zip(lps, ref_logprobs) for i, v in lp.top),
               top_ids=[[i for i, _ in lp.top] for lp in lps],
               ref_top_ids=[r.topk(3).indices.tolist() for r in ref_logprobs])


def prompt_logprobs(scenario: dict, world, out: dict) -> None:
    """A prompt prefilled (and cached) unscored, then scored with 3 alternatives per token (whole over the ranks,
    or in chunks of ``chunk_tokens``), a short request decoding beside it; on the front, the prompt through the
    model in one process: every prompt token's log-probability and top 3 against its full forward's log-softmax,
    and the first tokens against the unscored run's."""
    cfg = RunConfig(**scenario["run"])
    engine = Engine(EngineConfig(run=cfg, degree=scenario.get("degree", "auto"),
                                 chunk_tokens=scenario.get("chunk_tokens", 0)), world)
    if not engine.is_front:
        engine.worker_loop()
        return
    ids = prepare(cfg, world.world_size).ids
    plain, _ = engine.run_one(Request("plain", ids, SamplingParams(max_tokens=4)))
    engine.add(Request("beside", ids[:7], SamplingParams(max_tokens=40)))
    events, figures = engine.run_one(Request("scored", ids, SamplingParams(max_tokens=4, prompt_logprobs=3)))
    engine.shutdown()
    model = engine.ctx.lm.model
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
    scores = next(e for e in events if isinstance(e, TokenEvent)).prompt_logprobs
    out.update(tokens=[e.token_id for e in events if isinstance(e, TokenEvent)],
               plain_tokens=[e.token_id for e in plain if isinstance(e, TokenEvent)],
               later=[e.prompt_logprobs for e in events if isinstance(e, TokenEvent)][1:],
               degree=figures.degree, cached_tokens=figures.cached_tokens, chunks=len(figures.chunks),
               scored=[s.token_id for s in scores], prompt=ids,
               chosen_diff=max(abs(s.logprob - float(ref[i, s.token_id])) for i, s in enumerate(scores)),
               top_diff=max(abs(v - float(ref[i, t])) for i, s in enumerate(scores) for t, v in s.top),
               top_ids=[[t for t, _ in s.top] for s in scores],
               ref_top_ids=[ref[i].topk(3).indices.tolist() for i in range(len(scores))])


async def _collect(client: AsyncEngineClient, rid: str, ready: Path, out: dict, prompt: list[int]) -> None:
    async for event in client.generate(prompt, SamplingParams(max_tokens=4000), rid):
        if not ready.exists():
            ready.write_text("decoding")
        if isinstance(event, Finished):
            out[rid] = {"finish_reason": event.finish_reason, "error": event.error, "at_s": time.monotonic(),
                        "decode": event.figures.decode if event.figures else None}


def _front_client(scenario: dict, world) -> AsyncEngineClient | None:
    """The engine on every rank: the workers run their loop to its end (None), the front gets its client."""
    engine = Engine(EngineConfig(run=RunConfig(**scenario["run"]), heartbeat_s=0.2, **scenario.get("engine", {})),
                    world)
    if not engine.is_front:
        engine.worker_loop()
        return None
    return AsyncEngineClient(engine)


def _when_chunking(engine: Engine, ready: Path, tokens: int) -> None:
    """Write ``ready`` once a chunked prefill has ``tokens`` done and more to go: told by the scheduler as the
    chunk's rest goes back in line (a poll of its queue can miss a prompt that sits there for microseconds)."""
    resume = engine.scheduler.resume

    def resumed(seq) -> None:
        if seq.prefilled >= tokens and not ready.exists():
            ready.write_text("chunking")
        resume(seq)

    engine.scheduler.resume = resumed


def serve(scenario: dict, world, out: dict) -> None:
    client = _front_client(scenario, world)
    if client is None:
        return

    ready = Path(scenario["ready"])
    prompt = scenario.get("prompt", list(range(20, 80)))
    if scenario.get("ready_when") == "chunking":  # ready once a chunked prefill is half way, not at a first token
        prompt = list(range(20, 80)) * (scenario["prompt_tokens"] // 60)
        ready = Path(scenario["ready"] + ".unused")
        _when_chunking(client.engine, Path(scenario["ready"]), len(prompt) // 2)

    async def main() -> None:
        await asyncio.gather(*(_collect(client, f"r{i}", ready, out, prompt) for i in range(3)))

    asyncio.run(main())
    out["healthy"] = client.healthy
    out["done_s"] = time.monotonic()


def contained(scenario: dict, world, out: dict) -> None:
    """Placements that raise, over the chain, while a request decodes: the chain's partition raises for prompts of
    ``bad_len`` tokens (so "moved" runs on the front alone instead) and for "doomed" the front alone raises too (so
    it fails); "streaming" decodes throughout, "after" runs over the chain at the end. Each one's tokens, finish and
    figures; every greedy one also run first, before anything was broken."""
    engine = Engine(EngineConfig(run=RunConfig(**scenario["run"]), degree=str(world.world_size), learn="off",
                                 pack_tokens=0, prefix_cache_tokens=0), world)
    if not engine.is_front:
        engine.worker_loop()
        return
    long_ids, bad_ids = scenario["long"], scenario["bad"]
    params = SamplingParams(max_tokens=scenario["max_tokens"])
    ref = {name: [e.token_id for e in engine.run_one(Request(f"ref-{name}", ids, params))[0]
                  if isinstance(e, TokenEvent)] for name, ids in (("long", long_ids), ("bad", bad_ids))}
    placement = engine.placement
    partition, alone = placement.partition, placement.alone

    def broken_partition(n: int):
        if n == len(bad_ids):
            raise RuntimeError("a partition that cannot serve")
        return partition(n)

    def broken_alone(request_id: str, *args, **kwargs):
        if request_id == "doomed":
            raise RuntimeError("nor can the front alone")
        return alone(request_id, *args, **kwargs)

    placement.partition, placement.alone = broken_partition, broken_alone
    engine.add(Request("streaming", long_ids, SamplingParams(max_tokens=4 * scenario["max_tokens"])))
    events: list = []
    while not any(isinstance(e, TokenEvent) and e.request_id == "streaming" for e in events):
        events += engine.step()
    engine.add(Request("doomed", bad_ids, params))
    engine.add(Request("moved", bad_ids, params))
    while {e.request_id for e in events if isinstance(e, Finished)} < {"streaming", "doomed", "moved"}:
        events += engine.step()
    events += engine.run_one(Request("after", long_ids, params))[0]
    out["went_on"] = engine.healthy
    engine.shutdown()
    for rid in ("streaming", "doomed", "moved", "after"):
        done = next(e for e in events if isinstance(e, Finished) and e.request_id == rid)
        out[rid] = {"tokens": [e.token_id for e in events if isinstance(e, TokenEvent) and e.request_id == rid],
                    "finish_reason": done.finish_reason, "error": done.error, "bad_input": done.bad_input,
                    "degree": done.figures.degree if done.figures else None,
                    "degree_source": done.figures.degree_source if done.figures else None}
    out["ref"] = ref


def packed(scenario: dict, world, out: dict) -> None:
    """The prompts one at a time through the engine, then all queued at once (one packed prefill over the ranks)."""
    engine = Engine(EngineConfig(run=RunConfig(**scenario["run"]), degree=scenario.get("degree", "auto")), world)
    if not engine.is_front:
        engine.worker_loop()
        return
    params = SamplingParams(max_tokens=scenario["max_tokens"])
    alone = {}
    for i, ids in enumerate(scenario["prompts"]):
        events, _ = engine.run_one(Request(f"alone{i}", ids, params))
        alone[i] = [e.token_id for e in events if not isinstance(e, Finished)]
    for i, ids in enumerate(scenario["prompts"]):
        engine.add(Request(f"packed{i}", ids, params))
    events, finished = [], {}
    while len(finished) < len(scenario["prompts"]):
        for e in engine.step():
            events.append(e)
            if isinstance(e, Finished):
                finished[e.request_id] = e
    engine.shutdown()
    out["alone"] = [alone[i] for i in range(len(scenario["prompts"]))]
    out["packed"] = [[e.token_id for e in events if e.request_id == f"packed{i}" and not isinstance(e, Finished)]
                     for i in range(len(scenario["prompts"]))]
    figures = [finished[f"packed{i}"].figures for i in range(len(scenario["prompts"]))]
    out["packed_with"] = [f.packed_with for f in figures]
    out["boundaries"] = [f.boundaries for f in figures]
    out["bytes_sent"] = [[r["bytes_sent"] for r in f.ranks] for f in figures]


def learned(scenario: dict, world, out: dict) -> None:
    """Prompts of one length over the chain with ``--learn``: each prefill's partition, where it came from, its
    greedy tokens, and one process's tokens for the same prompt (transformers alone)."""
    engine = Engine(EngineConfig(run=RunConfig(**scenario["run"]), degree="2", learn=scenario["learn"],
                                 prefix_cache_tokens=0), world)
    if not engine.is_front:
        engine.worker_loop()
        return
    params = SamplingParams(max_tokens=scenario["max_tokens"])
    model = engine.ctx.lm.model
    for i, ids in enumerate(scenario["prompts"]):
        events, figures = engine.run_one(Request(f"r{i}", ids, params))
        with torch.no_grad():
            t = torch.tensor([ids])
            ref = model.generate(t, max_new_tokens=scenario["max_tokens"], do_sample=False)[0, t.shape[1]:]
        out.setdefault("runs", []).append({
            "boundaries": figures.boundaries, "source": figures.partition_source, "ref": ref.tolist(),
            "tokens": [e.token_id for e in events if not isinstance(e, Finished)],
            "busy": [r["compute_s"] for r in figures.ranks]})
    engine.shutdown()


def cached(scenario: dict, world, out: dict) -> None:
    """``first`` prefilled (and cached), then ``second``, which shares its start; the reference is ``second``'s
    whole prompt in this process with transformers alone: its first-token logits and greedy tokens."""
    engine = Engine(EngineConfig(run=RunConfig(**scenario["run"]), degree=scenario["degree"]), world)
    if not engine.is_front:
        engine.worker_loop()
        return
    params = SamplingParams(max_tokens=scenario["max_tokens"])
    engine.run_one(Request("first", scenario["first"], params))
    events, figures = engine.run_one(Request("second", scenario["second"], params))
    logits = engine.last_prefill_logits
    engine.shutdown()
    model = engine.ctx.lm.model
    with torch.no_grad():
        ids = torch.tensor([scenario["second"]])
        ref_logits = model(ids).logits[0, -1].float()
        ref = model.generate(ids, max_new_tokens=scenario["max_tokens"], do_sample=False)[0, ids.shape[1]:]
    out["tokens"] = [e.token_id for e in events if not isinstance(e, Finished)]
    out["ref_tokens"] = ref.tolist()
    out["max_abs_logit_diff"] = float((logits - ref_logits).abs().max())
    out["cached_tokens"], out["degree"], out["boundaries"] = figures.cached_tokens, figures.degree, figures.boundaries
    out["bytes_sent"] = [r["bytes_sent"] for r in figures.ranks]


def kvp(scenario: dict, world, out: dict) -> None:
    """Each prompt alone, then all at once (not packed: each its own chain prefill), the last one cancelled after
    its first tokens; every rank reports the shards it still holds at the end."""
    engine = Engine(EngineConfig(run=RunConfig(**scenario["run"]), degree=scenario["degree"], pack_tokens=0), world)
    if not engine.is_front:
        engine.worker_loop()
        out["shards_left"] = len(engine.ctx.shards)
        return
    params = SamplingParams(max_tokens=scenario["max_tokens"])
    prompts = scenario["prompts"]
    alone = []
    for i, ids in enumerate(prompts):
        events, figures = engine.run_one(Request(f"alone{i}", ids, params))
        alone.append([e.token_id for e in events if not isinstance(e, Finished)])
        out.setdefault("decode", []).append(figures.decode)
    for i, ids in enumerate(prompts):
        engine.add(Request(f"together{i}", ids, params))
    events, finished, steps = [], {}, 0
    while len(finished) < len(prompts):
        for e in engine.step():
            events.append(e)
            if isinstance(e, Finished):
                finished[e.request_id] = e
        steps += 1
        if steps == 2 * len(prompts) + 2:
            engine.cancel(f"together{len(prompts) - 1}")
    out["shards_left_front"] = len(engine.ctx.shards)
    engine.step()  # an idle step: the workers hear of the last requests that ended
    engine.shutdown()
    model = engine.ctx.lm.model
    with torch.no_grad():
        out["reference"] = [model.generate(torch.tensor([ids]), max_new_tokens=scenario["max_tokens"],
                                           do_sample=False)[0, len(ids):].tolist() for ids in prompts]
    out["alone"] = alone
    out["together"] = [[e.token_id for e in events if e.request_id == f"together{i}" and not isinstance(e, Finished)]
                       for i in range(len(prompts))]
    out["finish_reasons"] = [finished[f"together{i}"].finish_reason for i in range(len(prompts))]


def chunked(scenario: dict, world, out: dict) -> None:
    """Each prompt prefilled in chunks of ``chunk_tokens`` (one engine step each, a short prompt decoding between
    them), against the prompt whole in this process with transformers alone: first-token logits and greedy tokens.
    With ``cancel`` the first prompt is cancelled after its first chunk."""
    cfg = EngineConfig(run=RunConfig(**scenario["run"]), degree=scenario.get("degree", "auto"), pack_tokens=0,
                       chunk_tokens=scenario["chunk_tokens"], prefix_cache_tokens=0,
                       step_budget_ms=scenario.get("step_budget_ms", 0.0),
                       prefill=scenario.get("prefill", "chain"), spp_chunk_tokens=scenario.get("spp_chunk_tokens", 0))
    engine = Engine(cfg, world)
    out["shard_positions"] = held = {}  # a KV-parallel request's positions in this rank's shard when it ends
    forget = engine.ctx.forget

    def forgetting(request_id: str) -> bool:
        if request_id in engine.ctx.shards:
            held[request_id] = engine.ctx.shards[request_id][0].layers[0].keys.shape[-2]
        return forget(request_id)

    engine.ctx.forget = forgetting
    if not engine.is_front:
        engine.worker_loop()
        for request_id in list(engine.ctx.shards):  # the last request's: the Drop would come with the next step
            forgetting(request_id)
        out["partial_left"] = len(engine.ctx.partial) + len(engine.ctx.staged)
        return
    params = SamplingParams(max_tokens=scenario["max_tokens"])
    out["tokens"], out["ref_tokens"], out["max_abs_logit_diff"], out["chunks"] = [], [], [], []
    engine.add(Request("short", scenario["short"], SamplingParams(max_tokens=4 * len(scenario["prompts"]) + 40)))
    for i, ids in enumerate(scenario["prompts"]):
        events, figures = engine.run_one(Request(f"long{i}", ids, params))
        model = engine.ctx.model(plan_extension(engine.model_config, len(ids), False, cfg.run.model))[0].model
        with torch.no_grad():
            ref_logits = model(torch.tensor([ids])).logits[0, -1].float()
            ref = model.generate(torch.tensor([ids]), max_new_tokens=scenario["max_tokens"], do_sample=False)
        out["tokens"].append([e.token_id for e in events if not isinstance(e, Finished)])
        out["ref_tokens"].append(ref[0, len(ids):].tolist())
        out["max_abs_logit_diff"].append(float((engine.last_prefill_logits - ref_logits).abs().max()))
        out["chunks"].append(figures.chunks)
        out.setdefault("sources", []).append(figures.partition_source)
        out.setdefault("decodes", []).append(figures.decode)
    out["partial_left"] = len(engine.ctx.partial) + len(engine.ctx.staged)
    engine.shutdown()


def mixed(scenario: dict, world, out: dict) -> None:
    """Short requests decoding while a long prompt prefills (in chunks of ``chunk_tokens``, or whole with 0): every
    request's greedy tokens against transformers' ``generate`` on the prompt alone, in this process. Counts the
    forwards in which decode rows shared the prompt's forward, and the steps that carried both."""
    import kvrunahead.serve.step.executor as executor_module

    run = RunConfig(**scenario["run"])
    cfg = EngineConfig(run=run, degree=scenario.get("degree", "auto"), pack_tokens=0,
                       chunk_tokens=scenario.get("chunk_tokens", 0), prefix_cache_tokens=0,
                       mixed_steps=scenario.get("mixed_steps", True))
    shared = {"forwards": 0, "rows": 0}
    plain = executor_module.mixed_forward

    def counted(model, ids, link, rows, emit):
        shared["forwards"] += 1
        shared["rows"] += len(rows)
        return plain(model, ids, link, rows, emit)

    executor_module.mixed_forward = counted
    engine = Engine(cfg, world)
    if not engine.is_front:
        engine.worker_loop()
        out["partial_left"], out["shards_left"] = len(engine.ctx.partial), len(engine.ctx.shards)
        return
    requests = {f"short{i}": ids for i, ids in enumerate(scenario["shorts"])}
    requests |= {f"long{i}": ids for i, ids in enumerate(scenario["longs"])}
    max_tokens = scenario["max_tokens"]
    for rid, ids in requests.items():
        if rid.startswith("short"):
            engine.add(Request(rid, ids, SamplingParams(max_tokens=max_tokens)))
    schedule, both = engine.scheduler.schedule, []

    def counting(now=None):  # the steps that carry decode rows and a prefill
        step = schedule(now)
        both.append(step is not None and bool(step.decodes) and bool(step.prefills))
        return step

    engine.scheduler.schedule = counting
    events = []
    for _ in range(3):  # the short ones prefilled and decoding
        events += engine.step()
    for rid, ids in requests.items():
        if rid.startswith("long"):
            engine.add(Request(rid, ids, SamplingParams(max_tokens=max_tokens)))
    while engine.has_work():
        events += engine.step()
    engine.step()  # an idle step: the workers hear of the requests that ended
    engine.shutdown()
    finished = {e.request_id: e for e in events if isinstance(e, Finished)}
    out["decode"] = {rid: finished[rid].figures.decode for rid in requests}
    out["tokens"] = {rid: [e.token_id for e in events if e.request_id == rid and isinstance(e, TokenEvent)]
                     for rid in requests}
    out["reference"] = {}
    for rid, ids in requests.items():
        model = engine.ctx.model(plan_extension(engine.model_config, len(ids), False, run.model))[0].model
        with torch.no_grad():
            ref = model.generate(torch.tensor([ids]), max_new_tokens=max_tokens, do_sample=False)
        out["reference"][rid] = ref[0, len(ids):].tolist()
    out["shared_forwards"], out["shared_rows"], out["mixed_steps"] = shared["forwards"], shared["rows"], sum(both)
    out["partial_left"], out["shards_left"] = len(engine.ctx.partial), len(engine.ctx.shards)


def idle(scenario: dict, world, out: dict) -> None:
    """The front idles with the client's loop pinging; the test kills it and watches the worker exit."""
    client = _front_client(scenario, world)
    if client is None:
        return
    Path(scenario["ready"]).write_text("idle")
    time.sleep(120)
    client.shutdown()


def main() -> None:
    logging.basicConfig(level=logging.INFO)
    scenario = json.load(open(sys.argv[1]))
    if os.environ.get("KVR_TEST_COMPILE"):  # every engine's model compiled (docs/testing.md)
        scenario["run"]["compile"] = True
    world = init_world("torchrun", "gloo", timeout_s=scenario["run"].get("timeout_s", 60))
    out: dict = {}
    code = 0
    try:
        scenarios = {"match": match, "serve": serve, "idle": idle, "packed": packed, "cached": cached, "kvp": kvp,
                     "chunked": chunked, "mixed": mixed, "logprobs": logprobs, "prompt_logprobs": prompt_logprobs,
                     "learned": learned, "contained": contained}
        scenarios[scenario["name"]](scenario, world, out)
    except Exception as e:  # noqa: BLE001 - a rank that lost its peers exits non-zero, as the CLI does
        logging.exception("rank %d failed", world.rank)
        out["error"] = f"{type(e).__name__}: {e}"
        code = 2
    if out.get("healthy") is False:
        code = 3
    json.dump(out, open(f"{sys.argv[2]}.{world.rank}", "w"))
    if code == 0:
        leave_world()
    sys.stdout.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
