"""The serving engine (kvrunahead/serve/): one code path with the runner, batched decode exact, cancel, overload,
sampling, stop strings, and a rank failure that ends every request in flight without hanging."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from kvrunahead.config import RunConfig
from kvrunahead.ranks.launcher import World, free_port
from kvrunahead.serve.client import AsyncEngineClient
from kvrunahead.serve.config import EngineConfig
from kvrunahead.serve.engine import Engine
from kvrunahead.serve.sampling import nucleus
from kvrunahead.serve.sequence import EngineDead, Finished, QueueFull, Request, SamplingParams, StopText, TokenEvent
from tests.helpers import HERE, rank_env, wait_all

ROOT = HERE.parent
PROMPTS = [list(range(30, 70)), list(range(100, 117)), list(range(5, 90))]  # different lengths


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine(EngineConfig(run=RunConfig(model="tiny-llama", threads=1), max_queue=4), World(0, 1, 0, 1, "single"))


def _tokens(events) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for e in events:
        if isinstance(e, TokenEvent):
            out.setdefault(e.request_id, []).append(e.token_id)
    return out


def _until_finished(engine: Engine, ids: set[str], max_steps: int = 500) -> list:
    events: list = []
    for _ in range(max_steps):
        events += engine.step()
        if ids <= {e.request_id for e in events if isinstance(e, Finished)}:
            return events
    raise AssertionError(f"requests {ids} did not finish in {max_steps} steps")


def test_greedy_output_alone_equals_output_in_a_batch_joined_at_different_steps(engine):
    alone = {}
    for i, ids in enumerate(PROMPTS):
        events, _ = engine.run_one(Request(f"alone{i}", ids, SamplingParams(max_tokens=12)))
        alone[i] = _tokens(events)[f"alone{i}"]
    events, widest = [], 0
    for i, ids in enumerate(PROMPTS):  # each joins while the earlier ones decode
        engine.add(Request(f"batch{i}", ids, SamplingParams(max_tokens=12)))
        for _ in range(3):
            events += engine.step()
            widest = max(widest, len(engine.decoder.members))
    events += _until_finished(engine, {f"batch{i}" for i in range(3)})
    assert widest == 3  # the three really advanced in one forward
    batched = _tokens(events)
    assert all(batched[f"batch{i}"] == alone[i] for i in range(3)), (batched, alone)
    assert max(len(engine.decoder.members), len(engine.decoder.own)) == 0  # every cache freed


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-gemma3"])
def test_waiting_prompts_are_packed_into_one_prefill_and_answer_as_alone(model):
    # no prefix cache: the prompts run alone first, and a prompt whose start is cached is never packed
    engine = Engine(EngineConfig(run=RunConfig(model=model, threads=1), max_queue=8, prefix_cache_tokens=0),
                    World(0, 1, 0, 1, "single"))
    prompts = [*PROMPTS, [7], list(range(3, 140))]  # a 1-token prompt; one beyond the tiny Gemma's window of 64
    alone = {}
    for i, ids in enumerate(prompts):
        events, _ = engine.run_one(Request(f"alone{i}", ids, SamplingParams(max_tokens=10)))
        alone[i] = _tokens(events)[f"alone{i}"]
    for i, ids in enumerate(prompts):
        engine.add(Request(f"p{i}", ids, SamplingParams(max_tokens=10)))
    events = _until_finished(engine, {f"p{i}" for i in range(len(prompts))})
    packed = _tokens(events)
    assert all(packed[f"p{i}"] == alone[i] for i in range(len(prompts))), (packed, alone)
    done = [e for e in events if isinstance(e, Finished)]
    assert {e.figures.packed_with for e in done} == {len(prompts)}


def test_packing_stops_at_the_step_size_and_keeps_the_queue_order():
    engine = Engine(EngineConfig(run=RunConfig(model="tiny-llama", threads=1), max_queue=8, pack_tokens=100),
                    World(0, 1, 0, 1, "single"))
    for i, ids in enumerate([list(range(3, 43)), list(range(3, 53)), list(range(3, 23)), list(range(3, 13))]):
        engine.add(Request(f"q{i}", ids, SamplingParams(max_tokens=2)))
    events = _until_finished(engine, {f"q{i}" for i in range(4)})
    sizes = {e.request_id: e.figures.packed_with for e in events if isinstance(e, Finished)}
    assert sizes == {"q0": 2, "q1": 2, "q2": 2, "q3": 2}  # 40 + 50 fit 100; 20 does not join them; 20 + 10 do


def test_prompts_whose_start_is_cached_prefill_alone_their_new_tokens_only():
    """n choices of one prompt (the HTTP layer sends the other n - 1 once the first is prefilled): packed together
    they would prefill whole; alone each takes the cached K,V and first-token logits, no prefill at all, and
    decodes on from them as the first did (none writes into the entry the next one takes)."""
    engine = Engine(EngineConfig(run=RunConfig(model="tiny-llama", threads=1), max_queue=8, pack_tokens=1000),
                    World(0, 1, 0, 1, "single"))
    prompt = list(range(3, 203))
    first, _ = engine.run_one(Request("first", prompt, SamplingParams(max_tokens=2)))
    for i in range(3):
        engine.add(Request(f"fork{i}", prompt, SamplingParams(max_tokens=2)))
    engine.add(Request("other", list(range(300, 400)), SamplingParams(max_tokens=2)))
    events = _until_finished(engine, {"fork0", "fork1", "fork2", "other"})
    done = {e.request_id: e for e in events if isinstance(e, Finished)}
    assert [done[f"fork{i}"].figures.cached_tokens for i in range(3)] == [200] * 3
    assert {r: d.figures.packed_with for r, d in done.items()} == {"fork0": 1, "fork1": 1, "fork2": 1, "other": 1}
    tokens = _tokens(events)
    assert tokens["fork0"] == tokens["fork1"] == tokens["fork2"] == [e.token_id for e in first[:-1]]


@pytest.mark.timeout(500)
def test_packed_prefill_over_real_ranks_answers_each_prompt_as_alone(tmp_path):
    """Prompts packed over the chain answer as each alone; where every one ends at its first token none is kept, so
    rank 0 hands on only the prompt it cuts (its logits go to the front with its figures), not all it holds."""
    prompts = [list(range(3, 120)), [9], list(range(40, 75)), list(range(5, 200)), list(range(60, 66))]
    sent = {}
    for max_tokens in (8, 1):
        scenario = {"name": "packed", "run": {"model": "tiny-gemma3", "threads": 1}, "degree": "2",
                    "prompts": prompts, "max_tokens": max_tokens}
        (tmp_path / str(max_tokens)).mkdir()
        procs, out = _start_ranks(scenario, tmp_path / str(max_tokens))
        outputs = wait_all(procs, 280)
        assert [q.returncode for q in procs] == [0, 0], "\n".join(outputs)
        r = json.loads(Path(f"{out}.1").read_text())
        assert r["packed"] == r["alone"] and all(len(t) <= max_tokens for t in r["packed"])
        assert r["packed_with"] == [len(prompts)] * len(prompts)
        sent[max_tokens] = r["bytes_sent"][0][0]
    assert sent[8] > 2 * sent[1] > 0  # relayed every K,V it held to the front; then only the cut prompt's


def _alone(model: str, prompt: list[int], prefix_cache_tokens: int, *before: list[int]):
    """The tokens, first-token logits and figures of ``prompt`` on a fresh engine, after the prompts ``before``."""
    engine = Engine(EngineConfig(run=RunConfig(model=model, threads=1), prefix_cache_tokens=prefix_cache_tokens),
                    World(0, 1, 0, 1, "single"))
    for i, ids in enumerate(before):
        engine.run_one(Request(f"before{i}", ids, SamplingParams(max_tokens=3)))
    events, figures = engine.run_one(Request("it", prompt, SamplingParams(max_tokens=10)))
    return _tokens(events)["it"], engine.last_prefill_logits, figures


def test_a_prompt_whose_start_is_cached_prefills_only_its_new_tokens_and_answers_as_whole():
    base = list(range(3, 103))
    prompt = base + [9, 11, 13, 15]
    whole, whole_logits, whole_figures = _alone("tiny-llama", prompt, 0, base + [5, 6, 7])
    tokens, logits, figures = _alone("tiny-llama", prompt, 4096, base + [5, 6, 7])
    assert whole_figures.cached_tokens == 0 and figures.cached_tokens == len(base)
    assert tokens == whole and float((logits - whole_logits).abs().max()) <= 1e-4
    again, logits, figures = _alone("tiny-llama", prompt, 4096, prompt)  # the same prompt again: no prefill at all
    assert figures.cached_tokens == len(prompt) and again == whole and torch.equal(logits, whole_logits)
    assert figures.degree_source == "no prefill: the prefix cache kept its first-token logits"


def test_special_tokens_are_left_out_of_the_text_unless_asked_for_as_vllm_does():
    """SmolLM2's ``<|im_start|>`` forced by ``logit_bias``: no text by default (vLLM's skip_special_tokens), its
    own text with ``skip_special_tokens: false``; the tokens are the same either way."""
    engine = Engine(EngineConfig(run=RunConfig(model="smollm2-135m", threads=1)), World(0, 1, 0, 1, "single"))
    special = engine.tokenizer.convert_tokens_to_ids("<|im_start|>")
    texts, tokens = [], []
    for skip in (True, False):
        params = SamplingParams(max_tokens=2, logit_bias={special: 100.0}, skip_special_tokens=skip)
        events, _ = engine.run_one(Request(f"skip{skip}", engine.tokenizer.encode("Hello there"), params))
        texts.append("".join(e.text for e in events if isinstance(e, TokenEvent)))
        tokens.append([e.token_id for e in events if isinstance(e, TokenEvent)])
    assert tokens == [[special, special]] * 2 and texts == ["", "<|im_start|><|im_start|>"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("p", [2, 3])
def test_new_tokens_after_a_cached_prefix_run_over_the_chain_and_answer_as_the_whole_prompt(tmp_path, p):
    base = list(range(3, 103))
    second = base + list(range(200, 290))  # 90 new tokens cut over the ranks after the 100 cached
    scenario = {"name": "cached", "run": {"model": "tiny-llama", "threads": 1}, "degree": str(p),
                "first": base + [5, 6, 7], "second": second, "max_tokens": 8}
    procs, out = _start_ranks(scenario, tmp_path, p)
    outputs = wait_all(procs, 280)
    assert [q.returncode for q in procs] == [0] * p, "\n".join(outputs)
    r = json.loads(Path(f"{out}.{p - 1}").read_text())
    assert r["cached_tokens"] == len(base) and r["degree"] == p
    assert r["boundaries"][0] == len(base) and r["boundaries"][-1] == len(second) and len(r["boundaries"]) == p + 1
    assert r["tokens"] == r["ref_tokens"][: len(r["tokens"])] and len(r["tokens"]) >= 1
    assert r["max_abs_logit_diff"] <= 1e-4
    assert all(b > 0 for b in r["bytes_sent"])  # the front sent rank 0 the prefix; each rank handed on its K,V


def test_the_prefix_cache_skips_short_matches_and_sliding_window_models():
    short = list(range(3, 40)) + [1]  # 37 tokens in common: below the 64 worth looking up
    assert _alone("tiny-llama", short, 4096, list(range(3, 40)) + [2])[2].cached_tokens == 0
    prompt = list(range(3, 140))
    assert _alone("tiny-gemma3", prompt + [1], 4096, prompt + [2])[2].cached_tokens == 0  # windows kept only


def test_the_prefix_cache_holds_its_token_budget_least_recently_used_out():
    from types import SimpleNamespace

    from kvrunahead.serve.prefix_cache import PrefixCache

    def fake(n: int):
        return SimpleNamespace(layers=[SimpleNamespace(keys=torch.zeros(1, 1, n, 2), values=torch.zeros(1, 1, n, 2))])

    cache = PrefixCache(max_tokens=250, min_match=64)
    a, b, c = [1] * 100, [2] * 100, [3] * 100
    cache.put(a, fake(100)), cache.put(b, fake(100))
    assert cache.longest(a + [5])[0] == 100  # a is now the most recently used
    cache.put(c, fake(100))  # over 250 tokens: b goes
    assert cache.tokens == 200 and cache.longest(b + [5]) == (0, None) and cache.longest(c)[0] == 99
    cache.put([4] * 300, fake(300))  # beyond the whole budget: not kept
    assert cache.tokens == 200


def test_cancel_frees_the_request_at_the_next_step(engine):
    engine.add(Request("c", PROMPTS[0], SamplingParams(max_tokens=100)))
    engine.step(), engine.step()
    assert "c" in engine.decoder
    engine.cancel("c")
    events = engine.step()
    assert [e.finish_reason for e in events if isinstance(e, Finished)] == ["cancelled"]
    assert "c" not in engine.decoder and engine.in_flight == 0


def test_a_request_cancelled_before_any_step_ends_cancelled_without_a_prefill(engine):
    engine.add(Request("early", PROMPTS[0], SamplingParams(max_tokens=5)))
    engine.cancel("early")
    assert engine.in_flight == 1 and engine.has_work()  # in the inbox: the scheduler has not seen it
    events = engine.step()
    assert [(type(e).__name__, e.finish_reason) for e in events] == [("Finished", "cancelled")]
    assert engine.in_flight == 0 and not engine.has_work()


def test_requests_added_and_cancelled_from_other_threads_while_the_engine_steps_each_end_once(engine):
    """The HTTP side's threads only put into the engine's inbox; the stepping thread alone touches the scheduler."""
    ended: list = []
    stop = threading.Event()

    def stepping() -> None:
        while not stop.is_set() or engine.has_work():
            ended.extend(e for e in engine.step() if isinstance(e, Finished))

    def adding(k: int) -> None:
        for i in range(3):
            rid = f"t{k}-{i}"
            while True:
                try:
                    engine.add(Request(rid, PROMPTS[i % 3], SamplingParams(max_tokens=3)))
                    break
                except QueueFull:  # max_queue 4: wait for room, as a client retrying a 429
                    time.sleep(0.01)
            if i == 1:
                engine.cancel(rid)

    stepper = threading.Thread(target=stepping)
    stepper.start()
    adders = [threading.Thread(target=adding, args=(k,)) for k in range(3)]
    for t in adders:
        t.start()
    for t in adders:
        t.join(120)
    stop.set()
    stepper.join(120)
    ids = [e.request_id for e in ended]
    assert sorted(ids) == sorted(f"t{k}-{i}" for k in range(3) for i in range(3))  # each once
    assert all(e.finish_reason in ("length", "cancelled") for e in ended)
    assert {e.request_id for e in ended if e.finish_reason == "length"} >= {f"t{k}-{i}" for k in range(3)
                                                                            for i in (0, 2)}
    assert engine.in_flight == 0


def test_queue_full_is_refused_at_once(engine):
    for i in range(4):
        engine.add(Request(f"q{i}", PROMPTS[1], SamplingParams(max_tokens=1)))
    with pytest.raises(QueueFull):
        engine.add(Request("q4", PROMPTS[1], SamplingParams(max_tokens=1)))
    _until_finished(engine, {f"q{i}" for i in range(4)})


def test_bad_requests_are_refused_by_name(engine):
    with pytest.raises(ValueError, match="max_tokens"):
        engine.add(Request("bad", PROMPTS[0], SamplingParams(max_tokens=0)))
    with pytest.raises(ValueError, match="tokens"):
        engine.add(Request("long", [1] * (engine.max_model_len + 1)))


def test_sampling_with_the_same_seed_gives_the_same_tokens(engine):
    params = {"max_tokens": 10, "temperature": 0.9, "top_p": 0.8}
    runs = [_tokens(engine.run_one(Request(f"s{k}", PROMPTS[0], SamplingParams(seed=seed, **params)))[0])[f"s{k}"]
            for k, seed in enumerate((7, 7, 8))]
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


def test_nucleus_keeps_the_smallest_set_reaching_top_p():
    kept = nucleus(torch.tensor([0.5, 0.3, 0.15, 0.05]), 0.7)
    assert torch.allclose(kept, torch.tensor([0.625, 0.375, 0.0, 0.0]))


def test_stop_strings_are_cut_and_never_shown_in_part():
    stop = StopText(["END"])
    assert stop.advance("abc E") == ("abc ", False)  # "E" may start "END": held back
    assert stop.advance("abc EN") == ("", False)
    assert stop.advance("abc ENDxyz") == ("", True)
    again = StopText(["END"])
    assert again.advance("abc E") == ("abc ", False)
    assert again.advance("abc Ex") == ("Ex", False)


def test_a_stop_string_ends_the_request_with_its_text_cut(engine):
    events, _ = engine.run_one(Request("full", PROMPTS[2], SamplingParams(max_tokens=12)))
    text = "".join(e.text for e in events if isinstance(e, TokenEvent))
    stop = text[len(text) // 2:len(text) // 2 + 3]
    events, _ = engine.run_one(Request("cut", PROMPTS[2], SamplingParams(max_tokens=12, stop=[stop])))
    cut = "".join(e.text for e in events if isinstance(e, TokenEvent))
    assert events[-1].finish_reason == "stop"
    assert cut == text[:text.find(stop)]


def test_async_client_streams_and_refuses_when_draining(engine):
    client = AsyncEngineClient(engine)

    async def run() -> list:
        return [e async for e in client.generate(PROMPTS[0], SamplingParams(max_tokens=5))]

    try:
        events = asyncio.run(asyncio.wait_for(run(), 60))
        assert [type(e) for e in events] == [TokenEvent] * 5 + [Finished]
        client.begin_drain()

        async def refused() -> None:
            async for _ in client.generate(PROMPTS[0], SamplingParams()):
                pass

        with pytest.raises(EngineDead):
            asyncio.run(refused())
    finally:
        client._stop.set()  # leave the module's engine usable: stop the loop without shutting the engine
        client._wake.set()
        client._thread.join(10)


def _start_ranks(scenario: dict, tmp: Path, p: int = 2) -> tuple[list[subprocess.Popen], Path]:
    (tmp / "scenario.json").write_text(json.dumps(scenario))
    port = free_port()
    procs = [subprocess.Popen([sys.executable, str(HERE / "serve_harness.py"), str(tmp / "scenario.json"),
                               str(tmp / "out.json")], env=rank_env(r, p, port, PYTHONPATH=str(ROOT)),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(p)]
    return procs, tmp / "out.json"


def ranks_ran(scenario: dict, tmp: Path, p: int = 2, timeout_s: float = 240) -> list[dict]:
    """The scenario on p real ranks, each of which must exit 0; what every rank wrote, in rank order."""
    procs, out = _start_ranks(scenario, tmp, p)
    outputs = wait_all(procs, timeout_s)
    assert [q.returncode for q in procs] == [0] * p, "\n".join(outputs)
    return [json.loads(Path(f"{out}.{rank}").read_text()) for rank in range(p)]


@pytest.mark.timeout(240)
def test_engine_chain_prefill_matches_the_runner_on_real_ranks(tmp_path):
    run = {"model": "tiny-llama", "context_len": 96, "partition": "0.6,0.4", "max_new_tokens": 6, "threads": 1}
    procs, out = _start_ranks({"name": "match", "run": run, "degree": "2"}, tmp_path)
    outputs = wait_all(procs, 200)
    assert [q.returncode for q in procs] == [0, 0], "\n".join(outputs)
    r = json.loads(Path(f"{out}.1").read_text())
    assert r["degree"] == 2 and r["boundaries"] == r["ref_boundaries"]
    assert r["tokens"][0] == r["ref_first"] and r["tokens"] == r["ref_tokens"]
    assert r["max_abs_logit_diff"] <= 1e-3
    assert [x["rank"] for x in r["ranks"]] == [0, 1] and r["ranks"][0]["bytes_sent"] > 0


@pytest.mark.timeout(240)
@pytest.mark.parametrize("p, partition", [(1, "even"), (2, "0.6,0.4"), (3, "0.5,0.3,0.2")])
def test_greedy_logprobs_over_real_ranks_equal_transformers_generate_scores(tmp_path, p, partition):
    run = {"model": "tiny-llama", "context_len": 96, "partition": partition, "max_new_tokens": 6, "threads": 1}
    procs, out = _start_ranks({"name": "logprobs", "run": run, "degree": str(p)}, tmp_path, p)
    outputs = wait_all(procs, 200)
    assert [q.returncode for q in procs] == [0] * p, "\n".join(outputs)
    r = json.loads(Path(f"{out}.{p - 1}").read_text())
    assert r["degree"] == p and r["tokens"] == r["ref_tokens"]
    assert r["chosen_diff"] <= 1e-4 and r["top_diff"] <= 1e-4, r  # float32: a few roundings of the logits
    assert r["top_ids"] == r["ref_top_ids"]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("p, partition, chunk", [(1, "even", 0), (2, "0.6,0.4", 0), (3, "0.5,0.3,0.2", 0),
                                                  (2, "0.6,0.4", 37)])
def test_prompt_logprobs_over_real_ranks_equal_one_process_scores(tmp_path, p, partition, chunk):
    """Every rank scores its own part (in chunks too, where a chunk's last position scores the next chunk's first
    token); the prefix cache holding the prompt is passed over; the tokens are the unscored run's."""
    run = {"model": "tiny-llama", "context_len": 96, "partition": partition, "max_new_tokens": 4, "threads": 1}
    scenario = {"name": "prompt_logprobs", "run": run, "degree": str(p), "chunk_tokens": chunk}
    procs, out = _start_ranks(scenario, tmp_path, p)
    outputs = wait_all(procs, 200)
    assert [q.returncode for q in procs] == [0] * p, "\n".join(outputs)
    r = json.loads(Path(f"{out}.{p - 1}").read_text())
    assert r["degree"] == p and r["cached_tokens"] == 0 and r["chunks"] == (3 if chunk else 0)
    assert r["scored"] == r["prompt"][1:] and r["later"] == [None] * 3
    assert r["tokens"] == r["plain_tokens"]
    assert r["chosen_diff"] <= 1e-4 and r["top_diff"] <= 1e-4, r
    assert r["top_ids"] == r["ref_top_ids"]


