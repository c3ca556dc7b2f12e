"""Mixed steps (serve/step/rows.py, serve/executor.run_step): decode rows share a prompt's or a chunk's step, and on the
front its forward. Every request's greedy output equals transformers' on its prompt alone, whatever ran beside it,
on real ranks: p = 1-3, chunks over the chain and on the front alone, KV-parallel rows on every rank, a
sliding-window model (its rows in the decoder's own forward within the step)."""

import json
import pickle
from pathlib import Path

import pytest
import torch

from kvrunahead.model.forward import last_token_logits
from kvrunahead.model.layout import probe_kv_layout
from kvrunahead.model.paged import PagedKV
from kvrunahead.modes.kvr import ChainLink
from kvrunahead.ranks.setup import loaded_model
from kvrunahead.ranks.transport import LocalTransport
from kvrunahead.serve.scheduler import Scheduler
from kvrunahead.serve.sequence import Request, SamplingParams, Sequence
from kvrunahead.serve.step import executor
from kvrunahead.serve.step.plans import (
    FRONT,
    NOWHERE,
    RANKS,
    SHARDED,
    Alone,
    Chain,
    DecodeRow,
    KvParallel,
    Packed,
    Peer,
    Pipeline,
    ShardedRow,
    StepPlan,
    over,
)
from kvrunahead.serve.step.rows import Row, mixed_forward
from tests.helpers import wait_all
from tests.test_serve_engine import _start_ranks

SHORTS = [list(range(7, 20)), list(range(40, 49)), list(range(90, 121))]
LONGS = [list(range(3, 60)) + list(range(60, 120))]


def _run(tmp_path, p: int, **scenario) -> dict:
    scenario = {"name": "mixed", "run": {"model": "tiny-llama", "threads": 1}, "degree": str(p), "max_tokens": 24,
                "shorts": SHORTS, "longs": LONGS, **scenario}
    procs, out = _start_ranks(scenario, tmp_path, p)
    outputs = wait_all(procs, 240)
    assert [q.returncode for q in procs] == [0] * p, "\n".join(outputs)
    r = json.loads(Path(f"{out}.{p - 1}").read_text())
    assert r["tokens"] == r["reference"]
    for rank in range(p):
        left = json.loads(Path(f"{out}.{rank}").read_text())
        assert left["partial_left"] == 0 and left["shards_left"] == 0, rank
    return r


