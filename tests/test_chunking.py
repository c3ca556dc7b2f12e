"""Chunked prefill (serve/chunking.py) and the scheduler's orders (serve/scheduler.py): a prompt prefilled in
chunks answers as the whole prompt in one process, for any chunking over 1-3 real ranks; the chunks fit the budget
the cost model prices; LARS's order on hand-computed slacks; no request starves."""

import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from kvrunahead.bench.replay import Arrival, replay
from kvrunahead.config import RunConfig
from kvrunahead.errors import InputError
from kvrunahead.model.growing import GrowingKV
from kvrunahead.model.load import resolve_config
from kvrunahead.ranks.launcher import World
from kvrunahead.serve.chunking import ALONE_BUDGETS, CORRECTION_CAP, LEARN_CHUNKS, ChunkPlanner, Slack, relative_slack
from kvrunahead.serve.config import EngineConfig
from kvrunahead.serve.engine import Engine
from kvrunahead.serve.placement import kvp_predicted_faster
from kvrunahead.serve.prefix_cache import PrefixCache
from kvrunahead.serve.scheduler import WHOLE_CAP, Scheduler, yielded_share
from kvrunahead.serve.sequence import Finished, Request, SamplingParams, Sequence
from kvrunahead.sim.costmodel import CostModel
from kvrunahead.sim.flops import prompt_work
from kvrunahead.sim.optimize import balanced_boundaries
from kvrunahead.sim.profile import SHIPPED_DIR, HardwareProfile
from kvrunahead.sim.shape import shape_from_config
from kvrunahead.sim.simulate import SimError, simulate, simulate_chunk
from tests.helpers import wait_all
from tests.test_serve_engine import _kill_worker_and_wait, _start_ranks, ranks_ran

PROMPTS = [list(range(3, 60)), [5] + list(range(100, 140))]


def _cost() -> CostModel:
    return _shipped_cost(1)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("p,chunk", [(1, 5), (2, 1), (2, 13), (3, 7), (3, 17)])
def test_a_prompt_prefilled_in_chunks_answers_as_the_whole_prompt_in_one_process(tmp_path, p, chunk):
    """Chunks that cut across the ranks' boundaries, a chunk of one token, and a last chunk shorter than the
    rest; a short request decodes between the chunks."""
    scenario = {"name": "chunked", "run": {"model": "tiny-llama", "threads": 1}, "degree": str(p),
                "chunk_tokens": chunk, "max_tokens": 6, "prompts": PROMPTS, "short": list(range(7, 20))}
    ranks = ranks_ran(scenario, tmp_path, p)
    r = ranks[-1]
    assert r["tokens"] == r["ref_tokens"]
    assert max(r["max_abs_logit_diff"]) <= 1e-4
    for ids, chunks in zip(PROMPTS, r["chunks"]):
        assert [c["start"] for c in chunks] == list(range(0, len(ids), chunk))
        assert chunks[-1]["end"] == len(ids)
        for c in chunks:  # a chunk shorter than the ranks runs on the front alone
            alone = [c["start"]] * p + [c["end"]]
            assert c["cuts"] == alone if c["end"] - c["start"] < p else (len(c["cuts"]) == p + 1 and c["cuts"][
                0] == c["start"] and c["cuts"][-1] == c["end"] and c["cuts"] == sorted(set(c["cuts"])))
    assert all(x["partial_left"] == 0 for x in ranks)


@pytest.mark.timeout(300)
def test_a_chunked_prompt_beyond_the_trained_positions_runs_with_its_yarn_extension_over_the_chain(tmp_path):
    ids = list(range(3, 83))  # tiny-llama-short trains 48 positions: YaRN x2
    scenario = {"name": "chunked", "run": {"model": "tiny-llama-short", "threads": 1}, "degree": "2",
                "chunk_tokens": 30, "max_tokens": 5, "prompts": [ids], "short": list(range(7, 20))}
    procs, out = _start_ranks(scenario, tmp_path, 2)
    outputs = wait_all(procs, 240)
    assert [q.returncode for q in procs] == [0, 0], "\n".join(outputs)
    r = json.loads(Path(f"{out}.1").read_text())
    assert r["tokens"] == r["ref_tokens"] and r["max_abs_logit_diff"][0] <= 1e-4
    assert [c["end"] for c in r["chunks"][0]] == [30, 60, 80]


