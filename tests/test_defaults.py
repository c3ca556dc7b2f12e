"""What a user gets without flags: the attention, the partition (table, cost model or FLOP estimate) and the RoPE
extension."""

import dataclasses
import math

import pytest
import torch

from kvrunahead.config import RunConfig
from kvrunahead.decide import tables
from kvrunahead.decide.policy import prepare
from kvrunahead.decide.tables import TableError
from kvrunahead.errors import InputError
from kvrunahead.model.load import load_model, resolve_config
from kvrunahead.model.rope import ContextError, RopeExtension, plan_extension
from kvrunahead.partition import Partition
from kvrunahead.sim.flops import balanced_partition, estimated_partition, layer_cost


@pytest.fixture(autouse=True)
def no_shipped_tables(tmp_path, monkeypatch):
    """Every test here sees only the tables it writes itself."""
    monkeypatch.setattr(tables, "TABLES_DIR", tmp_path / "tables")
    (tmp_path / "tables").mkdir()
    return tmp_path / "tables"


@pytest.mark.parametrize("model, expected", [("tiny-llama", "split"), ("tiny-neox", "split"),
                                             ("tiny-bigcode", "split"), ("tiny-falcon", "masked")])
def test_default_attention_is_split_where_the_model_uses_the_attention_interface(model, expected):
    prepared = prepare(RunConfig(model=model, context_len=256), 2)
    assert prepared.kvr_attention == expected and prepared.attention_source.startswith("default")


def test_split_attention_is_refused_with_one_line_for_a_model_that_computes_attention_itself():
    with pytest.raises(InputError, match="computes it itself: use masked"):
        prepare(RunConfig(model="tiny-falcon", context_len=256, kvr_attention="split"), 2)


def test_without_a_table_the_default_partition_is_the_cost_models_and_never_even():
    prepared = prepare(RunConfig(model="tiny-llama", context_len=2048), 2)
    assert prepared.partition_source.startswith("cost model on") and "no partition table" in prepared.partition_source
    assert prepared.partition != Partition.even(2048, 2)
    assert prepared.partition.sizes[0] > prepared.partition.sizes[1]


def test_without_a_table_or_a_profile_the_default_partition_is_the_flop_estimate(tmp_path, monkeypatch):
    from kvrunahead.sim import profile

    monkeypatch.setenv("KVR_CACHE", str(tmp_path))
    monkeypatch.setattr(profile, "SHIPPED_DIR", tmp_path)
    prepared = prepare(RunConfig(model="tiny-llama", context_len=2048), 2)
    assert prepared.partition_source.startswith("cost estimate") and "kvr-calibrate" in prepared.partition_source
    assert prepared.partition.sizes[0] > prepared.partition.sizes[1]


def test_the_cost_model_prices_the_threads_the_ranks_will_run_with(tmp_path, monkeypatch):
    """Without --threads a rank runs OMP_NUM_THREADS threads (else cores / local ranks): the cost model's
    partition must come from that thread count's profile, not the 1-thread one."""
    monkeypatch.setenv("KVR_CACHE", str(tmp_path))  # no local profile: only the shipped cpu-t1 exists
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    unset = prepare(RunConfig(model="tiny-llama", context_len=2048), 2)
    assert unset.partition_source.startswith("cost estimate") and "kvr-calibrate --threads 3" in unset.partition_source
    one = prepare(RunConfig(model="tiny-llama", context_len=2048, threads=1), 2)
    assert one.partition_source.startswith("cost model on")


def test_a_matching_table_is_interpolated_by_default(no_shipped_tables, write_table):
    write_table(no_shipped_tables)
    prepared = prepare(RunConfig(model="tiny-llama", context_len=1536), 2)
    assert "interpolated between entries 1024 and 2048" in prepared.partition_source
    assert abs(prepared.partition.boundaries[1] - 0.7 * 1536) <= 1  # the entries hold 0.7 up to rounding