@pytest.mark.timeout(300)
@pytest.mark.parametrize("p,chunk", [(1, 9), (2, 1), (2, 16), (3, 11)])
def test_decodes_beside_a_chunked_prompt_answer_as_alone(tmp_path, p, chunk):
    """The short requests decode in every step of the long prompt's chunks, in the front's forward of each chunk
    (a chunk of one token included)."""
    r = _run(tmp_path, p, chunk_tokens=chunk)
    chunks = -(-len(LONGS[0]) // chunk)  # the short ones decode 24 tokens: some of the long one's chunks run alone
    assert r["mixed_steps"] >= min(chunks - 1, 10)
    assert r["shared_forwards"] >= min(chunks - 1, 10) and r["shared_rows"] >= r["shared_forwards"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("p", [2, 3])
def test_decodes_beside_a_whole_prompt_over_the_chain_answer_as_alone(tmp_path, p):
    r = _run(tmp_path, p)
    assert r["shared_forwards"] >= 1 and r["mixed_steps"] >= 1


@pytest.mark.timeout(300)
def test_separate_steps_answer_the_same_without_sharing_a_forward(tmp_path):
    r = _run(tmp_path, 2, chunk_tokens=16, mixed_steps=False)
    assert r["shared_forwards"] == 0 and r["mixed_steps"] == 0


@pytest.mark.timeout(300)
def test_kv_parallel_rows_run_on_every_rank_beside_a_chunk(tmp_path):
    """The short requests decode KV-cache parallel (their rows on every rank's shard) while the long prompt's
    chunks run over the chain in the same steps."""
    r = _run(tmp_path, 2, run={"model": "tiny-llama", "threads": 1, "decode": "kvp"}, chunk_tokens=40)
    assert all(r["decode"][f"short{i}"] == "kvp" for i in range(len(SHORTS)))
    assert r["mixed_steps"] >= 2


@pytest.mark.timeout(300)
@pytest.mark.parametrize("p", [1, 2])
def test_a_sliding_window_models_decodes_beside_a_prompt_answer_as_alone(tmp_path, p):
    """Gemma 3's hybrid layers: the rows run in the decoder's own forward within the step (no shared forward)."""
    r = _run(tmp_path, p, run={"model": "tiny-gemma3", "threads": 1},
             longs=[list(range(3, 200)) + list(range(3, 60))])
    assert r["shared_forwards"] == 0 and r["mixed_steps"] >= 1


def test_rows_in_a_prompts_forward_get_the_logits_they_get_alone():
    lm = loaded_model("tiny-llama", torch.float32, torch.device("cpu"), 0)
    model, layout = lm.model, probe_kv_layout(lm.model)

    def alone(ids, cache=None, position=0):
        from transformers import DynamicCache
        cache = cache if cache is not None else DynamicCache(config=model.config)
        pos = torch.arange(position, position + len(ids)).unsqueeze(0)
        return last_token_logits(model, torch.tensor([ids]), position_ids=pos, cache=cache), cache

    rows, expected = [], []
    pool = PagedKV(layout, 64, torch.float32)
    for i, ids in enumerate(SHORTS):
        logits, cache = alone(ids)
        token = int(logits.argmax())
        pool.add(f"r{i}", [(layer.keys, layer.values) for layer in cache.layers])
        expected.append(alone([token], cache, len(ids))[0])
        rows.append(Row(token, len(ids), f"r{i}", pool))
    prompt = LONGS[0]
    first, row_logits, cache = mixed_forward(model, prompt, ChainLink(LocalTransport(), 0, layout,
                                                                      torch.device("cpu")), rows, emit=True)
    assert torch.allclose(first, alone(prompt)[0], atol=1e-5)
    for got, want in zip(row_logits, expected):
        assert torch.allclose(got, want, atol=1e-5)
    assert all(pool.length(row.request_id) == len(ids) + 1 for row, ids in zip(rows, SHORTS))
    assert cache.layers[0].keys.shape[-2] == len(prompt)


def test_a_shared_contexts_questions_ride_on_its_segment_and_stay_on_the_front():
    context = Chain("c", tuple(range(10)), cuts=(0, 6, 10), questions=((1, 2), (3,)))
    plan = StepPlan((context,))
    assert plan.workers_plan.segments[0].questions == () and plan.prompt.questions == ((1, 2), (3,))
    with pytest.raises(ValueError, match="questions follow a prompt kept whole on the front"):
        Chain("c", tuple(range(10)), cuts=(0, 6, 10), keep=SHARDED, questions=((1,),))
    with pytest.raises(ValueError, match="at least one token"):
        Alone("c", (1, 2), questions=((),))


def test_a_step_is_one_prompt_or_chunk_with_decode_rows_and_tells_the_workers_only_what_they_run():
    chunk = over((20, 25, 30))("long", tuple(range(10)), 20, held=RANKS, keep=RANKS, cuts=(20, 25, 30))
    row = DecodeRow("a", (5,), 7)
    kvp = ShardedRow("b", (6,), 9)
    plan = StepPlan((row, kvp, chunk))
    assert type(chunk) is Chain and plan.way is Chain and (row.held, row.keep, kvp.held) == (FRONT, FRONT, SHARDED)
    assert plan.prompt is chunk and plan.rows == (row,) and plan.sharded == (kvp,)
    assert plan.needs_workers and plan.workers_plan.segments == (kvp, chunk)
    assert chunk.part(0, 2) == (20, 25) and chunk.part(1, 2) == (25, 30)
    alone = over((0, 0, 3))("x", (1, 2, 3), cuts=(0, 0, 3))
    assert type(alone) is Alone and alone.part(0, 2) == (0, 0) and alone.part(1, 2) == (0, 3)
    assert not StepPlan((row, alone)).needs_workers  # a whole prompt on the front: the workers are not told
    assert StepPlan((row,)).way is None and not StepPlan((row,)).needs_workers
    after_cache = Alone("x", (1,), 3, held=FRONT, cuts=(3, 3, 4))
    assert StepPlan((after_cache,)).way is Alone and not StepPlan((after_cache,)).needs_workers
    # a chunk alone on the front after every rank held the positions before it: the workers catch up
    assert StepPlan((Alone("y", (1,), 3, held=RANKS, keep=RANKS),)).needs_workers
    with pytest.raises(ValueError, match="one prompt or chunk, or several prompts packed"):
        StepPlan((chunk, alone))
    with pytest.raises(ValueError, match="packed prompts \\(way packed\\)"):
        StepPlan((chunk, alone), packed=(0, 5, 13))
    packed = StepPlan((row, Packed("p", (1, 2, 3)), Packed("q", (4, 5))), packed=(0, 3, 5))
    assert packed.prompt is None and [s.request_id for s in packed.prompts] == ["p", "q"]
    assert packed.packed_step.lengths == (3, 2) and packed.needs_workers and packed.way is Packed
    assert packed.workers_plan.packed == (0, 3, 5) and packed.workers_plan.rows == ()
    assert not StepPlan(packed.segments, packed=(0, 0, 5)).needs_workers  # packed on the front alone
    with pytest.raises(ValueError, match="packed prompts \\(way packed\\)"):
        StepPlan((Packed("p", (1, 2, 3)),))
    with pytest.raises(ValueError, match="exactly when"):
        Alone("x", (1,), 0, held=FRONT)
    with pytest.raises(ValueError, match="one token"):
        DecodeRow("x", (1, 2), 4)
    assert NOWHERE == Alone("x", (1,)).held


def test_a_segment_says_how_it_runs_and_carries_only_that_ways_fields():
    """One class per way, each with its own fields: a field of another way is no argument at all, and each way
    names where it may be held and kept."""
    with pytest.raises(ValueError, match="cut at its cuts"):
        Chain("x", (1, 2))  # the chain without its cuts
    with pytest.raises(ValueError, match="every part but the last empty"):
        Alone("x", (1, 2), cuts=(0, 1, 2))  # alone, yet cut
    with pytest.raises(ValueError, match="from its start to its end"):
        Chain("x", (1, 2), cuts=(0, 1, 3))  # cuts past its end
    with pytest.raises(TypeError, match="stages"):
        Chain("x", (1, 2), cuts=(0, 1, 2), stages=(0, 10, 30))
    with pytest.raises(TypeError, match="owner"):
        KvParallel("x", (1, 2), keep=SHARDED)
    with pytest.raises(ValueError, match="chain is held 'nowhere' .* and kept 'nowhere'"):
        Chain("x", (1, 2), cuts=(0, 1, 2), keep=NOWHERE)
    with pytest.raises(TypeError, match="score"):
        Pipeline("x", (1, 2), stages=(0, 10, 30), score=1)
    with pytest.raises(ValueError, match="only ring attention keeps nothing"):
        Peer("x", (1, 2), peer="tsp", cuts=(0, 1, 2), keep=NOWHERE)
    with pytest.raises(ValueError, match="one of tsp, ring, cp-allgather"):
        Peer("x", (1, 2), peer="sideways", cuts=(0, 1, 2))
    with pytest.raises(ValueError, match="kv-parallel is held 'nowhere' .* kept 'front'"):
        KvParallel("x", (1, 2), owner=0)
    with pytest.raises(ValueError, match="scored segment holds nothing on the front"):
        Chain("x", (1,), 3, held=FRONT, cuts=(3, 3, 4), score=1)
    assert Peer("x", (1, 2), peer="ring", cuts=(0, 1, 2), keep=NOWHERE).part(1, 2) == (1, 2)
    assert Pipeline("x", (1, 2), stages=(0, 10, 30)).part(0, 2) == (0, 2)
    assert Chain("x", (1, 2), cuts=(0, 1, 2), score=3, follows=9).targets(0, 2) == [2, 9]
    ways = set(executor.WAYS)
    assert ways == {Alone, Chain, Peer, Pipeline, KvParallel, Packed}  # every prompt way runs, keyed by its class
    plan = StepPlan((DecodeRow("a", (5,), 7), Chain("c", (1, 2), cuts=(0, 1, 2))))
    assert pickle.loads(pickle.dumps(plan)) == plan  # plans travel pickled


def test_mixed_steps_carry_every_running_request_beside_the_next_prefill():
    def seq(rid, n):
        return Sequence(Request(rid, list(range(n)), SamplingParams(max_tokens=4)))

    mixed, separate = Scheduler(8), Scheduler(8, mixed=False)
    for scheduler in (mixed, separate):
        running = seq("r", 5)
        scheduler.start_decoding(running)
        scheduler.add(seq("w", 9))
    step = mixed.schedule(0.0)
    assert [s.request_id for s in step.decodes] == ["r"] and len(step.prefills) == 1
    first, second = separate.schedule(0.0), separate.schedule(0.0)
    assert (first.decodes, second.prefills) == ([], []) or (not first.prefills) != (not second.prefills)
    assert not first.decodes or not first.prefills


def test_prefill_first_holds_the_decodes_until_no_prefill_waits():
    def seq(rid, n):
        return Sequence(Request(rid, list(range(n)), SamplingParams(max_tokens=4)))

    batch = Scheduler(8, prefill_first=True)
    batch.start_decoding(seq("r", 5))
    batch.add(seq("w", 9))
    batch.add(seq("v", 3))
    steps = [batch.schedule(0.0) for _ in range(3)]
    assert [(bool(s.decodes), bool(s.prefills)) for s in steps] == [(False, True), (False, True), (True, False)]


def test_rows_share_a_forward_only_where_the_model_takes_the_segment_attention():
    """A model whose forward the probe finds computing attention itself keeps its decode rows in the decoder's own
    forward. (Falcon was one until transformers 5.25 moved its attention onto the interface; the probe's verdict is
    set here on tiny-llama's model for the time of the check.)"""
    from kvrunahead.serve.step.rows import can_mix

    model = loaded_model("tiny-llama", torch.float32, torch.device("cpu"), 0).model
    assert can_mix(model)
    model._kvrunahead_uses_interface = False  # what the probe records for a forward that calls no interface
    try:
        assert not can_mix(model)
    finally:
        model._kvrunahead_uses_interface = True


def test_a_request_forked_from_the_prefix_cache_decodes_as_its_own_copy_would_and_shares_its_blocks():
    """``n`` choices of a prompt: the prefix cache's entry is read, never written; its K,V go into the pool's blocks
    once for every fork, which hold them by reference, each choice's tokens in blocks of its own after them; alone
    and riding a prompt's forward, their logits are those of a request decoding on a copy of its own."""
    from transformers import DynamicCache

    from kvrunahead.serve.prefix_cache import PrefixCache
    from kvrunahead.serve.step.batch_decode import BatchDecoder

    model = loaded_model("tiny-llama", torch.float32, torch.device("cpu"), 0).model
    layout = probe_kv_layout(model)
    ids = LONGS[0]
    cache = DynamicCache(config=model.config)
    prefixes = PrefixCache(10_000)
    prefixes.put(ids, cache, last_token_logits(model, torch.tensor([ids]), cache=cache))
    entry = prefixes.whole(ids)
    shared = prefixes.cache_of(entry, len(ids), model.config)
    assert shared.layers[0].keys.data_ptr() == entry.kv[0][0].data_ptr()  # a view of the entry, not a copy
    decoder = BatchDecoder(model, batched=True, layout=layout)
    decoder.add("copy", prefixes.cache_of(entry, len(ids), model.config))
    for rid in ("fork-1", "fork-2"):
        decoder.add(rid, prefixes.cache_of(entry, len(ids), model.config), fork=True)
    before = [kv.clone() for kv in entry.kv[0]]
    tokens = {"copy": 5, "fork-1": 5, "fork-2": 9}
    for step in range(4):
        logits = decoder.step(tokens, {rid: len(ids) + step for rid in tokens})
        assert torch.allclose(logits["copy"], logits["fork-1"], atol=1e-5)
        assert not torch.allclose(logits["fork-1"], logits["fork-2"], atol=1e-3)  # its own token, its own tokens
        tokens = {rid: int(row.argmax()) for rid, row in logits.items()}
    pool, prompt_blocks = decoder.kv.pool, -(-len(ids) // 16)
    one, two = pool.tables["fork-1"], pool.tables["fork-2"]
    assert one.blocks[:prompt_blocks] == two.blocks[:prompt_blocks] and one.shared_tokens == len(ids)
    assert set(one.blocks[prompt_blocks:]).isdisjoint(two.blocks) and len(one.blocks) == prompt_blocks + 1
    # the copy's blocks, the prompt's once, and one each for the forks' own four tokens
    assert pool.used_blocks == len(pool.tables["copy"].blocks) + prompt_blocks + 2
    assert decoder.kv.length("fork-1") == len(ids) + 4 and all(torch.equal(a, b) for a, b in zip(before, entry.kv[0]))
    # riding a prompt's forward: the forked rows attend the shared prompt the same way
    rows = decoder.riders([DecodeRow(rid, (tokens[rid],), len(ids) + 4) for rid in ("copy", "fork-1")])
    link = ChainLink(LocalTransport(), 0, layout, torch.device("cpu"))
    _, row_logits, _ = mixed_forward(model, SHORTS[0], link, list(rows.values()), emit=True)
    assert torch.allclose(row_logits[0], row_logits[1], atol=1e-5)


def test_the_other_choices_of_a_prompt_start_in_one_step_forked_and_decode_as_the_first():
    """The prompt's later requests (``n``'s other choices) need no prefill: the prefix cache answers every one of
    them in the same step; each forks the prompt's K,V kept there, and greedy they give the first choice's
    tokens."""
    from kvrunahead.config import RunConfig
    from kvrunahead.ranks.launcher import World
    from kvrunahead.serve.config import EngineConfig
    from kvrunahead.serve.engine import Engine
    from kvrunahead.serve.sequence import TokenEvent

    engine = Engine(EngineConfig(run=RunConfig(model="tiny-llama", threads=1)), World(0, 1, 0, 1, "single"))
    tokens: dict[str, list[int]] = {}

    def step() -> set[str]:
        got = [e for e in engine.step() if isinstance(e, TokenEvent)]
        for e in got:
            tokens.setdefault(e.request_id, []).append(e.token_id)
        return {e.request_id for e in got}

    engine.add(Request("c0", LONGS[0], SamplingParams(max_tokens=6)))
    assert step() == {"c0"}
    for j in (1, 2, 3):
        engine.add(Request(f"c{j}", LONGS[0], SamplingParams(max_tokens=6)))
    assert step() == {"c0", "c1", "c2", "c3"}  # the three answered together, beside c0's next token
    decoder = engine.decoder.by_variant[None]
    # the other choices decode forked from the one entry (the first on the cache its prefill left): its blocks
    tables = [decoder.kv.pool.tables[f"c{j}"] for j in (1, 2, 3)]
    shared = -(-len(LONGS[0]) // 16)
    assert all(t.shared_tokens == len(LONGS[0]) and t.blocks[:shared] == tables[0].blocks[:shared] for t in tables)
    while engine.has_work():
        step()
    assert tokens["c1"] == tokens["c2"] == tokens["c3"] == tokens["c0"] and len(tokens["c0"]) == 6