def _engine(**config) -> Engine:
    return Engine(EngineConfig(run=RunConfig(model="tiny-llama", threads=1), prefix_cache_tokens=0, **config),
                  World(0, 1, 0, 1, "single"))


def test_a_request_cancelled_between_its_chunks_frees_the_chunks_cache():
    engine = _engine(chunk_tokens=8, pack_tokens=0)
    engine.add(Request("long", list(range(3, 60)), SamplingParams(max_tokens=4)))
    engine.step()
    engine.step()
    assert "long" in engine.ctx.partial and engine.scheduler.prefilling
    engine.cancel("long")
    events = engine.step()
    assert [(e.request_id, e.finish_reason) for e in events if isinstance(e, Finished)] == [("long", "cancelled")]
    assert not engine.ctx.partial and not engine.scheduler.in_flight


def test_decodes_run_between_a_long_prompts_chunks():
    engine = _engine(chunk_tokens=8, pack_tokens=0)
    engine.run_one(Request("warm", list(range(3, 9)), SamplingParams(max_tokens=1)))
    engine.add(Request("short", list(range(3, 9)), SamplingParams(max_tokens=12)))
    engine.step()  # the short prompt's prefill: it decodes from here on
    engine.add(Request("long", list(range(3, 60)), SamplingParams(max_tokens=2)))
    kinds = []
    while engine.has_work():
        prefilling = bool(engine.scheduler.prefilling)
        events = engine.step()
        kinds.append(("long" in engine.ctx.partial or prefilling, any(e.request_id == "short" for e in events)))
    # while the long prompt was between chunks, every other step advanced the short request
    during = [short for chunking, short in kinds if chunking]
    assert sum(during) >= len(during) // 2 - 1 and len(during) >= 6


def test_chunking_and_lars_need_a_full_attention_model_with_a_cost_model():
    with pytest.raises(InputError, match="full-attention"):
        Engine(EngineConfig(run=RunConfig(model="tiny-gemma3", threads=1), step_budget_ms=100),
               World(0, 1, 0, 1, "single"))
    with pytest.raises(InputError, match="positive"):
        _engine(step_budget_ms=-1)


def test_a_chunk_is_priced_with_its_own_positions_on_the_chain_and_the_catch_up_after_it():
    cost = _cost()
    first = simulate_chunk(cost, (0, 900, 1500))
    assert first.ttft_s > simulate(cost, "kvr", 1500, 2, (0, 900, 1500)).ttft_s  # the same chain, then the catch-up
    later = simulate_chunk(cost, (4000, 4300, 4500))
    assert later.link_bytes == {"0->1": cost.kv_bytes(300) * cost.layers, "1->0": cost.kv_bytes(200) * cost.layers}
    assert simulate_chunk(cost, (8000, 8300, 8500)).ttft_s > later.ttft_s > 0  # more keys to attend
    alone = simulate_chunk(cost, (4000, 4000, 4001))  # shorter than the ranks: on the front alone
    assert alone.link_bytes == {"1->0": cost.kv_bytes(1) * cost.layers} and alone.ranks[0].compute_s < alone.ttft_s
    with pytest.raises(SimError):
        simulate_chunk(cost, (5, 5, 9, 9))


def test_the_chunks_fit_the_budget_and_shrink_as_the_cache_grows():
    config = resolve_config("smollm2-135m")
    planner = ChunkPlanner(_cost(), 2, "split", prompt_work(config), budget_s=1.0)
    assert not planner.chunked(256) and planner.chunked(16384)
    done, sizes = 0, []
    while done < 16384:
        end = planner.end(16384, done)
        assert end > done and (planner.predict_s(done, end) <= 1.0 or end - done <= planner.min_chunk)
        if end < 16384:  # the longest that fits: a little more would not
            assert planner.predict_s(done, min(16384, end + planner.min_chunk)) > 1.0
        sizes.append(end - done)
        done = end
    assert sizes[0] > 2 * sizes[-2] and all(a >= b * 0.9 for a, b in zip(sizes, sizes[1:-1]))
    assert planner.remaining_s(16384, 8192) < planner.whole_s(16384)
    fixed = ChunkPlanner(_cost(), 2, "split", prompt_work(config), 0.0, fixed=100)
    assert fixed.chunked(101) and not fixed.chunked(100) and fixed.end(250, 200) == 250


