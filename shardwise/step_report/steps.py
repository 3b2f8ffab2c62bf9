"""One step on one rank, reduced to the numbers the report shows (pure functions).

Definitions (all on this rank's clock, per step, in milliseconds):

- **wall**: from one ``Report.step()`` to the next.
- **exposed communication**: the time this rank's training thread was *blocked* in a
  shardwise collective's wait — ``wait_for_unshard`` of an all-gather, the wait of a
  reduction (reduce-scatter, all-reduce), and the whole of a synchronous collective. On
  CPU/gloo collectives run on gloo's own threads, so this is exactly the communication
  the step did not hide behind compute. (gloo's reduce-scatter is an all-to-all plus a
  local sum that runs in the wait: that sum is counted as exposed reduction time, as a
  native reduce-scatter would do it inside the collective.) On CUDA a wait only orders
  streams, so the host is rarely blocked: read the device side from the torch profiler.
- **compute**: wall minus exposed: everything else the thread did (kernels, Python,
  the optimizer, copy-in/copy-out, data loading inside the step).
- **communication per kind**: the time at least one collective of that kind was in
  flight, from its issue to its completion, clipped to the step. Completion is when the
  work was first seen complete (polled at each lifecycle event and at its wait: an upper
  bound, late by at most the gap between two events; see ``Trace.poll``).
- **overlap fraction**: ``1 - exposed / busy`` where ``busy`` is the time any
  collective was in flight: 1 means every collective was hidden, 0 means the thread
  waited through all of them.
- **waits**: exposed time per ``(group, collective kind, phase)``; phase is the group's
  training state at the wait (``forward``, ``backward``, or ``other``).
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, NamedTuple, Sequence

from shardwise.tracing import CommSpan

__all__ = ["StepRecord", "WaitRecord", "StepInput", "MemoryColumns", "union_ns", "phase_of", "summarize_step", "records_from_json"]

_NS_PER_MS = 1e6
_PHASES = {"forward": "forward", "pre_backward": "backward", "post_backward": "backward"}


@dataclasses.dataclass
class WaitRecord:
    """Exposed time of one group's collective of one kind in one phase, within one step."""

    fqn: str
    kind: str  # all_gather, reduce_scatter, all_reduce
    phase: str  # forward, backward, other
    ms: float  # blocked time, summed over the collectives of this key in the step
    count: int  # collectives waited
    lead_ms: float  # issue -> wait start, summed (how far ahead it was issued)
    duration_ms: float  # issue -> completion, summed


@dataclasses.dataclass
class StepRecord:
    """One step of one rank; every time in ms, every size in bytes (JSON-ready)."""

    step: int
    rank: int
    start_ms: float  # from the report's origin (the barrier at entry)
    wall_ms: float
    compute_ms: float
    exposed_ms: float
    busy_ms: float  # any collective in flight
    overlap: float | None  # None when no collective ran
    comm_ms: dict[str, float]  # kind -> in flight
    waits: list[WaitRecord]
    wire_bytes: dict[str, int]  # comm_stats kind -> bytes sent (ring model)
    peak_bytes: int
    peak_at_ms: float  # from the step's start
    peak_event: str  # the lifecycle event of the peak sample
    loss: float | None


def union_ns(intervals: Iterable[tuple[int, int]]) -> int:
    """Total length covered by the ``(start, end)`` intervals (overlaps counted once)."""
    total, cur_start, cur_end = 0, None, None
    for start, end in sorted(intervals):
        if cur_end is None or start > cur_end:
            if cur_end is not None:
                total += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    if cur_end is not None:
        total += cur_end - cur_start
    return total


def phase_of(training_state: str) -> str:
    """``forward``, ``backward`` or ``other`` for a group's training state value."""
    return _PHASES.get(training_state, "other")


def _waits(comms: list[CommSpan]) -> list[WaitRecord]:
    by_key: dict[tuple[str, str, str], WaitRecord] = {}
    for c in comms:
        if c.wait_start_ns is None:
            continue
        key = (c.fqn, c.kind, phase_of(c.wait_state))
        rec = by_key.get(key)
        if rec is None:
            rec = by_key[key] = WaitRecord(*key, 0.0, 0, 0.0, 0.0)
        rec.ms += c.blocked_ns / _NS_PER_MS
        rec.count += 1
        rec.lead_ms += (c.wait_start_ns - c.issue_ns) / _NS_PER_MS
        rec.duration_ms += (c.end_ns - c.issue_ns) / _NS_PER_MS
    return list(by_key.values())


def _in_flight(comms: list[CommSpan], start: int, end: int, kind: str | None) -> int:
    spans = [(max(c.issue_ns, start), min(c.end_ns, end)) for c in comms if kind is None or c.kind == kind]
    return union_ns((a, b) for a, b in spans if b > a)


class MemoryColumns(NamedTuple):
    """Memory samples of one step in columns: ``times[i]`` (ns), ``bytes[i]``."""

    times: Sequence[int]
    bytes: Sequence[int]


@dataclasses.dataclass
class StepInput:
    """What the recorder hands over at a step boundary (times in ns on this rank's clock)."""

    step: int
    rank: int
    origin_ns: int
    start_ns: int
    end_ns: int
    comms: list[CommSpan]  # issued in this step, or waited in it
    memory: MemoryColumns  # sample i at event i (kinds[i], fqns[i]), bytes -1 where not sampled; one more at the end
    kinds: list[str]
    fqns: list[str]
    wire_bytes: dict[str, int]
    loss: float | None


def summarize_step(s: StepInput) -> StepRecord:
    """Reduce one step's spans and samples to a :class:`StepRecord`."""
    wall = s.end_ns - s.start_ns
    waited = [c for c in s.comms if c.wait_start_ns is not None and c.wait_start_ns >= s.start_ns]
    exposed = sum(c.blocked_ns for c in waited)
    busy = _in_flight(s.comms, s.start_ns, s.end_ns, None)
    kinds = sorted({c.kind for c in s.comms})
    m = s.memory
    i = max(range(len(m.bytes)), key=m.bytes.__getitem__) if len(m.bytes) else None
    peak_t, peak = (m.times[i], m.bytes[i]) if i is not None else (s.start_ns, 0)
    kind, fqn = (s.kinds[i], s.fqns[i]) if i is not None and i < len(s.kinds) else ("", "")
    return StepRecord(
        step=s.step, rank=s.rank, start_ms=(s.start_ns - s.origin_ns) / _NS_PER_MS, wall_ms=wall / _NS_PER_MS,
        compute_ms=(wall - exposed) / _NS_PER_MS, exposed_ms=exposed / _NS_PER_MS, busy_ms=busy / _NS_PER_MS,
        overlap=None if busy == 0 else max(0.0, 1.0 - exposed / busy),
        comm_ms={k: _in_flight(s.comms, s.start_ns, s.end_ns, k) / _NS_PER_MS for k in kinds},
        waits=_waits(waited), wire_bytes=dict(s.wire_bytes), peak_bytes=peak,
        peak_at_ms=(peak_t - s.start_ns) / _NS_PER_MS, peak_event=f"{kind} ({fqn or 'root'})" if kind else "step end",
        loss=s.loss,
    )  # fmt: skip


def records_from_json(rows: list[dict]) -> list[StepRecord]:
    """Rebuild :class:`StepRecord` objects from their ``dataclasses.asdict`` form."""
    return [StepRecord(**{**r, "waits": [WaitRecord(**w) for w in r["waits"]]}) for r in rows]
