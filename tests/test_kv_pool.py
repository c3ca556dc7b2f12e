"""The front's K,V pool and the engine held to it (serve/kv_pool.py): blocks counted once however many holders share
them, prompts admitted where their blocks are free, the prefix cache's entries evicted before any request, the
request that arrived last preempted and run again with a stream that neither repeats nor changes a token, a request
that could never fit refused by name, and the pool's size and use exported under vLLM's names."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch

from kvrunahead.config import RunConfig
from kvrunahead.errors import InputError
from kvrunahead.model.layout import KVLayout
from kvrunahead.model.paged import PagedKV
from kvrunahead.ranks.launcher import World
from kvrunahead.serve.config import EngineConfig
from kvrunahead.serve.engine import Engine
from kvrunahead.serve.kv_pool import GIB, KVPool, OutOfBlocks, budget_bytes, env_gib, pool_for, token_bytes
from kvrunahead.serve.prefix_cache import PrefixCache
from kvrunahead.serve.sequence import Finished, Request, SamplingParams, TokenEvent

TINY_TOKEN_BYTES = 2 * 4 * 2 * 16 * 4  # tiny-llama in float32: K and V, 4 layers, 2 K,V heads of 16


def test_blocks_are_taken_as_positions_grow_and_none_is_taken_when_too_few_are_free():
    pool = KVPool(num_blocks=4, block_bytes=1, block_tokens=16)
    pool.hold("a", 17)
    assert pool.used_blocks == 2 and pool.needs("a", 32) == 0 and pool.needs("a", 33) == 1
    pool.hold("a", 32)
    assert pool.used_blocks == 2
    with pytest.raises(OutOfBlocks):
        pool.hold("b", 48)
    assert pool.free_blocks == 2 and "b" not in pool.tables  # nothing taken
    assert pool.release("a") == 2 and pool.free_blocks == 4 and pool.usage == 0


def test_a_fork_shares_its_source_s_blocks_which_stay_held_until_the_last_holder_lets_go():
    pool = KVPool(num_blocks=8, block_bytes=1, block_tokens=16)
    pool.hold("entry", 40)  # 3 blocks, the last partly full
    pool.share("fork1", "entry", 40)
    pool.share("fork2", "entry", 40)
    assert pool.used_blocks == 3  # counted once
    pool.hold("fork1", 41)  # its own token: a block of its own after the shared ones
    pool.hold("fork2", 40 + 16)
    assert pool.used_blocks == 5 and pool.needs("fork2", 40 + 17) == 1
    assert pool.release("entry") == 0  # both forks still read it
    assert pool.release("fork1") == 1
    assert pool.release("fork2") == 4 and pool.free_blocks == 8


def test_the_budget_comes_from_the_flag_then_vllm_s_variable_then_the_memory_free(monkeypatch):
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    assert budget_bytes(1.5) == (int(1.5 * GIB), "--kv-cache-memory 1.5")
    assert budget_bytes(None, free_bytes=10 * GIB)[0] == 4 * GIB
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "2")
    assert budget_bytes(None, free_bytes=10 * GIB) == (2 * GIB, "VLLM_CPU_KVCACHE_SPACE=2")
    assert budget_bytes(0.5)[0] == GIB // 2  # the flag first
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "lots")
    with pytest.raises(ValueError, match="VLLM_CPU_KVCACHE_SPACE must be a number of GiB"):
        env_gib()


def test_a_pool_that_cannot_hold_the_longest_request_is_refused_naming_the_size_it_needs():
    config = SimpleNamespace(num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, hidden_size=64)
    assert token_bytes(config, 4) == TINY_TOKEN_BYTES and token_bytes(config, 2, tp=2) == TINY_TOKEN_BYTES // 4
    pool, _ = pool_for(256 * TINY_TOKEN_BYTES / GIB, config, 4, 1, 256)
    assert pool.tokens == 256
    with pytest.raises(ValueError, match="cannot hold one request of the longest context, 257 tokens"):
        pool_for(256 * TINY_TOKEN_BYTES / GIB, config, 4, 1, 257)


def _fake_cache(n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return SimpleNamespace(layers=[SimpleNamespace(keys=torch.randn(1, 1, n, 2, generator=g),
                                                   values=torch.randn(1, 1, n, 2, generator=g))])


def _blocks(num_blocks: int) -> PagedKV:
    return PagedKV(KVLayout(heads=(1,), head_dim=(2,), dtype=torch.float32), num_blocks, torch.float32)


def test_the_prefix_cache_keeps_entries_in_the_pool_and_gives_them_up_oldest_first():
    kv = _blocks(10)
    pool = kv.pool
    cache = PrefixCache(max_tokens=10_000, min_match=64)
    cache.kv = kv
    cache.put([1] * 64, _fake_cache(64))  # 4 blocks, a copy written (no request holds it)
    cache.put([2] * 64, _fake_cache(64))  # 4 more
    assert pool.used_blocks == 8 and cache.tokens == 128 and cache.bytes == 8 * pool.block_bytes
    cache.put([3] * 64, _fake_cache(64, seed=3))  # 2 free: the oldest entry makes room
    assert cache.entry([1] * 64) is None and cache.entry([3] * 64) is not None and pool.used_blocks == 8
    assert torch.equal(cache.layers(cache.entry([3] * 64), 50)[0][0], _fake_cache(64, seed=3).layers[0].keys[:, :, :50])
    pool.hold("request", 32)  # a request takes the last 2
    cache.put([4] * 200, _fake_cache(200))  # 13 blocks: more than the pool has for entries, not kept
    assert cache.entry([4] * 200) is None
    assert cache.evict_oldest(skip={cache.entry([2] * 64).owner})  # the unpinned one goes
    assert cache.entry([3] * 64) is None and cache.entry([2] * 64) is not None
    assert not cache.evict_oldest(skip={cache.entry([2] * 64).owner})
    assert pool.used_blocks == 6


def test_an_entry_is_the_blocks_of_the_request_that_prefilled_it_by_reference_counted_once():
    kv = _blocks(12)
    cache = PrefixCache(max_tokens=10_000, min_match=64)
    cache.kv = kv
    prompt = _fake_cache(70, seed=1)
    kv.add("r", [(layer.keys, layer.values) for layer in prompt.layers])  # 5 blocks, the last partly full
    for _ in range(20):  # the request decodes on, into its last block and a block after it
        kv.grow("r")
    assert kv.pool.used_blocks == 6
    cache.put([7] * 70, prompt, owner="r")
    entry = cache.entry([7] * 70)
    assert kv.pool.used_blocks == 6 and kv.pool.tables[entry.owner].blocks == kv.pool.tables["r"].blocks[:5]
    assert torch.equal(cache.layers(entry, 70)[0][1], prompt.layers[0].values)  # its 70, not the request's 90
    kv.release("r")  # the request ends: the block of its own tokens alone goes
    assert kv.pool.used_blocks == 5
    kv.share("choice", entry.owner)  # a choice the cache answers: the entry's blocks, its own token after them
    kv.grow("choice")
    assert kv.pool.used_blocks == 6 and kv.length("choice") == 71
    cache.evict_oldest(skip=())
    assert kv.pool.used_blocks == 6  # the choice still reads them
    kv.release("choice")
    assert kv.pool.used_blocks == 0


PROMPTS = [list(range(30, 70)), list(range(100, 117)), list(range(5, 90))]


def _engine(positions: int, prefix_cache_tokens: int = 0, record: bool = False) -> Engine:
    run = RunConfig(model="tiny-llama", threads=1, dtype="float32")
    config = EngineConfig(run=run, max_queue=8, max_model_len=positions, prefix_cache_tokens=prefix_cache_tokens,
                          kv_cache_memory_gib=positions * TINY_TOKEN_BYTES / GIB)
    return Engine(config, World(0, 1, 0, 1, "single"), record=record)


def test_requests_beyond_the_pool_are_preempted_and_their_streams_go_on_exactly_without_a_repeated_token():
    engine = _engine(192, record=True)  # 12 blocks: the three requests' 80 + 57 + 125 positions do not fit together
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    alone = {}
    for i, ids in enumerate(PROMPTS):
        events, _ = engine.run_one(Request(f"alone{i}", ids, params))
        alone[i] = [e.token_id for e in events if isinstance(e, TokenEvent)]
    assert engine.kv.pool.used_blocks == 0
    for i, ids in enumerate(PROMPTS):
        engine.add(Request(f"r{i}", ids, params))
    events, most = [], 0
    for _ in range(2000):
        events += engine.step()
        most = max(most, engine.kv.pool.used_blocks)
        if sum(isinstance(e, Finished) for e in events) == 3:
            break
    assert engine.kv.preemptions >= 1 and most <= engine.kv.pool.num_blocks
    for i in range(3):
        sent = [e.token_id for e in events if isinstance(e, TokenEvent) and e.request_id == f"r{i}"]
        assert sent == alone[i], i  # each token sent once, the same tokens as alone
    assert all(e.finish_reason == "length" for e in events if isinstance(e, Finished))
    assert engine.kv.pool.used_blocks == 0 and not engine.kv.pool.tables
    # a request preempted ran again in one prefill over its prompt and the tokens it had sent (vLLM's recompute)
    prefills = [(rid, n) for record in engine.prefills for rid, n in zip(record.request_ids, record.lengths)
                if rid.startswith("r")]
    again = [(rid, n - len(PROMPTS[int(rid[1:])])) for rid, n in prefills if n > len(PROMPTS[int(rid[1:])])]
    assert again and all(0 < sent < 40 for _, sent in again), prefills
    assert len(prefills) == 3 + len(again)


def test_a_prompt_waits_for_its_blocks_rather_than_overtaking_or_failing():
    engine = _engine(128)
    engine.add(Request("long", list(range(3, 100)), SamplingParams(max_tokens=20, ignore_eos=True)))
    engine.step()  # its prefill: 97 of 128 positions
    engine.add(Request("next", list(range(5, 60)), SamplingParams(max_tokens=2)))
    events = engine.step()  # no room for 55 more: it waits while the first decodes
    assert any(s.request_id == "next" for s in engine.scheduler.waiting)
    for _ in range(100):
        events += engine.step()
        if sum(isinstance(e, Finished) for e in events) == 2:
            break
    finished = {e.request_id: e for e in events if isinstance(e, Finished)}
    assert finished["long"].finish_reason == "length" and finished["next"].finish_reason == "length"


def test_the_prefix_cache_gives_its_blocks_up_before_any_request_is_preempted():
    engine = _engine(320, prefix_cache_tokens=10_000)  # 20 blocks
    engine.run_one(Request("cached", list(range(1, 120)), SamplingParams(max_tokens=1)))
    assert engine.kv.pool.used_blocks == 8 and engine.placement.prefixes.tokens == 119  # the entry stays, held
    engine.add(Request("big", list(range(2, 202)), SamplingParams(max_tokens=30, ignore_eos=True)))  # 15 blocks
    events = []
    for _ in range(100):
        events += engine.step()
        if any(isinstance(e, Finished) for e in events):
            break
    prefixes = engine.placement.prefixes
    assert engine.kv.preemptions == 0 and prefixes.entry(list(range(1, 120))) is None
    # the big prompt's own entry is its blocks by reference: kept, at no block of its own
    assert prefixes.tokens == 200 and engine.kv.pool.used_blocks == 13
    assert [e.finish_reason for e in events if isinstance(e, Finished)] == ["length"]


def test_a_request_that_could_never_fit_is_refused_naming_both_numbers():
    engine = _engine(128)
    with pytest.raises(ValueError, match=r"may hold 140 positions .*its 100 prompt tokens and max_tokens 40.*holds "
                                         r"128"):
        engine.add(Request("huge", list(range(1, 101)), SamplingParams(max_tokens=40)))
    with pytest.raises(ValueError, match=r"2 questions with max_tokens 30 each"):
        engine.add(Request("ask", list(range(1, 50)), SamplingParams(max_tokens=30), questions=[[5] * 10, [6] * 10]))


def test_an_engine_whose_pool_cannot_hold_its_longest_request_does_not_start():
    run = RunConfig(model="tiny-llama", threads=1, dtype="float32")
    with pytest.raises(InputError, match="cannot hold one request of the longest context"):
        Engine(EngineConfig(run=run, max_model_len=512, kv_cache_memory_gib=256 * TINY_TOKEN_BYTES / GIB),
               World(0, 1, 0, 1, "single"))


def test_the_metrics_show_the_pool_and_its_preemptions_under_vllm_s_names():
    from kvrunahead.serve.http.metrics import Metrics

    pool = KVPool(num_blocks=10, block_bytes=1)
    pool.hold("a", 40)
    kv = SimpleNamespace(pool=pool, preemptions=3, request_blocks=lambda: 3)
    metrics = Metrics("m")
    metrics.track(lambda: 0, lambda: 0, kv=kv)
    text = metrics.render()[0].decode()
    assert 'vllm:kv_cache_usage_perc{model_name="m"} 0.3' in text
    assert 'vllm:num_preemptions_total{model_name="m"} 3.0' in text
    assert 'kvr_kv_cache_blocks{state="total"} 10.0' in text and 'kvr_kv_cache_blocks{state="free"} 7.0' in text
    assert 'kvr_kv_cache_blocks{state="requests"} 3.0' in text


def test_the_choices_of_a_cached_prompt_share_its_blocks_and_each_holds_only_its_own_tokens():
    engine = _engine(320, prefix_cache_tokens=10_000)
    prompt = list(range(1, 120))  # 8 blocks
    first, _ = engine.run_one(Request("first", prompt, SamplingParams(max_tokens=20, ignore_eos=True)))
    want = [e.token_id for e in first if isinstance(e, TokenEvent)]
    assert engine.kv.pool.used_blocks == 8  # the entry alone
    for i in range(3):
        engine.add(Request(f"choice{i}", prompt, SamplingParams(max_tokens=20, ignore_eos=True)))
    events = engine.step()  # the prefix cache answers all three: no prefill
    assert engine.kv.pool.used_blocks == 8
    events += engine.step()  # their second tokens: one block of its own each
    assert engine.kv.pool.used_blocks == 8 + 3
    for _ in range(40):
        events += engine.step()
    for i in range(3):
        assert [e.token_id for e in events if isinstance(e, TokenEvent) and e.request_id == f"choice{i}"] == want
    assert engine.kv.pool.used_blocks == 8


def test_kvr_serve_says_its_pool_preempts_under_load_and_every_stream_equals_its_greedy_text_alone():
    import re

    import httpx

    from tests.test_serve_cli import _api, serving

    positions = 600  # 37 blocks of tiny-llama's float32 K,V: the four requests' 4 x 200 positions do not fit at once
    gib = f"{positions * TINY_TOKEN_BYTES / GIB:.9f}"
    prompts = [f"Request {i}: tell me about the number {i * 7}." for i in range(4)]  # < 64 tokens: not cached
    with serving("--kv-cache-memory", gib, "--max-model-len", "512", "--dtype", "float32") as server:
        url = server.url()
        assert any(f"K,V cache: 0.000565 GiB of K,V: 37 blocks of 16 positions (592 positions) (--kv-cache-memory "
                   f"{float(gib):g})" in line for line in server.lines), "".join(server.lines)
        api = _api(url)
        ask = {"model": "tiny-llama", "max_tokens": 150, "temperature": 0, "extra_body": {"ignore_eos": True}}
        alone = [api.completions.create(prompt=p, **ask).choices[0].text for p in prompts]
        streamed: dict[int, list[str]] = {}

        def stream(i: int) -> None:
            streamed[i] = [c.choices[0].text for c in api.completions.create(prompt=prompts[i], stream=True, **ask)]

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        assert ["".join(streamed[i]) for i in range(4)] == alone
        metrics = httpx.get(f"{url}/metrics", timeout=10).text
        preempted = float(re.search(r'^vllm:num_preemptions_total\{model_name="tiny-llama"\} (\S+)$', metrics,
                                    re.M).group(1))
        assert preempted >= 1, metrics
        # no block held: the prompts are too short for the prefix cache, and a request that ran again keeps no entry
        # of the tokens it recomputed
        assert re.search(r'^vllm:kv_cache_usage_perc\{model_name="tiny-llama"\} 0\.0$', metrics, re.M), metrics
        assert 'kvr_kv_cache_blocks{state="total"} 37.0' in metrics


@pytest.mark.parametrize(("args", "says"), [
    (("--kv-cache-memory", "0"), "--kv-cache-memory must be a positive number of GiB, got 0.0"),
    (("--kv-cache-memory", "0.0001", "--max-model-len", "512", "--dtype", "float32"),
     "cannot hold one request of the longest context, 512 tokens: give --kv-cache-memory at least 0.000488 (GiB)"),
])
def test_a_pool_too_small_or_not_positive_is_one_line_and_exit_2(args, says):
    import subprocess
    import sys

    from tests.test_serve_cli import ENV, ROOT

    r = subprocess.run([sys.executable, "-m", "kvrunahead.cli.serve", "--model", "tiny-llama", *args],
                       capture_output=True, text=True, timeout=120, env=ENV, cwd=ROOT)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and says in r.stderr, r.stderr


def test_a_prompt_without_blocks_holds_back_new_prompts_but_not_a_chunked_prefill_that_holds_its_own():
    from kvrunahead.serve.scheduler import Scheduler
    from kvrunahead.serve.sequence import Sequence

    class Refusing:  # a pool with no room for a prompt not yet admitted
        def admit(self, seq, answered):
            return seq.prefilled > 0

        def release(self, seq):
            pass

    scheduler = Scheduler(max_queue=8)
    scheduler.kv = Refusing()
    new = Sequence(Request("new", [1] * 10, arrival_s=1.0))
    later = Sequence(Request("later", [1] * 10, arrival_s=3.0))
    chunked = Sequence(Request("chunked", [1] * 100, arrival_s=2.0), prefilled=50, chunked=True)
    scheduler.add(new)
    scheduler.add(later)
    scheduler.resume(chunked)
    assert scheduler.schedule().prefills == [chunked]  # first in line has no blocks; the chunk goes on
    assert scheduler.schedule() is None  # nothing else may overtake the first in line
    assert new.passed_over == 1 and later.passed_over == 1  # passed over by the chunk, not by an idle step


def test_the_default_budget_reads_the_room_left_in_the_process_s_cgroups_v1_and_v2(tmp_path):
    from kvrunahead.serve.kv_pool import cgroup_room

    proc = tmp_path / "cgroup"
    proc.write_text("4:memory:/box/inner\n3:cpu:/box\n0::/unified-box\n")
    v1 = tmp_path / "memory/box"
    (v1 / "inner").mkdir(parents=True)
    (v1 / "memory.limit_in_bytes").write_text(str(6 * GIB))
    (v1 / "memory.usage_in_bytes").write_text(str(2 * GIB))
    (v1 / "inner/memory.limit_in_bytes").write_text(str(2 ** 63 - 4096))  # v1's no limit
    (v1 / "inner/memory.usage_in_bytes").write_text("5")
    (tmp_path / "cgroup.controllers").write_text("memory\n")
    (tmp_path / "unified-box").mkdir()
    (tmp_path / "unified-box/memory.max").write_text(f"{3 * GIB}\n")
    (tmp_path / "unified-box/memory.current").write_text(f"{GIB}\n")
    (tmp_path / "memory.max").write_text("max\n")
    assert sorted(cgroup_room(str(proc), str(tmp_path))) == [2 * GIB, 4 * GIB]
    assert cgroup_room(str(tmp_path / "missing"), str(tmp_path)) == []


def test_while_a_worker_is_lost_only_the_prompts_the_prefix_cache_answers_whole_are_taken():
    from kvrunahead.serve.scheduler import Scheduler
    from kvrunahead.serve.sequence import Sequence

    scheduler = Scheduler(max_queue=8, answered=lambda seq: seq.request_id.startswith("cached"))
    for name in ("new", "cached0", "cached1"):
        scheduler.add(Sequence(Request(name, [1] * 10)))
    scheduler.hold_prefills = True
    assert [s.request_id for s in scheduler.schedule().prefills] == ["cached0", "cached1"]  # no rank computes them
    assert scheduler.schedule() is None and [s.request_id for s in scheduler.waiting] == ["new"]
