"""The calls the library makes: ``issue`` every collective, and mark step boundaries.

``ParamGroup`` and ``GradReducer`` start each collective through :func:`issue`, which
numbers it in its group's :class:`~shardwise.faults.ledger.Ledger`, runs the order check
when the step is checked, starts it, and wraps its work handle in a
:class:`~shardwise.faults.watchdog.WatchedWork` (gloo: the host waits), or hands it to
this rank's :class:`~shardwise.faults.poller.Poller` (NCCL: the host runs ahead). The root's forward calls
:func:`begin_step`, the end of its backward :func:`end_step`. Unchecked steps cost a dict
lookup, a counter and a wrapper per collective.

A group no root marks (the default group of a TP or HSDP job, a TP group: collectives a job
or :func:`~shardwise.clip.clip_grad_norm_` issue outside the FSDP groups) counts each of
its collectives as a step of its own. Its first collectives are then order-checked like a
root's first steps, later ones compared by the step digests, and its logs stay bounded: a
group left at step 0 would be order-checked forever (a store round trip per collective)
and its step's log would grow by one entry per collective.

:func:`all_reduce` is :func:`issue` for a blocking all-reduce, for the collectives outside
the FSDP hot path (gradient clipping, a training job's metrics and exit barrier).
"""

from __future__ import annotations

import atexit
import threading
from typing import Callable, Iterable

import torch
import torch.distributed as dist

from shardwise.faults import beacon, order_check, poller
from shardwise.faults.ledger import forget_all, ledger_for
from shardwise.faults.records import END_OF_STEP, Collective
from shardwise.faults.settings import current
from shardwise.faults.settings import reset as reset_settings
from shardwise.faults.watchdog import WatchedWork, raise_digest_error, stop_waiters

__all__ = ["issue", "all_reduce", "begin_step", "end_step", "shutdown", "reset"]


def _phase() -> str:
    return "backward" if torch._C._current_graph_task_id() != -1 else "forward"


def issue(op: str, fqn: str, pg: dist.ProcessGroup, tensor: torch.Tensor, start: Callable[[], object]):
    """Number, check and start one collective of ``fqn``'s group; returns its (watched) work.

    Args:
        op: "all-gather", "reduce-scatter" or "all-reduce".
        fqn: the fully_shard module's FQN.
        pg: the process group it runs on.
        tensor: its per-rank input (its size and dtype are compared across ranks).
        start: issues the collective (async) and returns the work handle.
    """
    ledger = ledger_for(pg)
    if ledger is None:
        return start()
    _raise_found(ledger)
    if not ledger.root_marked:
        ledger.begin_step()  # no root marks this group's steps: each collective is one
    settings = current()
    position = ledger.record(Collective(op, fqn, _phase(), tensor.numel(), tensor.dtype))
    if settings.checks_step(position.step):
        order_check.agree(ledger, position, settings.watchdog_s)
    work = start()
    if work is None or settings.watchdog_s <= 0:
        return work
    if ledger.host_waits:
        return WatchedWork(work, ledger, position, settings.watchdog_s)
    poller.poller_for(ledger.rank, settings.heartbeat_interval).watch(work, pg, ledger, position, settings.watchdog_s)
    return work


def all_reduce(tensor: torch.Tensor, pg: dist.ProcessGroup, op: dist.ReduceOp.RedOpType, what: str) -> torch.Tensor:
    """All-reduce ``tensor`` in place on ``pg`` through :func:`issue` and wait for it (on
    NCCL the wait orders the stream; the poller watches the host side); returns ``tensor``.

    Args:
        tensor: this rank's input, overwritten with the result.
        pg: the process group.
        op: the reduction (``dist.ReduceOp.SUM``, ``MAX``, ...).
        what: names the collective in errors (it stands where a module's FQN stands), the
            same on every rank.
    """
    work = issue("all-reduce", what, pg, tensor, lambda: dist.all_reduce(tensor, op=op, group=pg, async_op=True))
    if work is not None:
        work.wait()
    return tensor


def _raise_found(ledger) -> None:
    """Raise what a background thread found for this rank: a hang (poller), or ranks whose
    steps differed (step digest); each once."""
    poller.raise_if_failed(ledger.rank)
    raise_digest_error(ledger)


def begin_step(groups: Iterable[dist.ProcessGroup]) -> None:
    """The root's forward begins a step on each of its process groups (which are then
    marked by a root: their steps are the root's from now on)."""
    for pg in groups:
        ledger = ledger_for(pg)
        if ledger is not None:
            _raise_found(ledger)
            ledger.root_marked = True
            ledger.begin_step()


def end_step(groups: Iterable[dist.ProcessGroup]) -> None:
    """The root's backward ended: in a checked step, every group records the step's end."""
    settings = current()
    for pg in groups:
        ledger = ledger_for(pg)
        if ledger is not None and settings.checks_step(ledger.step):
            position = ledger.record(Collective(END_OF_STEP, "", "backward", 0, None))
            order_check.agree(ledger, position, settings.watchdog_s)


def reset() -> None:
    """Start this process over as a fresh job: stop the fault threads, forget every group's
    ledger (steps, numbering, what a root marked) and go back to the environment's
    settings. For harnesses that run many jobs in one process: :mod:`shardwise.testing`'s
    rank pools run one per task, so no task inherits another's steps or ``configure()``."""
    shutdown(waiter_join_s=0.5)  # a waiter left in a failed task's collective is not waited for
    forget_all()
    reset_settings()


WAITER_JOIN_S = 5.0
"""How long :func:`shutdown` waits for the watchdog's waiter threads to leave."""


@atexit.register
def shutdown(waiter_join_s: float = WAITER_JOIN_S) -> list[threading.Thread]:
    """Stop this process's fault threads (beacons, pollers, the watchdog's waiters) and join
    them; returns those still alive. Call it before destroying the process group at the end
    of a job (:func:`shardwise.train.distributed.teardown` does; it also runs at exit): a
    rank whose peer (the store's host) exits first must not be left inside a store call
    when the interpreter tears down. Fault detection restarts on the next collective.

    A thread still alive is inside a native call that has not returned: a store call, or a
    waiter inside the ``wait()`` of a collective that failed (it returns once its process
    group is destroyed). Such a thread must not outlive the interpreter: when the call
    returns into a finalizing interpreter, taking the GIL ends the thread through a forced
    unwind that C++ destructors turn into ``std::terminate`` ("terminate called without an
    active exception", SIGABRT). See :func:`shardwise.train.distributed.teardown`."""
    return poller.stop_all() + beacon.stop_all() + stop_waiters(waiter_join_s)
