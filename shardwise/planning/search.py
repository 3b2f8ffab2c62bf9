"""Choosing ``reshard_after_forward`` per unit: the cheapest communication that fits.

Keeping a block gathered after forward (False) saves its backward all-gather; keeping a
1/k share (int k) replaces it with a gather over k ranks; resharding (True) costs the
full gather but frees the most memory. The candidates, for every ``rest`` in
{True, each divisor k of N}::

    root False,  blocks[:n-m] = rest,  blocks[n-m:] = False     (m = 0 .. n)

(the *last* m blocks are kept: backward reaches them first, so they are freed first).
Memory grows with m and communication shrinks, so for each ``rest`` a binary search finds
the largest m that fits; the plan with the fewest bytes on the wire among those wins
(fewer collectives break ties). Each candidate is one replay of
:func:`~shardwise.planning.memory.peak_memory`.
"""

from __future__ import annotations

import dataclasses

from shardwise.planning.activations import ActivationTrace, Mark
from shardwise.planning.comm import CommCounts, step_comm
from shardwise.planning.memory import MemoryBreakdown, peak_memory
from shardwise.planning.setting import Setting
from shardwise.planning.structure import UnitShape

__all__ = ["Evaluation", "Evaluator", "cheapest_fitting", "layout", "rest_options"]


@dataclasses.dataclass(frozen=True)
class Evaluation:
    """One candidate wrapping and its predicted cost."""

    policies: tuple
    peak: MemoryBreakdown
    comm: CommCounts
    kept: int  # m: blocks kept gathered at the end
    rest: bool | int


class Evaluator:
    """Predicts cost of wrappings of one model in one setting (the trace is shared)."""

    def __init__(self, units: list[UnitShape], setting: Setting, trace: ActivationTrace | None, marks: list[Mark]):
        self.units, self.setting, self.trace, self.marks = units, setting, trace, marks

    def evaluate(self, policies: list, kept: int = 0, rest: bool | int = True) -> Evaluation:
        peak = peak_memory(self.units, policies, self.setting, self.trace, self.marks)
        return Evaluation(tuple(policies), peak, step_comm(self.units, policies, self.setting), kept, rest)

    def peak_without_activations(self, policies: list) -> MemoryBreakdown:
        return peak_memory(self.units, policies, self.setting, self.trace, self.marks, activations=False)


def layout(n_blocks: int, rest: bool | int, kept: int, root: bool | int = False) -> list:
    """Policies root first: the first ``n_blocks - kept`` blocks ``rest``, the last ``kept`` False."""
    return [root] + [rest] * (n_blocks - kept) + [False] * kept


def rest_options(shard_size: int) -> list[bool | int]:
    """True, then every proper divisor k >= 2 of the shard size (int reshard needs k | N)."""
    return [True] + [k for k in range(2, shard_size) if shard_size % k == 0]


def cheapest_fitting(ev: Evaluator, n_blocks: int, budget: int) -> tuple[Evaluation | None, Evaluation]:
    """(cheapest plan within ``budget`` or None, the least-memory plan).

    The least-memory plan is every block resharded (root kept), what to report when
    nothing fits.
    """
    leanest = ev.evaluate(layout(n_blocks, True, 0), 0, True)
    if leanest.peak.total > budget:
        return None, leanest
    best = None
    for rest in rest_options(ev.setting.shard_size):
        found = _most_kept(ev, n_blocks, rest, budget)
        if found is not None and (best is None or _cost(found) < _cost(best)):
            best = found
    return best, leanest


def _most_kept(ev: Evaluator, n_blocks: int, rest: bool | int, budget: int) -> Evaluation | None:
    """Binary search for the largest m whose plan fits (memory grows with m)."""
    lo, hi, found = 0, n_blocks, None
    while lo <= hi:
        m = (lo + hi) // 2
        cand = ev.evaluate(layout(n_blocks, rest, m), m, rest)
        if cand.peak.total <= budget:
            found, lo = cand, m + 1
        else:
            hi = m - 1
    return found


def _cost(e: Evaluation) -> tuple[int, int, int]:
    return e.comm.total_wire_bytes, e.comm.total_count, e.peak.total
