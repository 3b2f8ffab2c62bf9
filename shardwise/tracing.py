"""The lifecycle trace: what the schedule did, per rank, in order.

::

    with shardwise.trace() as t:
        loss = model(x).sum(); loss.backward()
    for e in t.events: print(e.kind, e.fqn, e.training_state)
    t.to_chrome_trace("step.json")   # open in chrome://tracing or Perfetto

Events (``kind``): ``unshard`` (all-gather issued), ``wait_unshard`` (all-gather waited,
params registered unsharded), ``reshard`` (unsharded storage freed), ``post_backward``
(a group's grads are complete), ``reduce`` (reduction issued), ``reduce_done``
(reduction waited and accumulated into ``.grad``). With no trace active and no torch
profiler running the cost is :func:`wanted`'s two flag tests per event; profiler ranges
named ``shardwise::<kind> (<fqn>)`` appear only while the torch profiler is running.

Collectives (``Trace.comms``): one :class:`CommSpan` per all-gather, reduce-scatter or
all-reduce a group issued, with three moments on this rank's monotonic clock: issued
(just before the call), done (first seen complete, polled at each lifecycle event) and waited (the span of ``work.wait()`` on the calling
thread: time this rank was *blocked* on the collective). :mod:`shardwise.step_report` turns
them into exposed communication and overlap.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import json
import os
import time
from typing import Iterator

import torch
import torch.autograd.profiler as _profiler
import torch.distributed as dist

from shardwise.collectives import work_is_completed

__all__ = ["trace", "Trace", "TraceEvent", "CommSpan"]


@dataclasses.dataclass(frozen=True)
class TraceEvent:
    """One lifecycle event of one group on this rank."""

    kind: str
    fqn: str
    training_state: str
    time_ns: int  # time.monotonic_ns()


@dataclasses.dataclass
class CommSpan:
    """One collective of one group on this rank; times are ``time.monotonic_ns()``.

    ``done_ns`` is when the collective was first seen complete (``work.is_completed()``
    polled at each lifecycle event and at its wait: see :meth:`Trace.poll`); a handle that
    cannot be polled (a custom comm's) counts as done when its wait returns. A synchronous
    collective (no work returned) was waited on from its issue to its return.
    """

    kind: str  # "all_gather", "reduce_scatter" or "all_reduce"
    fqn: str  # the group's module FQN
    training_state: str  # the group's training state when issued
    issue_ns: int
    done_ns: int | None = None
    wait_start_ns: int | None = None  # None: not waited (yet)
    wait_end_ns: int | None = None
    wait_state: str = ""  # the group's training state when waited

    @property
    def blocked_ns(self) -> int:
        """How long this rank's calling thread was blocked waiting for it."""
        if self.wait_start_ns is None or self.wait_end_ns is None:
            return 0
        return self.wait_end_ns - self.wait_start_ns

    @property
    def end_ns(self) -> int:
        """When the collective finished: its completion, else the end of its wait, else its issue."""
        if self.done_ns is not None:
            return self.done_ns
        return self.wait_end_ns if self.wait_end_ns is not None else self.issue_ns


class Trace:
    """The events recorded while a :func:`trace` context was active on this rank."""

    def __init__(self) -> None:
        self.events: list[TraceEvent] = []
        self.comms: list[CommSpan] = []
        self._in_flight: dict[int, tuple] = {}  # id(work) -> (work, its span), until waited
        self.rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0

    def add(self, kind: str, fqn: str, training_state: str) -> None:
        """Record one lifecycle event now (subclasses may sample more here)."""
        now = time.monotonic_ns()
        self.events.append(TraceEvent(kind, fqn, training_state, now))
        if self._in_flight:
            self.poll(now)

    def poll(self, now: int) -> None:
        """Stamp ``now`` as the completion of every in-flight collective found complete.

        Completion is observed, not signalled: a Python callback on the work's future would
        run on the communication thread and need the GIL at every collective (a first
        version did; GPT-small steps measured 13% slower with it, on a heavily loaded
        machine, so the share of the GIL handoffs in that is not known). So each lifecycle
        event asks the works still in flight ``is_completed()`` (a flag read in C++), and
        ``done_ns`` is an upper bound, late by at most the gap between two events.
        """
        for work, span in self._in_flight.values():
            if span.done_ns is None and work.is_completed():
                span.done_ns = now

    def add_comm(self, kind: str, fqn: str, training_state: str, start_ns: int, work) -> None:
        """Record a collective issued at ``start_ns`` (``work`` None: it ran synchronously)."""
        span = CommSpan(kind, fqn, training_state, start_ns)
        self.comms.append(span)
        if work is None:  # synchronous: blocked from issue to now
            span.wait_start_ns = start_ns
            span.wait_end_ns = span.done_ns = time.monotonic_ns()
            span.wait_state = training_state
        elif callable(getattr(work, "is_completed", None)):
            self._in_flight[id(work)] = (work, span)
        else:  # a custom handle that cannot be polled: done when its wait returns
            self._in_flight[id(work)] = (_NeverDone, span)

    def timed_wait(self, work, kind: str, fqn: str, training_state: str) -> None:
        """``work.wait()``, recording the blocked span against the collective's record."""
        _, span = self._in_flight.pop(id(work), (None, None))
        start = time.monotonic_ns()
        if span is not None and span.done_ns is None and work is not None and work_is_completed(work):
            span.done_ns = start
        work.wait()
        end = time.monotonic_ns()
        if span is None:  # issued before this trace began
            span = CommSpan(kind, fqn, training_state, start)
            self.comms.append(span)
        if span.done_ns is None:
            span.done_ns = end
        span.wait_start_ns, span.wait_end_ns, span.wait_state = start, end, training_state


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


class _NeverDone:
    """Stands in for a work that cannot be polled."""

    @staticmethod
    def is_completed() -> bool:
        return False


_ACTIVE: Trace | None = None


@contextlib.contextmanager
def trace() -> Iterator[Trace]:
    """Record this rank's lifecycle events while the context is open."""
    with recording(Trace()) as t:
        yield t


def _state_name(training_state: "str | enum.Enum") -> str:
    return training_state.value if isinstance(training_state, enum.Enum) else training_state


def wanted() -> bool:
    """Whether an event would go anywhere: a trace is active or the torch profiler runs.

    The hot path tests this before calling :func:`emit` (``if tracing.wanted(): emit(...)``):
    a step emits about nine events per unit, and the test alone costs half the call."""
    return _ACTIVE is not None or _profiler._is_profiler_enabled


def emit(kind: str, fqn: str, training_state: "str | enum.Enum") -> None:
    """Record an event if a trace is active; mark it for the torch profiler if one runs.

    ``training_state`` may be the group's enum: its name is read only when recording (with
    nothing :func:`wanted`, the call is two flag tests)."""
    if _ACTIVE is not None:
        _ACTIVE.add(kind, fqn, _state_name(training_state))
    if _profiler._is_profiler_enabled:
        with torch.profiler.record_function(f"shardwise::{kind} ({fqn})"):
            pass


@contextlib.contextmanager
def recording(recorder: Trace) -> Iterator[Trace]:
    """Make ``recorder`` (a :class:`Trace` or subclass) the active trace while open."""
    global _ACTIVE
    previous, _ACTIVE = _ACTIVE, recorder
    try:
        yield recorder
    finally:
        _ACTIVE = previous


def comm_clock() -> int:
    """The issue time of a collective about to start when a trace is active, else 0 (no clock read)."""
    return time.monotonic_ns() if _ACTIVE is not None else 0


def comm_issued(kind: str, fqn: str, training_state: "str | enum.Enum", start_ns: int, work) -> None:
    """Record a collective issued at ``start_ns`` (from :func:`comm_clock`) if a trace is active;
    ``work`` is its handle, ``None`` for a synchronous collective."""
    if _ACTIVE is not None:
        _ACTIVE.add_comm(kind, fqn, _state_name(training_state), start_ns, work)


def wait(work, kind: str, fqn: str, training_state: "str | enum.Enum") -> None:
    """``work.wait()``; while a trace is active, also record how long this rank was blocked."""
    if _ACTIVE is None:
        work.wait()
    else:
        _ACTIVE.timed_wait(work, kind, fqn, _state_name(training_state))
