"""torch's ``MultiThreadedTestCase`` with shardwise's timeouts: ranks are threads of this
process (``init_process_group("threaded")``), every fault default on.

``ThreadedCase`` joins the rank threads within ``TIMEOUT`` s (torch's runner reads its
module-level ``TIMEOUT_DEFAULT`` at join time) and, when a rank is still running then,
fails with the stack of every stuck rank thread: a hang is a failure that shows where each
rank waited. Lazy init's rank-agreement check gives up after ``SHARDWISE_INIT_TIMEOUT_S``.
"""

from __future__ import annotations

import os
import sys
import time
import traceback

from torch.testing._internal import common_distributed
from torch.testing._internal.common_distributed import MultiThreadedTestCase

TIMEOUT = 60.0


class ThreadedCase(MultiThreadedTestCase):
    """A threaded-process-group test case of ``world_size`` thread-ranks."""

    WORLD_SIZE = 2

    @property
    def world_size(self) -> int:
        return self.WORLD_SIZE

    def setUp(self) -> None:
        super().setUp()
        self._saved_init_timeout = os.environ.get("SHARDWISE_INIT_TIMEOUT_S")
        os.environ["SHARDWISE_INIT_TIMEOUT_S"] = "30"
        self._spawn_threads()

    def tearDown(self) -> None:
        if self._saved_init_timeout is None:
            os.environ.pop("SHARDWISE_INIT_TIMEOUT_S", None)
        else:
            os.environ["SHARDWISE_INIT_TIMEOUT_S"] = self._saved_init_timeout
        super().tearDown()

    @classmethod
    def _join_threads(cls, threads, fn):
        deadline = time.monotonic() + TIMEOUT
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        stuck = {rank: t for rank, t in enumerate(threads) if t.is_alive()}
        stacks = _stacks(stuck)
        saved = common_distributed.TIMEOUT_DEFAULT
        common_distributed.TIMEOUT_DEFAULT = 0.01 if stuck else TIMEOUT  # joined above already
        try:
            super()._join_threads(threads, fn)
        except RuntimeError as err:
            if not stuck:
                raise
            raise RuntimeError(f"{err}\nthread-ranks still running after {TIMEOUT:.0f} s:\n{stacks}") from None
        finally:
            common_distributed.TIMEOUT_DEFAULT = saved
        if stuck:  # torch's runner only logs some failures: a hang always fails here
            raise RuntimeError(f"thread-ranks {sorted(stuck)} still running after {TIMEOUT:.0f} s:\n{stacks}")


def _stacks(threads: dict) -> str:
    frames = sys._current_frames()
    parts = []
    for rank, thread in sorted(threads.items()):
        frame = frames.get(thread.ident)
        where = "".join(traceback.format_stack(frame)[-12:]) if frame is not None else "  (no frame)\n"
        parts.append(f"--- rank {rank} ({thread.name}):\n{where}")
    return "".join(parts)
