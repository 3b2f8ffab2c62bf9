"""What rank 0 shows while training: a header, a progress bar, and a summary.

This is the one module of :mod:`shardwise.train` that prints. On a terminal the
progress bar redraws one line in place with ``\\r``::

    [##########----------]  100/200 | loss 2.4512 | 48,210 tokens/s

Piped to a file or a test it writes a plain line every tenth of the run instead, so logs
stay readable. The summary ends with one line meant to be grepped::

    final loss 2.3100 | 12,345 tokens/s | 1.2 MB/step/rank
"""

from __future__ import annotations

import math
import sys
from typing import TYPE_CHECKING, TextIO

from shardwise.train.config import TrainConfig, TrainResult

if TYPE_CHECKING:
    from shardwise.comm_stats import CommStats

__all__ = ["ProgressBar", "format_bytes", "print_header", "summary_lines", "final_line", "print_summary"]


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


def print_header(cfg: TrainConfig, world_size: int, device: str, n_params: int) -> None:
    """One line saying what is about to run."""
    m = cfg.model_config()
    print(
        f"shardwise train: {cfg.model} GPT ({n_params / 1e6:.2f}M params, {m.n_layers} layers, dim {m.dim}) | "
        f"{world_size} ranks on {device} | impl {cfg.impl} | mixed precision {cfg.mixed_precision} | "
        f"{cfg.steps} steps x {cfg.batch_size} x {m.seq_len} tokens per rank",
        flush=True,
    )


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


def summary_lines(result: TrainResult) -> list[str]:
    """The summary block, ending with :func:`final_line`."""
    return [
        f"steps         {result.steps} on {result.world_size} ranks ({result.tokens_per_step:,} tokens/step)",
        f"wall time     {result.wall_s:.1f} s training (+{result.setup_s:.1f} s setup)",
        f"throughput    {result.tokens_per_s:,.0f} tokens/s (all ranks)",
        f"loss          {result.first_loss:.4f} -> {result.final_loss:.4f} (mean over ranks)",
        *_comm_lines(result.comm, result.steps),
        *_peak_lines(result),
        final_line(result),
    ]


def print_summary(result: TrainResult) -> None:
    """Print :func:`summary_lines` to stdout."""
    print("\n".join(summary_lines(result)), flush=True)
