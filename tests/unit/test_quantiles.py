"""The summaries' quantiles and the bounded sample they are read from (loads and relay runs that
last hours keep at most `size` values)."""

from __future__ import annotations

import random

from pin_pipelines.quantiles import Reservoir, quantile


def test_quantile_is_the_nearest_rank_of_sorted_values() -> None:
    assert quantile([], 0.5) is None
    assert quantile([1.0, 2.0, 3.0, 4.0], 0.5) == 3.0
    assert quantile([1.0, 2.0, 3.0, 4.0], 0.99) == 4.0


def test_a_reservoir_keeps_all_values_until_full_then_a_uniform_sample() -> None:
    """Tried: 100,000 values 0..99,999 into 1,000 slots: the sample stays at 1,000, the maximum
    is exact, and the sample's median is the stream's within 10 % (a uniform sample's median
    lies this close with overwhelming probability; seeded, so the run is repeatable)."""
    random.seed(28)
    small = Reservoir(5)
    for value in (3.0, 1.0, 2.0):
        small.add(value)
    assert sorted(small.values) == [1.0, 2.0, 3.0] and small.max == 3.0 and small.seen == 3
    assert small.quantile(0.5) == 2.0
    big = Reservoir(1_000)
    for value in range(100_000):
        big.add(float(value))
    assert len(big.values) == 1_000 and big.seen == 100_000 and big.max == 99_999.0
    median = big.quantile(0.5)
    assert median is not None and abs(median - 50_000) < 5_000
