"""Partition tables: interpolation (fig. 10), rounding, JSON round trip, refusal of mismatched tables."""

import json

import pytest
from click.testing import CliRunner

from kvrunahead.decide.tables import TABLES_DIR, Table, TableEntry, TableError, TableKey, TableMeta, table_filename
from kvrunahead.model.load import resolve_config
from kvrunahead.sim.shape import config_hash


def _table(world_size=2, model="tiny-llama", dtype="float32"):
    t = Table(TableMeta(model=model, config_hash=config_hash(resolve_config(model)), dtype=dtype,
                        world_size=world_size, backend="gloo", transport="torch", device="cpu", threads_per_rank=1,
                        bandwidth="loopback"))
    for ctx, r0 in ((8192, 0.56), (12288, 0.60)):
        b1 = round(r0 * ctx)
        t.add(TableEntry(ctx, [0, b1, ctx], [b1 / ctx, 1 - b1 / ctx], 1.0, 1.2, 10, 5.0))
    return t


def test_a_length_between_entries_interpolates_their_ratios():
    lookup = _table().lookup(10240, name="t.json")
    # 10k is halfway between 8k and 12k: rank 0's share is halfway between the entries' shares
    # (0.56 and 0.60, as stored after rounding to tokens: 4588 / 8192 and 7373 / 12288)
    assert lookup.partition.boundaries == (0, round((4588 / 8192 + 7373 / 12288) / 2 * 10240), 10240)
    assert "interpolated between entries 8192 and 12288" in lookup.source and lookup.warning is None


def test_an_entry_is_used_as_is_and_outside_the_range_the_nearest_with_a_warning():
    t = _table()
    assert t.lookup(8192).partition.boundaries == (0, 4588, 8192)
    far = t.lookup(16384)
    assert far.partition.ratios[0] == pytest.approx(0.60, abs=1e-3) and "outside" in far.warning


@pytest.mark.parametrize("ctx", [2, 3, 7, 1000, 9999, 10001])
def test_interpolated_parts_sum_to_the_context_and_none_is_empty(ctx):
    p = _table().lookup(ctx).partition
    assert p.context_len == ctx and min(p.sizes) >= 1


def test_round_trip(tmp_path):
    t = _table()
    t.save(tmp_path / "t.json")
    back = Table.load(tmp_path / "t.json")
    assert back == t
    assert json.loads((tmp_path / "t.json").read_text())["meta"]["world_size"] == 2


@pytest.mark.parametrize("kw, message", [
    (dict(world_size=4), "world size 2, not 4"),
    (dict(model="tiny-neox"), "model tiny-llama"),
    (dict(dtype="bfloat16"), "dtype float32, not bfloat16"),
    (dict(kvr_attention="split"), "attention masked, not split"),
    (dict(device_kind="cuda"), "device cpu, not cuda"),
    (dict(bandwidth="cap-13MBps"), "network loopback, not cap-13MBps"),
])
def test_mismatched_tables_are_refused(kw, message):
    args = dict(model="tiny-llama", world_size=2, dtype="float32", kvr_attention="masked", device_kind="cpu",
                bandwidth="loopback") | kw
    key = TableKey(config_hash=config_hash(resolve_config(args["model"])), **args)
    with pytest.raises(TableError, match=message):
        _table().check(key)
    assert _table().meta.key != key


def test_a_table_made_before_attention_was_recorded_reads_as_masked_on_cpu(tmp_path):
    data = {"meta": {k: v for k, v in json.loads(json.dumps(_table().meta.__dict__)).items()
                     if k not in ("kvr_attention", "device_kind")}, "entries": []}
    (tmp_path / "old.json").write_text(json.dumps(data))
    meta = Table.load(tmp_path / "old.json").meta
    assert (meta.kvr_attention, meta.device_kind) == ("masked", "cpu")


def test_the_shipped_tables_name_their_setting():
    shipped = list(TABLES_DIR.glob("*.json"))
    assert shipped
    for path in shipped:
        assert path.name == table_filename(Table.load(path).meta.key)


