"""Run as a script: N times, 2 gloo ranks start a beacon that beats every 0.5 ms (so its
thread is nearly always inside a store call) and exit at once; prints the aborted runs.

Before the beacon threads were joined at exit, about half the runs died in
``std::terminate`` ("terminate called without an active exception")."""

import socket
import sys

import torch.distributed as dist
import torch.multiprocessing as mp

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


if __name__ == "__main__":
    runs = int(sys.argv[1])
    aborted = 0
    for _ in range(runs):
        try:
            mp.spawn(_rank, args=(_free_port(),), nprocs=2)
        except mp.ProcessExitedException:
            aborted += 1
    print(f"aborted runs: {aborted} of {runs}")
