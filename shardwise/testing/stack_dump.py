"""Ask a hung rank where it is: ``faulthandler`` stack dumps on ``SIGUSR1``.

A rank stuck in a gloo collective sits inside C++ with the GIL released, so nothing in
Python can interrupt it politely. ``faulthandler`` can: its signal handler is plain C,
walks every thread's Python frames and writes them to a file without needing the
interpreter to reach a safe point. The two halves:

- in the rank process, :func:`install` opens the rank's dump file (kept open for the
  life of the process) and registers the handler;
- in the parent, :func:`collect` notes each file's size, sends ``SIGUSR1`` and reads
  back whatever each rank appended.

The dump looks like ``Thread 0x... (most recent call first):`` followed by
``  File "...", line N in func`` lines, innermost first.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import time
from collections.abc import Mapping
from typing import IO

# The open dump file of this process; faulthandler writes to its descriptor, so the
# file object must outlive every possible signal.
_DUMP_FILE: IO[str] | None = None

_POLL_S = 0.05
_SETTLE_S = 0.1


def install(path: str) -> None:
    """In a rank process: dump all threads' Python stacks to ``path`` on SIGUSR1, and on
    a fatal signal (SIGSEGV, SIGABRT, ...) just before the process dies."""
    global _DUMP_FILE
    _DUMP_FILE = open(path, "a", buffering=1, encoding="utf-8")  # noqa: SIM115 - lives with the process
    faulthandler.register(signal.SIGUSR1, file=_DUMP_FILE, all_threads=True, chain=False)
    faulthandler.enable(file=_DUMP_FILE, all_threads=True)


def read_all(path: str) -> str:
    """Everything a rank dumped so far: for a rank that died, its fatal-signal stacks."""
    return _read_from(path, 0)


def collect(targets: Mapping[int, tuple[int, str]], wait_s: float = 3.0) -> dict[int, str]:
    """In the parent: signal each rank and return what it dumped.

    Args:
        targets: rank -> (pid, dump file path) of each rank to ask.
        wait_s: how long to wait for the dumps to appear.

    Returns:
        rank -> the stack text that rank wrote, or a line saying why there is none
        (the process is gone, or wrote nothing in ``wait_s``).
    """
    sizes = {rank: _size(path) for rank, (_, path) in targets.items()}
    gone = {}
    for rank, (pid, _) in targets.items():
        try:
            os.kill(pid, signal.SIGUSR1)
        except ProcessLookupError:
            gone[rank] = f"(process {pid} no longer exists; no stacks)"
    waiting = {rank: path for rank, (_, path) in targets.items() if rank not in gone}
    _wait_for_growth(waiting, sizes, wait_s)
    dumps = {rank: _read_from(path, sizes[rank]) for rank, path in waiting.items()}
    for rank, text in dumps.items():
        if not text.strip():
            pid = targets[rank][0]
            dumps[rank] = f"(process {pid} wrote no stacks within {wait_s:g} s of SIGUSR1)"
    return {**dumps, **gone}


def _wait_for_growth(paths: Mapping[int, str], sizes: Mapping[int, int], wait_s: float) -> None:
    """Return once every file grew and then stopped growing, or after ``wait_s``."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if all(_size(path) > sizes[rank] for rank, path in paths.items()):
            break
        time.sleep(_POLL_S)
    # faulthandler writes one thread after another; give the last one time to land.
    last = {rank: _size(path) for rank, path in paths.items()}
    while time.monotonic() < deadline:
        time.sleep(_SETTLE_S)
        now = {rank: _size(path) for rank, path in paths.items()}
        if now == last:
            return
        last = now


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except FileNotFoundError:
        return 0


def _read_from(path: str, offset: int) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            f.seek(offset)
            return f.read()
    except FileNotFoundError:
        return ""
