"""What each rank process runs: join the gloo group once, then serve tasks until told to stop.

The parent (:class:`shardwise.testing.pool.RankPool`) starts one process per rank with
:func:`worker_main` as its target and talks to it over a private pipe:

1. startup: take the parent's environment, install the stack-dump handler, connect to
   the parent's ``TCPStore``,
   ``init_process_group("gloo", ...)`` over loopback, send :class:`Ready`;
2. per task: receive :class:`Task`, reset the cheap per-process knobs (one intra-op
   thread, ``torch.manual_seed(0)``, grad mode, default dtype, shardwise's fault state:
   :func:`shardwise.faults.monitor.reset`), all-gather the task id
   to prove every rank is at the same task, give the task its own store namespace, run
   ``fn(*args, **kwargs)``, destroy any process group the task created, send :class:`Reply`;
3. on ``None`` or a closed pipe: destroy the default group and exit at once.

Values cross the pipe as ``pickle`` bytes made here, not by ``multiprocessing``'s own
pickler, so tensors travel by value instead of as shared-memory file descriptors.
A rank that fails replies at once and does no cleanup: the parent discards the whole
pool after any failure, because the surviving ranks may be stuck in a collective.
"""

from __future__ import annotations

import ctypes
import datetime
import logging
import os
import pickle
import random
import signal
import socket
import sys
import traceback
from multiprocessing.connection import Connection
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

from shardwise.faults import monitor
from shardwise.testing import stack_dump

_log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>

_POOL_STORE: dist.Store | None = None  # the default group's own store, before any task prefix


class WorkerSpec(NamedTuple):
    """Everything one rank process needs to start."""

    rank: int
    world_size: int
    store_port: int  # the parent's TCPStore on 127.0.0.1
    stack_path: str  # faulthandler writes this rank's stacks here on SIGUSR1
    parent_pid: int | None  # the rank exits when this process is gone (None: started by the fork server)
    startup_timeout_s: float
    environ: dict[str, str]  # the parent's environment when it started the rank


class Ready(NamedTuple):
    """Sent once the rank is inside the default process group."""

    rank: int
    pid: int


class Task(NamedTuple):
    """One call: ``payload`` is ``pickle.dumps((fn, args, kwargs))`` made by the parent."""

    task_id: int
    payload: bytes
    sys_path: list[str]  # the parent's sys.path, so fn's module imports here too


class Reply(NamedTuple):
    """The outcome of one task on one rank: a pickled value, or a traceback."""

    task_id: int
    rank: int
    ok: bool
    value: bytes  # pickle.dumps(return value) when ok
    error: str  # formatted traceback when not ok


def worker_main(spec: WorkerSpec, conn: Connection) -> None:
    """Entry point of a rank process (the ``target`` of its Process)."""
    os.environ.clear()  # a forked rank holds the fork server's environment: the parent's, as of now
    os.environ.update(spec.environ)
    stack_dump.install(spec.stack_path)
    _exit_with_parent(spec.parent_pid)
    _configure_process()
    _join_default_group(spec)
    conn.send(Ready(spec.rank, os.getpid()))
    _serve(conn, spec.rank)
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip interpreter teardown: over a second with torch loaded, and nothing to save


def _configure_process() -> None:
    """Process-wide settings made once: line-buffered output, one inter-op thread."""
    for stream in (sys.stdout, sys.stderr):
        stream.reconfigure(line_buffering=True)
    torch.set_num_threads(1)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # already set, or inter-op work already ran
        pass


def _join_default_group(spec: WorkerSpec) -> None:
    """``init_process_group("gloo")`` against the parent's store, on the loopback device."""
    os.environ["GLOO_SOCKET_IFNAME"] = _loopback_interface()  # 127.0.0.1 only, whatever the host has
    timeout = datetime.timedelta(seconds=spec.startup_timeout_s)
    store = dist.TCPStore("127.0.0.1", spec.store_port, spec.world_size, is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=spec.rank, world_size=spec.world_size)


def _loopback_interface() -> str:
    """The name of the loopback interface ('lo' on Linux, 'lo0' on macOS)."""
    names = [name for _, name in socket.if_nameindex()]
    for name in ("lo", "lo0"):
        if name in names:
            return name
    raise RuntimeError(f"no loopback interface among {names}; set GLOO_SOCKET_IFNAME")


def _exit_with_parent(parent_pid: int | None) -> None:
    """Leave no orphan: ask Linux to SIGKILL this process when its parent dies.

    ``PR_SET_PDEATHSIG`` fires when the *thread* that spawned us exits, so a pool
    started from a short-lived thread dies with it (and is replaced on the next call).
    A rank forked by the fork server (``parent_pid`` None) dies with that server, which
    exits with the process that started it. Elsewhere there is no such call; a rank
    whose parent vanished then exits on its next read of the closed pipe.
    """
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if parent_pid is not None and os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)


