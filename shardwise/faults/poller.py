"""Poller: the watchdog for backends whose ``wait()`` does not block the host (NCCL).

On NCCL ``work.wait()`` only orders the compute stream after the collective and returns at
once; the host blocks later, somewhere the library never sees (``loss.item()``, the next
allocation that needs memory, a stream sync). So the deadline cannot be a wait with a
timeout as on gloo (:mod:`~shardwise.faults.watchdog`). Instead every collective issued on
such a group is handed to this rank's poller, whose daemon thread, every heartbeat::

    drops the works that say is_completed()
    publishes the oldest one left as what this rank waits on (peers read it, as on gloo)
    for a work older than the deadline: reads every peer's status (the same diagnosis)
        a hang (a stale peer, peers on other collectives) -> log the explanation at once,
            abort the process group (its kernels exit, the blocked host call returns) and
            raise the error on the main thread at its next shardwise collective or step
        a slow step (peers compute, or wait with us)       -> keep polling

The main thread's cost per collective: a lock, an append and a dict lookup.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
import weakref
from typing import NamedTuple

import torch.distributed as dist

from shardwise.collectives import work_is_completed
from shardwise.faults.beacon import Beacon, own_client, repeat_while_alive
from shardwise.faults.errors import CollectiveTimeoutError
from shardwise.faults.ledger import Ledger
from shardwise.faults.records import Position
from shardwise.faults.watchdog import peer_report, timeout_error

__all__ = ["Poller", "poller_for", "raise_if_failed", "stop_all"]

logger = logging.getLogger(__name__)


class _InFlight(NamedTuple):
    work: object
    pg: dist.ProcessGroup
    ledger: Ledger
    beacon: Beacon
    position: Position
    issued_at: float  # time.time()
    deadline: float  # seconds


class Poller:
    """This rank's in-flight collectives on non-blocking backends, and the thread that watches them."""

    error: CollectiveTimeoutError | None  # set by the thread once a hang is diagnosed

    def __init__(self, interval: float):
        self.interval = interval
        self.error = None
        self._lock = threading.Lock()
        self._in_flight: list[_InFlight] = []
        self._published: Beacon | None = None  # the beacon whose ``waiting`` this poller set
        self._aborted: set[int] = set()  # ids of the process groups aborted (once each)
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=repeat_while_alive,
            args=(weakref.ref(self), self._stop, interval, Poller.poll),
            name="shardwise-poller",
            daemon=True,
        )
        self._thread.start()

    def watch(self, work, pg: dist.ProcessGroup, ledger: Ledger, position: Position, deadline: float) -> None:
        """Follow ``work`` until it says it completed (called on the thread that issued it)."""
        entry = _InFlight(work, pg, ledger, ledger.beacon, position, time.time(), deadline)
        with self._lock:
            self._in_flight.append(entry)

    def forget(self) -> None:
        """Drop the works followed and the diagnosed error (it was raised)."""
        with self._lock:
            self._in_flight = []
        self.error = None

    def in_flight(self) -> int:
        with self._lock:
            return len(self._in_flight)

    def poll(self) -> None:
        """One heartbeat: forget completed works, publish the oldest, judge the overdue."""
        with self._lock:
            self._in_flight = [f for f in self._in_flight if not work_is_completed(f.work)]
            pending = list(self._in_flight)
        self._publish_oldest(pending[0] if pending else None)
        if self.error is not None:
            return
        now, judged = time.time(), set()
        for entry in pending:
            if entry.ledger.digests.error is not None:  # the ranks diverged: nobody will complete it
                self._abort_once(entry.pg)  # the main thread returns to its next collective, and raises there
                return
            if now - entry.issued_at > entry.deadline and id(entry.ledger) not in judged:
                judged.add(id(entry.ledger))
                self._judge(entry, now - entry.issued_at)
                if self.error is not None:
                    return

    def _publish_oldest(self, oldest: _InFlight | None) -> None:
        if oldest is None:
            if self._published is not None:
                self._published.unblock()
                self._published = None
            return
        beacon = oldest.beacon
        if beacon.waiting != oldest.position:
            beacon.waiting, beacon.waiting_since, beacon.checking = oldest.position, oldest.issued_at, False
        self._published = beacon

    def _judge(self, entry: _InFlight, waited: float) -> None:
        store = own_client(entry.beacon.store)  # this thread's client: never the training thread's
        entry.beacon.publish(store)
        hang, report = peer_report(entry.ledger, entry.position, stale_after=entry.deadline, store=store)
        if not hang or work_is_completed(entry.work):
            return
        self.error = timeout_error(entry.ledger, entry.position, waited, report)
        logger.error("%s", self.error)
        self._abort_once(entry.pg)

    def _abort_once(self, pg: dist.ProcessGroup) -> None:
        if id(pg) not in self._aborted:
            self._aborted.add(id(pg))
            _abort(pg)

    def stop(self, join_timeout: float | None = None) -> None:
        self._stop.set()
        if join_timeout is not None and self._thread is not threading.current_thread():
            self._thread.join(join_timeout)


def _abort(pg: dist.ProcessGroup) -> None:
    """Abort a non-gloo group so that its stuck kernels exit and the host call blocked on
    them returns; the main thread then meets the error at its next collective."""
    if dist.get_backend(pg) == "gloo":
        return
    try:
        dist.distributed_c10d._abort_process_group(pg)
    except Exception as err:  # the explanation is logged already; the abort is best effort
        logger.warning("shardwise watchdog could not abort process group %s: %s", pg.group_name, err)


_POLLERS: dict[int, Poller] = {}  # global rank -> its poller (ranks may be threads of one process)


def poller_for(rank: int, interval: float) -> Poller:
    """The poller of global ``rank`` (started on first use; restarted when the interval changed)."""
    poller = _POLLERS.get(rank)
    if poller is None or poller.interval != interval:
        if poller is not None:
            poller.stop()
        poller = _POLLERS[rank] = Poller(interval)
    return poller


def raise_if_failed(rank: int) -> None:
    """Raise the hang this rank's poller diagnosed, once (a dict lookup otherwise). The
    works it followed are forgotten with it: their group is aborted."""
    poller = _POLLERS.get(rank)
    if poller is not None and poller.error is not None:
        error = poller.error
        poller.forget()
        raise error


@atexit.register
def stop_all() -> list[threading.Thread]:
    """Join the poller threads before the interpreter tears down (see beacon.py: a daemon
    thread inside a c10d store call while the store is destroyed ends in std::terminate).
    Returns the threads that did not leave in time."""
    pollers = list(_POLLERS.values())
    _POLLERS.clear()
    for poller in pollers:
        poller.stop(join_timeout=poller.interval + 5.0)
    return [p._thread for p in pollers if p._thread.is_alive() and p._thread is not threading.current_thread()]
