"""The KVP decode (decode/kvp.py): every rank keeps its own part of the chain's cache and the partial attention
outputs are merged per layer; greedy tokens and logits must be the single process's, for full and sliding-window
models, parts shorter than the window and windows that leave a rank's part behind while decoding."""

import json
import queue
import threading
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import DynamicCache

from kvrunahead.decode.kvp import ShardCache, ShardLayer, level_shards, merge_parts, shard_attention, shard_cache
from kvrunahead.model.layout import KVLayout
from kvrunahead.ranks.transport import Transport
from tests.helpers import kvr_prefill, skewed_ratios, world_runs
from tests.test_serve_engine import _start_ranks, ranks_ran, wait_all

CONTEXT = 200
WINDOW = 64  # the tiny presets' window
NEW_TOKENS = 40  # the owner's window moves past every other rank's part
MODELS = ["tiny-llama", "tiny-gemma3", "tiny-mistral"]


def partitions(p: int) -> dict[str, str]:
    if p == 1:
        return {"one": "even"}
    tail = [0] + [CONTEXT - p + 1 + i for i in range(p - 1)] + [CONTEXT]  # the last ranks hold one token each
    short = [30 * i for i in range(p)] + [CONTEXT]  # parts of 30 < 64, then a long last part
    return {
        "skewed": ",".join(f"{x:.4f}" for x in skewed_ratios(p)),
        "one-token-tail": ",".join(map(str, tail)),
        "short-parts": ",".join(map(str, short)),
    }


def _cases(p: int) -> list[dict]:
    return [{"name": f"{model}/{name}",
             "config": dict(model=model, context_len=CONTEXT, dtype="float32", device="cpu", partition=spec,
                            max_new_tokens=NEW_TOKENS, decode="kvp", verify=True, threads=1, atol=1e-4, chat=False)}
            for model in MODELS for name, spec in partitions(p).items()]


@pytest.fixture(scope="module")
def worlds(tmp_path_factory):
    return world_runs(_cases, tmp_path_factory, "kvp-p")


@pytest.mark.parametrize("p", [1, 2, 3, 4])
@pytest.mark.parametrize("model", MODELS)
def test_kvp_decode_gives_the_single_process_tokens(worlds, p, model):
    results = worlds(p)
    for name in partitions(p):
        r = results[f"{model}/{name}"]
        v = r["verification"]
        assert len(r["boundaries"]) == p + 1
        assert v["max_abs_logit_diff"] <= 1e-4 and v["first_token_match"], v
        assert v["generated_match"] and len(r["generated_tokens"]) >= 2, (r["generated_tokens"], v)


