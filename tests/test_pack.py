"""Prepacking over the KV chain: the plan (bins, balanced cuts at prompt edges) on plain numbers, and packed
batches of mixed lengths on 1-4 real ranks, every prompt against the same prompt prefilled alone in one process."""

import random

import pytest

from kvrunahead.modes.packing import PackedStep, cuts_after_cached, ffd_bins, packed_cuts
from tests.helpers import world_runs


def quadratic(t: int) -> float:
    return 100.0 * t + t * (t + 1) / 2


def test_ffd_puts_the_longest_first_each_into_the_first_bin_with_room():
    assert ffd_bins([5, 9, 3, 4, 8], 12) == [[1, 2], [4, 3], [0]]
    assert ffd_bins([20, 1], 10) == [[0], [1]]  # a prompt beyond the step gets a bin of its own
    assert sorted(i for b in ffd_bins([7] * 9, 20) for i in b) == list(range(9))


def test_cuts_balance_the_packed_work_when_no_edge_is_near():
    cuts = packed_cuts([1000], 2, quadratic, edge_slack=0.1)
    assert cuts[0] == 0 and cuts[-1] == 1000
    left, right = quadratic(cuts[1]), quadratic(1000) - quadratic(cuts[1])
    assert abs(left - right) <= quadratic(cuts[1]) - quadratic(cuts[1] - 1)  # balanced to one token
    assert cuts[1] > 500  # the later tokens see more keys: the first part is longer


def test_new_tokens_after_a_cached_prefix_are_cut_by_their_work_with_the_prefix_priced_in():
    for p in (2, 3):
        cuts = cuts_after_cached(1000, 1400, p, quadratic)
        assert cuts[0] == 1000 and cuts[-1] == 1400 and len(cuts) == p + 1
        work = [quadratic(b) - quadratic(a) for a, b in zip(cuts, cuts[1:])]
        step = quadratic(1400) - quadratic(1399)  # one token's work, the most of any
        assert max(work) - min(work) <= step
    # against the cuts of the new tokens alone (no prefix to attend): the long prefix flattens the work per token,
    # so the first part shrinks toward an even cut
    alone = cuts_after_cached(0, 400, 2, quadratic)[1]
    assert alone - 0 > cuts_after_cached(1000, 1400, 2, quadratic)[1] - 1000 >= 195
    with pytest.raises(ValueError, match="nothing"):
        cuts_after_cached(400, 400, 2, quadratic)


def test_cuts_move_to_a_prompt_edge_within_the_slack_and_not_beyond():
    lengths = [300, 290, 310, 300]
    assert packed_cuts(lengths, 2, quadratic, edge_slack=0.1)[1] == 590  # an edge 1% of a part's work away
    assert packed_cuts(lengths, 2, quadratic, edge_slack=0.0)[1] not in (0, 300, 590, 900, 1200)
    one_long = [10, 2000, 10]
    cut = packed_cuts(one_long, 2, quadratic, edge_slack=0.1)[1]
    assert 10 < cut < 2010  # no edge is within reach: the long prompt is cut


def test_every_rank_gets_tokens_while_there_are_enough_and_empty_parts_sit_at_zero():
    assert packed_cuts([1, 1, 1, 1], 4, quadratic) == (0, 1, 2, 3, 4)
    assert packed_cuts([2], 4, quadratic) == (0, 0, 0, 1, 2)
    cuts = packed_cuts([1, 5000, 1], 4, quadratic, edge_slack=0.5)
    assert all(b > a for a, b in zip(cuts, cuts[1:]))


def test_a_step_knows_its_segments_positions_and_what_a_boundary_hands_on():
    step = PackedStep((0, 1, 2), (3, 4, 2), (0, 5, 9))
    assert step.edges == (0, 3, 7, 9)
    assert step.positions(0, 5) == [0, 1, 2, 0, 1] and step.positions(5, 9) == [2, 3, 0, 1]
    assert step.segments(0, 5) == [(0, 0, 3), (1, 3, 5)] and step.segments(5, 9) == [(1, 5, 7), (2, 7, 9)]
    assert step.handed_on(5) == 2 and step.handed_on(3) == 0 and step.handed_on(9) == 0
    assert step.ending_in(0, 5) == [0] and step.ending_in(5, 9) == [1, 2]


