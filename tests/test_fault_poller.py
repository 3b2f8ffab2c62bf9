"""The watchdog for non-blocking backends (NCCL): shardwise.faults.poller.

On NCCL ``wait()`` returns at once, so the deadline is kept by a thread polling
``is_completed()`` of the in-flight works. These tests drive the real poller, ledger,
beacons and store on 2 gloo ranks; only the work handles are stand-ins (a collective that
never completes, or completes when told), with the ledger marked as one whose host does
not wait, as NCCL's. tests/test_cuda.py runs the same poller against real NCCL works.
"""

from __future__ import annotations

import threading
import time

import torch
import torch.distributed as dist

from shardwise import faults
from shardwise.faults import monitor, poller
from shardwise.faults.ledger import ledger_for
from shardwise.testing import run_on_ranks

DEADLINE_S = 1.0
HEARTBEAT_S = 0.1


class StuckWork:
    """A work handle that says it completed only once ``done`` is set."""

    def __init__(self):
        self.done = threading.Event()

    def is_completed(self) -> bool:
        return self.done.is_set()

    def wait(self, timeout=None) -> bool:  # NCCL's: orders a stream, never blocks the host
        return True


def _nccl_like_group() -> dist.ProcessGroup:
    pg = dist.new_group(backend="gloo")
    ledger_for(pg).host_waits = False  # as on NCCL: wait() does not block the host
    return pg


def _issue(pg, op: str, fqn: str, work) -> object:
    return monitor.issue(op, fqn, pg, torch.ones(4), lambda: work)


def _wait_for_error(pg, limit_s: float) -> tuple[str | None, float]:
    """Keep issuing (as a host running ahead would) until the poller's error is raised."""
    start = time.monotonic()
    while time.monotonic() - start < limit_s:
        try:
            _issue(pg, "all-reduce", "probe", None)
        except faults.CollectiveTimeoutError as err:
            return str(err), time.monotonic() - start
        time.sleep(0.05)
    return None, time.monotonic() - start


def _diverged() -> tuple[str | None, float]:
    """Rank 0 issues the all-gather of ``extra`` where rank 1 issues the reduce-scatter of ``layers.0``."""
    faults.configure(order_check="off", watchdog_s=DEADLINE_S, heartbeat_s=HEARTBEAT_S)
    pg = _nccl_like_group()
    if dist.get_rank() == 0:
        _issue(pg, "all-gather", "extra", StuckWork())
    else:
        _issue(pg, "reduce-scatter", "layers.0", StuckWork())
    return _wait_for_error(pg, limit_s=10 * DEADLINE_S)


def test_poller_names_diverged_ranks_on_every_rank():
    results = run_on_ranks(_diverged, 2, timeout=60)
    for rank, (message, seconds) in enumerate(results):
        assert message is not None, f"rank {rank}: no error within {seconds:.1f} s"
        assert "all-gather of extra" in message and "reduce-scatter of layers.0" in message, message
        assert f"rank {rank} waited" in message, message
        assert DEADLINE_S <= seconds < DEADLINE_S + 3.0, seconds


def _dead_peer() -> tuple[str | None, float]:
    """Rank 1's beacon stops (a frozen or dead host); rank 0 waits on a collective."""
    faults.configure(order_check="off", watchdog_s=DEADLINE_S, heartbeat_s=HEARTBEAT_S)
    pg = _nccl_like_group()
    dist.barrier()
    if dist.get_rank() == 1:
        ledger_for(pg).beacon.stop(join_timeout=5.0)
        time.sleep(4 * DEADLINE_S)
        return None, 0.0
    _issue(pg, "all-gather", "layers.1", StuckWork())
    return _wait_for_error(pg, limit_s=10 * DEADLINE_S)


def test_poller_names_a_peer_that_stopped_reporting():
    message, seconds = run_on_ranks(_dead_peer, 2, timeout=60)[0]
    assert message is not None, f"no error within {seconds:.1f} s"
    assert "rank 1 has not reported" in message and "dead or stopped" in message, message
    assert "forward all-gather of layers.1" in message, message
    assert seconds < 2 * DEADLINE_S + 3.0, seconds


def _slow_but_healthy() -> tuple[bool, int, str | None]:
    """Both ranks wait on the same collective for 3 deadlines, then it completes: no error."""
    faults.configure(order_check="off", watchdog_s=DEADLINE_S, heartbeat_s=HEARTBEAT_S)
    pg = _nccl_like_group()
    work = StuckWork()
    _issue(pg, "reduce-scatter", "layers.0", work)
    time.sleep(3 * DEADLINE_S)
    seen = ledger_for(pg).beacon.status().waiting
    work.done.set()
    time.sleep(3 * HEARTBEAT_S)
    mine = poller.poller_for(ledger_for(pg).rank, HEARTBEAT_S)
    try:
        _issue(pg, "all-reduce", "next", None)
        error = None
    except faults.CollectiveTimeoutError as err:
        error = str(err)
    return seen is not None and seen.collective.fqn == "layers.0", mine.in_flight(), error


def test_poller_never_blames_a_slow_step_and_publishes_what_it_waits_on():
    for published, in_flight, error in run_on_ranks(_slow_but_healthy, 2, timeout=60):
        assert error is None, error
        assert published, "the beacon did not publish the collective the rank waits on"
        assert in_flight == 0, "a completed work is still followed"


def _threads_after_shutdown() -> tuple[list[str], list[str], list[str]]:
    """Fault threads before ``monitor.shutdown()``, after it, and after the next collective."""
    faults.configure(order_check="off", watchdog_s=DEADLINE_S, heartbeat_s=HEARTBEAT_S)
    pg = _nccl_like_group()
    work = StuckWork()
    _issue(pg, "all-gather", "layers.0", work)

    def fault_threads():
        return sorted(t.name.split("-")[1] for t in threading.enumerate() if t.name.startswith("shardwise-") and t.is_alive())

    before = fault_threads()
    monitor.shutdown()
    after = fault_threads()
    work.done.set()
    _issue(pg, "all-gather", "layers.0", work)  # the next watched collective starts them again
    return before, after, fault_threads()


def test_shutdown_stops_and_joins_every_fault_thread_and_they_restart_on_use():
    for before, after, again in run_on_ranks(_threads_after_shutdown, 2, timeout=60):
        assert "beacon" in before and "poller" in before, before
        assert "beacon" not in after and "poller" not in after, after
        assert "beacon" in again and "poller" in again, again
