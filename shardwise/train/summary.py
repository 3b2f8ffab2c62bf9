"""What rank 0 shows while training: a header, a progress bar, and a summary.

This is the one module of :mod:`shardwise.train` that prints. On a terminal the
progress bar redraws one line in place with ``\\r``::

    [##########----------]  100/200 | loss 2.4512 | 48,210 tokens/s

Piped to a file or a test it writes a plain line every tenth of the run instead, so logs
stay readable. The summary ends with one line meant to be grepped::

    final loss 2.3100 | 12,345 tokens/s | 1.2 MB/step/rank
"""

from __future__ import annotations

import contextlib
import math
import signal
import sys
from typing import TYPE_CHECKING, Iterator, TextIO

import torch
from shardwise.step_report import Report, report
from shardwise.step_report.text import format_summary
from shardwise.train.config import TrainConfig, TrainResult
from shardwise.train.distributed import DistEnv

if TYPE_CHECKING:
    from shardwise.comm_stats import CommStats

__all__ = [
    "ProgressBar", "format_bytes", "print_header", "summary_lines", "final_line", "print_summary", "step_report",
    "PEAK_FLOPS", "device_peak_flops", "print_eval",
]


def format_bytes(n: float) -> str:
    """``1234567`` -> ``"1.2 MB"`` (decimal units, as network bandwidth is quoted)."""
    for unit in ("B", "kB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


class ProgressBar:
    """A one-line progress bar with the latest loss and the throughput so far."""

    total: int  # steps in the run
    stream: TextIO  # where to draw (stdout by default)
    width: int  # characters between the brackets
    interactive: bool  # redraw in place (a terminal) or append lines (a pipe)

    def __init__(self, total: int, stream: TextIO | None = None, width: int = 24) -> None:
        self.total = max(1, total)
        self.stream = stream if stream is not None else sys.stdout
        self.width = width
        self.interactive = bool(getattr(self.stream, "isatty", lambda: False)())
        self._every = max(1, self.total // 10)

    def _render(self, step: int, loss: float, tokens_per_s: float) -> str:
        filled = self.width * step // self.total
        bar = "#" * filled + "-" * (self.width - filled)
        digits = len(str(self.total))
        return f"[{bar}] {step:>{digits}}/{self.total} | loss {loss:.4f} | {tokens_per_s:,.0f} tokens/s"

    def update(self, step: int, loss: float, tokens_per_s: float) -> None:
        """Show that ``step`` (1-based) of ``total`` finished with ``loss``."""
        line = self._render(step, loss, tokens_per_s)
        if self.interactive:
            self.stream.write("\r" + line)
        elif step % self._every == 0 or step == self.total or step == 1:
            self.stream.write(line + "\n")
        self.stream.flush()

    def close(self) -> None:
        """End the in-place line so later output starts on a fresh one."""
        if self.interactive:
            self.stream.write("\n")
            self.stream.flush()


def _mesh_text(cfg: TrainConfig, env: DistEnv) -> str:
    if env.tp_mesh is None and cfg.replicate == 1:
        return f"{env.world_size} ranks"
    names = env.mesh.mesh_dim_names + (("tp",) if env.tp_mesh is not None else ())
    shape = tuple(env.mesh.shape) + ((env.tp_size,) if env.tp_mesh is not None else ())
    return f"{env.world_size} ranks as {dict(zip(names, shape))}"


def print_header(cfg: TrainConfig, model: str, seq_len: int, env: DistEnv, device: str) -> None:
    """One line saying what is about to run (``model`` describes it: name, size, layers)."""
    extras = [f"{flag} {value}" for flag, value, off in (
        ("ac", cfg.ac, "none"), ("grad-accum", cfg.grad_accum, 1), ("clip-norm", cfg.clip_norm, None),
        ("compile", cfg.compile, False), ("cpu-offload", cfg.cpu_offload, False), ("float8", cfg.float8, False))
        if value != off]
    print(
        f"shardwise train: {model} | {_mesh_text(cfg, env)} on {device} | impl {cfg.impl} | "
        f"mixed precision {cfg.mixed_precision}{''.join(' | ' + e for e in extras)} | "
        f"{cfg.steps} steps x {cfg.batch_size} x {seq_len} tokens per data-parallel rank",
        flush=True,
    )


def print_eval(step: int, loss: float) -> None:
    """``--eval-every``: one line with the held-out loss at ``step``."""
    print(f"step {step}: held-out loss {loss:.4f}", flush=True)


def _comm_lines(comm: "CommStats | None", steps: int) -> list[str]:
    if comm is None:
        return ["comm/rank     n/a (only --impl shardwise tallies its collectives)"]
    if not comm.counts:
        return ["comm/rank     no collectives recorded"]
    lines = [f"comm/rank     {format_bytes(comm.total_wire_bytes)} sent in all over {steps} steps (ring model)"]
    for kind in sorted(comm.counts):
        payload, wire = format_bytes(comm.payload_bytes[kind] / steps), format_bytes(comm.wire_bytes[kind] / steps)
        calls = comm.counts[kind] / steps
        lines.append(f"comm/rank     {kind:<14} {calls:6.1f} calls/step | payload {payload}/step | wire {wire}/step")
    return lines


def _peak_lines(result: TrainResult) -> list[str]:
    """--auto: the plan's predicted peak against the measured one."""
    predicted, measured = result.predicted_peak_bytes, result.measured_peak_bytes
    if predicted is None or not measured:
        return []
    error = 100 * (predicted - measured) / measured
    return [f"peak memory   predicted {format_bytes(predicted)} | measured {format_bytes(measured)} "
            f"(last step, live tensors) | {error:+.1f}%"]


def final_line(result: TrainResult) -> str:
    """``final loss 2.3100 | 12,345 tokens/s | 1.2 MB/step/rank`` (``comm n/a`` without a tally)."""
    per_step = result.wire_bytes_per_step
    comm = "comm n/a" if per_step is None else f"{format_bytes(per_step)}/step/rank"
    loss = f"{result.final_loss:.4f}" if math.isfinite(result.final_loss) else str(result.final_loss)
    return f"final loss {loss} | {result.tokens_per_s:,.0f} tokens/s | {comm}"


PEAK_FLOPS: dict[str, dict[str, float]] = {
    # dense peak FLOP/s per GPU (NVIDIA data sheets, SXM): bf16 tensor cores, and fp32 without TF32
    "H200": {"bf16": 989e12, "none": 67e12},
    "H100": {"bf16": 989e12, "none": 67e12},
    "A100": {"bf16": 312e12, "none": 19.5e12},
}
"""Devices whose peak is known, by a substring of ``torch.cuda.get_device_name``; for MFU."""


def device_peak_flops(device: torch.device, mixed_precision: str) -> float | None:
    """The peak FLOP/s of one ``device`` at the run's precision, or ``None`` when unknown (CPUs)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, peaks in PEAK_FLOPS.items():
        if key in name:
            return peaks.get(mixed_precision)
    return None


def _throughput_line(result: TrainResult) -> str:
    mfu = result.mfu
    mfu_text = "MFU n/a (device peak unknown)" if mfu is None else f"MFU {100 * mfu:.1f}%"
    return f"throughput    {result.tokens_per_s:,.0f} tokens/s (all ranks) | {mfu_text}"


def _eval_lines(result: TrainResult) -> list[str]:
    if not result.eval_losses:
        return []
    points = ", ".join(f"{loss:.4f} @ {step}" for step, loss in sorted(result.eval_losses.items()))
    return [f"held-out loss {points}"]


def summary_lines(result: TrainResult) -> list[str]:
    """The summary block, ending with :func:`final_line`."""
    return [
        f"steps         {result.steps} on {result.world_size} ranks ({result.tokens_per_step:,} tokens/step)",
        *_stop_lines(result),
        f"wall time     {result.wall_s:.1f} s training (+{result.setup_s:.1f} s setup)",
        _throughput_line(result),
        f"loss          {result.first_loss:.4f} -> {result.final_loss:.4f} (mean over ranks)",
        *_eval_lines(result),
        *_comm_lines(result.comm, result.steps),
        *_peak_lines(result),
        final_line(result),
    ]


def _stop_lines(result: TrainResult) -> list[str]:
    """A line when a signal ended the run early (see :mod:`~shardwise.train.signals`)."""
    if not result.stopped_by:
        return []
    name = signal.Signals(result.stopped_by).name
    return [f"stopped       by {name} after step {result.resumed_from + result.steps} "
            f"(exit code {result.exit_code})"]


def print_summary(result: TrainResult) -> None:
    """Print :func:`summary_lines` to stdout."""
    print("\n".join(summary_lines(result)), flush=True)


@contextlib.contextmanager
def step_report(cfg: TrainConfig, env: DistEnv) -> Iterator[Report | None]:
    """``shardwise.report(cfg.report)`` around the step loop (``None`` when no report was asked
    for); rank 0 prints the report's summary and where the files are once it is written."""
    if cfg.report is None:
        yield None
        return
    model = cfg.hf_model or cfg.hf_config or f"{cfg.model} GPT"
    meta = {"model": model, "reshard_after_forward": cfg.reshard_after_forward, "mesh": _mesh_text(cfg, env),
            "mixed_precision": cfg.mixed_precision, "ac": cfg.ac, "batch": f"{cfg.batch_size} sequences/rank"}
    with report(cfg.report, meta=meta, device=env.device) as r:
        yield r
    if r.summary is not None:
        print(f"\nstep report: {cfg.report}/index.html (shardwise report {cfg.report})", flush=True)
        print(format_summary(r.summary), flush=True)
