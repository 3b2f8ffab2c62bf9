"""Beacon: each rank's status in the c10d store, refreshed by a daemon thread.

A rank blocked in a collective cannot tell a slow peer from a dead one by itself. So
every rank publishes, every heartbeat, a :class:`~shardwise.faults.records.RankStatus`
under ``shardwise/faults/status/<rank>``: the wall time and what the main thread is
blocked on (set and cleared by the watchdog and the order check: two attribute writes
per wait, no store traffic on the hot path). The thread keeps beating while the main
thread computes (a healthy slow rank stays fresh) and stops when the process stops or
dies (SIGSTOP, a crash, a lost link): its status goes stale, and that is how a peer
knows. One beacon per rank (ranks can be threads of one process), on the current store.

A c10d store object is used by one thread only. torch's ``TCPStore`` serialises the
requests of one client with a lock, but counts them in a map it updates *before* taking
that lock (``clientCounters_[op]`` in every call, torch 2.13): two threads calling one
client at once race on that map, and an insertion racing a lookup corrupts the heap
(a ``double free or corruption`` abort seen once in a full test run, while the main thread
waited on a collective and a beacon published). So a background thread talks to the store
through a connection of its own, :func:`own_client` (``store.clone()``: the same server and
keys, another client), and the training thread keeps the store torch gave it.
"""

from __future__ import annotations

import atexit
import logging
import pickle
import threading
import time
import weakref
from typing import Any, Callable

import torch
import torch.distributed as dist

from shardwise.faults.records import Position, RankStatus

__all__ = ["Beacon", "beacon_for", "hold_while_compiling", "own_client", "repeat_while_alive", "status_key", "stop_all"]

logger = logging.getLogger(__name__)

_PREFIX = "shardwise/faults/status"


def status_key(rank: int) -> str:
    return f"{_PREFIX}/{rank}"


_THREAD_CLIENT = threading.local()  # .entry = (the store asked for, this thread's clone of it)


def own_client(store: dist.Store) -> dist.Store:
    """This thread's own client of ``store``'s server (made on first use, one per thread:
    a thread that moves to another store drops the previous clone). A store that cannot be
    cloned is returned as it is."""
    entry = getattr(_THREAD_CLIENT, "entry", None)
    if entry is None or entry[0] is not store:
        try:
            clone = store.clone()
        except (RuntimeError, NotImplementedError, AttributeError):
            clone = store
        entry = _THREAD_CLIENT.entry = (store, clone)
    return entry[1]


class Beacon:
    """This rank's published status and the thread that keeps it fresh."""

    store: dist.Store
    rank: int  # global rank
    interval: float  # seconds between heartbeats
    waiting: Position | None  # what the main thread is blocked on now
    waiting_since: float | None
    checking: bool  # blocked in the order check rather than on a collective

    def __init__(self, store: dist.Store, rank: int, interval: float):
        self.store = store
        self.rank = rank
        self.interval = interval
        self.waiting = None
        self.waiting_since = None
        self.checking = False
        self._stop = threading.Event()
        self._followers: weakref.WeakSet = weakref.WeakSet()
        self.publish()
        self._thread = threading.Thread(
            target=repeat_while_alive,
            args=(weakref.ref(self), self._stop, interval, Beacon.beat),
            name=f"shardwise-beacon-{rank}",
            daemon=True,
        )
        self._thread.start()

    def status(self) -> RankStatus:
        return RankStatus(self.rank, time.time(), self.waiting, self.waiting_since, self.checking)

    def publish(self, store: dist.Store | None = None) -> None:
        """Write the status, through ``store`` when the caller is not the training thread."""
        (store or self.store).set(status_key(self.rank), pickle.dumps(self.status()))

    def follow(self, follower) -> None:
        """Call ``follower.on_beat(store, interval)`` on every heartbeat while it lives (held weakly)."""
        self._followers.add(follower)

    def beat(self) -> None:
        """One heartbeat (on the beacon's thread, through its own client): publish the status,
        then run the followers' work (a failing follower is logged and skipped: the status
        must keep flowing)."""
        store = own_client(self.store)
        self.publish(store)
        for follower in list(self._followers):
            try:
                follower.on_beat(store, self.interval)
            except Exception as err:
                logger.debug("shardwise beacon follower %r failed: %s", follower, err)

    def block(self, position: Position, checking: bool = False) -> None:
        """The main thread is about to block on ``position``; published now, then every beat."""
        self.waiting, self.waiting_since, self.checking = position, time.time(), checking

    def unblock(self) -> None:
        self.waiting = self.waiting_since = None
        self.checking = False

    def read(self, ranks: list[int], store: dist.Store | None = None) -> dict[int, RankStatus | None]:
        """The last status each of ``ranks`` published (None: never reported); through
        ``store`` when the caller is not the training thread."""
        store = store or self.store
        keys = [status_key(r) for r in ranks]
        present = [r for r, k in zip(ranks, keys) if store.check([k])]
        values = store.multi_get([status_key(r) for r in present]) if present else []
        found = {r: pickle.loads(v) for r, v in zip(present, values)}
        return {r: found.get(r) for r in ranks}

    def stop(self, join_timeout: float | None = None) -> None:
        """Stop beating; with ``join_timeout``, also wait (that long at most) for the thread
        to leave any store call it is in."""
        self._stop.set()
        if join_timeout is not None and self._thread is not threading.current_thread():
            self._thread.join(join_timeout)