def test_chunks_measured_slower_than_predicted_make_the_next_ones_shorter_to_fit_the_budget():
    config = resolve_config("smollm2-135m")
    planner = ChunkPlanner(_cost(), 2, "split", prompt_work(config), budget_s=1.0)
    before = planner.end(16384, 8000)
    slow = planner.record(planner.cuts(8000, before), 1.5 * planner.predict_s(8000, before), 1.0)
    assert slow["correction"] == 1.0 and slow["predicted_s"] == planner.predict_s(8000, before)  # sized before it
    first = planner.record(planner.cuts(0, 900), 9.0, 1.0, learn=False)  # one-off costs: not learnt from
    assert planner.correction == pytest.approx(1.5) and first["correction"] == pytest.approx(1.5)
    after = planner.end(16384, 8000)
    assert after < before and planner.expected_s(8000, after) <= 1.0 < planner.expected_s(8000, after + 16)
    assert planner.record(planner.cuts(8000, after), 0.5, 1.0)["correction"] == pytest.approx(1.5)
    for _ in range(LEARN_CHUNKS):  # the latest chunks decide: a machine that sped up gets longer chunks again
        planner.record(planner.cuts(8000, after), 0.5 * planner.predict_s(8000, after), 1.0)
    assert planner.correction == pytest.approx(0.5) and planner.end(16384, 8000) > before
    for _ in range(LEARN_CHUNKS):  # bounded: a stalled step does not stop the chunking
        planner.record(planner.cuts(8000, after), 1000.0, 1.0)
    assert planner.correction == CORRECTION_CAP


def _seq(rid: str, n: int, arrival: float, prefilled: int = 0) -> Sequence:
    seq = Sequence(Request(rid, list(range(n)), arrival_s=arrival))
    seq.prefilled = prefilled
    return seq


def _linear_slack(target_s: float) -> Slack:
    """Work of 1 ms per token, the same target for all: slack by hand."""
    return Slack(lambda s: target_s, lambda s: s.prompt_len / 1000, lambda s: (s.prompt_len - s.prefilled) / 1000)


def test_lars_takes_the_least_relative_slack_first_and_fcfs_the_first_arrival():
    # now = 10 s, target 20 s. long: arrived 0, 10000 tokens (10 s of work, 4 s done): slack 0 + 20 - 10 - 6 = 4 s,
    # relative 4 / 10 = 0.4. short: arrived 9, 500 tokens: slack 9 + 20 - 10 - 0.5 = 18.5 s, relative 37.
    # mid: arrived 5, 3000 tokens: slack 5 + 20 - 10 - 3 = 12 s, relative 4.
    long, short, mid = _seq("long", 10000, 0.0, 4000), _seq("short", 500, 9.0), _seq("mid", 3000, 5.0)
    slack = _linear_slack(20.0)
    assert slack.of(long, 10.0) == pytest.approx(0.4) and slack.of(short, 10.0) == pytest.approx(37.0)
    assert relative_slack(5.0, 20.0, 3.0, 3.0, 10.0) == pytest.approx(4.0)
    lars = Scheduler(8, policy="lars", slack=slack)
    fcfs = Scheduler(8)
    for scheduler in (lars, fcfs):
        scheduler.waiting.extend([short, mid])
        scheduler.resume(long)
    assert [s.request_id for s in lars.order(10.0)] == ["long", "mid", "short"]
    assert [s.request_id for s in fcfs.order(10.0)] == ["long", "mid", "short"]
    # A tighter target for the short one (its own): slack 9 + 1.2 - 10 - 0.5 = -0.3, relative -0.6: it goes first.
    short.request.ttft_target_s = 1.2
    tight = Slack(lambda s: s.request.ttft_target_s or 20.0, slack.total_s, slack.remaining_s)
    urgent = Scheduler(8, policy="lars", slack=tight)
    urgent.waiting.extend([short, mid])
    urgent.resume(long)
    assert [s.request_id for s in urgent.order(10.0)] == ["short", "long", "mid"]


