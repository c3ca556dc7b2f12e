"""Partition parsing and rounding."""

import pytest

from kvrunahead.partition import Partition, PartitionError, boundaries_at_rates, parse_partition


def test_even_partition_covers_the_context():
    p = parse_partition("even", 10, 3)
    assert p.boundaries == (0, 3, 7, 10) and sum(p.sizes) == 10


def test_explicit_boundaries_are_kept():
    assert parse_partition("0,9728,16384", 16384, 2).sizes == (9728, 6656)


@pytest.mark.parametrize("ratios, c", [([0.35, 0.25, 0.21, 0.19], 1000), ([0.5, 0.5], 7), ([0.3, 0.3, 0.4], 11)])
def test_ratios_round_to_within_one_token_and_sum_to_the_context(ratios, c):
    p = Partition.from_ratios(ratios, c)
    assert p.context_len == c
    assert all(abs(s - r * c) < 1 for s, r in zip(p.sizes, ratios))


def test_tiny_shares_are_raised_to_one_token_from_the_largest_part():
    assert Partition.from_ratios([0.97, 0.01, 0.01, 0.01], 5).sizes == (2, 1, 1, 1)


def test_ratio_spec_is_parsed():
    assert parse_partition("0.6,0.4", 100, 2).boundaries == (0, 60, 100)


@pytest.mark.parametrize(
    "spec, c, p, message",
    [
        ("0,5,10", 10, 3, "2 parts but the world size is 3"),
        ("0,5,5,10", 10, 3, "part 1 is empty"),
        ("0,5,9", 10, 2, "must end at the context length 10"),
        ("1,5,10", 10, 2, "must start at 0"),
        ("even", 2, 3, "smaller than the 3 ranks"),
        ("0.5,0.2", 10, 2, "sum to 1"),
    ],
)
def test_bad_partitions_are_refused(spec, c, p, message):
    with pytest.raises(PartitionError, match=message):
        parse_partition(spec, c, p)


@pytest.mark.parametrize("p", [2, 3, 4])
@pytest.mark.parametrize("rates", [(1.0, 1.0, 1.0, 1.0), (1.0, 5.0, 0.2, 3.0), (0.05, 1.0, 20.0, 1.0)])
def test_boundaries_at_rates_are_a_partition_of_every_length_the_ranks_can_share(p, rates):
    """A quantum of 8 tokens for prompts of p to 80 tokens: every part non-empty, every cut inside the prompt (a
    5-token prompt over 2 ranks was once cut at -3)."""
    def work(prefix, tokens):
        return tokens * (1 + (prefix + tokens / 2) / 100)

    for n in range(p, 81):
        b = boundaries_at_rates(rates[:p], work, n, quantum=8)
        assert b[0] == 0 and b[-1] == n and all(lo < hi for lo, hi in zip(b, b[1:])), (n, b)
        assert len(b) == p + 1
    with pytest.raises(PartitionError, match="smaller than"):
        boundaries_at_rates(rates[:p], work, p - 1, quantum=8)
