"""The partition search on synthetic TTFT functions with known optima (no torch, no ranks)."""

import json

import pytest

from kvrunahead.search.algorithm import Evaluator, search


def pipeline_ttft(alpha: float = 1.0, beta: float = 4e-4, layers: int = 30):
    """A KV-Runahead-like cost: each layer a rank works linearly in its tokens plus attention to all keys
    before them; the chain runs at the pace of the slowest rank, plus the fill of the earlier ones.
    Minimised by uneven parts, larger for the early ranks."""

    def ttft(b):
        work = [alpha * (hi - lo) + beta * (hi - lo) * (lo + (hi - lo) / 2) for lo, hi in zip(b, b[1:])]
        return layers * max(work) + sum(work[:-1])

    return ttft


def brute_force(f, c, p, step):
    import itertools

    best = None
    for inner in itertools.combinations(range(step, c, step), p - 1):
        b = (0, *inner, c)
        if best is None or f(b) < f(best):
            best = b
    return best


class Counting:
    def __init__(self, f):
        self.f, self.calls = f, []

    def __call__(self, b):
        self.calls.append(b)
        return self.f(b)


@pytest.mark.parametrize("p, c", [(2, 16384), (3, 6144), (4, 4096)])
def test_search_finds_the_optimum_within_one_min_stride_and_never_measures_twice(p, c):
    def quadratic(b, opt=None):
        opt = opt or {2: (0, 9728, c), 3: (0, 2600, 4480, c), 4: (0, 1380, 2420, 3300, c)}[p]
        return sum((x - o) ** 2 for x, o in zip(b, opt)) + 1.0

    for f in (quadratic,):
        measure = Counting(f)
        result = search(measure, c, p, min_stride=64)
        opt = {2: (0, 9728, c), 3: (0, 2600, 4480, c), 4: (0, 1380, 2420, 3300, c)}[p]
        assert all(abs(x - o) <= 64 for x, o in zip(result.boundaries, opt)), result
        assert len(measure.calls) == len(set(measure.calls)) == result.evaluations


@pytest.mark.parametrize("p, c", [(2, 4096), (3, 3072)])
def test_search_matches_brute_force_on_a_pipeline_cost(p, c):
    f = pipeline_ttft()
    result = search(Counting(f), c, p, min_stride=64)
    exact = brute_force(f, c, p, 64)
    # Within one minimum stride of the best grid point, and no worse than it by more than one stride's cost.
    assert all(abs(x - o) <= 64 for x, o in zip(result.boundaries, exact)), (result.boundaries, exact)


def test_seeded_search_stays_in_its_window_and_costs_less():
    c, p = 16384, 2
    f = lambda b: (b[1] - 9728) ** 2 + 1.0  # noqa: E731
    full = search(Counting(f), c, p, min_stride=64)
    seeded = search(Counting(f), c, p, min_stride=64, seed=(0, 9600, c), window=512)
    assert abs(seeded.boundaries[1] - 9728) <= 64
    assert seeded.evaluations < full.evaluations


def test_resume_continues_without_remeasuring(tmp_path):
    c, p = 4096, 3
    f = pipeline_ttft()
    ckpt = tmp_path / "search.json"
    calls = []

    class Interrupt(Exception):
        pass

    def flaky(b):
        if len(calls) == 20:
            raise Interrupt
        calls.append(b)
        return f(b)

    with pytest.raises(Interrupt):
        search(flaky, c, p, min_stride=64, checkpoint=ckpt)
    assert len(json.loads(ckpt.read_text())["evaluations"]) == 20
    again = Counting(f)
    resumed = search(again, c, p, min_stride=64, checkpoint=ckpt)
    fresh = search(Counting(f), c, p, min_stride=64)
    assert resumed.boundaries == fresh.boundaries
    assert not set(again.calls) & set(calls)  # the 20 done before the interruption were not measured again
    assert len(again.calls) == fresh.evaluations - 20


def test_evaluator_memoises():
    ev = Evaluator(Counting(lambda b: 1.0))
    ev((0, 5, 10))
    ev((0, 5, 10))
    assert ev.measured == 1


@pytest.mark.parametrize("p, c, opt, seed", [
    (2, 16384, (0, 9728, 16384), (0, 8600, 16384)),  # the seed is off by more than the window
    (3, 6144, (0, 2600, 4480, 6144), (0, 2048, 4096, 6144)),
])
def test_a_seeded_window_slides_to_an_optimum_beyond_its_edge(p, c, opt, seed):
    f = lambda b: sum((x - o) ** 2 for x, o in zip(b, opt)) + 1.0  # noqa: E731
    measure = Counting(f)
    result = search(measure, c, p, min_stride=64, seed=seed, window=256)
    assert all(abs(x - o) <= 64 for x, o in zip(result.boundaries, opt)), result
    assert len(measure.calls) == len(set(measure.calls))


def test_polish_ends_on_a_point_no_neighbour_of_which_is_better_despite_a_misleading_measurement():
    # Rank 0's best part is 1088 of 2048, just past the even 1024. One noisy measurement (1280 a hair better
    # than 1216) sends the golden section to [1216, 1408], so without polishing the even partition, measured
    # first, stays the best and nothing between 1024 and 1216 is ever measured.
    def f(b):
        t = abs(b[1] - 1088) / 64 + 1.0
        return t - 1.1 if b[1] == 1280 else t

    rough = search(Counting(f), 2048, 2, min_stride=64, polish_best=False)
    polished = search(Counting(f), 2048, 2, min_stride=64)
    assert rough.boundaries == (0, 1024, 2048)
    assert polished.boundaries == (0, 1088, 2048) and polished.ttft_s == 1.0
    for step in (-64, 64):
        assert polished.all[(0, 1088 + step, 2048)] >= polished.ttft_s


@pytest.mark.parametrize("p, c", [(3, 3072), (4, 4096)])
def test_polish_measures_every_inner_boundary_of_the_best_point_both_ways(p, c):
    result = search(Counting(pipeline_ttft()), c, p, min_stride=64)
    best = result.boundaries
    for i in range(1, p):
        for step in (-64, 64):
            b = (*best[:i], best[i] + step, *best[i + 1:])
            assert b in result.all and result.all[b] >= result.ttft_s
