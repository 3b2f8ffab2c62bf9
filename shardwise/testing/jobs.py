"""Stopping a launched job for good: its launcher and every worker under it.

``torchrun`` starts each worker in a session of its own, so ``os.killpg`` on the
launcher's group misses them, and a SIGKILLed launcher cannot forward the signal: its
workers live on as orphans (a rank cut off from the store blocks in it for the store's
timeout, 30 minutes). :func:`kill_job` collects the whole process tree first.
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

__all__ = ["descendants", "kill_job"]


def descendants(pid: int) -> list[int]:
    """Every live process under ``pid``, children first (read from ``/proc``)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            children = [int(c) for c in Path(f"/proc/{p}/task/{p}/children").read_text().split()]
        except OSError:
            continue
        out += children
        todo += children
    return out


def kill_job(proc: subprocess.Popen, timeout: float = 30) -> None:
    """SIGKILL a launched job: every process under it, then the launcher's process group
    (the launcher was started with ``start_new_session=True``); wait for the launcher."""
    if proc.poll() is None:
        for pid in descendants(proc.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait(timeout=timeout)
