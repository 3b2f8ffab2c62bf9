"""The lifecycle trace: what the schedule did, per rank, in order.

::

    with shardwise.trace() as t:
        loss = model(x).sum(); loss.backward()
    for e in t.events: print(e.kind, e.fqn, e.training_state)
    t.to_chrome_trace("step.json")   # open in chrome://tracing or Perfetto

Events (``kind``): ``unshard`` (all-gather issued), ``wait_unshard`` (all-gather waited,
params registered unsharded), ``reshard`` (unsharded storage freed), ``post_backward``
(a group's grads are complete), ``reduce`` (reduction issued), ``reduce_done``
(reduction waited and accumulated into ``.grad``). With no trace active the cost is
one ``is None`` test per event; profiler ranges named ``shardwise::<kind> (<fqn>)``
appear only while the torch profiler is running.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import time
from typing import Iterator

import torch
import torch.distributed as dist

__all__ = ["trace", "Trace", "TraceEvent"]


@dataclasses.dataclass(frozen=True)
class TraceEvent:
    """One lifecycle event of one group on this rank."""

    kind: str
    fqn: str
    training_state: str
    time_ns: int  # time.monotonic_ns()


class Trace:
    """The events recorded while a :func:`trace` context was active on this rank."""

    def __init__(self) -> None:
        self.events: list[TraceEvent] = []
        self.rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0

    def of(self, *kinds: str) -> list[tuple[str, str]]:
        """``(kind, fqn)`` pairs of the events whose kind is in ``kinds`` (all if none given)."""
        return [(e.kind, e.fqn) for e in self.events if not kinds or e.kind in kinds]

    def to_chrome_trace(self, path: str | os.PathLike) -> None:
        """Write the events as Chrome trace-event JSON (instant events on this rank's track)."""
        origin = self.events[0].time_ns if self.events else 0
        records = [
            {
                "name": f"{e.kind} ({e.fqn})",
                "cat": e.training_state,
                "ph": "i",
                "s": "t",
                "ts": (e.time_ns - origin) / 1000.0,
                "pid": self.rank,
                "tid": 0,
            }
            for e in self.events
        ]
        with open(path, "w") as f:
            json.dump({"traceEvents": records, "displayTimeUnit": "ms"}, f)


_ACTIVE: Trace | None = None


@contextlib.contextmanager
def trace() -> Iterator[Trace]:
    """Record this rank's lifecycle events while the context is open."""
    global _ACTIVE
    previous, _ACTIVE = _ACTIVE, Trace()
    try:
        yield _ACTIVE
    finally:
        _ACTIVE = previous


def emit(kind: str, fqn: str, training_state: str) -> None:
    """Record an event if a trace is active; mark it for the torch profiler if one runs."""
    if _ACTIVE is not None:
        _ACTIVE.events.append(TraceEvent(kind, fqn, training_state, time.monotonic_ns()))
    if torch.autograd.profiler._is_profiler_enabled:
        with torch.profiler.record_function(f"shardwise::{kind} ({fqn})"):
            pass
