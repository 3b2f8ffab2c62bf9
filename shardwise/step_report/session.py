"""``shardwise.report(DIR)``: record a training loop's steps on every rank, write the report on exit.

::

    with shardwise.report("runs/report") as r:
        for x, y in batches:
            loss = loss_fn(model(x), y); loss.backward(); opt.step(); opt.zero_grad()
            r.step(loss)                      # one call per step, on every rank

On exit rank 0 gathers every rank's step records (one ``gather_object`` on the default
group, so every rank must leave the ``with`` block) and writes ``summary.json``,
``trace.json`` (Chrome / Perfetto), the PNG plots and ``index.html`` into DIR; ``r.summary``
holds the summary there. If the block raises, no collective is attempted (the peers may
be gone): each rank writes its own records to ``DIR/rank<r>.json`` and the error
propagates.

Clocks: on entry every rank passes a barrier and takes that moment as time zero, so the
per-rank timelines share one axis (to within the barrier's exit skew).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from shardwise import tracing
from shardwise.step_report.memory import sampler_for
from shardwise.step_report.recorder import StepRecorder
from shardwise.step_report.export import write_report
from shardwise.step_report.steps import StepRecord

__all__ = ["Report", "report"]

logger = logging.getLogger(__name__)


def _default_device() -> torch.device:
    if dist.is_initialized() and dist.get_backend() == "nccl" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class Report:
    """Records per-step, per-rank timing, overlap and memory while active; see :func:`report`."""

    out_dir: Path
    meta: dict[str, Any]  # free-form facts shown in the summary (model, ranks, settings)
    plots: bool  # write the PNGs and index.html (needs matplotlib)
    summary: dict[str, Any] | None  # rank 0 after a clean exit
    recorder: StepRecorder | None  # while active

    def __init__(self, out_dir: str | os.PathLike, *, meta: dict[str, Any] | None = None,
                 keep_raw: int = 20, plots: bool = True, device: torch.device | str | None = None) -> None:  # fmt: skip
        if keep_raw < 1:
            raise ValueError(f"shardwise.report: keep_raw must be >= 1 (the timeline needs a step), got {keep_raw}")
        self.out_dir = Path(out_dir)
        self.meta = dict(meta or {})
        self.plots = plots
        self.summary = None
        self.recorder = None
        self._keep_raw = keep_raw
        self._device = torch.device(device) if device is not None else None
        self._ctx = None

    def __repr__(self) -> str:
        steps = len(self.recorder.records) if self.recorder else 0
        return f"Report({str(self.out_dir)!r}, {steps} steps recorded)"

    def __enter__(self) -> "Report":
        if self.recorder is not None:
            raise RuntimeError("shardwise.report: this Report is already active; use a new one per run")
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.barrier()
        device = self._device or _default_device()
        self.recorder = StepRecorder(sampler_for(device), time.monotonic_ns(), self._keep_raw)
        self.meta.setdefault("device", str(device))
        self.meta.setdefault("memory", self.recorder.sampler.label)
        self._ctx = tracing.recording(self.recorder)
        self._ctx.__enter__()
        return self

    def step(self, loss: float | torch.Tensor | None = None) -> StepRecord:
        """End the current training step (``loss``: its loss, for the curve) and start the next.

        A tensor loss is read with ``.item()`` (a device sync on GPUs): pass a float you
        already have to avoid it.
        """
        if self.recorder is None:
            raise RuntimeError("shardwise.report: step() outside the `with shardwise.report(DIR) as r:` block")
        if isinstance(loss, torch.Tensor):
            loss = loss.detach().float().item()
        return self.recorder.end_step(None if loss is None else float(loss))

    def __exit__(self, exc_type, exc, tb) -> None:
        self._ctx.__exit__(None, None, None)
        recorder, self.recorder = self.recorder, None
        self.out_dir.mkdir(parents=True, exist_ok=True)
        if exc_type is not None:
            self._write_local(recorder)
            return
        gathered = _gather(_payload(recorder))
        if gathered is not None:
            self.summary = write_report(self.out_dir, gathered, self.meta, plots=self.plots)

    def _write_local(self, recorder: StepRecorder) -> None:
        path = self.out_dir / f"rank{recorder.rank}.json"
        path.write_text(json.dumps(_payload(recorder), indent=1))
        logger.warning("shardwise.report: the run raised; wrote this rank's records to %s", path)


def _payload(recorder: StepRecorder) -> dict[str, Any]:
    return {
        "rank": recorder.rank,
        "records": [dataclasses.asdict(r) for r in recorder.records],
        "raw": [r.to_json(recorder.origin_ns) for r in recorder.raw],
    }


def _gather(payload: dict[str, Any]) -> list[dict[str, Any]] | None:
    """Every rank's payload on rank 0 (index = rank); ``None`` on the other ranks."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [payload]
    rank = dist.get_rank()
    out = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object(payload, out, dst=0)
    return out


def report(out_dir: str | os.PathLike, **kwargs: Any) -> Report:
    """Record where each training step's time and memory go, on every rank; write a report to ``out_dir``.

    Args:
        out_dir: directory for ``summary.json``, ``trace.json``, the PNG plots and ``index.html``
            (created if missing).

    Keyword Args:
        meta: facts to show in the summary's header (``{"model": "small"}``).
        keep_raw: how many of the last steps keep their raw spans for the timeline and the
            trace (default 20); every step keeps its summary numbers.
        plots: write the PNG plots and ``index.html`` (default True; needs matplotlib:
            ``pip install 'shardwise[plot]'``, else only the JSON files are written and a
            warning says so).
        device: whose memory to sample (default: the current CUDA device under NCCL, else CPU).

    Call ``r.step(loss)`` once per training step on every rank. What the numbers mean
    (exposed communication, overlap, compute) is defined in :mod:`shardwise.step_report.steps`;
    ``shardwise report DIR`` prints the summary and the top causes of exposed communication.
    Recording costs a clock read per collective and a memory sample per lifecycle event;
    with no report active, nothing.
    """
    return Report(out_dir, **kwargs)
