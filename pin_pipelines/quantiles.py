"""The quantiles the summaries report (drain runs, relay runs, loads): nearest rank, no
interpolation."""

from __future__ import annotations

import random
from collections.abc import Sequence


def quantile(sorted_values: Sequence[float], q: float) -> float | None:
    """The `q` quantile of already sorted values, rounded to microseconds; None when empty."""
    if not sorted_values:
        return None
    return round(sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))], 6)


class Reservoir:
    """A uniform sample of at most `size` values of a stream (algorithm R) and the stream's
    maximum: quantiles of a worker that runs for hours in bounded memory."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.values: list[float] = []
        self.seen = 0
        self.max: float | None = None

    def add(self, value: float) -> None:
        self.seen += 1
        self.max = value if self.max is None else max(value, self.max)
        if len(self.values) < self.size:
            self.values.append(value)
        elif (slot := random.randrange(self.seen)) < self.size:
            self.values[slot] = value

    def quantile(self, q: float) -> float | None:
        return quantile(sorted(self.values), q)
