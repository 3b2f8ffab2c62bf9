"""``--metrics PATH``: one JSON line per optimizer step, appended and flushed as it goes.

Each line is a self-contained record, so a crash loses no step that was logged and a
partial last line (the process killed mid-write) is simply skipped by readers::

    {"step": 12, "loss": 4.8213, "tokens_per_s": 18342.5, "step_s": 0.0558, "lr": 0.001, "checkpoint_s": 0.0}

``loss`` is the mean over ranks (the loop's one scalar all-reduce per step, only when metrics or TensorBoard are on);
``tokens_per_s`` counts every rank's tokens over this step's wall time, ``step_s``, which
includes ``checkpoint_s``, the time the step was held by a checkpoint save. Rank 0 writes.

A resumed run appends to the same file, so the steps after the checkpoint it resumed from
appear twice; :func:`read_metrics` keeps the last record of each step: the curve of the
run that finished.
"""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path
from typing import TextIO

__all__ = ["MetricsLog", "read_metrics"]

logger = logging.getLogger(__name__)


class MetricsLog:
    """Appends step records to a JSON-lines file on rank 0; every rank calls :meth:`log`."""

    path: Path | None  # None: metrics are off and log() does nothing
    _file: TextIO | None  # open on rank 0 only

    def __init__(self, path: str | os.PathLike | None, is_main: bool) -> None:
        self.path = None if path is None else Path(path)
        self._file = None
        if self.path is not None and is_main:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "a", encoding="utf-8")

    def __repr__(self) -> str:
        return f"MetricsLog({None if self.path is None else str(self.path)!r})"

    def log(self, step: int, mean_loss: float, **fields: float | None) -> None:
        """Write ``step``, ``mean_loss`` (already averaged over ranks) and ``fields``; rank 0 only writes."""
        if self._file is None:
            return
        record = {"step": step, "loss": mean_loss, **fields}
        self._file.write(json.dumps({k: _finite(v) for k, v in record.items()}) + "\n")
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def _finite(v: float) -> float | str | int:
    """JSON has no NaN/inf: write them as strings ("nan") so every line stays valid JSON."""
    return v if not isinstance(v, float) or math.isfinite(v) else str(v)


def read_metrics(path: str | os.PathLike) -> dict[int, dict]:
    """``{step: record}`` from a metrics file, the last record of each step winning, in step order."""
    records: dict[int, dict] = {}
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            try:
                record = json.loads(line)
            except ValueError:
                logger.warning("%s:%d: skipping an incomplete line (a crash mid-write?)", path, n)
                continue
            records[int(record["step"])] = record
    return dict(sorted(records.items()))
