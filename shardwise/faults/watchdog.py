"""The watchdog: a collective that has not completed by the deadline is explained, not hung.

Waiting on a shardwise collective goes through :class:`WatchedWork`::

    completed already?            -> wait() (the common case: one is_completed() call)
    wait() on the waiter thread,  -> done
      this thread waits on its event with the deadline
    deadline passed               -> read every peer's status from the store (diagnose):
        a peer has not reported for the deadline      -> dead or stopped: raise
        a peer waits on another collective of this     -> the ranks diverged: raise
          group (another number, or the same number
          but another module/op)
        otherwise (peers compute, or wait with us)     -> a slow step: keep waiting,
                                                          diagnose again every heartbeat
    the wait itself fails (a peer's connection closed) -> raise, with the peers' statuses

Every live rank that waits reaches its own deadline and raises, each naming what every
rank was doing. A healthy slow rank keeps its heartbeat fresh from its beacon thread and
is never blamed. A custom comm's handle without ``is_completed`` is waited on plainly.

Backends: on gloo ``wait()`` blocks the host until the data is there, so the deadline wait
above is the whole watchdog. On NCCL ``wait()`` only orders the compute stream after the
collective and returns at once; blocking there would serialise every overlap. There the
same diagnosis (:func:`peer_report`, :func:`timeout_error`) runs from a host-side thread
that polls ``is_completed()`` of the in-flight works: :mod:`~shardwise.faults.poller`.
"""

from __future__ import annotations

import queue
import threading
import time

from shardwise.collectives import work_is_completed
from shardwise.faults.errors import CollectiveFailedError, CollectiveTimeoutError
from shardwise.faults.ledger import Ledger
from shardwise.faults.records import Position, RankStatus, describe_position

__all__ = ["WatchedWork", "diagnose", "peer_report", "raise_digest_error", "stop_waiters", "timeout_error"]


class WatchedWork:
    """A collective's work handle whose ``wait()`` runs the watchdog (idempotent)."""

    __slots__ = ("_work", "_ledger", "_position", "_deadline")

    def __init__(self, work, ledger: Ledger, position: Position, deadline: float):
        self._work = work
        self._ledger = ledger
        self._position = position
        self._deadline = deadline

    def is_completed(self) -> bool:
        """True once done; False while in flight or when the handle cannot say (a custom comm's
        work without ``is_completed``), as for any unpollable c10d work."""
        return self._work is None or work_is_completed(self._work)

    def wait(self, timeout=None) -> bool:
        work, self._work = self._work, None
        if work is None:
            return True
        if not hasattr(work, "is_completed") or work.is_completed():
            work.wait()
            return True
        _watch(work, self._ledger, self._position, self._deadline)
        return True


def _watch(work, ledger: Ledger, position: Position, deadline: float) -> None:
    """Wait with the deadline. On success the status is cleared; on an error it keeps
    saying what we were waiting on (that collective never completes now), so a peer whose
    deadline comes a little later still sees where this rank stopped.

    The blocking ``work.wait()`` runs on a waiter thread while this thread waits on an event
    with the deadline: gloo's native reduce-scatter work ignores ``wait(timeout)`` and
    reports ``is_completed()`` only once waited on, so neither can bound the wait itself."""
    beacon = ledger.beacon
    beacon.block(position)
    done, failure = _waiter().submit(work)
    try:
        waited = 0.0
        while not done.wait(beacon.interval):  # wakes each heartbeat: what the beacon found
            waited += beacon.interval
            raise_digest_error(ledger)
            if waited >= deadline:
                diagnose(ledger, position, waited, deadline, done.is_set)
        if failure:
            raise _failed(ledger, position, failure[0]) from failure[0]
    except BaseException:
        if not done.is_set() and _WAITER:  # that thread stays blocked on the dead collective:
            _LEFT_BEHIND.append(_WAITER.pop())  # the next wait gets a new one
        _publish_quietly(beacon)
        raise
    beacon.unblock()


