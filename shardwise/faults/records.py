"""What a rank says about its collectives: the descriptor of one collective, and the status
each rank publishes to the c10d store (what it waits on, when it last reported).

Both are small picklable values: ranks compare descriptors (the order check) and read
each other's status (the watchdog) through the store, never through a collective.
"""

from __future__ import annotations

import time
from typing import NamedTuple

__all__ = ["Collective", "Position", "RankStatus", "END_OF_STEP", "describe_position"]

END_OF_STEP = "end of step"
"""The op of the marker every rank records at the end of an order-checked step, so a rank
that issued fewer collectives in that step meets a marker instead of a collective."""


class Collective(NamedTuple):
    """One collective as every rank must issue it: same op, module, size and dtype."""

    op: str  # "all-gather", "reduce-scatter", "all-reduce", or END_OF_STEP
    fqn: str  # the fully_shard module's FQN ("" for the root module)
    phase: str  # "forward" or "backward"
    numel: int  # elements of the collective's (per-rank) input
    dtype: object  # its torch.dtype (None for END_OF_STEP)

    def same_as(self, other: "Collective") -> bool:
        """Whether two ranks' collectives match (the phase is context only)."""
        return (self.op, self.fqn, self.numel, self.dtype) == (other.op, other.fqn, other.numel, other.dtype)

    @property
    def module(self) -> str:
        return self.fqn or "the root module"

    def describe(self) -> str:
        """``the backward reduce-scatter of layers.3`` / ``the end of its step``."""
        if self.op == END_OF_STEP:
            return "at the end of its step (no further collective)"
        return f"in the {self.phase} {self.op} of {self.module}"


class Position(NamedTuple):
    """Where in the sequence of one process group a collective sits."""

    group: str  # the process group's name (same on every rank)
    seq: int  # 0-based index of the collective on that group (shown 1-based: #seq+1)
    step: int  # root forwards begun on that group before it (0-based)
    collective: Collective


def describe_position(pos: Position) -> str:
    """``in the forward all-gather of extra (step 5, collective #41)``."""
    return f"{pos.collective.describe()} (step {pos.step}, collective #{pos.seq + 1})"


class RankStatus(NamedTuple):
    """What a rank publishes every heartbeat: when, and what it is blocked on."""

    rank: int
    wall_time: float  # time.time() at publication
    waiting: Position | None  # the collective (or order check) it is blocked on
    waiting_since: float | None  # time.time() when that wait began
    checking: bool  # blocked in the order check (before issuing), not on a collective

    def age(self, now: float | None = None) -> float:
        return (time.time() if now is None else now) - self.wall_time

    def describe(self) -> str:
        if self.waiting is None:
            return f"rank {self.rank} is not in a shardwise collective (computing)"
        where = describe_position(self.waiting)
        if self.checking:
            return f"rank {self.rank} is about to issue: {where[3:] if where.startswith('in ') else where}"
        return f"rank {self.rank} is {where}"