def _wait_ready(ready: Path, procs, what: str) -> None:
    deadline = time.monotonic() + 120
    while not ready.exists():
        assert time.monotonic() < deadline and all(q.poll() is None for q in procs), what
        time.sleep(0.1)


def _kill_worker_and_wait(tmp_path: Path, scenario: dict, timeout_s: float, settle_s: float = 0.0
                          ) -> tuple[dict, float]:
    """Start the scenario on 2 ranks, kill the worker once the front writes ``scenario["ready"]`` (and
    ``settle_s`` later); the front's JSON and when the worker was killed. The front must exit unhealthy (3)."""
    procs, out = _start_ranks(scenario, tmp_path)
    try:
        _wait_ready(Path(scenario["ready"]), procs, "never got ready")
        time.sleep(settle_s)
        killed_at = time.monotonic()
        os.kill(procs[0].pid, signal.SIGKILL)
        outputs = wait_all(procs[1:], timeout_s + 30)
    finally:
        for q in procs:
            if q.poll() is None:
                q.kill()
                q.wait(10)
    assert procs[1].returncode == 3, outputs
    return json.loads(Path(f"{out}.1").read_text()), killed_at


@pytest.mark.timeout(180)
def test_a_killed_worker_ends_every_request_with_an_error_within_the_timeout(tmp_path):
    timeout_s = 5.0
    scenario = {"name": "serve", "ready": str(tmp_path / "ready"),
                "run": {"model": "tiny-llama", "threads": 1, "timeout_s": timeout_s, "partition": "even"}}
    front, killed_at = _kill_worker_and_wait(tmp_path, scenario, timeout_s, settle_s=0.5)
    assert front["healthy"] is False
    assert [front[f"r{i}"]["finish_reason"] for i in range(3)] == ["error"] * 3, front
    assert front["done_s"] - killed_at < timeout_s + 10