class _Waiter:
    """A daemon thread that calls ``wait()`` on the works handed to it, one at a time, until
    handed ``None`` (:func:`stop_waiters`)."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, name="shardwise-waiter", daemon=True)
        self.thread.start()

    def submit(self, work) -> tuple[threading.Event, list]:
        done, failure = threading.Event(), []
        self._queue.put((work, done, failure))
        return done, failure

    def stop(self) -> None:
        """Ask the thread to leave once the work in hand (if any) returns."""
        self._queue.put(None)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            work, done, failure = item
            try:
                work.wait()
            except BaseException as err:  # handed back to the waiting thread
                failure.append(err)
            # Drop the work before signalling: a work keeps its tensors alive, and a kept
            # gradient buffer is reused only while nothing else holds its storage.
            del work, item
            done.set()


_WAITER: list[_Waiter] = []  # the waiter new waits go to (empty: start one)
_LEFT_BEHIND: list[_Waiter] = []  # waiters left inside the wait of a collective that failed


def _waiter() -> _Waiter:
    if not _WAITER:
        _WAITER.append(_Waiter())
    return _WAITER[0]


def stop_waiters(join_timeout: float) -> list[threading.Thread]:
    """Stop every waiter thread and join it (``join_timeout`` seconds in all at most); the
    threads still alive: each is blocked inside a collective's native ``wait()``, which
    returns only when its process group completes, fails or is destroyed."""
    waiters = _WAITER + _LEFT_BEHIND
    _WAITER.clear()
    _LEFT_BEHIND.clear()
    for waiter in waiters:
        waiter.stop()
    deadline = time.monotonic() + join_timeout
    for waiter in waiters:
        waiter.thread.join(max(0.0, deadline - time.monotonic()))
    stuck = [w for w in waiters if w.thread.is_alive()]
    _LEFT_BEHIND.extend(stuck)
    return [w.thread for w in stuck]


def _publish_quietly(beacon) -> None:
    try:
        beacon.publish()
    except Exception:  # the store is gone as well: the original error says more
        pass


def _failed(ledger: Ledger, position: Position, err: BaseException) -> CollectiveFailedError:
    first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    report = peer_report(ledger, position, stale_after=None)[1]
    return CollectiveFailedError(
        f"shardwise: collective #{position.seq + 1} failed on rank {ledger.rank}, "
        f"{describe_position(position)} on process group {ledger.name!r} (ranks {ledger.ranks}): {first_line}. "
        f"{report}"
    )


def raise_digest_error(ledger: Ledger) -> None:
    """Raise (once) the divergence the beacon thread's step-digest exchange found. A rank
    blocked in a collective that a diverged peer will never join raises it from the wait,
    within a heartbeat, instead of waiting for a peer that has already stopped."""
    error = ledger.digests.error
    if error is not None:
        ledger.digests.error = None
        raise error


def diagnose(ledger: Ledger, position: Position, waited: float, deadline: float, done=lambda: False) -> None:
    """After the deadline: raise :class:`CollectiveTimeoutError` if the peers' statuses
    show a hang (a stale peer, or one waiting on another collective of this group);
    return to keep waiting on a slow step."""
    ledger.beacon.publish()
    hang, report = peer_report(ledger, position, stale_after=deadline)
    if hang and not done():
        raise timeout_error(ledger, position, waited, report)


def timeout_error(ledger: Ledger, position: Position, waited: float, report: str) -> CollectiveTimeoutError:
    """The error every rank raises for a hang: what it waited on, and what each peer does."""
    return CollectiveTimeoutError(
        f"shardwise watchdog: rank {ledger.rank} waited {waited:.1f} s {describe_position(position)} "
        f"on process group {ledger.name!r} (ranks {ledger.ranks}). {report}"
    )


def peer_report(
    ledger: Ledger, position: Position, stale_after: float | None, store=None
) -> tuple[bool, str]:
    """(whether the statuses show a hang, one sentence per peer). ``stale_after`` None:
    report only (after a failure), no verdict. ``store``: the calling thread's own client
    when it is not the training thread (see :func:`~shardwise.faults.beacon.own_client`)."""
    try:
        statuses = ledger.beacon.read(ledger.peers(), store)
    except Exception as err:  # the store's host is gone too
        return stale_after is not None, f"The store is unreachable ({err}): the job's host rank is gone."
    now = time.time()
    hang, notes = False, []
    for rank, status in statuses.items():
        verdict, note = _judge(rank, status, position, now, stale_after)
        hang |= verdict
        notes.append(note)
    return hang, "; ".join(notes) + "."


def _judge(rank: int, status: RankStatus | None, mine: Position, now: float, stale_after: float | None):
    """(is this peer the reason for a hang, a sentence on what it does)."""
    if status is None:
        return stale_after is not None, f"rank {rank} has never reported: not started, dead or stopped"
    age = status.age(now)
    if stale_after is not None and age > stale_after:
        return True, f"rank {rank} has not reported for {age:.0f} s: dead or stopped"
    theirs = status.waiting
    note = status.describe() if stale_after is not None else f"rank {rank} last reported {age:.1f} s ago: {status.describe()}"
    if stale_after is None or theirs is None or theirs.group != mine.group:
        return False, note
    if theirs.seq == mine.seq:
        return not theirs.collective.same_as(mine.collective), note
    stuck_for = now - (status.waiting_since or now)
    return stuck_for >= stale_after, note