def test_no_request_starves_under_lars_a_long_one_among_a_stream_of_urgent_short_ones():
    """Every short request is more urgent than the long one (tight own targets); each prefill step one short
    arrives. The long one still gets a chunk at least every ``starve_after + 1`` prefill steps."""
    scheduler = Scheduler(64, policy="lars", slack=Slack(lambda s: s.request.ttft_target_s or 1e6,
                                                         lambda s: s.prompt_len / 1000,
                                                         lambda s: (s.prompt_len - s.prefilled) / 1000),
                          starve_after=4)
    scheduler.add(_seq("long", 100000, 0.0))
    now, turns, prefill_steps = 0.0, [], 0
    while prefill_steps < 60:
        arriving = _seq(f"s{prefill_steps}", 50, now)
        arriving.request.ttft_target_s = 0.1
        scheduler.add(arriving)
        [seq] = scheduler.schedule(now).prefills
        now += 0.05
        prefill_steps += 1
        if seq.request_id == "long":
            turns.append(prefill_steps)
            seq.prefilled += 1000
            scheduler.resume(seq)
        else:
            scheduler.start_decoding(seq)
            scheduler.finish(seq)
    gaps = [b - a for a, b in zip([0, *turns], turns)]
    assert turns and max(gaps) <= 5, turns
    # and the short ones do not wait behind it: most prefill steps go to them
    assert len(turns) <= prefill_steps // 5 + 1


def test_fcfs_keeps_a_chunked_prompt_in_line_and_lars_needs_a_slack():
    scheduler = Scheduler(8)
    long, short = _seq("long", 5000, 0.0, 1000), _seq("short", 10, 1.0)
    scheduler.resume(long)
    scheduler.add(short)
    assert scheduler.schedule(2.0).prefills == [long]
    with pytest.raises(ValueError, match="cost model"):
        Scheduler(8, policy="lars")
    with pytest.raises(ValueError, match="unknown schedule"):
        Scheduler(8, policy="edf")


def test_a_long_prefill_yields_part_of_its_budget_by_its_relative_slack():
    assert yielded_share(0.2) == pytest.approx(0.8)
    assert yielded_share(0.9) == 0.5 and yielded_share(-1.0) == 1.0


def test_a_prefill_yields_to_shorter_waiting_ones_only():
    """Under LARS the long prompt's chunk shrinks while a short one waits; the short one's keeps the whole budget
    with the long one waiting (a yield to a longer prompt would only cut the short one into more chunks)."""
    planner = ChunkPlanner(_cost(), 2, "split", prompt_work(resolve_config("smollm2-135m")), 1.0)
    scheduler = Scheduler(8, policy="lars", slack=_linear_slack(100.0), chunks=planner)
    long, short = _seq("long", 16000, 0.0, 2000), _seq("short", 600, 1.0)
    scheduler.resume(long)
    scheduler.add(short)
    assert scheduler.chunk_budget(long, 2.0) == pytest.approx(0.5)  # slack 100 s: the floor
    assert scheduler.chunk_budget(short, 2.0) == 1.0
    scheduler.policy = "fcfs"  # first come, first served never yields
    assert scheduler.chunk_budget(long, 2.0) == 1.0


