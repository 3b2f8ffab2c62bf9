"""What every rank runs for one case: both implementations, interleaved step by step.

Algorithm of :func:`run_case` (every rank, in lockstep):

1. Build both contenders from the same seed (identical weights) and draw this rank's
   batches; step ``i`` of either implementation trains on batch ``i``. Rank 0 also
   builds the compute-only baseline (:mod:`bench.baseline`).
2. Warm up, then time: for each step index, run one step of each implementation, the
   order flipping every step (A B, B A, A B, ...), so slow drift of the machine's load
   and any "second one runs warmer" effect hit both sides equally; then rank 0 runs
   the baseline's step while the others wait in the next barrier. Each contender step
   starts after a barrier and is timed on every rank; ``wchar`` is read around it.
3. Untimed extra steps, each implementation in turn on the same batch: one under
   :class:`~shardwise.testing.CommCounter` (collectives and payloads), one under
   :class:`~bench.memory.PeakMemory` (peak live bytes; the baseline too), and with
   ``profile`` one under cProfile on rank 0. They come after timing so no mode is ever
   active while timing.

The result is a :class:`CaseMeasurement` per rank, raw (every step time);
:mod:`bench.report` turns the ranks' measurements into the report.
"""

from __future__ import annotations

import dataclasses
import time
from typing import NamedTuple

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from bench.baseline import build_compute_only
from bench.cases import Case, Settings
from bench.contenders import Contender, build_pair
from bench.memory import PeakMemory, tensors_of
from bench.profiling import PACKAGE_OF, StepProfile, profile_call
from bench.wire import CountedComm, count_events, read_wchar
from bench.workload import Batch, make_batches, train_step
from shardwise import comm_stats
from shardwise.testing import CommCounter
from shardwise.train.model import GPTConfig

__all__ = ["ImplMeasurement", "CaseMeasurement", "EXTRA_STEPS", "run_case"]

EXTRA_STEPS = 3
"""Untimed steps after the timed ones: counted, memory-tracked, profiled (batches are drawn for all)."""


@dataclasses.dataclass
class ImplMeasurement:
    """One rank's raw measurements of one implementation (or the baseline) in one case."""

    name: str  # contender name, e.g. "torch.fully_shard"
    step_s: list[float] = dataclasses.field(default_factory=list)  # each timed step
    thread_cpu_s: list[float] = dataclasses.field(default_factory=list)  # training thread's CPU time of each timed step
    socket_bytes: list[int] = dataclasses.field(default_factory=list)  # wchar delta of each timed step
    losses: list[float] = dataclasses.field(default_factory=list)  # warmup, timed, counted, memory steps
    comm: CountedComm | None = None  # collectives of the counted step (not for the baseline)
    self_reported_wire_bytes: int | None = None  # shardwise.comm_stats over the counted step
    peak_bytes: int = 0  # peak live tensor bytes of the memory step
    start_bytes: int = 0  # live bytes of parameters, grads and optimizer state at its start
    profile: StepProfile | None = None  # rank 0 with Settings.profile only


class CaseMeasurement(NamedTuple):
    """One rank's measurements of a case."""

    shardwise: ImplMeasurement
    torch: ImplMeasurement
    compute_only: ImplMeasurement | None  # rank 0 only


class _Arm(NamedTuple):
    """A contender and where its measurements go."""

    contender: Contender
    record: ImplMeasurement


def run_case(case: Case, settings: Settings, mesh: DeviceMesh) -> CaseMeasurement:
    """Measure ``case`` on this rank; every rank of ``mesh`` must call it with the same arguments."""
    pair = [_Arm(c, ImplMeasurement(c.name)) for c in build_pair(case, mesh, settings.seed, settings.optimizer)]
    baseline = None
    if dist.get_rank() == 0:
        plain = build_compute_only(case, settings.seed, settings.optimizer)
        baseline = _Arm(plain, ImplMeasurement(plain.name))
    total = settings.warmup + settings.steps + EXTRA_STEPS
    batches = iter(make_batches(GPTConfig.preset(case.model), settings.batch_size, total, settings.seed, dist.get_rank()))
    for i in range(settings.warmup + settings.steps):
        _interleaved_step(i, pair, baseline, next(batches), timed=i >= settings.warmup)
    _counted_step(pair, next(batches))
    _memory_step(pair, baseline, next(batches))
    batch = next(batches)
    if settings.profile:
        _profiled_step(pair, batch)
    return CaseMeasurement(pair[0].record, pair[1].record, baseline.record if baseline else None)


def _order(step: int) -> tuple[int, int]:
    """Which implementation goes first at ``step``: A B, then B A, alternating."""
    return (0, 1) if step % 2 == 0 else (1, 0)


def _interleaved_step(i: int, pair: list[_Arm], baseline: _Arm | None, batch: Batch, timed: bool) -> None:
    """Step ``i`` of both implementations (a barrier before each), then of the baseline on rank 0."""
    for j in _order(i):
        dist.barrier()
        _step(pair[j], batch, timed)
    if baseline is not None:
        _step(baseline, batch, timed)  # the other ranks wait in the next barrier meanwhile


def _step(arm: _Arm, batch: Batch, timed: bool) -> None:
    """One training step; when ``timed``, record its seconds and its ``wchar`` delta."""
    c, rec = arm
    wchar0 = read_wchar()
    cpu0, start = time.thread_time(), time.perf_counter()
    loss = train_step(c.model, c.optimizer, batch)
    elapsed, cpu = time.perf_counter() - start, time.thread_time() - cpu0
    wchar1 = read_wchar()
    rec.losses.append(loss.item())
    if timed:
        rec.step_s.append(elapsed)
        rec.thread_cpu_s.append(cpu)
        if wchar0 is not None and wchar1 is not None:
            rec.socket_bytes.append(wchar1 - wchar0)


def _counted_step(pair: list[_Arm], batch: Batch) -> None:
    """One step per implementation with CommCounter on (and shardwise's own tally reset)."""
    for c, rec in pair:
        dist.barrier()
        comm_stats.reset()
        with CommCounter() as counter:
            loss = train_step(c.model, c.optimizer, batch)
        rec.comm = count_events(counter.events)
        if c.name.startswith("shardwise."):
            rec.self_reported_wire_bytes = comm_stats.snapshot().total_wire_bytes
        rec.losses.append(loss.item())


def _memory_step(pair: list[_Arm], baseline: _Arm | None, batch: Batch) -> None:
    """One step per implementation (and baseline) under PeakMemory, seeded with its long-lived tensors and the batch."""
    for arm in pair + ([baseline] if baseline is not None else []):
        c, rec = arm
        if arm is not baseline:
            dist.barrier()
        with PeakMemory(tensors_of(c.model, c.optimizer) + list(batch)) as memory:
            loss = train_step(c.model, c.optimizer, batch)
        rec.peak_bytes, rec.start_bytes = memory.peak_bytes, memory.start_bytes
        rec.losses.append(loss.item())


def _profiled_step(pair: list[_Arm], batch: Batch) -> None:
    """One step per implementation, under cProfile on rank 0 (plain elsewhere)."""
    for c, rec in pair:
        dist.barrier()
        step = lambda: train_step(c.model, c.optimizer, batch)  # noqa: E731 - bound per contender
        if dist.get_rank() == 0:
            rec.profile = profile_call(step, PACKAGE_OF[c.name])
        else:
            step()
