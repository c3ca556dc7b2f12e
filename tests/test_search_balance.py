"""The balance-guided partition search (kvrunahead/search/balance.py) on synthetic chains whose true per-rank
costs it does not know: it must find the balanced partition in few runs, stay unmoved by a machine that drifts
between runs, and resume an interrupted search without running again what it ran."""

import itertools
import random
import statistics

import pytest

from kvrunahead.search.balance import Measurement, balance_search, balanced_boundaries, neighbours, toward_balance


def model_work(prefix: float, tokens: float) -> float:
    """The FLOP model the search is given: linear work plus causal attention pairs (split attention)."""
    return 1.0 * tokens + 2e-4 * (tokens * prefix + tokens * (tokens + 1) / 2)


class Chain:
    """A chain of ranks whose true cost differs from the model: rank-specific speeds, attention dearer than the
    model says, and optional drift (every rank slowed alike per run) and noise."""

    def __init__(self, speeds, drift: float = 0.0, noise: float = 0.0, seed: int = 0):
        self.speeds, self.drift, self.noise = speeds, drift, noise
        self.rng = random.Random(seed)
        self.runs: list[tuple[int, ...]] = []

    def busy(self, b) -> list[float]:
        return [s * (1.0 * n + 3e-4 * (n * lo + n * (n + 1) / 2)) / 1000
                for s, lo, n in ((s, b[i], b[i + 1] - b[i]) for i, s in enumerate(self.speeds))]

    def __call__(self, b) -> Measurement:
        self.runs.append(tuple(b))
        factor = 1 + self.rng.uniform(-self.drift, self.drift)  # the machine's speed this run, for every rank
        busy = [x * factor * (1 + self.rng.uniform(-self.noise, self.noise)) for x in self.busy(b)]
        return Measurement(max(busy) * 1.02 + 0.01 * factor, tuple(busy))

    def true_best(self, n: int, p: int, step: int = 8):
        grid = range(step, n, step)
        cands = [(0, *c, n) for c in itertools.combinations(grid, p - 1)] if p <= 3 else None
        return min(cands, key=lambda b: max(self.busy(b)))


@pytest.mark.parametrize("speeds", [(1.0, 1.0), (1.0, 1.15), (1.2, 1.0), (1.0, 1.1, 0.95)])
def test_the_search_balances_the_ranks_in_few_runs(speeds):
    n, p = 4096, len(speeds)
    chain = Chain(speeds)
    even = tuple(round(i * n / p) for i in range(p + 1))
    result = balance_search(chain, even, model_work, stride=64, quantum=8, confirm_rounds=1)
    assert result.balance <= 1.02
    assert len(result.steps) <= 4  # Newton-like: the measured rates correct the model's error at once
    assert result.candidates == len(set(chain.runs)) <= 4 + 1 + 2 * (p - 1)
    best = chain.true_best(n, p)
    assert max(abs(x - y) for x, y in zip(result.boundaries, best)) <= 64 + 8


def test_drift_between_runs_does_not_move_the_balance_steps():
    n = 8192
    quiet = balance_search(Chain((1.0, 1.1)), (0, 4096, n), model_work, confirm_rounds=1)
    drifting = balance_search(Chain((1.0, 1.1), drift=0.15, seed=3), (0, 4096, n), model_work, confirm_rounds=1)
    assert [s["boundaries"] for s in drifting.steps] == [s["boundaries"] for s in quiet.steps]


def test_confirmation_is_interleaved_and_picks_the_lowest_median():
    chain = Chain((1.0, 1.1), drift=0.15, noise=0.01, seed=1)
    result = balance_search(chain, (0, 4096, 8192), model_work, stride=64, confirm_rounds=3, confirm="both",
                            confirm_margin=0.0)
    balanced = tuple(min(result.steps, key=lambda s: s["balance"])["boundaries"])
    pool = {balanced, *neighbours(balanced, 64)}
    confirm = chain.runs[len(result.steps):]
    assert set(confirm) == pool and result.boundaries in pool  # the balanced point and its neighbours
    assert all(set(confirm[i:i + 3]) == pool for i in (0, 3, 6))  # one run of each per round
    medians = {k: sorted(v)[1] for k, v in result.confirmation.items()}
    assert result.ttft_s == min(medians.values())


@pytest.mark.parametrize("faster, chosen", [(0.005, 4096), (0.03, 4032)])
def test_a_neighbour_replaces_the_balanced_point_only_when_faster_by_more_than_the_margin(faster, chosen):
    ttft = {4096: 10.0, 4032: 10.0 * (1 - faster), 4160: 10.5}

    def measure(b):  # balanced at the seed; the neighbour below it `faster` quicker in every round
        return Measurement(ttft[b[1]], (5.0, 5.0) if b[1] == 4096 else (4.9, 5.1))

    result = balance_search(measure, (0, 4096, 8192), model_work, stride=64, confirm="both", confirm_margin=0.01)
    assert result.boundaries == (0, chosen, 8192) and result.ttft_s == ttft[chosen]
    assert result.balance == (1.0 if chosen == 4096 else 5.1 / 4.9)


