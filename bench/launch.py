"""Start N gloo ranks on this machine and stream each case's measurements back.

One launch per world size serves all of its cases (starting interpreters and the gloo
rendezvous costs seconds, a case costs the same whether it runs first or last)::

    parent: TCPStore on 127.0.0.1:<port the OS picked>
       └─ torch.multiprocessing.start_processes(rank_main, nprocs=N, start_method="spawn")
            rank r: 1 intra-op thread, gloo pinned to the loopback interface,
                    for each case: run_case -> gather_object to rank 0 -> rank 0 puts it on the queue

The parent drains the queue while it waits, so a caller sees each case as soon as it is
done. If a rank raises, ``torch.multiprocessing`` terminates the others and re-raises
its traceback here (``ProcessRaisedException``).
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import socket
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as tmp
from torch.distributed.device_mesh import init_device_mesh

from bench.cases import Case, Settings
from bench.rank import CaseMeasurement, run_case

__all__ = ["LaunchSpec", "CaseResult", "launch", "spawn_draining", "gather_each"]

CaseResult = list[CaseMeasurement]
"""One case as measured by every rank, index = rank."""

OnResult = Callable[[Case, CaseResult], None]

START_METHOD = "spawn"
"""How ranks start: ``spawn``, a fresh interpreter per rank that holds only what the bench
imports and sees this process's environment as it is now. The tests set ``forkserver``: the
ranks then fork from the fork server of the test harness's warm pools
(:mod:`shardwise.testing.pool`), which imported torch and shardwise once, instead of each
importing them again (seconds of CPU per rank)."""


@dataclasses.dataclass(frozen=True)
class LaunchSpec:
    """What every rank of one launch needs."""

    world_size: int
    """Number of ranks; every case must have this world size."""
    cases: tuple[Case, ...]
    """Run in order, each on all ranks."""
    settings: Settings
    """Warmup, steps, batch size, seed, profiling."""
    store_port: int
    """The parent's TCPStore on 127.0.0.1."""
    timeout_s: float = 900.0
    """Process-group timeout: a collective (or barrier) waiting longer than this fails."""

    def __post_init__(self) -> None:
        wrong = [c.label for c in self.cases if c.world_size != self.world_size]
        if wrong:
            raise ValueError(f"cases {wrong} do not have world_size={self.world_size}")


def launch(world_size: int, cases: list[Case], settings: Settings, on_result: OnResult) -> None:
    """Run ``cases`` on ``world_size`` fresh ranks; call ``on_result(case, result)`` as each finishes."""
    store = _loopback_store()
    spec = LaunchSpec(world_size, tuple(cases), settings, store.port)
    spawn_draining(rank_main, spec, world_size, lambda index, result: on_result(spec.cases[index], result))


def spawn_draining(target: Callable, spec: object, world_size: int, on_item: Callable[[int, list], None]) -> None:
    """Spawn ``target(rank, spec, queue)`` on ``world_size`` ranks; while they run, call
    ``on_item(index, per_rank)`` for each ``(index, per_rank)`` rank 0 puts on the queue."""
    queue = tmp.get_context(START_METHOD).SimpleQueue()
    procs = tmp.start_processes(target, args=(spec, queue), nprocs=world_size, join=False, start_method=START_METHOD)
    done = False
    while not done:
        done = procs.join(timeout=0.2)
        while not queue.empty():
            on_item(*queue.get())


def gather_each(items: Sequence, measure: Callable[[Any], Any], queue) -> None:
    """Every rank: ``measure(item)`` for each item in turn, gathered to rank 0, which puts
    ``(index, [one result per rank])`` on ``queue``; a barrier after the last."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    for index, item in enumerate(items):
        measured = measure(item)
        gathered = [None] * world_size if rank == 0 else None
        dist.gather_object(measured, gathered, dst=0)
        if rank == 0:
            queue.put((index, gathered))
    dist.barrier()


def rank_main(rank: int, spec: LaunchSpec, queue) -> None:
    """Entry point of one rank (``torch.multiprocessing`` passes ``rank`` first)."""
    torch.set_num_threads(1)
    os.environ["GLOO_SOCKET_IFNAME"] = _loopback_interface()
    timeout = datetime.timedelta(seconds=spec.timeout_s)
    store = dist.TCPStore("127.0.0.1", spec.store_port, spec.world_size, is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=spec.world_size, timeout=timeout)
    try:
        mesh = init_device_mesh("cpu", (spec.world_size,))
        gather_each(spec.cases, lambda case: run_case(case, spec.settings, mesh), queue)
    finally:
        dist.destroy_process_group()


def _loopback_store() -> dist.TCPStore:
    """A TCPStore server bound to 127.0.0.1 on a port the OS picked (no port races, no network)."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(128)
    port = listener.getsockname()[1]
    return dist.TCPStore(
        "127.0.0.1", port, None, True, datetime.timedelta(seconds=120), wait_for_workers=False,
        master_listen_fd=listener.detach(),
    )  # fmt: skip


def _loopback_interface() -> str:
    """The name of the loopback interface ('lo' on Linux, 'lo0' on macOS)."""
    names = [name for _, name in socket.if_nameindex()]
    for name in ("lo", "lo0"):
        if name in names:
            return name
    raise RuntimeError(f"no loopback interface among {names}; set GLOO_SOCKET_IFNAME")
