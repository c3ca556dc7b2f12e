"""Decode caches that grow in place (kvrunahead/model/growing.py): the same positions as a concatenation per token,
across the buffer's regrowths, the K,V they were given left untouched, and the same greedy tokens and logits."""

import inspect

import pytest
import torch
from transformers import DynamicCache

from kvrunahead.model.forward import greedy_decode, last_token_logits, with_cache
from kvrunahead.model.growing import MIN_ROOM, GrowingKV, GrowingLayer, grow_in_place
from kvrunahead.model.load import load_model

CPU = torch.device("cpu")


def kv(tokens: int, batch: int = 1, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 2, tokens, 4, generator=gen), torch.randn(batch, 2, tokens, 4, generator=gen)


@pytest.mark.parametrize("drop_every", [None, 3])
def test_appends_hold_what_a_concatenation_holds_across_regrowths(drop_every):
    keys, values = kv(10)
    given = keys.clone()
    held = GrowingKV(keys, values)
    want_k, want_v = keys, values
    for i in range(3 * MIN_ROOM):
        k, v = kv(1 + i % 4, seed=i + 1)
        got_k, got_v = held.append(k, v)
        want_k, want_v = torch.cat((want_k, k), dim=-2), torch.cat((want_v, v), dim=-2)
        if drop_every and i % drop_every == 0:  # a sliding window moving on
            held.drop_front(2)
            want_k, want_v = want_k[..., 2:, :], want_v[..., 2:, :]
            got_k, got_v = held.keys, held.values
        assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)
    assert torch.equal(keys, given)
    assert held.capacity_bytes < 2 * (want_k.nbytes + want_v.nbytes)  # room for an eighth more, or MIN_ROOM


def test_a_view_handed_out_is_never_written_into():
    held = GrowingKV(*kv(5))
    first, _ = held.append(*kv(1, seed=1))
    snapshot = first.clone()
    held.truncate(3)  # a crop: later appends write over rows past the third
    for i in range(2 * MIN_ROOM):
        held.append(*kv(1, seed=i + 2))
    assert torch.equal(first[..., :3, :], snapshot[..., :3, :])
    assert held.keys.shape[-2] == 3 + 2 * MIN_ROOM


def test_left_padded_rows_keep_each_request_right_aligned_and_the_pads_zero():
    rows = [kv(3, seed=1), kv(7, seed=2), kv(1, seed=3)]
    held = GrowingKV.left_padded(rows)
    assert held.keys.shape == (3, 2, 7, 4)
    for b, (k, v) in enumerate(rows):
        n = k.shape[-2]
        assert torch.equal(held.keys[b:b + 1, :, 7 - n:], k) and torch.equal(held.values[b:b + 1, :, 7 - n:], v)
        assert not held.keys[b, :, :7 - n].any() and not held.values[b, :, :7 - n].any()


def test_the_layer_adopts_what_transformers_put_in_its_place_and_crops():
    keys, values = kv(6, batch=3)
    layer = GrowingLayer(GrowingKV(keys, values))
    layer.batch_select_indices(torch.tensor([0, 2]))  # transformers reassigns keys/values
    k, v = kv(1, batch=2, seed=5)
    got_k, _ = layer.update(k, v)
    assert torch.equal(got_k, torch.cat((keys[[0, 2]], k), dim=-2))
    layer.crop(-3)
    got_k, got_v = layer.update(k, v)
    assert torch.equal(got_k, torch.cat((keys[[0, 2], :, :4], k), dim=-2))
    assert layer.get_seq_length() == 5 and got_v.shape == got_k.shape


def plain_decode(model, first: int, cache: DynamicCache, position: int, new_tokens: int):
    """transformers' own concatenating cache: the reference tokens and each step's logits."""
    tokens, steps = [first], []
    while len(tokens) < new_tokens:
        logits = last_token_logits(model, torch.tensor([[tokens[-1]]]), position_ids=torch.tensor([[position]]),
                                   cache=cache)
        position += 1
        steps.append(logits)
        tokens.append(int(logits.argmax()))
    return tokens, cache


