"""What a native crash looks like in a process's output, and the environment that makes one loud.

Shared by the two ``./dev stress`` modes (pytest selections, :mod:`~shardwise.testing.stress`;
launches of the training job, :mod:`~shardwise.testing.launch_stress`)::

    MALLOC_CHECK_=3        glibc checks every free and aborts on heap corruption at once
    MALLOC_PERTURB_=<b>    freed and fresh memory is filled with a byte that changes per run,
                           so a read of freed memory gives garbage instead of old values
    PYTHONFAULTHANDLER=1   every Python process prints its threads' stacks on SIGABRT/SIGSEGV
"""

from __future__ import annotations

import os
import re

__all__ = ["NATIVE_CRASH", "loud_crash_env"]

NATIVE_CRASH = re.compile(
    r"died with exit code -(6|11|7|4)|Fatal Python error|double free|corruption|free\(\): |"
    r"malloc\(\)|Segmentation fault|Aborted|terminate called|Signal (6|11|7|4) \(SIG",
)
"""A line of output that says a process died in native code (an abort, a bad access, a heap check)."""


def loud_crash_env(seed: int) -> dict[str, str]:
    """This process's environment with glibc's heap checks and Python's fault handler on."""
    return dict(os.environ, MALLOC_CHECK_="3", MALLOC_PERTURB_=str(1 + seed % 255), PYTHONFAULTHANDLER="1")