def test_a_stale_table_is_said_and_its_partition_reweighted_by_the_cost_model(no_shipped_tables, write_table,
                                                                               monkeypatch):
    """A table searched on torch's attention, a run on a kernel timed 4x as fast: the run says the table is stale
    and moves the cut earlier (the later rank's longer prefix costs it less); on the table's own settings the
    table's partition as it is."""
    from kvrunahead.decide import policy

    write_table(no_shipped_tables, computes={"attention_kernel": "torch", "linears": "torch"})
    rates = {"torch": (1.0, 1.0), "ours (fast)": (4.0, 1.0)}
    monkeypatch.setattr(policy, "compute_scale", lambda settings, dtype: rates[settings["attention_kernel"]])
    for kernel in rates:
        monkeypatch.setattr(policy, "compute_settings",
                            lambda dtype, kind="cpu", k=kernel: {"attention_kernel": k, "linears": "torch"})
        cfg = RunConfig(model="tiny-llama", context_len=2048)
        prepared = prepare(cfg, 2)
        if kernel == "torch":
            assert prepared.partition.boundaries[1] == round(0.7 * 2048) and prepared.warning is None
            assert "stale" not in prepared.partition_source
        else:
            assert "is stale: searched with attention kernel torch (this run: ours (fast))" in prepared.warning
            assert "stale: re-weighted by the cost model" in prepared.partition_source
            assert 1024 < prepared.partition.boundaries[1] < round(0.7 * 2048)
            explicit = prepare(dataclasses.replace(cfg, table=str(no_shipped_tables / "tiny-llama_split_p2.json")),
                               2)
            assert explicit.partition == prepared.partition and "stale" in explicit.warning


def test_reweighting_at_the_rates_the_table_was_searched_at_keeps_its_partition():
    from kvrunahead.sim.optimize import reweighted_partition

    config = resolve_config("tiny-llama")
    same = reweighted_partition(config, "float32", 1, 4096, 3, "split", [0.5, 0.3, 0.2], (1.5, 0.8), (1.5, 0.8))
    assert same.boundaries == (0, 2048, 3277, 4096)
    slower = reweighted_partition(config, "float32", 1, 4096, 3, "split", [0.5, 0.3, 0.2], (1.0, 1.0), (0.5, 1.0))
    assert slower.boundaries[1] > 2048  # attention slower than searched: the first rank (no prefix) takes more


def test_a_table_of_the_other_attention_is_not_picked_by_default(no_shipped_tables, write_table):
    write_table(no_shipped_tables, attention="masked")
    prepared = prepare(RunConfig(model="tiny-llama", context_len=1536), 2)  # split by default
    assert prepared.partition_source.startswith("cost model")
    masked = prepare(RunConfig(model="tiny-llama", context_len=1536, kvr_attention="masked"), 2)
    assert "interpolated" in masked.partition_source


def test_a_table_of_another_network_is_not_picked_by_default(no_shipped_tables, write_table):
    write_table(no_shipped_tables, bandwidth="cap-13MBps")
    assert prepare(RunConfig(model="tiny-llama", context_len=1536), 2).partition_source.startswith("cost model")


def test_a_context_outside_the_table_falls_back_to_the_cost_model_and_says_so(no_shipped_tables, write_table):
    write_table(no_shipped_tables)
    prepared = prepare(RunConfig(model="tiny-llama", context_len=4096), 2)
    assert prepared.partition_source.startswith("cost model") and "outside" in prepared.partition_source


def test_a_table_of_the_other_attention_is_refused_unless_forced(no_shipped_tables, write_table):
    path = write_table(no_shipped_tables, attention="masked")
    with pytest.raises(InputError, match="attention masked, not split"):
        prepare(RunConfig(model="tiny-llama", context_len=1536, table=str(path)), 2)
    forced = prepare(RunConfig(model="tiny-llama", context_len=1536, table=str(path), force_table=True), 2)
    assert "interpolated" in forced.partition_source


def test_partition_table_without_a_matching_table_is_an_error_not_an_estimate():
    with pytest.raises(InputError, match="no partition table .* with split attention on cpu over loopback"):
        prepare(RunConfig(model="tiny-llama", context_len=1536, partition="table"), 2)


def test_modes_with_their_own_layout_take_the_default_partition_as_their_layout():
    assert prepare(RunConfig(model="tiny-llama", context_len=100, mode="tsp"), 2).partition == Partition.even(100, 2)
    with pytest.raises(InputError, match="sets its own layout"):
        prepare(RunConfig(model="tiny-llama", context_len=100, mode="ring", partition="0.6,0.4"), 2)