@pytest.mark.parametrize("model_name", ["tiny-llama", "tiny-gemma3"])
def test_greedy_decode_grown_in_place_equals_the_concatenating_cache(model_name):
    """Long enough to regrow the buffers (prompt 40 + 2 x MIN_ROOM tokens); Gemma 3 keeps its sliding layers."""
    torch.set_num_threads(1)
    model = load_model(model_name, torch.float32, CPU, seed=0).model
    ids = torch.randint(0, 200, (1, 40), generator=torch.Generator().manual_seed(3))
    caches, firsts = [], []
    for _ in range(2):
        cache = DynamicCache(config=model.config)
        firsts.append(int(last_token_logits(model, ids, cache=cache).argmax()))
        caches.append(cache)
    full = next(i for i, layer in enumerate(caches[1].layers) if not layer.is_sliding)
    prefill_keys = caches[1].layers[full].keys.clone()
    want, want_cache = plain_decode(model, firsts[0], caches[0], 40, 2 * MIN_ROOM)
    got = greedy_decode(model, firsts[1], caches[1], 40, 2 * MIN_ROOM, set())
    assert got == want
    assert any(isinstance(layer, GrowingLayer) for layer in caches[1].layers)
    for mine, theirs in zip(caches[1].layers, want_cache.layers):
        assert torch.equal(mine.keys, theirs.keys) and torch.equal(mine.values, theirs.values)
    assert torch.equal(caches[1].layers[full].keys[..., :40, :], prefill_keys)


def test_grow_in_place_leaves_sliding_layers_to_transformers():
    model = load_model("tiny-gemma3", torch.float32, CPU, seed=0).model
    cache = DynamicCache(config=model.config)
    last_token_logits(model, torch.tensor([[1, 2, 3]]), cache=cache)
    grow_in_place(cache)
    kinds = {type(layer).__name__ for layer in cache.layers}
    assert "GrowingLayer" in kinds and len(kinds) == 2


def test_the_chains_filled_layers_grow_in_place_and_kvp_shards_keep_their_own_decode():
    from kvrunahead.decode.kvp import ShardCache, ShardLayer
    from kvrunahead.modes.kvr import RunaheadLayer

    chain = DynamicCache()
    layer = RunaheadLayer(0, link=None)
    layer.keys, layer.values = kv(9)
    layer.is_initialized = True
    chain.layers = [layer]
    grow_in_place(chain)
    assert isinstance(chain.layers[0], GrowingLayer) and torch.equal(chain.layers[0].keys, layer.keys)
    shards = ShardCache(None, 9)
    shards.layers.append(ShardLayer(*kv(9), start=0, owner=True, window=None, cache=shards))
    grow_in_place(shards)
    assert type(shards.layers[0]) is ShardLayer


def test_a_stacked_kv_grows_chunk_by_chunk_and_keeps_what_it_handed_out():
    parts = [torch.randn(2, 1, 3, n, 4) for n in (5, 1, 7, 2, 9)]
    held = GrowingKV.stacked(parts[0].clone())
    before = held.kv
    for k in range(1, len(parts)):
        got = held.extend(*parts[k:k + 1])
        assert torch.equal(got, torch.cat(parts[:k + 1], dim=-2))
    assert torch.equal(before, parts[0])  # a view handed out earlier still reads what it held
    assert held.n == sum(p.shape[-2] for p in parts) and held.extend().shape[-2] == held.n


def test_the_cache_goes_under_the_keyword_the_forward_takes():
    model = load_model("tiny-llama", torch.float32, CPU, seed=0).model

    class Older(torch.nn.Module):  # a transformers release before the rename
        def forward(self, input_ids, past_key_values=None, use_cache=None):
            return past_key_values

    cache = DynamicCache(config=model.config)
    taken = "cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values"
    assert with_cache(model, cache) == {taken: cache} and with_cache(model.base_model, cache) == {taken: cache}
    assert Older()(torch.zeros(1), **with_cache(Older(), cache)) is cache
