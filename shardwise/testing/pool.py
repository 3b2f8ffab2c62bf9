"""RankPool: N rank processes in one gloo world, reused task after task.

Starting a rank in a fresh interpreter costs seconds (importing torch, then the gloo
rendezvous); on Linux ranks are forked from a server that imported torch once
(:func:`_start_context`), a fraction of a second; running a task on a warm rank costs
milliseconds. So a pool is started once and serves many tasks, and is thrown away only
when it can no longer be trusted.

Algorithm of :meth:`RankPool.run`:

1. pickle ``(fn, args, kwargs)`` here, so a bad argument fails in the caller untouched;
2. send the same :class:`~shardwise.testing.worker.Task` to every rank;
3. wait on all pipes and process sentinels at once until every rank has replied, the
   timeout runs out, or a rank has failed and a short grace period for its peers to
   report too has passed;
4. every rank ok: unpickle and return the values in rank order. Otherwise dump the
   Python stacks of the ranks still running, kill the pool and raise
   :class:`~shardwise.testing.errors.RankFailure` or
   :class:`~shardwise.testing.errors.RankTimeout`.

After any failure the pool is killed, not repaired: a rank that raised half-way leaves
its peers inside a collective, or with process-group counters out of step, and the only
state known to be clean is a new one.

The rendezvous store is a ``TCPStore`` hosted by the parent on a loopback socket whose
port the OS picked, so pools never race for ports and never share keys; gloo itself
is pinned to the loopback interface in each rank.
"""

from __future__ import annotations

import datetime
import logging
import multiprocessing
import os
import pickle
import shutil
import socket
import sys
import tempfile
import time
from multiprocessing.connection import Connection, wait
from typing import Any, Callable, NoReturn

import torch.distributed as dist

from shardwise.testing import stack_dump
from shardwise.testing.errors import RankFailure, RankTimeout
from shardwise.testing.worker import Ready, Reply, Task, WorkerSpec, worker_main

_log = logging.getLogger(__name__)

PRELOAD = ("torch", "torch.distributed.tensor", "torch._dynamo", "shardwise", "shardwise.testing.worker")
"""What the fork server imports once, before it forks any rank (see :func:`_start_context`)."""

_preload = list(PRELOAD)
_server_started = False


def preload_in_ranks(*modules: str) -> None:
    """Have the fork server import ``modules`` too, once, before it forks any rank.

    A module a test imports inside its ranks (Transformers' model code, torch's FSDP2 as the
    oracle) otherwise costs its import in every rank of every pool: seconds of CPU each,
    on a machine where the ranks share two cores. Call it before the first pool starts
    (``tests/conftest.py`` does); a module that fails to import is skipped by the server and
    imported by the rank that needs it, as before.
    """
    if _server_started:
        raise RuntimeError(f"preload_in_ranks{modules}: the fork server has already started; "
                           "call it before the first run_on_ranks (e.g. in conftest.py)")
    _preload.extend(m for m in modules if m not in _preload)
    if _CTX.get_start_method() == "forkserver":
        _CTX.set_forkserver_preload(list(_preload))


def _start_context() -> multiprocessing.context.BaseContext:
    """How rank processes start. On Linux they are forked from multiprocessing's fork server,
    a process that imported :data:`PRELOAD` once and runs no threads: a rank starts in a
    fraction of a second instead of the 2-3 s (of CPU) that importing torch, DTensor and
    Dynamo costs a fresh interpreter, and a test suite starts dozens. Elsewhere each rank is
    a fresh spawned interpreter. Either way a rank leaves through ``os._exit`` (the worker
    skips interpreter teardown) and sees the parent's environment as it was when the rank
    was started (:class:`~shardwise.testing.worker.WorkerSpec` carries it)."""
    if sys.platform.startswith("linux"):
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(list(_preload))
        return ctx
    return multiprocessing.get_context("spawn")


_CTX = _start_context()
_FAILURE_GRACE_S = 1.0  # after one rank fails, how long its peers get to report
_CLOSE_JOIN_S = 3.0


