"""``--tensorboard DIR``: the run's scalars as TensorBoard event files (rank 0 writes).

Per optimizer step, under the ``train/`` tags::

    train/loss            mean over ranks          train/lr              the scheduler's rate for the step
    train/grad_norm       global, before clipping  train/tokens_per_s    all ranks' tokens over the step's time
    train/step_s          wall time of the step    train/peak_memory_gb  CUDA peak allocated in the step; on CPU
                                                                         the process's peak RSS (never resets)
    train/wire_mb         MB this rank sent in the step (ring model; only --impl shardwise tallies)

and ``eval/loss`` at every ``--eval-every`` step. Open with ``tensorboard --logdir DIR``.
TensorBoard is an optional dependency (``pip install shardwise[tensorboard]``);
:func:`require_tensorboard` says so before any rank starts.
"""

from __future__ import annotations

import logging
import os
from typing import Mapping

__all__ = ["TensorBoardLog", "require_tensorboard"]

logger = logging.getLogger(__name__)


def require_tensorboard() -> None:
    """Raise a clear ``ImportError`` when the ``tensorboard`` package is missing."""
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        raise ImportError("--tensorboard needs the tensorboard package: pip install 'shardwise[tensorboard]'") from None


class TensorBoardLog:
    """Scalars by step into an event file under ``directory``; a no-op off rank 0 or without a directory."""

    directory: str | None
    _writer: object | None  # torch.utils.tensorboard.SummaryWriter on rank 0

    def __init__(self, directory: str | os.PathLike | None, is_main: bool) -> None:
        self.directory = None if directory is None else str(directory)
        self._writer = None
        if self.directory is not None and is_main:
            require_tensorboard()
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(log_dir=self.directory)

    def __repr__(self) -> str:
        return f"TensorBoardLog({self.directory!r})"

    @property
    def enabled(self) -> bool:
        return self.directory is not None

    def log(self, step: int, scalars: Mapping[str, float | None], prefix: str = "train/") -> None:
        """Add each scalar that is not ``None`` at ``step``."""
        if self._writer is None:
            return
        for tag, value in scalars.items():
            if value is not None:
                self._writer.add_scalar(prefix + tag, value, global_step=step)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.flush()
            self._writer.close()
            self._writer = None
