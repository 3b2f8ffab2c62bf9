"""The recording half of the report: a :class:`~shardwise.tracing.Trace` that also samples
memory, cut into steps.

While a :class:`StepRecorder` is the active trace, every lifecycle event also samples this
rank's memory, every collective a group issues becomes a
:class:`~shardwise.tracing.CommSpan` (issue, completion, blocked wait), and
``end_step()`` reduces what the step recorded to one
:class:`~shardwise.step_report.steps.StepRecord` and starts the next. The raw spans of the
last ``keep_raw`` steps are kept for the timeline plot and the Chrome trace; older ones
are dropped, so a long run's memory stays bounded.

Cost. Events are stored in columns (lists of the strings given, ``array`` of times and
bytes), not as one object per event: nothing the garbage collector tracks is allocated on
the hot path besides one :class:`~shardwise.tracing.CommSpan` per collective. Conversion to
JSON happens once, when the report is written. With no report active none of this runs.
"""

from __future__ import annotations

import collections
import math
import dataclasses
import time
from array import array
from typing import Any

from shardwise import comm_stats
from shardwise.step_report.memory import MemorySampler
from shardwise.step_report.steps import MemoryColumns, StepInput, StepRecord, summarize_step
from shardwise.tracing import CommSpan, Trace

__all__ = ["RawStep", "StepRecorder"]

_NS_PER_MS = 1e6

MEMORY_BUDGET = 0.003
"""At most this fraction of a step goes to memory samples. ``mallinfo2`` walks every malloc
arena (one per thread that allocated: gloo's threads add theirs), tens of µs per call in a
training process; GPT-small at 2 ranks spent ~5% of its training thread's CPU sampling at
every event. Each step measures the cost and thins the next step's samples to every k-th
event (the step's end is always sampled)."""


@dataclasses.dataclass
class RawStep:
    """One kept step of one rank, as recorded (ns on this rank's clock); :meth:`to_json` converts."""

    step: int
    rank: int
    start_ns: int
    end_ns: int
    kinds: list[str]  # event i: kind, group FQN, training state, time; memory sample i was taken at it
    fqns: list[str]
    states: list[str]
    memory: MemoryColumns  # a time per event and one at the step's end; bytes -1 where not sampled
    comms: list[CommSpan]

    def to_json(self, origin_ns: int) -> dict[str, Any]:
        """Times in ms from ``origin_ns``: the form the export and the plots read."""

        def ms(ns: int | None) -> float | None:
            return None if ns is None else (ns - origin_ns) / _NS_PER_MS

        m = self.memory
        labels = [f"{k} ({f or 'root'})" for k, f in zip(self.kinds, self.fqns)] + ["step end"]
        return {
            "step": self.step, "rank": self.rank, "start_ms": ms(self.start_ns), "end_ms": ms(self.end_ns),
            "events": [(k, f, s, ms(t)) for k, f, s, t in zip(self.kinds, self.fqns, self.states, m.times)],
            "comms": [_comm_json(c, ms) for c in self.comms],
            "memory": [(ms(t), b, label) for t, b, label in zip(m.times, m.bytes, labels) if b >= 0],
        }  # fmt: skip


class StepRecorder(Trace):
    """A trace cut into steps, with a memory sample at every lifecycle event.

    Unlike a plain :class:`~shardwise.tracing.Trace`, ``events`` stays empty: the
    recorder keeps its events in columns (see the module docstring).
    """

    sampler: MemorySampler
    origin_ns: int  # time zero of every recorded ms (the report's entry barrier)
    records: list[StepRecord]  # one per finished step
    raw: collections.deque  # RawStep of the last keep_raw steps

    def __init__(self, sampler: MemorySampler, origin_ns: int, keep_raw: int = 20) -> None:
        super().__init__()
        self.sampler = sampler
        self.origin_ns = origin_ns
        self.records = []
        self.raw = collections.deque(maxlen=keep_raw)
        self._every = self._countdown = 1  # sample memory at every k-th event
        self._sample_ns = self._samples = 0  # cost of this step's memory samples
        self._step = 0
        self._start_ns = time.monotonic_ns()
        self._wire = comm_stats.snapshot().wire_bytes
        self._new_columns()

    def _new_columns(self) -> None:
        self._kinds: list[str] = []
        self._fqns: list[str] = []
        self._states: list[str] = []
        self._memory = MemoryColumns(array("q"), array("q"))

    def add(self, kind: str, fqn: str, training_state: str) -> None:
        now = time.monotonic_ns()
        self._kinds.append(kind)
        self._fqns.append(fqn)
        self._states.append(training_state)
        self._memory.times.append(now)
        self._countdown -= 1
        if self._countdown > 0:
            self._memory.bytes.append(-1)  # not sampled (see MEMORY_BUDGET)
        else:
            self._countdown = self._every
            self._memory.bytes.append(self.sampler.sample())
            self._sample_ns += time.monotonic_ns() - now
            self._samples += 1
        if self._in_flight:
            self.poll(now)

    def _thin_memory_samples(self, wall_ns: int, events: int) -> None:
        """Sample every k-th event next step, so sampling costs at most MEMORY_BUDGET of a step."""
        per_sample = self._sample_ns / max(1, self._samples)
        allowed = max(1.0, MEMORY_BUDGET * wall_ns / max(per_sample, 1.0))
        self._every = max(1, math.ceil(events / allowed))
        self._sample_ns = self._samples = 0

    def end_step(self, loss: float | None = None) -> StepRecord:
        """Close the current step (its record is returned) and open the next."""
        end = time.monotonic_ns()
        self._memory.times.append(end)
        self._memory.bytes.append(self.sampler.sample())
        self._sample_ns += time.monotonic_ns() - end
        self._samples += 1
        self._thin_memory_samples(end - self._start_ns, len(self._kinds))
        self.poll(end)
        wire = comm_stats.snapshot().wire_bytes
        record = summarize_step(StepInput(
            self._step, self.rank, self.origin_ns, self._start_ns, end, self.comms, self._memory, self._kinds,
            self._fqns, {k: wire[k] - self._wire.get(k, 0) for k in wire if wire[k] != self._wire.get(k, 0)}, loss,
        ))  # fmt: skip
        self.records.append(record)
        self.raw.append(RawStep(self._step, self.rank, self._start_ns, end, self._kinds, self._fqns, self._states,
                                self._memory, self.comms))  # fmt: skip
        # issued in this step, waited in the next (a prefetch across the boundary): carry once
        self.comms = [c for c in self.comms if c.wait_start_ns is None and c.issue_ns >= self._start_ns]
        keep = {id(c) for c in self.comms}
        self._in_flight = {k: v for k, v in self._in_flight.items() if id(v[1]) in keep}
        self._new_columns()
        self._step, self._start_ns, self._wire = self._step + 1, end, wire
        return record


def _comm_json(c: CommSpan, ms) -> dict:
    return {
        "kind": c.kind, "fqn": c.fqn, "issue": ms(c.issue_ns), "done": ms(c.end_ns),
        "wait_start": ms(c.wait_start_ns), "wait_end": ms(c.wait_end_ns), "wait_state": c.wait_state,
    }  # fmt: skip