def test_ffd_bins_keep_every_prompt_once_and_under_the_step_size():
    rng = random.Random(1)
    lengths = [rng.randrange(1, 400) for _ in range(40)] + [1500]
    bins = ffd_bins(lengths, 1000)
    assert sorted(i for b in bins for i in b) == list(range(41))
    assert [40] in bins  # longer than a step: a bin of its own
    assert all(sum(lengths[i] for i in b) <= 1000 for b in bins if b != [40])
    # the engine packs waiting prompts in order up to the first that does not fit: submitted bin by bin, it takes
    # each bin whole, because no prompt of a later bin fitted an earlier one
    for earlier, later in zip(bins, bins[1:]):
        assert sum(lengths[i] for i in earlier) + lengths[later[0]] > 1000


# Mixed lengths: 1-token prompts, one far longer than the rest (cut across ranks without edge slack), short
# prompts wholly inside a part. Token ids are drawn from the tiny models' vocabulary.
RNG = random.Random(7)
MIXED = [[RNG.randrange(3, 250) for _ in range(n)] for n in (1, 40, 7, 230, 1, 19, 64, 3)]
NEW_TOKENS = 6
MODELS = ["tiny-llama", "tiny-gemma3"]  # full attention; sliding windows of 64 (Gemma 3 hybrid)


def _config(model: str) -> dict:
    return dict(model=model, dtype="float32", device="cpu", max_new_tokens=NEW_TOKENS, verify=True, threads=1,
                atol=1e-4, chat=False)


def _cases(p: int) -> list[dict]:
    cases = []
    for model in MODELS:
        batches = {"edges": dict(batching="packed", step_tokens=4096),
                   "cut": dict(batching="packed", step_tokens=4096, edge_slack=0.0),
                   "bins": dict(batching="packed", step_tokens=128, edge_slack=0.0),
                   "sequential": dict(batching="sequential")}
        for name, batch in batches.items():
            cases.append({"name": f"{model}/{name}", "config": _config(model), "prompts": MIXED, "batch": batch})
    return cases


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return world_runs(_cases, tmp_path_factory, "pack")


@pytest.mark.parametrize("p", [1, 2, 3, 4])
@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("batch", ["edges", "cut", "bins", "sequential"])
def test_packed_batch_matches_each_prompt_alone_in_one_process(runs, p, model, batch):
    got = runs(p)[f"{model}/{batch}"]
    assert len(got["prompts"]) == len(MIXED)
    bad = [(r["index"], r["first_logit_diff"], r["reference_text"]) for r in got["prompts"] if not r["matches"]]
    assert got["verified"] and not bad, bad
    assert [r["prompt_tokens"] for r in got["prompts"]] == [len(x) for x in MIXED]
    assert all(len(r["tokens"]) >= 1 for r in got["prompts"])


@pytest.mark.parametrize("p", [2, 3, 4])
def test_cut_prompts_travel_the_chain_and_edge_cuts_send_nothing(runs, p):
    cut = runs(p)["tiny-llama/cut"]
    assert any(n > 0 for s in cut["steps"] for n in s["handed_on"])  # the long prompt is cut between ranks
    assert sum(r["bytes_sent"] for r in cut["ranks"]) > 0
    for s in runs(p)["tiny-llama/edges"]["steps"]:
        for n, b in zip(s["handed_on"], s["boundaries"][1:-1]):
            assert n == 0 or b not in _edges(s["prompts"])


def _edges(members: list[int]) -> set[int]:
    out, at = {0}, 0
    for i in members:
        at += len(MIXED[i])
        out.add(at)
    return out


def test_a_prompt_spanning_three_ranks_is_relayed_whole(runs):
    cut = runs(4)["tiny-llama/cut"]
    step = next(s for s in cut["steps"] if 3 in s["prompts"])
    assert sum(n > 0 for n in step["handed_on"]) >= 2  # the 230-token prompt crosses two boundaries or more
