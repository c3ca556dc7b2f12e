"""Every prefill mode on p real ranks (gloo, CPU) against the single-process model, for GQA, MHA and MQA."""

import os

import pytest

from kvrunahead import kernels
from kvrunahead.partition import Partition, parse_partition, zigzag_ranges
from tests.helpers import skewed_ratios, world_runs

CONTEXT = 61  # odd on purpose: even parts cannot all be equal
MODELS = ["tiny-llama", "tiny-neox", "tiny-falcon", "tiny-bigcode"]  # GQA, MHA, MQA, MQA
# Falcon calls SDPA itself, so the modes that insert their own attention run on the other three.
BASELINES = {
    "kvr-nocomm": MODELS,
    "tsp": MODELS,
    "cp-allgather": ["tiny-llama", "tiny-neox", "tiny-bigcode"],
    "ring": ["tiny-llama", "tiny-neox", "tiny-bigcode"],
}
SPLIT_MODELS = ["tiny-llama", "tiny-neox", "tiny-bigcode"]
BASELINE_CASES = [(mode, model) for mode, models in BASELINES.items() for model in models]
NEW_TOKENS = 6
PER_TOKEN = 4 * 2 * 2 * 16 * 4  # K,V bytes of one token of tiny-llama: 4 layers, 2 KV heads of 16, float32, K and V


def partitions(p: int) -> dict[str, str]:
    head = list(range(p)) + [CONTEXT]  # the first p-1 ranks hold one token each
    tail = [0] + [CONTEXT - p + 1 + i for i in range(p - 1)] + [CONTEXT]  # the last p-1 ranks hold one token each
    skew = ",".join(f"{x:.4f}" for x in skewed_ratios(p))
    return {
        "even": "even",
        "skewed": skew if p > 1 else "even",
        "one-token-head": ",".join(map(str, head)),
        "one-token-tail": ",".join(map(str, tail)),
    }


def _config(model: str, dtype: str, **kw) -> dict:
    return dict(model=model, context_len=CONTEXT, dtype=dtype, device="cpu", max_new_tokens=NEW_TOKENS,
                verify=True, threads=1, atol=1e-4 if dtype == "float32" else None, **kw)


def _cases(p: int) -> list[dict]:
    cases = []
    for dtype in ("float32", "bfloat16"):
        for model in MODELS:
            for pname, spec in partitions(p).items():
                cases.append({"name": f"{model}/{pname}/{dtype}",
                              "config": _config(model, dtype, partition=spec, kvr_attention="masked")})
        for mode, model in BASELINE_CASES:
            cases.append({"name": f"{mode}/{model}/{dtype}", "config": _config(model, dtype, mode=mode)})
    for model in SPLIT_MODELS:
        for pname, spec in partitions(p).items():
            cfg = _config(model, "float32", partition=spec, kvr_attention="split")
            cases.append({"name": f"split/{model}/{pname}", "config": cfg})
    for attention in ("masked", "split"):
        for pname, spec in partitions(p).items():
            cfg = _config("tiny-llama-short", "float32", partition=spec, kvr_attention=attention)
            cases.append({"name": f"yarn/{attention}/{pname}", "config": cfg})
    cases.append({"name": "yarn/default", "config": _config("tiny-llama-short", "float32")})
    return cases


@pytest.fixture(scope="module", params=["ours", "torch"])
def worlds(request, tmp_path_factory):
    """Every case on p real ranks, run once per world size whichever tests ask for it: on our CPU attention kernel
    and on torch's (the fallback where it cannot be built), the one-process reference on the same."""
    run = world_runs(_cases, tmp_path_factory, f"{request.param}-p")

    def on_kernel(p: int) -> dict:
        before = os.environ.get(kernels.ENV)
        os.environ[kernels.ENV] = request.param
        try:
            return run(p)
        finally:
            os.environ.pop(kernels.ENV) if before is None else os.environ.__setitem__(kernels.ENV, before)

    on_kernel.kernel = request.param
    return on_kernel


TORCH_SIZES = (1, 3)  # torch's attention (the fallback) runs the matrix on one rank and a chain of 3; ours at every p


def _on(worlds, p: int) -> dict:
    if worlds.kernel == "torch" and p not in TORCH_SIZES:
        pytest.skip(f"torch's attention runs the matrix at p in {TORCH_SIZES}; ours at every p")
    return worlds(p)