def test_lars_runs_a_prefill_whole_where_its_chunks_would_miss_its_deadline_and_cuts_it_where_they_would_not():
    planner = ChunkPlanner(_cost(), 2, "split", prompt_work(resolve_config("smollm2-135m")), 1.0)
    n = next(n for n in range(64, 16384, 64) if planner.predict_s(0, n) > 2.0)  # two budgets' work, just over
    rest = planner.predict_s(0, n)
    decoding = _seq("decoding", 4000, 0.0)
    gap = planner.cost.decode_step_s([decoding.next_position])  # its 3 chunks have 2 decode steps between them
    for target, whole in ((rest + gap, True), (rest + 3 * gap, False)):  # the chunks end after (before) the deadline
        scheduler = Scheduler(8, policy="lars", slack=_linear_slack(target), chunks=planner)
        scheduler.start_decoding(decoding)
        short = _seq("short", n, 1.0)
        scheduler.add(short)
        step = scheduler.schedule(1.0)  # the scheduler sizes the step: its chunk ends where the budget says
        assert step.prefills == [short] and step.decodes == [decoding]
        assert (step.budget_s, step.chunk_end) == ((rest, n) if whole else (1.0, planner.end(n, 0)))
        assert planner.end(n, 0) < n
    too_long = next(n for n in range(64, 65536, 256) if planner.predict_s(0, n) > WHOLE_CAP)
    scheduler = Scheduler(8, policy="lars", slack=_linear_slack(0.1), chunks=planner)
    scheduler.add(_seq("long", too_long, 1.0))
    assert scheduler.chunk_budget(scheduler.waiting[0], 1.0) == 1.0  # cut, whatever its deadline


@pytest.mark.timeout(180)
def test_a_worker_killed_during_a_chunked_prefill_ends_every_request_with_an_error_in_bound(tmp_path):
    timeout_s = 5.0
    scenario = {"name": "serve", "ready": str(tmp_path / "ready"), "ready_when": "chunking", "prompt_tokens": 2400,
                "run": {"model": "tiny-llama", "threads": 1, "timeout_s": timeout_s},
                "engine": {"chunk_tokens": 16, "pack_tokens": 0, "degree": "2"}}
    front, killed_at = _kill_worker_and_wait(tmp_path, scenario, timeout_s)
    assert front["healthy"] is False
    assert [front[f"r{i}"]["finish_reason"] for i in range(3)] == ["error"] * 3, front
    assert max(front[f"r{i}"]["at_s"] for i in range(3)) - killed_at < timeout_s + 10


@pytest.mark.timeout(180)
def test_a_worker_killed_during_a_kvp_decode_ends_every_request_with_an_error_in_bound(tmp_path):
    timeout_s = 5.0
    scenario = {"name": "serve", "ready": str(tmp_path / "ready"),
                "run": {"model": "tiny-llama", "threads": 1, "timeout_s": timeout_s, "partition": "even",
                        "decode": "kvp"},
                "engine": {"degree": "2", "pack_tokens": 0}}
    front, killed_at = _kill_worker_and_wait(tmp_path, scenario, timeout_s)
    assert front["healthy"] is False and "kvp" in [front[f"r{i}"]["decode"] for i in range(3)]
    assert [front[f"r{i}"]["finish_reason"] for i in range(3)] == ["error"] * 3, front
    assert max(front[f"r{i}"]["at_s"] for i in range(3)) - killed_at < timeout_s + 10


def _shipped_cost(threads: int) -> CostModel:
    profile = HardwareProfile.load(SHIPPED_DIR / f"cpu-t{threads}.json")
    return CostModel(shape_from_config(resolve_config("smollm2-135m"), "float32"), profile)


def test_a_decode_step_is_read_bound_and_kvp_splits_its_attention_for_an_exchange_per_layer():
    cost = _shipped_cost(1)
    s = cost.shape
    weights = cost.layers * s.layer_params * s.dtype_bytes / cost.profile.memory_Bps
    assert cost.decode_step_s([1]) >= weights  # one token reads every weight once
    assert cost.decode_step_s([32768], parts=2) < cost.decode_step_s([32768])  # half the K,V read per rank
    exchange = cost.layers * (cost.link.latency_s + s.heads * (s.head_dim + 1) * 4 / cost.link.bandwidth_Bps)
    assert cost.decode_step_s([2], parts=2) - cost.decode_step_s([2]) == pytest.approx(exchange, rel=0.05)
    assert cost.decode_step_s([100, 200]) < cost.decode_step_s([100]) + cost.decode_step_s([200])  # one batch