def _reference(q, k, v, q_pos, window):
    """SDPA of queries at ``q_pos`` over all keys (positions 0..), causal, within ``window``."""
    k_pos = torch.arange(k.shape[2])[None, :]
    visible = k_pos <= q_pos[:, None]
    if window is not None:
        visible &= k_pos > q_pos[:, None] - window
    heads = q.shape[1]
    return F.scaled_dot_product_attention(q, k.repeat_interleave(heads // k.shape[1], 1),
                                          v.repeat_interleave(heads // v.shape[1], 1), attn_mask=visible)


@pytest.mark.parametrize("window", [None, 5, 16])
@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("cuts", [(0, 10, 20), (0, 1, 2), (0, 19, 20), (0, 3, 7, 20)])
def test_shard_attentions_merged_equal_attention_over_every_key(window, n, cuts):
    g = torch.Generator().manual_seed(sum(cuts) + n)
    total = cuts[-1] + n  # the prompt, then n new tokens (on the owner)
    q = torch.randn(2, 6, n, 8, generator=g)
    k, v = torch.randn(2, 2, total, 8, generator=g), torch.randn(2, 2, total, 8, generator=g)
    parts = []
    for r, (a, b) in enumerate(zip(cuts, cuts[1:])):
        owner = r == len(cuts) - 2
        end = total if owner else b
        out, lse = shard_attention(q, k[:, :, a:end], v[:, :, a:end], a, cuts[-1], owner, window, None)
        parts.append(torch.cat((out, lse.unsqueeze(-1)), dim=-1))
    merged = merge_parts(torch.stack(parts))
    ref = _reference(q, k, v, torch.arange(cuts[-1], total), window)
    assert torch.allclose(merged, ref, atol=1e-5)


def test_a_rank_whose_keys_all_left_the_window_adds_nothing():
    q, k, v = torch.randn(1, 2, 1, 4), torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4)
    out, lse = shard_attention(q, k, v, 0, 50, False, 8, None)  # keys at 0-2, the query at 50, window 8
    assert torch.isneginf(lse).all() and not out.abs().any()
    empty = shard_attention(q, k[:, :, :0], v[:, :, :0], 0, 50, False, None, None)
    assert torch.isneginf(empty[1]).all()


def test_a_shard_keeps_its_own_part_only_and_the_windows_reach():
    layout = KVLayout(heads=(2, 2), head_dim=(4, 4), dtype=torch.float32, windows=(None, 8))
    cache = DynamicCache()
    full = torch.arange(30.0).view(1, 1, 30, 1).expand(1, 2, 30, 4)  # the chain's [0, 30) on the rank of [20, 30)
    cache.update(full, full, 0)
    cache.update(full[:, :, -7:], full[:, :, -7:], 1)  # a sliding layer keeps its last window - 1
    shards = shard_cache(cache, layout, (20, 30), 40, owner=False)
    assert shards.layers[0].start == 20 and shards.layers[0].keys[0, 0, :, 0].tolist() == list(range(20, 30))
    # a token at 40 or later sees positions > 40 - 8: none of [20, 30) on the sliding layer
    assert shards.layers[1].keys.shape[-2] == 0 and shards.layers[1].start == 30
    assert shards.layers[0].keys.untyped_storage().data_ptr() != full.untyped_storage().data_ptr()  # a copy
    owner = shard_cache(cache, layout, (20, 30), 30, owner=True)
    assert owner.layers[1].start == 23 and owner.layers[1].keys.shape[-2] == 7


def test_the_owner_trims_its_sliding_window_as_it_decodes():
    layer = ShardLayer(torch.zeros(1, 1, 7, 2), torch.zeros(1, 1, 7, 2), 23, True, 8, cache=None)
    for step in range(5):
        keys, _ = layer.update(torch.ones(1, 1, 1, 2), torch.ones(1, 1, 1, 2))
        assert keys.shape[-2] == 8  # the new token's window: itself and the 7 before it
        assert layer.start == 23 + step  # positions [23 + step, 31 + step): the token at 30 + step and 7 before


class _Pipes(Transport):
    """Ranks as threads of this process: a send is a copy into the receiver's queue for that (source, tag)."""

    name = "pipes"

    def __init__(self, rank: int, world_size: int, queues: dict) -> None:
        super().__init__(rank, world_size, timeout_s=10)
        self.queues = queues

    def _isend(self, t, dst, tag):
        self.queues[(self.rank, dst, tag)].put(t.clone())
        return _Posted(lambda: None)

    def _irecv(self, t, src, tag):
        return _Posted(lambda: t.copy_(self.queues[(src, self.rank, tag)].get(timeout=10)))


class _Posted:
    def __init__(self, then):
        self.then = then

    def wait(self, timeout=None):
        self.then()
        return True


def _positions(a: int, b: int) -> torch.Tensor:
    return torch.arange(float(a), float(b)).view(1, 1, b - a, 1).expand(1, 2, b - a, 3).contiguous()


@pytest.mark.parametrize("bounds", [(0, 80, 100), (0, 20, 100), (0, 10, 100, 105, 120), (0, 1, 2, 3, 120),
                                    (0, 117, 118, 119, 120), (0, 40, 80, 120)])
def test_levelled_shards_hold_an_even_share_of_the_positions_and_sliding_layers_keep_their_windows(bounds):
    """Moves both ways along the chain (a part longer and one shorter than its even share), several hops."""
    p, n = len(bounds) - 1, bounds[-1]
    queues = {(a, b, t): queue.Queue() for a in range(p) for b in range(p) for t in range(3)}
    caches, results = [], [None] * p
    for r in range(p):
        cache = ShardCache(None, n)
        for window in (None, 8, None):  # layer 1 slides: only the last rank holds what a new token can reach
            a, b = (bounds[r], bounds[r + 1]) if window is None else (max(bounds[r], n - 7), bounds[r + 1])
            a = min(a, b)
            k = _positions(a, b)
            cache.layers.append(ShardLayer(k, -k, a, r == p - 1, window, cache))
        caches.append(cache)

    def run(r):
        results[r] = level_shards(caches[r], bounds, _Pipes(r, p, queues))

    threads = [threading.Thread(target=run, args=(r,)) for r in range(p)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    even = tuple(round(r * n / p) for r in range(p + 1))
    assert results == [even] * p
    for r, cache in enumerate(caches):
        for i in (0, 2):
            layer = cache.layers[i]
            assert layer.start == even[r] and layer.keys[0, 0, :, 0].tolist() == list(range(even[r], even[r + 1]))
            assert torch.equal(layer.values, -layer.keys)
        slid = cache.layers[1]
        lo = min(max(bounds[r], n - 7), bounds[r + 1])
        assert slid.start == lo and slid.keys.shape[-2] == bounds[r + 1] - lo  # untouched
    assert all(q.empty() for q in queues.values())


@pytest.mark.parametrize("args, message", [
    (["--mode", "tsp", "--nproc", "2"], "--decode kvp decodes on the K,V that kvr leaves"),
    (["--model", "tiny-falcon"], "--decode kvp cannot run tiny-falcon"),
])
def test_kvp_refuses_what_it_cannot_run_in_one_line(args, message):
    r = kvr_prefill("--ctx", "64", "--decode", "kvp", "--model", "tiny-llama", *args)
    assert r.returncode == 2, r.stderr
    assert message in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


@pytest.mark.timeout(300)
@pytest.mark.parametrize("model", ["tiny-llama", "tiny-gemma3"])
def test_kvr_prefill_decodes_kvp_through_the_engine_as_one_process(model):
    r = kvr_prefill("--nproc", "2", "--model", model, "--ctx", "200", "--no-chat", "--partition", "0,150,200",
                    "--decode", "kvp", "--max-new-tokens", str(NEW_TOKENS), "--verify", "--atol", "1e-4",
                    "--threads", "1", "--json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["decode"] == "kvp" and d["verification"]["generated_match"], d["verification"]


@pytest.mark.timeout(300)
def test_the_engine_decodes_kvp_requests_together_and_frees_their_shards(tmp_path):
    prompts = [list(range(3, 150)), list(range(40, 130)), list(range(7, 180))]
    scenario = {"name": "kvp", "run": {"model": "tiny-gemma3", "threads": 1, "decode": "kvp"}, "degree": "2",
                "prompts": prompts, "max_tokens": 24}
    procs, out = _start_ranks(scenario, tmp_path)
    outputs = wait_all(procs, 280)
    assert [q.returncode for q in procs] == [0, 0], "\n".join(outputs)
    front, worker = (json.loads(Path(f"{out}.{r}").read_text()) for r in (1, 0))
    assert front["decode"] == ["kvp"] * len(prompts)
    for alone, ref in zip(front["alone"], front["reference"]):
        assert alone == ref[: len(alone)] and len(alone) >= 2
    assert front["together"][:-1] == front["alone"][:-1]
    assert front["finish_reasons"][-1] == "cancelled"
    assert front["together"][-1] == front["alone"][-1][: len(front["together"][-1])]
    assert front["shards_left_front"] == 0 and worker["shards_left"] == 0


@pytest.mark.timeout(300)
@pytest.mark.parametrize("p,chunk", [(2, 13), (2, 1), (3, 7), (3, 20)])
def test_kv_parallel_prefill_chunks_answer_as_the_one_shot_prefill_with_no_rank_holding_the_whole_prompt(
        tmp_path, p, chunk):
    """Medha's KVP for prefill chunks (--decode kvp with chunked prefill): each chunk runs on every rank against its
    own shard of the positions before it, the partial attention merged by log-sum-exp, its K,V kept by one rank
    (rank 0 first, the next once it holds its share). The first-token logits and greedy tokens are those of the
    prompt whole in one process, whether a chunk is one token or crosses a share's edge; the
    shards end even and together hold each position once; a short request decodes between the chunks."""
    prompts = [list(range(3, 60)), [5] + list(range(100, 140))]
    scenario = {"name": "chunked", "run": {"model": "tiny-llama", "threads": 1, "decode": "kvp"}, "degree": str(p),
                "chunk_tokens": chunk, "max_tokens": 6, "prompts": prompts, "short": list(range(7, 20))}
    ranks = ranks_ran(scenario, tmp_path, p)
    r = ranks[-1]
    assert r["tokens"] == r["ref_tokens"]
    assert max(r["max_abs_logit_diff"]) <= 1e-4
    assert r["decodes"] == ["kvp", "kvp"] and all("KV-parallel" in s for s in r["sources"]), r
    for i, ids in enumerate(prompts):
        held = [x["shard_positions"][f"long{i}"] for x in ranks]
        decoded = 6 - 1  # the front's shard grew by the decode's tokens (the last one is not fed back)
        assert sum(held) == len(ids) + decoded and max(held) < len(ids), held
        if chunk < len(ids) // p:  # the shares fill in rank order: each rank at most a chunk over its share
            assert max(h for h in held[:-1]) <= -(-len(ids) // p) + chunk, held
    assert all(x["partial_left"] == 0 for x in ranks)