@pytest.fixture(scope="module", params=[1, 2, 3, 4])
def world(request, worlds):
    return request.param, _on(worlds, request.param)


@pytest.fixture(scope="module", params=[2, 3, 4])
def multi_rank_world(request, worlds):
    """The world sizes where ranks have someone to send to: at p = 1 every mode's byte count is [0], so a byte
    count test there compares nothing (test_a_lone_rank_sends_nothing_in_any_mode says what p = 1 must do)."""
    return request.param, _on(worlds, request.param)


def test_every_case_ran_on_the_attention_kernel_it_was_given(world, worlds):
    p, results = world
    ran = {name: r["attention_kernel"] for name, r in results.items() if "attention_kernel" in r}
    assert ran and all(k.startswith(worlds.kernel) for k in ran.values()), ran


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("pname", ["even", "skewed", "one-token-head", "one-token-tail"])
def test_kvr_float32_logits_match_single_process(world, model, pname):
    p, results = world
    r = results[f"{model}/{pname}/float32"]
    v = r["verification"]
    assert len(r["boundaries"]) == p + 1
    assert v["max_abs_logit_diff"] <= 1e-4, v
    assert v["first_token_match"], v
    # The extension phase continues from the chained cache exactly as from a single-process cache.
    assert v["generated_match"], (r["generated_tokens"], v["reference_tokens"])


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("pname", ["even", "skewed", "one-token-head", "one-token-tail"])
def test_kvr_bfloat16_matches_single_process_within_its_rounding(world, model, pname):
    """First token, greedy continuation, and logits within the tolerance derived from bfloat16's rounding."""
    _, results = world
    v = results[f"{model}/{pname}/bfloat16"]["verification"]
    assert v["ok"], v


@pytest.mark.parametrize("pname", ["even", "skewed", "one-token-head", "one-token-tail"])
def test_kvr_sends_only_the_prefix_chain(multi_rank_world, pname):
    """Rank i sends K,V of [0, b_{i+1}) once per layer (eq. 6), b the partition asked for; the last rank sends
    nothing."""
    p, results = multi_rank_world
    r = results[f"tiny-llama/{pname}/float32"]
    b = parse_partition(partitions(p)[pname], CONTEXT, p).boundaries
    assert r["boundaries"] == list(b)
    # Every b_{i+1} >= 1 (no part is empty): each rank but the last sends something.
    assert r["bytes_sent"] == [b[i + 1] * PER_TOKEN for i in range(p - 1)] + [0]


@pytest.mark.parametrize("mode, model", BASELINE_CASES)
def test_baseline_modes_match_single_process(world, mode, model):
    p, results = world
    r = results[f"{mode}/{model}/float32"]
    v = r["verification"]
    assert sum(r["tokens"]) == CONTEXT and len(r["tokens"]) == p
    assert v["max_abs_logit_diff"] <= 1e-4, v
    assert v["first_token_match"] and v["generated_match"], v
    assert results[f"{mode}/{model}/bfloat16"]["verification"]["ok"]


def _layout_tokens(mode: str, p: int) -> list[int]:
    """Tokens per rank in the layout the mode sets itself: even contiguous parts (tsp), zigzag chunks (the others)."""
    ranges = Partition.even(CONTEXT, p).ranges() if mode == "tsp" else zigzag_ranges(CONTEXT, p)
    return [sum(e - a for a, e in mine) for mine in ranges]


@pytest.mark.parametrize("mode", ["tsp", "cp-allgather"])
def test_all_gather_modes_send_every_block_to_every_other_rank(multi_rank_world, mode):
    """All-gather delivers each rank's K,V (padded to the largest block) to the p-1 others per layer (eq. 4)."""
    p, results = multi_rank_world
    r = results[f"{mode}/tiny-llama/float32"]
    tokens = _layout_tokens(mode, p)
    assert r["tokens"] == tokens
    assert r["bytes_sent"] == [(p - 1) * max(tokens) * PER_TOKEN] * p


def test_ring_passes_on_every_block_but_its_successors(multi_rank_world):
    """In p-1 ring steps rank i forwards its own block and those of i-1 .. i-p+2, once per layer."""
    p, results = multi_rank_world
    r = results["ring/tiny-llama/float32"]
    n = _layout_tokens("ring", p)
    assert r["tokens"] == n
    assert r["bytes_sent"] == [(CONTEXT - n[(i + 1) % p]) * PER_TOKEN for i in range(p)]


