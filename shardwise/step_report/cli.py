"""``shardwise report DIR``: print a report directory's summary table and the top causes of
exposed communication (reads ``DIR/summary.json``; nothing is recomputed)."""

from __future__ import annotations

import json
from pathlib import Path

from shardwise.step_report.text import format_summary

__all__ = ["print_report", "load_summary"]


def load_summary(directory: str | Path) -> dict:
    """The ``summary.json`` of a report directory; a clear error when there is none."""
    path = Path(directory) / "summary.json"
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} not found: write a report first (`shardwise train --report {directory}` or "
            f"`with shardwise.report({str(directory)!r}) as r: ... r.step()`)"
        )
    return json.loads(path.read_text())


def print_report(directory: str | Path) -> None:
    """Print the summary of the report in ``directory`` to stdout."""
    print(format_summary(load_summary(directory)), flush=True)