def test_a_profiles_decode_kernel_prices_the_decode_attention_and_the_memory_rate_bounds_it():
    cost = _shipped_cost(2)
    slow = dataclasses.replace(cost.profile.attention["full"], call_s=1e-3, key_s=0.0, query_s=0.0, flops_per_s=1e9)
    with_kernel = CostModel(cost.shape, dataclasses.replace(cost.profile,
                                                            attention={**cost.profile.attention, "decode": slow}))
    pairs = 32768 * cost.shape.flops_per_pair / 1e9
    assert with_kernel.decode_attention_s(32768) == pytest.approx(1e-3 + pairs)
    fast = dataclasses.replace(slow, call_s=0.0, flops_per_s=1e18)
    bound = CostModel(cost.shape, dataclasses.replace(cost.profile, attention={**cost.profile.attention,
                                                                                "decode": fast}))
    assert bound.decode_attention_s(32768) == pytest.approx(cost.kv_bytes(32768) / cost.profile.memory_Bps)
    without = CostModel(cost.shape, dataclasses.replace(cost.profile, attention={
        k: v for k, v in cost.profile.attention.items() if k != "decode"}))
    assert without.decode_attention_s(32768) == pytest.approx(max(
        without.full_s(1, 32768), cost.kv_bytes(32768) / cost.profile.memory_Bps))


def test_auto_decode_chooses_kvp_for_long_contexts_only_where_the_cost_model_says_so():
    chain, solo = _shipped_cost(1), _shipped_cost(2)
    assert not kvp_predicted_faster(chain, solo, 1024, 2)
    assert kvp_predicted_faster(chain, solo, 32768, 2)
    crossing = next(n for n in range(1024, 65536, 512) if kvp_predicted_faster(chain, solo, n, 2))
    assert all(kvp_predicted_faster(chain, solo, n, 2) for n in range(crossing, 65536, 4096))


def test_auto_decode_keeps_short_contexts_in_the_front_batch_whatever_the_front_profile_fits():
    # A calibrated 2-thread profile with a per-layer overhead the 1-thread one lacks (this machine's fit: 5 ms)
    # makes a lone KVP step look faster at any length; a short context still joins the front's batch, which reads
    # the weights once for every request, while a KVP request runs its own forward.
    chain, solo = _shipped_cost(1), _shipped_cost(2)
    slow_front = CostModel(solo.shape, dataclasses.replace(solo.profile, layer_s=0.005))
    assert chain.decode_step_s([77], 2) < slow_front.decode_step_s([77])
    assert not any(kvp_predicted_faster(chain, slow_front, n, 2) for n in (77, 1024, 4096))
    assert kvp_predicted_faster(chain, slow_front, 32768, 2)


def test_the_replay_schedules_a_trace_as_the_engine_would_and_lars_shortens_the_short_requests_wait():
    config = resolve_config("smollm2-135m")
    cost = _shipped_cost(1)
    trace = [Arrival(0.0, 12000, 4, "long")] + [Arrival(0.5 + i, 200, 8) for i in range(20)]
    fcfs = replay(trace, cost, 2, prompt_work(config))
    lars = replay(trace, cost, 2, prompt_work(config), "lars", budget_s=1.0)
    for run in (fcfs, lars):
        assert all(r.ttft_s is not None and r.e2e_s >= r.ttft_s and r.output_tokens == a.output_tokens
                   for r, a in zip(run, trace))
    whole = simulate(cost, "kvr", 12032, 2, balanced_boundaries(cost, 12032, 2, "split")).ttft_s
    assert fcfs[0].ttft_s == pytest.approx(whole)  # the long one first and whole; every short one waits for it
    assert min(r.ttft_s for r in fcfs[1:]) > 0.5 * whole
    assert max(r.ttft_s for r in lars[1:]) < min(r.ttft_s for r in fcfs[1:])
    assert lars[0].ttft_s > fcfs[0].ttft_s  # the long one pays for its chunks and the short ones' turns


