"""Run as ``python _waiter_exit.py RANK PORT`` (2 ranks): rank 1 leaves a watched all-reduce
on an error while the watchdog's waiter thread is inside the collective's native ``wait()``,
and its interpreter finalises slowly (an object whose ``__del__`` sleeps); rank 0 joins the
all-reduce 1.5 s late, so the waiter's ``wait()`` returns while rank 1 finalises.

Unless the waiter is joined before finalisation (``shardwise.faults.monitor.shutdown`` at
exit), the returning thread takes the GIL of a finalising interpreter: a forced unwind
through pybind11's GIL release, ``terminate called without an active exception``, SIGABRT.
Rank 1 must exit with 1 (its error), never a signal."""

import os
import signal
import sys
import time

os.environ["SHARDWISE_ORDER_CHECK"] = "off"  # the all-reduce starts at once; only the wait is watched

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from shardwise.faults import monitor  # noqa: E402


class SlowFinalizer:
    def __del__(self):
        time.sleep(3.0)  # the interpreter is finalising (module globals are being cleared)


def _interrupt(signum, frame):
    raise RuntimeError("rank 1 leaves its watched all-reduce")


def main(rank: int, port: int) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    if rank == 0:
        time.sleep(1.5)
        monitor.all_reduce(torch.ones(1), dist.group.WORLD, dist.ReduceOp.SUM, "late")
        return
    globals()["_slow"] = SlowFinalizer()
    signal.signal(signal.SIGALRM, _interrupt)
    signal.setitimer(signal.ITIMER_REAL, 0.3)
    monitor.all_reduce(torch.ones(1), dist.group.WORLD, dist.ReduceOp.SUM, "late")


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