@pytest.mark.parametrize("model", ["smollm2-135m", "tiny-llama", "tiny-falcon", "tiny-bigcode", "llama-7b"])
@pytest.mark.parametrize("attention", ["masked", "split"])
@pytest.mark.parametrize("p", [2, 3, 4, 8])
def test_the_cost_estimate_gives_every_rank_the_same_work_and_earlier_ranks_more_tokens(model, attention, p):
    cost = layer_cost(resolve_config(model))
    context = 8192
    part = balanced_partition(cost, context, p, attention)
    work = [cost.rank_flops(part.boundaries[i], part.sizes[i], attention) for i in range(p)]
    # Equal up to the rounding to whole tokens (one token of the largest rank's work).
    one_token = cost.flops_per_token + cost.flops_per_pair * context
    assert max(work) - min(work) <= 2 * one_token
    assert list(part.sizes) == sorted(part.sizes, reverse=True) and part.sizes[0] > context / p


def test_the_cost_estimate_counts_the_decoder_layers_of_the_model():
    cost = layer_cost(resolve_config("llama-7b"))
    # Llama-7B: 4 * 4096^2 attention + 3 * 4096 * 11008 MLP parameters per layer (and two norms)
    assert cost.flops_per_token == pytest.approx(2 * (4 * 4096**2 + 3 * 4096 * 11008 + 2 * 4096), rel=1e-5)
    assert cost.flops_per_pair == 4 * 4096


def test_masked_attention_skews_more_than_split_beyond_the_first_rank():
    config = resolve_config("smollm2-135m")
    masked = estimated_partition(config, 8192, 2, "masked")
    split = estimated_partition(config, 8192, 2, "split")
    assert masked.sizes[0] > split.sizes[0] > 4096


@pytest.mark.parametrize("context, factor", [(8192, None), (8193, 2), (16384, 2), (16385, 3), (32768, 4)])
def test_the_smallest_whole_yarn_factor_covers_the_context(context, factor):
    ext = plan_extension(resolve_config("tiny-llama"), context)  # trained for 8192 positions
    assert (ext.factor if ext else None) == factor
    if ext:
        assert ext.describe() == f"RoPE extended by YaRN x{factor} beyond the 8192 trained positions"


def test_a_context_beyond_the_extension_is_refused_and_allow_long_context_runs_it_unextended():
    with pytest.raises(ContextError, match="exceeds 32768 positions, the most YaRN x4"):
        plan_extension(resolve_config("tiny-llama"), 32769)
    assert plan_extension(resolve_config("tiny-llama"), 40000, allow_long_context=True) is None


def test_a_model_without_rotary_embedding_is_refused_beyond_its_positions():
    with pytest.raises(ContextError, match="cannot be extended by YaRN"):
        plan_extension(resolve_config("tiny-bigcode"), 9000)


def test_the_extension_reaches_the_rotary_embedding_the_model_builds():
    cpu = torch.device("cpu")
    extended = load_model("tiny-llama-short", torch.float32, cpu, rope=RopeExtension(2, 48)).model.model.rotary_emb
    plain = load_model("tiny-llama-short", torch.float32, cpu).model.model.rotary_emb
    assert (extended.rope_type, plain.rope_type) == ("yarn", "default")
    assert extended.attention_scaling == pytest.approx(1 + 0.1 * math.log(2))  # YaRN's mscale for factor 2
    # Low frequencies interpolated by the factor, the highest kept (YaRN's ramp between the two).
    assert extended.inv_freq[-1] == pytest.approx(plain.inv_freq[-1] / 2)
    assert extended.inv_freq[0] == pytest.approx(plain.inv_freq[0])


def test_prepare_reports_the_extension_and_refuses_beyond_it():
    assert prepare(RunConfig(model="tiny-llama", context_len=12000), 2).rope.factor == 2
    with pytest.raises(InputError, match="YaRN x4"):
        prepare(RunConfig(model="tiny-llama", context_len=40000), 2)
    assert prepare(RunConfig(model="tiny-llama", context_len=40000, allow_long_context=True), 2).rope is None


def test_find_table_names_everything_it_matched_on(no_shipped_tables):
    with pytest.raises(TableError, match="tiny-llama at world size 2 in float32 with split attention on cpu"):
        tables.find_table(tables.TableKey("tiny-llama", "x", 2, "float32", "split", "cpu", "loopback"))
