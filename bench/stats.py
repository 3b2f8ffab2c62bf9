"""Summaries of step times: a median with a spread, and how ranks are combined.

Every rank times every step (after a barrier, so all ranks start together). A rank's
steps are summarised by their median and 10th/90th percentiles; across ranks the report
takes the *maximum* of each statistic, because a synchronous data-parallel step is as
slow as its slowest rank.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

__all__ = ["Spread", "percentile", "spread", "worst_rank"]


class Spread(NamedTuple):
    """Median and 10th/90th percentiles of a set of samples (seconds)."""

    median: float
    p10: float
    p90: float


def percentile(samples: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) with linear interpolation between order statistics."""
    if not samples:
        raise ValueError("percentile of no samples")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q must be in [0, 100], got {q}")
    ordered = sorted(samples)
    pos = (len(ordered) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def spread(samples: Sequence[float]) -> Spread:
    """Median, p10 and p90 of ``samples``."""
    return Spread(percentile(samples, 50), percentile(samples, 10), percentile(samples, 90))


def worst_rank(per_rank: Sequence[Sequence[float]]) -> Spread:
    """Max over ranks of each rank's median, p10 and p90."""
    spreads = [spread(samples) for samples in per_rank]
    return Spread(*(max(values) for values in zip(*spreads)))
