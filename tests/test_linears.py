"""The CPU linears on oneDNN with prepacked weights (model/linears.py) against the math, and the attention switch
that every mode's forward makes (model/attention.switch_attention) against transformers' own."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
import torch.nn.functional as F

from kvrunahead.model import linears
from kvrunahead.model.attention import attention_mode, switch_attention
from kvrunahead.model.load import load_model

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN in this torch")


@pytest.fixture(autouse=True)
def packed_linears(monkeypatch):
    """The packed path itself, whatever ``auto`` would choose on this CPU."""
    monkeypatch.setenv(linears.ENV, "onednn")


BF16 = pytest.param(torch.bfloat16, marks=pytest.mark.skipif(not linears.bf16_supported(),
                                                             reason="no oneDNN bfloat16 on this CPU (AVX2 only)"))


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
@pytest.mark.parametrize("rows", [1, 3, 8, 130])
@pytest.mark.parametrize("bias", [False, True])
def test_a_packed_linear_matches_the_float64_product(dtype, rows, bias):
    torch.manual_seed(rows)
    layer = torch.nn.Linear(96, 40, bias=bias).to(dtype)
    x = torch.randn(1, rows, 96).to(dtype)
    with torch.no_grad():
        assert linears.prepack(layer) == 1
        assert isinstance(layer, linears.PackedLinear)
        out = layer(x)
        exact = F.linear(x.double(), layer.weight.double(), None if layer.bias is None else layer.bias.double())
    assert out.dtype == dtype and out.shape == exact.shape
    # the output's own rounding, plus the accumulation's: k products of inputs exactly representable in dtype
    eps = torch.finfo(dtype).eps
    bound = eps * exact.abs() + 96 * torch.finfo(torch.float32).eps * (x.double().abs() @ layer.weight.double().abs().T)
    assert ((out.double() - exact).abs() <= bound + 1e-30).all()


def test_without_onednn_bfloat16_a_bfloat16_layer_stays_on_f_linear(monkeypatch):
    """An AVX2-only CPU: oneDNN's bfloat16 reorder raises there, so its bfloat16 layers are not packed (float32 ones
    still are) and compute as F.linear does."""
    monkeypatch.setattr(linears, "bf16_supported", lambda: False)
    model = torch.nn.Sequential(torch.nn.Linear(32, 8).to(torch.bfloat16), torch.nn.Linear(32, 8))
    assert linears.prepack(model) == 1
    assert type(model[0]) is torch.nn.Linear and isinstance(model[1], linears.PackedLinear)
    x = torch.randn(2, 32).to(torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(model[0](x), F.linear(x, model[0].weight, model[0].bias))


def test_every_decode_row_takes_the_packed_path_in_float32():
    """One row through a small layer (the case once kept on F.linear) goes to oneDNN: measured faster when weights
    stream from memory, as a forward reads them (experiments/kernels/linears.jsonl)."""
    layer = torch.nn.Linear(64, 16)
    linears.prepack(layer)
    with torch.no_grad(), mock.patch.object(torch.ops.mkldnn, "_linear_pointwise",
                                            wraps=torch.ops.mkldnn._linear_pointwise) as packed:
        layer(torch.randn(1, 1, 64))
    assert packed.call_count == 1


def test_with_gradients_the_layer_takes_f_linear():
    layer = torch.nn.Linear(32, 8)
    linears.prepack(layer)
    x = torch.randn(2, 32, requires_grad=True)
    layer(x).sum().backward()  # oneDNN's packed op has no backward: the plain path is taken
    assert x.grad is not None and layer.weight.grad is not None


def test_torch_s_linears_pack_nothing(monkeypatch):
    monkeypatch.setenv(linears.ENV, "torch")
    layer = torch.nn.Linear(32, 8)
    assert linears.prepack(layer) == 0 and type(layer) is torch.nn.Linear


def _implementations(model) -> list:
    return [(type(m).__name__, m.config._attn_implementation_internal) for m in model.modules()
            if hasattr(m, "config")]


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-gemma3"])
def test_a_replayed_attention_switch_sets_what_transformers_sets(preset):
    model = load_model(preset, torch.float32, torch.device("cpu")).model
    start = model.config._attn_implementation  # the one the default kernel loaded: may be "sdpa"
    names = tuple(dict.fromkeys(("sdpa", "eager", start)))
    seen = {}
    for name in names:
        model.set_attn_implementation(name)
        seen[name] = _implementations(model)
    model.set_attn_implementation(start)
    with mock.patch.object(type(model), "set_attn_implementation", autospec=True,
                           side_effect=type(model).set_attn_implementation) as full:
        for _ in range(3):
            for name in names:
                switch_attention(model, name)
                assert _implementations(model) == seen[name]
    assert full.call_count == len(names)  # once per name: every later switch is replayed


def test_attention_mode_restores_the_implementation_it_found():
    model = load_model("tiny-llama", torch.float32, torch.device("cpu")).model
    before = _implementations(model)
    for _ in range(2):
        with attention_mode(model, "eager", state=None):
            assert model.config._attn_implementation == "eager"
        assert _implementations(model) == before


def test_auto_packs_a_dtypes_layers_where_onednn_was_timed_faster_and_keeps_the_timing(monkeypatch, tmp_path):
    """``--linears auto`` (the default): both ways timed once per machine and torch version, the choice and the
    rates kept in the cache folder; a dtype's layers packed where oneDNN was faster, left on F.linear where not."""
    import json

    monkeypatch.delenv(linears.ENV)
    monkeypatch.setenv("KVR_CACHE", str(tmp_path))
    picks = linears.auto_choice()
    assert json.loads(linears.choice_file().read_text())["dtypes"] == picks
    for name, pick in picks.items():
        assert pick["torch_gflops"] > 0
        faster = "onednn" if pick["onednn_gflops"] >= pick["torch_gflops"] else "torch"
        assert pick["linears"] == faster or (name == "bfloat16" and not linears.bf16_supported()), (name, pick)
    for way in ("torch", "onednn"):
        linears.choice_file().write_text(json.dumps({"dtypes": {"float32": {
            "linears": way, "onednn_gflops": 1.0, "torch_gflops": 1.0}}}))
        monkeypatch.setattr(linears, "_picks", {})
        layer = torch.nn.Linear(32, 8)
        assert linears.prepack(layer) == (way == "onednn")
        assert isinstance(layer, linears.PackedLinear) == (way == "onednn")


