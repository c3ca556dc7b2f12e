"""The serving engine's degree per prompt: one rank or the KV chain, from the cost model (or as asked), with the
one-rank side priced at the threads the front runs with alone."""

import re
import shutil

import pytest

from kvrunahead.config import RunConfig
from kvrunahead.model.load import resolve_config
from kvrunahead.serve.degree import DegreePolicy, parse_degree
from kvrunahead.serve.executor import solo_threads
from kvrunahead.sim import profile


def _policy(solo: int | None = 2, degree: str = "auto", p: int = 2) -> DegreePolicy:
    cfg = RunConfig(threads=1)
    return DegreePolicy(cfg, resolve_config(cfg.model), p, p, "split", 1, degree, solo)


@pytest.fixture
def shipped_profiles_only(tmp_path, monkeypatch):
    monkeypatch.setenv("KVRUNAHEAD_CACHE", str(tmp_path))  # no profile calibrated on this machine


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
