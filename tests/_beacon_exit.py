"""Run as a script: N times, 2 gloo ranks start a beacon that beats every 0.5 ms (so its
thread is nearly always inside a store call) and exit at once; prints the aborted runs.

Before the beacon threads were joined at exit, about half the runs died in
``std::terminate`` ("terminate called without an active exception")."""

import sys

import torch.distributed as dist
import torch.multiprocessing as mp

from shardwise.faults import beacon


def _rank(rank: int, port: int) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    beacon.beacon_for(0.0005)
    dist.barrier()


if __name__ == "__main__":
    runs, first_port = int(sys.argv[1]), int(sys.argv[2])
    aborted = 0
    for i in range(runs):
        try:
            mp.spawn(_rank, args=(first_port + i,), nprocs=2)
        except mp.ProcessExitedException:
            aborted += 1
    print(f"aborted runs: {aborted} of {runs}")