def test_a_forced_table_for_another_world_size_is_still_refused(tmp_path):
    from kvrunahead.cli.prefill import main

    _table().save(tmp_path / "t.json")
    result = CliRunner().invoke(main, ["--model", "tiny-llama", "--ctx", "10240", "--table", str(tmp_path / "t.json"),
                                       "--force-table", "--allow-long-context", "--json", "--max-new-tokens", "1"])
    # world size 1 against a 2-rank table: refused even when forced, the parts cannot match
    assert result.exit_code == 2 and "2 parts" in result.output


def test_kvr_prefill_refuses_a_table_for_another_world_size(tmp_path):
    from kvrunahead.cli.prefill import main

    _table(world_size=2).save(tmp_path / "t.json")
    result = CliRunner().invoke(main, ["--model", "tiny-llama", "--ctx", "1k", "--table", str(tmp_path / "t.json")])
    assert result.exit_code == 2 and "made for world size 2, not 1" in result.output


def test_a_search_seed_beyond_the_table_extrapolates_the_two_nearest_entries():
    t = _table()  # 8192: 4588 (0.560), 12288: 7373 (0.600)
    r8, r12 = 4588 / 8192, 7373 / 12288
    assert t.search_seed(16384) == (0, round((r12 + (r12 - r8)) * 16384), 16384)  # one step further out
    assert t.search_seed(10240) == t.lookup(10240).partition.boundaries  # inside: the interpolation
    assert t.search_seed(4096)[1] == round((r8 - (r12 - r8)) * 4096)


def test_a_search_seed_that_would_favour_a_later_rank_falls_back_to_the_nearest_entry():
    t = _table()
    t.entries[1] = TableEntry(12288, [0, 6200, 12288], [6200 / 12288, 1 - 6200 / 12288], 1.0, 1.2, 10, 5.0)
    # 0.560 at 8k, 0.505 at 12k: extrapolated to 20k, rank 0 would get less than half
    assert t.search_seed(20480) == t.lookup(20480).partition.boundaries


def test_markdown_lists_every_entry_with_its_gain_over_even():
    md = _table().markdown()
    assert "| 8192 | 0,4588,8192 | 0.560 | 1.00 | 1.20 | 0.83 | 10 | 5 s |" in md and md.count("\n") == 4


@pytest.mark.parametrize("p", [3, 4])
def test_three_and_four_ranks_get_the_shipped_cost_model_table_not_the_fallback(p):
    from kvrunahead.config import RunConfig
    from kvrunahead.decide.policy import prepare

    prepared = prepare(RunConfig(model="smollm2-135m", context_len=3072), p)
    name = f"smollm2-135m_p{p}_float32_cpu_split.json (cost model: cpu-t1)"
    # On a CPU whose kernels differ from the search's, the source goes on to say it was re-weighted (policy.py).
    assert prepared.partition_source.startswith(f"{name}, interpolated between entries 2048 and 4096")
    table = Table.load(TABLES_DIR / f"smollm2-135m_p{p}_float32_cpu_split.json")
    assert all(e.criterion == "model" and len(e.busy_s) == p and e.balance >= 1 for e in table.entries)
    sizes = prepared.partition.sizes
    assert sizes[0] > sizes[-1]  # the chain's first rank takes the most


def test_a_table_searched_oversubscribed_says_so_wherever_it_is_used(tmp_path):
    t = _table()
    t.meta.oversubscribed = True
    t.save(tmp_path / "t.json")
    assert "(searched OVERSUBSCRIBED)" in Table.load(tmp_path / "t.json").lookup(10240, name="t.json").source
    assert "OVERSUBSCRIBED" not in _table().lookup(10240, name="t.json").source  # tables before the flag: not


def test_a_table_records_what_it_was_searched_with_and_says_when_a_run_computes_otherwise():
    t = _table()
    assert t.searched_with() == {"attention_kernel": "torch", "linears": "torch"}  # before settings were recorded
    line = t.stale({"attention_kernel": "ours (amx)", "linears": "onednn"}, name="t.json")
    assert line.startswith("partition table t.json is stale: searched with attention kernel torch (this run: ours "
                           "(amx)), linears torch (this run: onednn), before tables recorded their settings")
    t.meta.attention_kernel, t.meta.linears = "ours (amx)", "onednn"
    assert t.stale({"attention_kernel": "ours (amx)", "linears": "onednn"}) is None
    assert "linears onednn (this run: torch)" in t.stale({"attention_kernel": "ours (amx)", "linears": "torch"})