def repeat_while_alive(ref: weakref.ref, stop: threading.Event, interval: float, tick: Callable[[Any], None]) -> None:
    """A daemon thread's loop: every ``interval`` seconds call ``tick(ref())`` until ``stop``
    is set, the object is collected, or a tick fails (the store is gone: shutdown, a lost
    link; nothing left to tell). Holds the object only during a tick. A tick waits while
    Dynamo compiles in this process (two intervals at most): see :func:`hold_while_compiling`."""
    while not stop.wait(interval):
        hold_while_compiling(stop, 2 * interval)
        owner = ref()
        if owner is None or stop.is_set():
            return
        try:
            tick(owner)
        except Exception as err:
            logger.debug("shardwise %s stops: %s", type(owner).__name__, err)
            return
        del owner


_HOLD_POLL_S = 0.005


def hold_while_compiling(stop: threading.Event, at_most: float) -> None:
    """Wait (``at_most`` seconds) while Dynamo compiles on this process's main thread.

    Dynamo iterates live dicts while it allocates: torch's module-state registry (a
    ``WeakKeyDictionary`` that every ``fully_shard``-ed module is in) among them. A tick's
    Python work (the status, the step digests' per-step records) allocates too, and an
    allocation can start a GC pass *in this thread*; the pass frees dead sharded models
    (they die in reference cycles) and runs their weakref callbacks, which delete registry
    entries under Dynamo's iteration: ``InternalTorchDynamoError: RuntimeError: dictionary
    changed size during iteration``. So background work waits for the compile to end; the
    bound keeps the published status younger than the watchdog's deadline (the interval is
    at most a quarter of it)."""
    deadline = time.monotonic() + at_most
    while _dynamo_compiling() and time.monotonic() < deadline and not stop.wait(_HOLD_POLL_S):
        pass


def _dynamo_compiling() -> bool:
    """Whether a torch.compile session is open in this process (torch 2.13 sets this flag for it)."""
    return bool(getattr(torch.compiler, "_is_compiling_flag", False))


_BEACONS: dict[int, Beacon] = {}  # global rank -> its beacon (ranks may be threads of one process)


@atexit.register
def stop_all() -> list[threading.Thread]:
    """Join every beacon thread before the interpreter tears down: a daemon thread still
    inside a c10d store call (the GIL released) while the store is destroyed under it ends
    the process in ``std::terminate`` ("terminate called without an active exception").
    Returns the threads that did not leave in time (each inside a store call)."""
    beacons = list(_BEACONS.values())
    _BEACONS.clear()
    for beacon in beacons:
        beacon.stop(join_timeout=beacon.interval + 5.0)
    return [b._thread for b in beacons if b._thread.is_alive() and b._thread is not threading.current_thread()]


def beacon_for(interval: float) -> Beacon:
    """This rank's beacon on the default store (started on first use; restarted, the old
    thread stopped, when the store or the interval changed)."""
    store = dist.distributed_c10d._get_default_store()
    rank = dist.get_rank()
    beacon = _BEACONS.get(rank)
    if beacon is None or beacon.store is not store or beacon.interval != interval:
        if beacon is not None:
            beacon.stop()
        beacon = _BEACONS[rank] = Beacon(store, rank, interval)
    return beacon
