"""The errors fault detection raises: every rank that detects a fault raises one of these,
with a message naming the step, the collective (module and op) and what each rank did."""

from __future__ import annotations

__all__ = ["CollectiveFailedError", "CollectiveMismatchError", "CollectiveTimeoutError"]


class CollectiveMismatchError(RuntimeError):
    """Ranks issued different collectives at the same position (control flow that differs
    by rank, different modules called): found before the collective is issued."""


class CollectiveTimeoutError(RuntimeError):
    """A collective did not complete by the watchdog deadline and the ranks' reports explain
    why (a peer waits on another collective, or has not reported: dead or stopped), or the
    collective failed (a peer's connection closed)."""


class CollectiveFailedError(RuntimeError):
    """A shardwise collective failed (the backend raised: a peer closed its connection,
    the process-group timeout passed); the message adds what every peer last reported."""