def test_kvr_without_communication_sends_nothing(multi_rank_world):
    p, results = multi_rank_world
    assert results["kvr-nocomm/tiny-llama/float32"]["bytes_sent"] == [0] * p


def test_a_lone_rank_sends_nothing_in_any_mode(worlds):
    """At p = 1 one rank holds the whole prompt: no mode sends a byte, to itself included (an all-gather or ring
    step over a world of one moves nothing)."""
    results = worlds(1)
    names = [f"tiny-llama/{pname}/float32" for pname in partitions(1)] + [
        f"{mode}/tiny-llama/float32" for mode in BASELINES]
    for name in names:
        r = results[name]
        assert (r["tokens"], r["boundaries"], r["bytes_sent"]) == ([CONTEXT], [0, CONTEXT], [0]), name


@pytest.mark.parametrize("model", SPLIT_MODELS)
@pytest.mark.parametrize("pname", ["even", "skewed", "one-token-head", "one-token-tail"])
def test_kvr_with_split_attention_matches_single_process(world, model, pname):
    v = world[1][f"split/{model}/{pname}"]["verification"]
    assert v["max_abs_logit_diff"] <= 1e-4 and v["first_token_match"] and v["generated_match"], v


@pytest.mark.parametrize("attention", ["masked", "split"])
@pytest.mark.parametrize("pname", ["even", "skewed", "one-token-head", "one-token-tail"])
def test_kvr_beyond_the_trained_positions_matches_the_single_process_with_the_same_yarn_extension(
        world, attention, pname):
    r = world[1][f"yarn/{attention}/{pname}"]
    v = r["verification"]
    assert r["rope_extension"] == "RoPE extended by YaRN x2 beyond the 48 trained positions"
    assert v["max_abs_logit_diff"] <= 1e-4 and v["first_token_match"] and v["generated_match"], v


def test_the_default_run_uses_split_attention_and_no_even_partition_beyond_one_rank(world):
    p, results = world
    r = results["yarn/default"]
    # one rank runs the whole prompt with the model's own attention: nothing to split (oneshot/on_engine.py)
    assert r["kvr_attention"].startswith("split (default" if p > 1 else "masked (one rank")
    assert r["verification"]["max_abs_logit_diff"] <= 1e-4 and r["verification"]["generated_match"]
    if p > 1:
        assert r["partition_source"].startswith("cost model") and r["boundaries"] != list(
            Partition.even(CONTEXT, p).boundaries)


def test_a_continuation_that_parts_is_placed_and_weighed_by_the_reference_model():
    """Where two greedy continuations part, the reference model's logits over the prompt and the shared tokens
    weigh the two tokens: the run is within rounding only if they tie within the tolerance."""
    import torch
    from transformers import DynamicCache

    from kvrunahead.model.forward import greedy_decode, last_token_logits
    from kvrunahead.model.load import load_model
    from kvrunahead.model.reference import where_parted
    from kvrunahead.oneshot.runner import Verification

    lm = load_model("tiny-llama", torch.float32, torch.device("cpu"))
    ids = list(range(40, 80))
    cache = DynamicCache(config=lm.model.config)
    first = int(last_token_logits(lm.model, torch.tensor([ids]), cache=cache).argmax())
    reference = greedy_decode(lm.model, first, cache, len(ids), 5, lm.eos_token_ids)
    other = (reference[3] + 1) % 512
    step, gap = where_parted(lm.model, ids, reference, [*reference[:3], other, 7])
    logits = last_token_logits(lm.model, torch.tensor([ids + reference[:3]]),
                               cache=DynamicCache(config=lm.model.config))
    assert step == 3 and gap == pytest.approx(float(logits[reference[3]] - logits[other]), abs=1e-6) and gap > 0
    assert where_parted(lm.model, ids, reference, reference[:2]) == (2, float("inf"))  # one ended early
    v = Verification(0.0, None, 1, 0.0, atol=gap / 2, first_token_match=True, generated_match=False,
                     reference_tokens=reference, parted_at=step, parted_gap=gap)
    assert not v.ok
    v.atol = 2 * gap
    assert v.generated_within_rounding and v.ok