def _serve(conn: Connection, rank: int) -> None:
    """Run tasks one at a time until the parent sends ``None`` or closes the pipe."""
    while True:
        try:
            task = conn.recv()
        except EOFError:
            return
        if task is None:
            return
        reply = _run_task(task, rank)
        _log.debug("rank %d finished task %d: %s", rank, task.task_id, "ok" if reply.ok else "failed")
        conn.send(reply)


def _run_task(task: Task, rank: int) -> Reply:
    """Run one task; any exception (even SystemExit) becomes a failed Reply."""
    try:
        _reset_per_task_state()
        _extend_sys_path(task.sys_path)
        _check_same_task(task.task_id, rank)
        _give_task_its_own_store_namespace(task.task_id)
        groups_before = set(distributed_c10d._world.pg_map)
        fn, args, kwargs = pickle.loads(task.payload)
        value = pickle.dumps(fn(*args, **kwargs))
        _destroy_groups_created_since(groups_before)
        _clear_dtensor_caches()
    except BaseException:  # noqa: BLE001 - every failure must reach the parent
        return Reply(task.task_id, rank, ok=False, value=b"", error=traceback.format_exc())
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    return Reply(task.task_id, rank, ok=True, value=value, error="")


def _reset_per_task_state() -> None:
    """The cheap global knobs a test may have changed, back to their defaults."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    random.seed(0)
    torch.set_grad_enabled(True)
    torch.set_default_dtype(torch.float32)
    monitor.reset()  # no task inherits another's fault settings, steps or collective numbering


def _extend_sys_path(parent_path: list[str]) -> None:
    for entry in parent_path:
        if entry not in sys.path:
            sys.path.append(entry)


def _check_same_task(task_id: int, rank: int) -> None:
    """All-gather the task id: a barrier that also proves every rank runs the same task."""
    mine = torch.tensor([task_id], dtype=torch.int64)
    everyone = torch.empty(dist.get_world_size(), dtype=torch.int64)
    dist.all_gather_into_tensor(everyone, mine)
    if not bool((everyone == task_id).all()):
        raise RuntimeError(
            f"rank {rank} is starting task {task_id} but the ranks report tasks {everyone.tolist()}: "
            "the ranks are out of step (a previous task left a collective unmatched)"
        )


def _give_task_its_own_store_namespace(task_id: int) -> None:
    """Point the default group's store (where new groups rendezvous) at a fresh prefix.

    ``new_group(use_local_synchronization=True)`` names a group after its ranks and the
    number of live groups, so a task's group can get the name of one an earlier task made
    and the harness destroyed. gloo's rendezvous would then find the destroyed group's
    addresses under that name in the pool's long-lived store and connect to dead ports
    (connection refused, or worse, another group's listener). One prefix per task keeps
    every task's keys apart; the default group itself no longer reads the store.
    """
    global _POOL_STORE
    default = distributed_c10d._get_default_group()
    backend, store = distributed_c10d._world.pg_map[default]
    if _POOL_STORE is None:
        _POOL_STORE = store
    distributed_c10d._world.pg_map[default] = (backend, dist.PrefixStore(f"task{task_id}/", _POOL_STORE))


def _destroy_groups_created_since(groups_before: set) -> None:
    """Destroy the process groups a task made (new_group, 2-D meshes).

    Each gloo group holds sockets to its peers and worker threads; without this a long
    test session would pile up thousands of them in every rank. Runs only after a
    successful task, when every collective this rank issued has completed.
    """
    created = [group for group in list(distributed_c10d._world.pg_map) if group not in groups_before]
    for group in created:
        dist.destroy_process_group(group)


def _clear_dtensor_caches() -> None:
    """Forget DTensor's cached sharding decisions: the next task's mesh of the same shape and
    names compares equal to a destroyed one, and a cached spec would point at dead groups.

    Cleared after every task, not only after one that left groups for the harness to destroy:
    a task may destroy its own groups (a job re-initialising them), and what is left then
    does not say whether a cached spec holds a dead group's mesh."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._redistribute import _gen_transform_infos

    propagator = DTensor._op_dispatcher.sharding_propagator
    propagator.propagate_op_sharding.cache_clear()
    propagator._propagate_tensor_meta_cached.cache_clear()
    torch._C._clear_DTensor_sharding_propagator_cache()
    _gen_transform_infos.cache_clear()