def test_lars_counts_the_step_under_way_so_short_prompts_meet_their_target_during_a_long_prefill():
    """A 16k document and short prompts arriving every ~3 s while it is chunked (1 s budget, 2 s target): every
    short one's first token within the target, the document itself not delayed by them more than fcfs's order
    delays the short ones. Without the step's margin in the slack, short prompts waited until their slack fell
    below the document's and then behind one more chunk (12 of 25 over 2 s in this replay)."""
    config = resolve_config("smollm2-135m")
    cost = _shipped_cost(1)
    sizes = [40, 60, 150, 400]
    trace = [Arrival(0.0, 16000, 16, "long")] + [Arrival(0.3 + 2.9 * i + (i * 0.37) % 1, sizes[i % 4], 64)
                                                  for i in range(25)]
    lars = replay(trace, cost, 2, prompt_work(config), "lars", budget_s=1.0)
    assert max(r.ttft_s for r in lars[1:]) < 2.0
    fcfs = replay(trace, cost, 2, prompt_work(config))
    assert lars[0].ttft_s < 2.0 * fcfs[0].ttft_s


def test_the_prefix_cache_keeps_a_chunked_caches_positions_without_the_room_for_appends():
    n = 40
    held = GrowingKV.stacked(torch.randn(2, 1, 3, 30, 4))
    kv = held.extend(torch.randn(2, 1, 3, 10, 4))  # room after the 40: the last chunk's cache is a view into it
    stacked = torch.randn(2, 1, 3, n, 4)  # a chain's K,V: one storage of their size
    layers = [SimpleNamespace(keys=kv[0], values=kv[1]), SimpleNamespace(keys=stacked[0], values=stacked[1])]
    prefixes = PrefixCache(max_tokens=1000, min_match=1)
    prefixes.put(list(range(n)), SimpleNamespace(layers=layers))
    (k0, v0), (k1, v1) = prefixes.entries[tuple(range(n))].kv
    assert torch.equal(k0, kv[0]) and torch.equal(v0, kv[1])
    assert k0.untyped_storage().nbytes() == k0.numel() * 4 and v0.untyped_storage().nbytes() == v0.numel() * 4
    assert k1.data_ptr() == stacked[0].data_ptr() and v1.data_ptr() == stacked[1].data_ptr()  # not copied


def test_a_prompt_alone_runs_in_chunks_of_growing_length_and_one_beside_others_in_the_budget():
    """Alone on the server a long prompt's chunk may take as long as its prefill so far, up to ALONE_BUDGETS
    budgets (fewer chunks, each one's fixed cost paid fewer times; an arrival waits at most that long); beside a
    decode or a waiting request it is cut to the budget; --chunk-tokens cuts it whatever else runs."""
    planner = ChunkPlanner(_cost(), 2, "split", prompt_work(resolve_config("smollm2-135m")), 0.5)
    n = 16384
    ends, done = [], 0
    while done < n:
        alone = Scheduler(8, chunks=planner)
        if done:
            alone.resume(_seq("long", n, 0.0, prefilled=done))
        else:
            alone.add(_seq("long", n, 0.0))
        step = alone.schedule(1.0)
        done = step.chunk_end or n
        ends.append(done)
        before = ends[-2] if len(ends) > 1 else 0
        assert step.budget_s == pytest.approx(min(max(0.5, planner.predict_s(0, before)), ALONE_BUDGETS * 0.5)
                                              if before else 0.5)
    budgeted, done = 0, 0
    while done < n:
        done, budgeted = planner.end(n, done, 0.5), budgeted + 1
    assert ends[0] == planner.end(n, 0) and len(ends) < budgeted / 2
    for other in ("decoding", "waiting"):
        busy = Scheduler(8, chunks=planner, mixed=True)
        busy.resume(_seq("long", n, 0.0, prefilled=8000))
        if other == "decoding":
            busy.start_decoding(_seq("short", 100, 0.5))
        else:
            busy.add(_seq("short", 100, 0.5))
        step = busy.schedule(1.0)
        assert [s.request_id for s in step.prefills] == ["long"], other
        assert step.chunk_end == planner.end(n, 8000) < n, other
    fixed = Scheduler(8, chunks=dataclasses.replace(planner, fixed=1000))
    fixed.resume(_seq("long", n, 0.0, prefilled=8000))
    assert fixed.schedule(1.0).chunk_end == 9000