class RankPool:
    """``world_size`` rank processes, each already inside one gloo default group.

    Attributes:
        world_size: number of ranks.
        alive: False once the pool was closed or killed; it never comes back.
    """

    world_size: int
    alive: bool
    _procs: list  # multiprocessing Process (forkserver or spawn context), index = rank
    _conns: list[Connection]  # parent end of each rank's pipe, index = rank
    _pids: list[int]  # as reported by each rank's Ready
    _store: dist.TCPStore  # rendezvous for the default group; lives as long as the pool
    _tmpdir: str  # holds rank{r}.stacks, the faulthandler dump files
    _next_task_id: int

    def __init__(self, world_size: int, startup_timeout: float = 120.0) -> None:
        """Spawn the ranks and wait until all are inside the process group.

        Raises:
            RankFailure: a rank died or raised while starting.
            RankTimeout: the ranks did not all start within ``startup_timeout`` s.
        """
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        self.alive = True
        self._next_task_id = 0
        self._tmpdir = tempfile.mkdtemp(prefix=f"shardwise-ranks{world_size}-pid{os.getpid()}-")
        self._store = _loopback_store(startup_timeout)
        self._procs, self._conns, self._pids = [], [], []
        try:
            for rank in range(world_size):
                self._spawn(rank, startup_timeout)
            self._pids = [p.pid for p in self._procs]
            self._wait_ready(startup_timeout)
        except BaseException:
            self.kill()
            raise

    def __repr__(self) -> str:
        state = "alive" if self.alive else "dead"
        return f"RankPool(world_size={self.world_size}, pids={self._pids}, {state})"

    @property
    def pids(self) -> list[int]:
        """Process ids of the ranks, index = rank."""
        return list(self._pids)

    def healthy(self) -> bool:
        """True while the pool is alive and every rank process still exists."""
        return self.alive and all(p.is_alive() for p in self._procs)

    def run(self, fn: Callable[..., Any], args: tuple, kwargs: dict, timeout: float) -> list:
        """Run ``fn(*args, **kwargs)`` on every rank; return the values in rank order.

        Raises:
            TypeError: ``fn`` or an argument cannot be pickled (the pool is unharmed).
            RankFailure: a rank raised or died; the pool is killed.
            RankTimeout: not every rank returned within ``timeout`` s; the pool is killed.
        """
        __tracebackhide__ = True  # pytest: show the caller's frame, not the harness's
        if not self.alive:
            raise RuntimeError(f"{self!r} was closed; start a new pool")
        name = _qualified_name(fn)
        payload = _pickle_call(fn, args, kwargs, name)
        task_id, self._next_task_id = self._next_task_id, self._next_task_id + 1
        task = Task(task_id, payload, list(sys.path))
        deadline = time.monotonic() + timeout
        try:
            for rank, conn in enumerate(self._conns):
                self._send(rank, conn, task)
            replies = self._collect(task_id, deadline)
        except BaseException:  # Ctrl-C, a pytest timeout, a protocol error: ranks are mid-task
            self.kill()
            raise
        if len(replies) == self.world_size and all(r.ok for r in replies.values()):
            return [pickle.loads(replies[rank].value) for rank in range(self.world_size)]
        self._fail(name, replies, timeout)

    def close(self) -> None:
        """Ask every rank to leave the group and exit; kill any that do not. Idempotent."""
        if not self.alive:
            return
        for conn in self._conns:
            try:
                conn.send(None)
            except OSError:
                pass
        deadline = time.monotonic() + _CLOSE_JOIN_S
        for proc in self._procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        self.kill()

    def kill(self) -> None:
        """SIGKILL every rank and release the store and dump files. Idempotent."""
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
        for proc in self._procs:
            proc.join()
            proc.close()
        for conn in self._conns:
            conn.close()
        self._procs, self._conns = [], []
        if self.alive:
            self.alive = False
            del self._store
            shutil.rmtree(self._tmpdir, ignore_errors=True)

    # -- internals -----------------------------------------------------------------

    def _stack_path(self, rank: int) -> str:
        return os.path.join(self._tmpdir, f"rank{rank}.stacks")

    def _spawn(self, rank: int, startup_timeout: float) -> None:
        global _server_started
        _server_started = True
        parent_conn, child_conn = _CTX.Pipe(duplex=True)
        spec = WorkerSpec(
            rank=rank,
            world_size=self.world_size,
            store_port=self._store.port,
            stack_path=self._stack_path(rank),
            parent_pid=os.getpid() if _CTX.get_start_method() == "spawn" else None,  # else the fork server
            startup_timeout_s=startup_timeout,
            environ=dict(os.environ),
        )
        proc = _CTX.Process(target=worker_main, args=(spec, child_conn), name=f"shardwise-rank{rank}")
        proc.start()
        child_conn.close()
        self._procs.append(proc)
        self._conns.append(parent_conn)

    def _wait_ready(self, startup_timeout: float) -> None:
        """Block until every rank sent Ready; on a death or timeout, kill and raise."""
        start = time.monotonic()
        deadline = start + startup_timeout
        ready: dict[int, Ready] = {}
        replies: dict[int, Reply] = {}
        while len(ready) + len(replies) < self.world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            waiting = set(range(self.world_size)) - set(ready) - set(replies)
            for rank, msg in self._wait_some(waiting, remaining, task_id=-1):
                if isinstance(msg, Ready):
                    ready[rank] = msg
                else:
                    replies[rank] = msg
        if len(ready) == self.world_size:
            self._pids = [ready[rank].pid for rank in range(self.world_size)]
            _log.info("started %r in %.1f s", self, time.monotonic() - start)
            return
        self._fail(f"RankPool({self.world_size}) startup", replies, startup_timeout)

    def _send(self, rank: int, conn: Connection, task: Task) -> None:
        try:
            conn.send(task)
        except OSError as exc:  # the rank died since the last task; its sentinel will say how
            _log.warning("could not send task %d to rank %d: %s", task.task_id, rank, exc)

    def _collect(self, task_id: int, deadline: float) -> dict[int, Reply]:
        """Gather replies until all ranks answered, time ran out, or a failure's grace ended."""
        replies: dict[int, Reply] = {}
        while len(replies) < self.world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            waiting = set(range(self.world_size)) - set(replies)
            for rank, reply in self._wait_some(waiting, remaining, task_id):
                if reply.task_id != task_id:
                    raise RuntimeError(f"rank {rank} answered task {reply.task_id} while task {task_id} ran")
                replies[rank] = reply
                if not reply.ok:
                    deadline = min(deadline, time.monotonic() + _FAILURE_GRACE_S)
        return replies

    def _wait_some(self, ranks: set[int], timeout: float, task_id: int) -> list[tuple[int, Any]]:
        """Wait for messages or deaths among ``ranks``; a death becomes a failed Reply to ``task_id``."""
        by_conn = {self._conns[r]: r for r in ranks}
        by_sentinel = {self._procs[r].sentinel: r for r in ranks}
        out: dict[int, Any] = {}
        for obj in wait([*by_conn, *by_sentinel], timeout):
            rank = by_conn.get(obj, by_sentinel.get(obj))
            if rank in out:
                continue
            conn = self._conns[rank]
            try:
                if obj in by_conn or conn.poll():
                    out[rank] = conn.recv()
                    continue
            except (EOFError, OSError):
                pass
            out[rank] = self._death_reply(rank, task_id)
        return list(out.items())

    def _death_reply(self, rank: int, task_id: int) -> Reply:
        proc = self._procs[rank]
        proc.join(1.0)
        stacks = stack_dump.read_all(self._stack_path(rank)).strip()
        error = (
            f"rank {rank} process (pid {self._pids[rank]}) died with exit code {proc.exitcode}; "
            "its last words, if any, are in the captured stderr\n"
        )
        if stacks:
            error += f"where its threads were when it died:\n{stacks}\n"
        return Reply(task_id=task_id, rank=rank, ok=False, value=b"", error=error)

    def _fail(self, name: str, replies: dict[int, Reply], timeout: float) -> NoReturn:
        """Dump the stacks of ranks without a reply, kill the pool, raise the right error."""
        __tracebackhide__ = True
        pending = [r for r in range(self.world_size) if r not in replies]
        targets = {r: (self._pids[r], self._stack_path(r)) for r in pending}
        stacks = stack_dump.collect(targets) if targets else {}
        self.kill()
        finished = tuple(sorted(r for r, reply in replies.items() if reply.ok))
        failed = {r: reply.error for r, reply in replies.items() if not reply.ok}
        if failed:
            raise RankFailure(name, self.world_size, finished, failed, stacks)
        raise RankTimeout(name, self.world_size, finished, timeout, stacks)


def _loopback_store(timeout_s: float) -> dist.TCPStore:
    """A TCPStore server on 127.0.0.1 and a port the OS picked.

    TCPStore binds every interface when it opens its own socket; handing it a socket
    already bound to loopback keeps the store off the network. The store owns (and
    closes) the descriptor from then on.
    """
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(128)
    port = listener.getsockname()[1]
    timeout = datetime.timedelta(seconds=timeout_s)
    return dist.TCPStore(
        "127.0.0.1", port, None, True, timeout, wait_for_workers=False, master_listen_fd=listener.detach()
    )


def _qualified_name(fn: Callable[..., Any]) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


def _pickle_call(fn: Callable[..., Any], args: tuple, kwargs: dict, name: str) -> bytes:
    """Pickle the call by reference; explain the usual mistake when that fails."""
    try:
        return pickle.dumps((fn, args, kwargs))
    except (pickle.PicklingError, AttributeError, TypeError) as exc:
        raise TypeError(
            f"cannot send {name} to the ranks: {exc}. The function must be defined at module "
            "level (no lambdas, closures or methods) and every argument must be picklable."
        ) from exc
