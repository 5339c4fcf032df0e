"""The quantiles the summaries report (drain runs, relay runs): nearest rank, no interpolation."""

from __future__ import annotations

from collections.abc import Sequence


def quantile(sorted_values: Sequence[float], q: float) -> float | None:
    """The `q` quantile of already sorted values, rounded to microseconds; None when empty."""
    if not sorted_values:
        return None
    return round(sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))], 6)