def test_an_interrupted_search_resumes_without_running_again(tmp_path):
    ckpt = tmp_path / "4096.json"
    full = balance_search(Chain((1.0, 1.15)), (0, 2048, 4096), model_work, checkpoint=tmp_path / "ref.json")

    class Stop(Exception):
        pass

    chain = Chain((1.0, 1.15))

    def dying(b):
        if len(chain.runs) == 4:
            raise Stop
        return chain(b)

    with pytest.raises(Stop):
        balance_search(dying, (0, 2048, 4096), model_work, checkpoint=ckpt)
    again = Chain((1.0, 1.15))
    resumed = balance_search(again, (0, 2048, 4096), model_work, checkpoint=ckpt)
    assert resumed.boundaries == full.boundaries and resumed.runs == full.runs
    assert len(again.runs) == full.runs - 4


@pytest.mark.parametrize("p", [2, 3, 5])
def test_balanced_boundaries_are_rounded_ordered_and_cover_the_context(p):
    n = 1000
    b = tuple(round(i * n / p) for i in range(p + 1))
    busy = [1.0 + 0.5 * i for i in range(p)]  # later ranks slower: they must get fewer tokens
    new = balanced_boundaries(b, busy, model_work, quantum=8)
    sizes = [y - x for x, y in zip(new, new[1:])]
    assert new[0] == 0 and new[-1] == n and all(s >= 8 for s in sizes)
    assert all(x % 8 == 0 for x in new[1:-1]) and sizes[0] > sizes[-1]
    with pytest.raises(ValueError, match="no busy time"):
        balanced_boundaries(b, [0.0] * p, model_work)


def test_the_entrys_balance_is_the_median_over_every_run_of_the_chosen_partition():
    """One run's balance reading is noisy (about 5% on the CPU ranks): the entry records the median of them all."""
    chain = Chain((1.0, 1.1), noise=0.05, seed=2)
    seen: dict[tuple, list[float]] = {}
    result = balance_search(chain, (0, 4096, 8192), model_work, stride=64, confirm_rounds=5,
                            on_measure=lambda phase, b, m: seen.setdefault(tuple(b), []).append(m.balance))
    runs = seen[tuple(result.boundaries)]
    assert len(runs) >= 5
    assert result.balance == statistics.median(runs)


@pytest.mark.parametrize("speeds", [(1.0, 1.15), (1.2, 1.0), (1.0, 1.1, 0.9)])
def test_confirmation_times_only_the_neighbour_the_imbalance_points_to(speeds):
    chain = Chain(speeds)
    n, p = 6144, len(speeds)
    result = balance_search(chain, tuple(round(i * n / p) for i in range(p + 1)), model_work, stride=64,
                            confirm_rounds=2)
    balanced = tuple(min(result.steps, key=lambda s: s["balance"])["boundaries"])
    busy = min(result.steps, key=lambda s: s["balance"])["busy_s"]
    pool = {balanced, *toward_balance(balanced, busy, 64)}
    assert len(pool) == p and set(chain.runs[len(result.steps):]) == pool  # one neighbour per boundary
    for c in pool - {balanced}:  # away from the busier rank of the two beside it
        j = next(k for k in range(1, p) if c[k] != balanced[k])
        assert (c[j] < balanced[j]) == (busy[j - 1] > busy[j])
    assert result.candidates == len(set(chain.runs))
    assert result.busy_s == pytest.approx(chain.busy(result.boundaries))  # no noise: every run reads the same


@pytest.mark.parametrize("speeds", [(1.0, 1.15), (1.25, 1.0), (1.0, 1.1, 0.9)])
def test_the_rates_of_a_shorter_length_seed_a_longer_one_near_its_balance(speeds):
    """The chain's attention is dearer than the model says, so the model's rates drift with the length; carried
    from 4k they still place 8k within the tolerance, where the FLOP-even seed needs balancing steps."""
    chain, p = Chain(speeds), len(speeds)
    short = balance_search(chain, tuple(round(i * 4096 / p) for i in range(p + 1)), model_work, confirm_rounds=1)
    seed = balanced_boundaries(short.boundaries, short.busy_s, model_work, quantum=8, length=8192)
    assert seed[-1] == 8192 and len(seed) == p + 1
    carried = balance_search(Chain(speeds), seed, model_work, confirm_rounds=1)
    even = balance_search(Chain(speeds), tuple(round(i * 8192 / p) for i in range(p + 1)), model_work,
                          confirm_rounds=1)
    assert len(carried.steps) == 1 and carried.steps[0]["balance"] <= 1.02 < even.steps[0]["balance"]
    assert carried.candidates == p < even.candidates
