"""Where a step's Python time goes: cProfile one step and keep the top functions.

On CPU the FSDP wrappers' own cost is Python (hooks, bookkeeping, DTensor dispatch)
around the collectives and the model's kernels, which is exactly what cProfile sees.
:func:`profile_call` returns two short lists: the costliest functions overall and those
defined in the implementation's own package (``shardwise/``, ``torch/distributed/fsdp/``,
``torch/nn/parallel/``), plus the step's total. The overall list is ordered by *own* time
(``tottime``: the kernels, the collective waits, DTensor's dispatch), the package list by
*cumulative* time (``cumtime``), which names the phases of the wrapper's hot path
(unshard, wait, reduce) and what each costs including what it calls.
"""

from __future__ import annotations

import cProfile
import os
import pstats
from typing import Any, Callable, NamedTuple

__all__ = ["ProfileEntry", "StepProfile", "PACKAGE_OF", "profile_call"]

_NOT_LIBRARY = (os.path.join("shardwise", "train", ""), os.path.join("shardwise", "testing", ""))
"""shardwise's training job and test harness are not part of its hot path."""

PACKAGE_OF = {
    "shardwise.fully_shard": f"shardwise{os.sep}",
    "shardwise.fully_shard+report": f"shardwise{os.sep}",
    "shardwise.replicate": f"shardwise{os.sep}",
    "torch.fully_shard": os.path.join("torch", "distributed", "fsdp", ""),
    "torch.DDP": os.path.join("torch", "nn", "parallel", ""),
    "torch.DDP matched": os.path.join("torch", "nn", "parallel", ""),
    "torch.replicate": os.path.join("torch", "distributed", "fsdp", ""),  # replicate_with_fsdp runs on FSDP2's hooks
}
"""Contender name -> path fragment identifying its own source files."""


class ProfileEntry(NamedTuple):
    """One function's line of ``pstats``."""

    function: str  # "file.py:123(name)", the path shortened to its package
    ncalls: int
    tottime_s: float  # time in the function itself
    cumtime_s: float  # including callees


class StepProfile(NamedTuple):
    """The top costs of one profiled call."""

    total_s: float
    calls: int  # Python function calls in the step: a deterministic measure of interpreter work
    own_calls: int  # of which in the implementation's package
    top: list[ProfileEntry]  # all functions, by tottime
    own: list[ProfileEntry]  # only the implementation's package, by cumtime


def profile_call(fn: Callable[[], Any], package: str, limit: int = 15) -> StepProfile:
    """Run ``fn()`` under cProfile; keep the ``limit`` costliest functions, overall and in ``package``."""
    profiler = cProfile.Profile()
    profiler.runcall(fn)
    stats = pstats.Stats(profiler)
    entries = [_entry(key, row) for key, row in stats.stats.items()]
    top = sorted(entries, key=lambda e: -e.tottime_s)
    own = sorted((e for e in entries if _is_own(e.function, package)), key=lambda e: -e.cumtime_s)
    return StepProfile(stats.total_tt, stats.total_calls, sum(e.ncalls for e in own), top[:limit], own[:limit])


def _is_own(function: str, package: str) -> bool:
    return package in function and not any(part in function for part in _NOT_LIBRARY)


def _entry(key: tuple[str, int, str], row: tuple) -> ProfileEntry:
    filename, line, name = key
    _, ncalls, tottime, cumtime, _ = row
    return ProfileEntry(f"{_short_path(filename)}:{line}({name})", ncalls, tottime, cumtime)


def _short_path(filename: str) -> str:
    """Drop everything before the package root (``.../site-packages/``, the repo root)."""
    for marker in (f"site-packages{os.sep}", f"{os.sep}shardwise{os.sep}", f"{os.sep}bench{os.sep}"):
        at = filename.rfind(marker)
        if at >= 0:
            start = at + len(marker) if marker.startswith("site") else at + 1
            return filename[start:]
    return filename