class _Attention(torch.nn.Module):
    def __init__(self, bias: bool) -> None:
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = (torch.nn.Linear(48, n, bias=bias) for n in (48, 16, 16))
        self.o_proj = torch.nn.Linear(48, 48)


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
@pytest.mark.parametrize("bias", [False, True])
def test_one_inputs_layers_are_one_product_that_each_takes_its_columns_of(dtype, bias):
    torch.manual_seed(3)
    attention = _Attention(bias).to(dtype)
    x = torch.randn(5, 48).to(dtype)
    layers = (attention.q_proj, attention.k_proj, attention.v_proj)
    with torch.no_grad():
        want = [F.linear(x, m.weight, m.bias) for m in layers]
        assert linears.prepack(attention) == 4
        assert [type(m).__name__ for m in attention.children()] == ["GroupedLinear"] * 3 + ["PackedLinear"]
        group = attention.q_proj.group
        with mock.patch.object(group, "product", wraps=group.product) as product:
            got = [attention.q_proj(x), attention.k_proj(x), attention.v_proj(x)]
            assert product.call_count == 1  # the three layers, one product
            assert group._last[0] is None  # nothing held after the last member took its columns
            attention.k_proj(x + 1)  # another input: computed again
            assert product.call_count == 2
    for g, w in zip(got, want):
        assert g.is_contiguous() and g.shape == w.shape
        eps = torch.finfo(dtype).eps
        assert (g.float() - w.float()).abs().max() <= 48 * eps * w.float().abs().max()
    # the separate copies' bytes are gone: one packed weight for the three
    assert linears.packed_bytes(attention) == sum(
        t.numel() * t.element_size() for t in (group.packed, attention.o_proj.packed))
    with linears.unpacked(attention):
        assert all(type(m) is torch.nn.Linear for m in attention.children())
    assert attention.q_proj.group is group and type(attention.v_proj) is linears.GroupedLinear
    linears.unpack(attention)
    assert all(type(m) is torch.nn.Linear for m in attention.children())
