"""A rank's K,V in blocks (model/paged.py): positions land in their blocks' slots, a shared prompt is written once and
held by reference, the kernel reads the blocks in place exactly as torch's attention reads them gathered, and the
decoder keeps a request's K,V there and nowhere else."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import DynamicCache

from kvrunahead.kernels import attention as kernel
from kvrunahead.model.forward import last_token_logits
from kvrunahead.model.layout import KVLayout, probe_kv_layout
from kvrunahead.model.paged import PagedKV
from kvrunahead.modes.kvr import split_block
from kvrunahead.ranks.setup import loaded_model
from kvrunahead.serve.step.batch_decode import BatchDecoder

LAYOUT = KVLayout(heads=(2, 2), head_dim=(16, 16), dtype=torch.float32)


def _kv(tokens: int, layout: KVLayout = LAYOUT, dtype=torch.float32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(1, h, tokens, d, generator=g, dtype=torch.float32).to(dtype),
             torch.randn(1, h, tokens, d, generator=g, dtype=torch.float32).to(dtype))
            for h, d in zip(layout.heads, layout.head_dim)]


def _append(pool: PagedKV, owner: str, kv, seed: int) -> None:
    """One position more for ``owner`` in every layer, its K,V appended to ``kv`` too (the reference)."""
    slot = torch.tensor([pool.grow(owner)])
    new = _kv(1, seed=seed)
    for layer, (k, v) in enumerate(new):
        pool.write(layer, slot, k, v)
        kv[layer] = (torch.cat((kv[layer][0], k), dim=2), torch.cat((kv[layer][1], v), dim=2))


def test_positions_go_into_their_blocks_slots_in_runs_and_read_back_as_written():
    pool = PagedKV(LAYOUT, 16, torch.float32)
    a, b = _kv(20, seed=1), _kv(5, seed=2)
    pool.add("a", a)
    pool.add("b", b)
    assert pool.runs["a"] == [[0, 20, 0]] and pool.pool.tables["a"].blocks == [0, 1]  # two blocks, one run
    for step in range(30):  # a and b grow in turn: a's next blocks are no longer next to its last
        _append(pool, "a", a, 10 + step)
        _append(pool, "b", b, 100 + step)
    assert len(pool.runs["a"]) > 1 and pool.length("a") == 50
    for owner, kv in (("a", a), ("b", b)):
        for layer in range(2):
            keys, values = pool.gather(owner, layer)
            assert torch.equal(keys, kv[layer][0]) and torch.equal(values, kv[layer][1])
    pool.truncate("a", 33)  # a failed forward's positions cut back: the next goes into the same slot
    assert pool.length("a") == 33 and sum(hi - lo for lo, hi, _ in pool.runs["a"]) == 33
    slot = pool.grow("a")
    assert slot == pool.slots("a")[33] and pool.length("a") == 34
    pool.release("a")
    pool.release("b")
    assert pool.pool.used_blocks == 0 and not pool.lengths


def test_freed_blocks_are_taken_again_first_and_in_runs():
    pool = PagedKV(LAYOUT, 16, torch.float32)
    pool.add("a", _kv(40))
    pool.add("b", _kv(8))
    blocks = list(pool.pool.tables["a"].blocks)
    pool.release("a")
    pool.add("c", _kv(40))  # the memory a touched, in its order: one run again
    assert pool.pool.tables["c"].blocks == blocks and pool.runs["c"] == [[blocks[0] * 16, blocks[0] * 16 + 40, 0]]


def test_a_shared_prompt_is_written_once_and_held_by_reference_until_its_last_fork_goes():
    pool = PagedKV(LAYOUT, 16, torch.float32)
    prompt = _kv(40)
    before = [k.clone() for k, _ in prompt]
    pool.fork("f1", prompt)
    pool.fork("f2", prompt)
    assert pool.pool.used_blocks == 3  # the prompt's 3 blocks, once
    one, two = pool.pool.tables["f1"], pool.pool.tables["f2"]
    assert one.blocks == two.blocks and one.shared_tokens == 40
    f1, f2 = [list(x) for x in prompt], [list(x) for x in prompt]
    _append(pool, "f1", f1, 1)
    _append(pool, "f2", f2, 2)
    assert pool.pool.used_blocks == 5  # one block each for their own tokens: nothing copied on write
    assert pool.length("f1") == 41 and pool.runs["f1"][0] == pool.runs["f2"][0]
    for owner, kv in (("f1", f1), ("f2", f2)):
        keys, _ = pool.gather(owner, 1)
        assert torch.equal(keys, kv[1][0])
    assert all(torch.equal(k, b) for (k, _), b in zip(prompt, before))  # the source is read, never written
    pool.release("f1")
    assert pool.pool.used_blocks == 4  # f1's own block; the prompt stays for f2
    pool.release("f2")
    assert pool.pool.used_blocks == 0 and not pool.lengths


def test_a_sliding_layer_keeps_its_window_and_the_slots_before_it_are_never_read():
    layout = KVLayout(heads=(2, 2), head_dim=(16, 16), dtype=torch.float32, windows=(None, 8))
    full, window = _kv(30, layout, seed=3), _kv(7, layout, seed=4)
    pool = PagedKV(layout, 8, torch.float32)
    pool.add("a", [full[0], window[1]], tokens=30)
    assert pool.length("a") == 30
    keys, _ = pool.gather("a", 1, last=7)
    assert torch.equal(keys, window[1][0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 24])
def test_the_kernel_reads_the_blocks_in_place_as_torch_reads_them_gathered(dtype, window):
    if not kernel.usable(torch.zeros(1, dtype=dtype)):
        pytest.skip("our kernel is not the one chosen for this dtype here")
    layout = KVLayout(heads=(2,), head_dim=(64,), dtype=dtype)
    pool = PagedKV(layout, 64, dtype)
    lengths = {"a": 100, "b": 17, "c": 300}
    for i, (owner, n) in enumerate(lengths.items()):
        pool.add(owner, _kv(n, layout, dtype, seed=i))
    for step in range(20):  # interleaved growth: each row's keys in several runs of blocks
        for owner in lengths:
            slot = torch.tensor([pool.grow(owner)])
            k, v = _kv(1, layout, dtype, seed=1000 + step)[0]
            pool.write(0, slot, k, v)
    owners = list(lengths)
    q = torch.randn(1, 4, len(owners), 64).to(dtype)  # 4 query heads on 2 K,V heads
    scale = 1 / math.sqrt(64)
    got, _ = kernel.varlen(q, [], causal=True, window=window, scale=scale, out_float=False,
                           paged=(*pool.kernel_views(0), *pool.tables(owners)))
    for j, owner in enumerate(owners):
        keys, values = pool.gather(owner, 0)
        want = split_block(q[:, :, j:j + 1].float(), keys.float(), values.float(), scale, window=window)
        assert torch.allclose(got[:, j:j + 1].float(), want, atol=2e-2 if dtype == torch.bfloat16 else 1e-5)


def test_the_decoder_keeps_a_requests_k_v_in_its_pool_alone_and_frees_every_block():
    model = loaded_model("tiny-llama", torch.float32, torch.device("cpu"), 0).model
    layout = probe_kv_layout(model)
    decoder = BatchDecoder(model, batched=True, layout=layout, kv=PagedKV(layout, 32, torch.float32))
    expected, tokens, positions = {}, {}, {}
    for i, n in enumerate((9, 33, 70)):
        ids = list(range(5 + i, 5 + i + n))
        cache = DynamicCache(config=model.config)
        logits = last_token_logits(model, torch.tensor([ids]), cache=cache)
        alone = DynamicCache(config=model.config)
        last_token_logits(model, torch.tensor([ids]), cache=alone)
        token = int(logits.argmax())
        expected[f"r{i}"] = last_token_logits(model, torch.tensor([[token]]), cache=alone,
                                              position_ids=torch.tensor([[n]]))
        decoder.add(f"r{i}", cache)
        tokens[f"r{i}"], positions[f"r{i}"] = token, n
    assert all(v is decoder.kv for v in decoder.own.values())  # where each request's K,V are: the pool
    got = decoder.step(tokens, positions)
    for rid, want in expected.items():
        assert torch.allclose(got[rid], want, atol=1e-5)
    assert [decoder.kv.length(r) for r in tokens] == [10, 34, 71]
    for rid in tokens:
        decoder.remove(rid)
    assert decoder.kv.pool.used_blocks == 0 and not decoder.own


@pytest.mark.parametrize("batched", [True, False])
def test_an_unpaged_decode_starts_from_a_holders_blocks_gathered(batched):
    """A decode that cannot read blocks (no layout: the padded batch, or one request per forward) and a prompt the
    pool holds (a prefix cache entry, by name): its K,V are gathered out of the blocks, and it decodes as the prompt
    alone does."""
    model = loaded_model("tiny-llama", torch.float32, torch.device("cpu"), 0).model
    layout = probe_kv_layout(model)
    pool = PagedKV(layout, 32, torch.float32)
    decoder = BatchDecoder(model, batched=batched, layout=None, kv=pool)
    assert not decoder.paged and decoder.blocks is pool
    ids = torch.tensor([list(range(5, 40))])
    cache, alone = DynamicCache(config=model.config), DynamicCache(config=model.config)
    token = int(last_token_logits(model, ids, cache=cache).argmax())
    last_token_logits(model, ids, cache=alone)
    pool.add("entry", [(layer.keys, layer.values) for layer in cache.layers])
    decoder.add("r", None, fork="entry")
    got = decoder.step({"r": token}, {"r": 35})["r"]
    want = last_token_logits(model, torch.tensor([[token]]), cache=alone, position_ids=torch.tensor([[35]]))
    assert torch.allclose(got, want, atol=1e-5)
    assert pool.length("entry") == 35  # the entry's blocks read, not written
