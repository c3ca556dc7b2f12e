"""A Llama's and a Gemma 3's decode rows over their weights (model/direct_rows.py) against the same rows through
the model's forward (serve/step/rows.mixed_forward): the same logits, step after step,
rows joining at unequal lengths."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from kvrunahead import kernels
from kvrunahead.model import direct_rows
from kvrunahead.model.forward import last_token_logits
from kvrunahead.model.layout import probe_kv_layout
from kvrunahead.model.paged import PagedKV
from kvrunahead.model.reference import default_atol
from kvrunahead.ranks.setup import loaded_model
from kvrunahead.serve.step.batch_decode import BatchDecoder

needs_kernel = pytest.mark.skipif(not kernels.build(), reason="the CPU attention kernel is not built here")


@pytest.fixture(autouse=True)
def our_kernel(monkeypatch):
    """Our attention kernel in both dtypes, whichever ``auto`` would choose on this CPU (the path under test)."""
    monkeypatch.setenv(kernels.ENV, "ours")


def _decoders(model, dtype, lengths):
    """Two decoders holding the same prompts: one decoding over the weights, one through the forward."""
    layout = probe_kv_layout(model)
    pair = []
    for direct in (True, False):
        d = BatchDecoder(model, batched=True, layout=layout, kv=PagedKV(layout, 64, dtype))
        d.direct = direct and d.direct
        pair.append(d)
    g = torch.Generator().manual_seed(7)
    for i, n in enumerate(lengths):
        ids = torch.randint(0, model.config.vocab_size, (1, n), generator=g)
        for d in pair:
            cache = DynamicCache(config=model.config)
            last_token_logits(model, ids, cache=cache)
            d.add(f"r{i}", cache)
    return pair


@needs_kernel
@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gemma3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_over_the_weights_give_the_forwards_logits_step_after_step(name, dtype):
    model = loaded_model(name, dtype, torch.device("cpu"), 0).model
    lengths = [5, 70, 17]  # tiny-gemma3's sliding layers see 64 tokens: the second row decodes past its window
    direct, forward = _decoders(model, dtype, lengths)
    assert direct.direct and not forward.direct
    positions = {f"r{i}": n for i, n in enumerate(lengths)}
    tokens = {rid: 3 + i for i, rid in enumerate(positions)}
    for step in range(6):
        if step == 3:
            positions.pop("r1"), tokens.pop("r1")  # a row leaves; the others go on at their own lengths
        got, want = direct.step(tokens, positions), forward.step(tokens, positions)
        for rid in tokens:  # bfloat16 runs transformers' very ops; float32's norm is one fused torch.rms_norm
            if dtype == torch.float32:
                assert (got[rid] - want[rid]).abs().max() <= default_atol(dtype, want[rid])
                assert int(got[rid].argmax()) == int(want[rid].argmax())
            else:
                assert torch.equal(got[rid], want[rid])
        tokens = {rid: int(want[rid].argmax()) for rid in tokens}
        positions = {rid: p + 1 for rid, p in positions.items()}
    for rid in positions:
        assert direct.kv.length(rid) == forward.kv.length(rid) == positions[rid]


@needs_kernel
def test_a_row_whose_position_is_not_its_length_is_refused():
    model = loaded_model("tiny-llama", torch.float32, torch.device("cpu"), 0).model
    direct, _ = _decoders(model, torch.float32, [9])
    with pytest.raises(RuntimeError, match="its next position is 12 but its K,V hold 9"):
        direct.step({"r0": 3}, {"r0": 12})


@needs_kernel
def test_only_an_unhooked_llama_decodes_over_its_weights():
    llama = loaded_model("tiny-llama", torch.float32, torch.device("cpu"), 0).model
    assert direct_rows.takes(llama, torch.float32)
    handle = llama.model.layers[0].self_attn.o_proj.register_forward_hook(lambda *a: None)  # as a TP all-reduce
    try:
        assert not direct_rows.takes(llama, torch.float32)
    finally:
        handle.remove()
    assert direct_rows.takes(llama, torch.float32)
    assert direct_rows.takes(loaded_model("tiny-gemma3", torch.float32, torch.device("cpu"), 0).model, torch.float32)
    for other in ("tiny-mistral", "tiny-neox"):
        assert not direct_rows.takes(loaded_model(other, torch.float32, torch.device("cpu"), 0).model, torch.float32)
