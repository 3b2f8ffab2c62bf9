"""Run as a script: N times, 2 gloo ranks start a beacon that beats every 0.5 ms (so its
thread is nearly always inside a store call) and exit at once; prints the aborted runs.

Each rank is forked from this process, which imported torch and shardwise once, and leaves
the way a launched rank does: through the interpreter's finalisation (``sys.exit`` out of
the script; multiprocessing's children skip it with ``os._exit``, and spawned ones would
import torch again, seconds of CPU per rank).

Before the beacon threads were joined at exit, about half the runs died in
``std::terminate`` ("terminate called without an active exception")."""

import os
import socket
import sys
import traceback

import torch.distributed as dist

from shardwise.faults import beacon


def _rank(rank: int, port: int) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    beacon.beacon_for(0.0005)
    dist.barrier()


def _free_port() -> int:
    """A port free right now (picked per run: a fixed range of ports met other tests' stores)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _fork_rank(rank: int, port: int) -> int:
    """The child's pid here; in the child, run the rank and leave the script with its status."""
    pid = os.fork()
    if pid:
        return pid
    try:
        _rank(rank, port)
    except BaseException:
        traceback.print_exc()
        sys.exit(1)
    sys.exit(0)  # SystemExit out of the script: the interpreter finalises, atexit hooks first


def _aborted(runs: int) -> int:
    """Runs in which a rank did not exit with 0 (a signal, or an error)."""
    aborted = 0
    for _ in range(runs):
        port = _free_port()
        pids = [_fork_rank(rank, port) for rank in (0, 1)]
        codes = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in pids]
        if any(codes):
            print(f"exit codes {codes}", file=sys.stderr)
            aborted += 1
    return aborted


if __name__ == "__main__":
    runs = int(sys.argv[1])
    print(f"aborted runs: {_aborted(runs)} of {runs}")