@pytest.mark.timeout(180)
def test_a_worker_whose_front_died_exits_non_zero_within_the_timeout(tmp_path):
    timeout_s = 4.0
    ready = tmp_path / "ready"
    scenario = {"name": "idle", "ready": str(ready), "run": {"model": "tiny-llama", "threads": 1,
                                                           "timeout_s": timeout_s}}
    procs, _ = _start_ranks(scenario, tmp_path)
    try:
        _wait_ready(ready, procs, "the front never started")
        time.sleep(timeout_s + 2)  # idle longer than --timeout: the pings keep the worker waiting
        assert procs[0].poll() is None, "the worker left an idle but live front"
        killed_at = time.monotonic()
        os.kill(procs[1].pid, signal.SIGKILL)
        outputs = wait_all(procs[:1], timeout_s + 30)
        assert procs[0].returncode not in (0, None), outputs
        assert time.monotonic() - killed_at < timeout_s + 10
    finally:
        for q in procs:
            if q.poll() is None:
                q.kill()
                q.wait(10)


@pytest.mark.timeout(240)
def test_a_placement_that_raises_fails_or_moves_that_request_alone_while_another_decodes_on_real_ranks(tmp_path):
    """Over the chain of 2 real ranks: a prompt whose partition raises runs on the front alone ("moved", the same
    greedy tokens as over the chain), one whose every placement raises fails by itself with a 500 naming why
    ("doomed"), the request decoding beside them streams to its end, and the engine goes on over the chain."""
    long, bad = list(range(20, 80)), list(range(100, 123))
    run = {"model": "tiny-llama", "threads": 1}
    front = ranks_ran({"name": "contained", "run": run, "long": long, "bad": bad, "max_tokens": 6}, tmp_path)[1]
    assert front["went_on"] is True
    streaming, doomed, moved, after = (front[k] for k in ("streaming", "doomed", "moved", "after"))
    assert streaming["finish_reason"] == "length" and streaming["error"] is None and len(streaming["tokens"]) == 24
    assert streaming["tokens"][:6] == front["ref"]["long"]
    assert doomed["finish_reason"] == "error" and not doomed["bad_input"] and doomed["tokens"] == []
    assert "could not plan" in doomed["error"] and "nor can the front alone" in doomed["error"]
    assert moved["error"] is None and moved["tokens"] == front["ref"]["bad"] and moved["degree"] == 1
    assert "the placement failed" in moved["degree_source"] and "cannot serve" in moved["degree_source"]
    assert after["error"] is None and after["degree"] == 2 and after["tokens"] == front["ref"]["long"]
