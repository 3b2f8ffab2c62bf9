"""Faults are named, not hung: the order check and the watchdog (shardwise.faults).

Each case is one from issue #16's "Why", on real gloo ranks. The model lives on a fresh
process group (``dist.new_group``) so that an unmatched collective never touches the warm
pool's default group. Cases where an order-check error stops the ranks before a
collective is issued return their messages; cases where a real collective is left hanging
(the watchdog's) let the ranks fail, which throws the pool away: they come last.

Detection times (divergence to error) are measured inside the ranks and checked against
the deadline with generous slack: they are behaviour (the error comes from the watchdog,
not from gloo's 30 min timeout), not speed targets.
"""

from __future__ import annotations

import os
import re
import signal
import time

import pytest
import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

import shardwise
from shardwise import faults
from shardwise.faults import step_digest
from shardwise.testing import RankFailure, pool_pids, run_on_ranks

TIMEOUT_S = 60.0
DEADLINE_S = 2.0  # the watchdog deadline in these tests (default 60 s)


class Blocks(nn.Module):
    """Two same-shaped blocks ``a``, ``b`` and an optional ``extra`` one, all sharded."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.extra = nn.Linear(8, 8)

    def forward(self, x, order=("a", "b")):
        for name in order:
            x = getattr(self, name)(x)
        return x


def _sharded_blocks() -> Blocks:
    mesh = DeviceMesh.from_group(dist.new_group(backend="gloo"), "cpu")
    model = Blocks()
    for block in (model.a, model.b, model.extra):
        shardwise.fully_shard(block, mesh=mesh)
    return shardwise.fully_shard(model, mesh=mesh)


def _order(case: str, step: int, at: int) -> tuple[str, ...]:
    """The blocks rank 0 and rank 1 run at ``step`` when the divergence is ``at``."""
    if step != at or dist.get_rank() == 1:
        return ("a", "b")
    return {"extra": ("a", "extra", "b"), "swapped": ("b", "a"), "skipped": ("a",), "same": ("a", "b")}[case]


def _train(case: str, at: int, steps: int = 4) -> None:
    model = _sharded_blocks()
    for step in range(steps):
        model(torch.ones(2, 8), order=_order(case, step, at)).sum().backward()


def _caught(case: str, at: int, order_check) -> tuple[str, float]:
    """Run until the order check raises; (message, seconds from the divergent step's start)."""
    faults.configure(order_check=order_check, watchdog_s=DEADLINE_S)
    model = _sharded_blocks()
    for step in range(at + 2):
        start = time.monotonic()
        try:
            model(torch.ones(2, 8), order=_order(case, step, at)).sum().backward()
        except faults.CollectiveMismatchError as err:
            return str(err), time.monotonic() - start
    return "no error", 0.0


# -- the order check ------------------------------------------------------------------


@pytest.mark.parametrize(
    "case,names",
    [("extra", ("extra", "b")), ("swapped", ("of b", "of a")), ("skipped", ("all-gather of a", "all-gather of b"))],
    ids=["extra-block-on-rank-0", "same-shape-blocks-swapped", "block-skipped-on-rank-0"],
)
def test_order_check_names_the_diverging_collective_on_every_rank(case, names):
    results = run_on_ranks(_caught, 2, case, 1, 2, timeout=TIMEOUT_S)

    for rank, (message, seconds) in enumerate(results):
        assert "ranks diverged at step 1" in message, (rank, message)
        assert all(name in message for name in names), (rank, message)
        assert "rank 0:" in message and "rank 1:" in message, message
        assert seconds < DEADLINE_S, (rank, seconds, message)  # found before anything hung


def test_order_check_always_catches_a_late_step_and_default_leaves_it_to_the_watchdog():
    always = run_on_ranks(_caught, 2, "swapped", 4, "always", timeout=TIMEOUT_S)

    assert all("ranks diverged at step 4" in m for m, _ in always), always


def _recreated_groups(incarnations: int) -> list[tuple[str, str]]:
    """The same group, destroyed and made again: each incarnation trains a checked step and
    then diverges at step 1; (group name, message) per incarnation.

    Each incarnation rendezvouses in a fresh namespace of the job's store, as a job that
    re-initialises does (torchrun gives each attempt its own prefix): gloo itself would
    otherwise find the destroyed group's addresses under the same name and connect to dead
    ports. The fault monitor's own keys and threads must carry nothing over either."""
    faults.configure(order_check=2, watchdog_s=DEADLINE_S)
    default = distributed_c10d._get_default_group()
    backend, job_store = distributed_c10d._world.pg_map[default]
    found = []
    for incarnation in range(incarnations):
        distributed_c10d._world.pg_map[default] = (backend, dist.PrefixStore(f"attempt{incarnation}/", job_store))
        group = dist.new_group(backend="gloo", use_local_synchronization=True)
        mesh = DeviceMesh.from_group(group, "cpu")
        model = Blocks()
        for block in (model.a, model.b, model.extra):
            shardwise.fully_shard(block, mesh=mesh)
        model = shardwise.fully_shard(model, mesh=mesh)
        message = "no error"
        for step in range(2):
            try:
                model(torch.ones(2, 8), order=_order("swapped", step, 1)).sum().backward()
            except faults.CollectiveMismatchError as err:
                message = str(err)
                break
        found.append((group.group_name, message))
        del model, mesh
        dist.destroy_process_group(group)
    distributed_c10d._world.pg_map[default] = (backend, job_store)
    return found


def test_order_check_agrees_on_a_group_destroyed_and_made_again():
    """A group's name comes back when it is re-created (a job re-initialising its groups):
    the ranks must meet under the same keys again, not a stale incarnation's."""
    results = run_on_ranks(_recreated_groups, 2, 3, timeout=TIMEOUT_S)

    for rank, found in enumerate(results):
        names = {name for name, _ in found}
        assert len(names) == 1, (rank, names)  # the same name each time: the case under test
        for name, message in found:
            assert "ranks diverged at step 1" in message, (rank, message)


def _slow_rank() -> list[float]:
    """Rank 1 computes for twice the deadline in step 2's forward; nobody is blamed."""
    faults.configure(watchdog_s=1.0, order_check=1)
    model = _sharded_blocks()

    def slow(module, args):
        if dist.get_rank() == 1 and slow.step == 2:
            time.sleep(2.5)

    model.b.register_forward_pre_hook(slow)
    losses = []
    for slow.step in range(4):
        losses.append(model(torch.ones(2, 8)).sum().item())
        model.a.weight.grad = None
    return losses


def test_a_slow_rank_is_not_a_fault():
    losses = run_on_ranks(_slow_rank, 2, timeout=TIMEOUT_S)

    assert losses[0] == losses[1]


# -- collectives outside forward and backward: clipping, the job's ----------------------


def _step(model: Blocks) -> None:
    """One training step of ``shardwise train``'s shape: forward, backward, the gradient
    clip (on the FSDP group), the loss mean (on the default group, which no root marks
    here, as in a TP or HSDP job)."""
    from shardwise.train.loop import mean_across_ranks

    model(torch.ones(2, 8)).sum().backward()
    shardwise.clip_grad_norm_(model.parameters(), 1.0)
    mean_across_ranks(1.0, torch.device("cpu"))


def _stopped_before(pids: list[int], collective) -> tuple[str, float] | None:
    """Rank 1 stops (SIGSTOP) right before ``collective``; rank 0 runs it until the watchdog
    names the stopped rank, then wakes rank 1 (SIGCONT), which runs it too: its collective
    meets the one rank 0 left in flight, and both go on. Rank 0: (message, seconds)."""
    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGSTOP)
        collective()
        return None
    start = time.monotonic()
    try:
        collective()
    except faults.CollectiveTimeoutError as err:
        return str(err), time.monotonic() - start
    finally:
        os.kill(pids[1], signal.SIGCONT)
    return "no error", time.monotonic() - start


def _job_collectives_with_a_rank_stopped_before_each(pids: list[int]) -> dict:
    """Past the order-checked steps, rank 1 stops before each collective issued outside
    forward and backward: the gradient clip's norm, ``shardwise train``'s loss mean, its
    ``--auto`` peak memory, its exit barrier."""
    from types import SimpleNamespace

    from shardwise.train.distributed import DistEnv, teardown
    from shardwise.train.loop import _peaks, mean_across_ranks

    faults.configure(watchdog_s=DEADLINE_S)  # the pool resets fault state before each task
    destroy = dist.destroy_process_group
    dist.destroy_process_group = lambda group=None: None  # the exit barrier's teardown: keep the pool's group
    try:
        model = _sharded_blocks()
        for _ in range(2):
            _step(model)
        model(torch.ones(2, 8)).sum().backward()
        found = {"clip": _stopped_before(pids, lambda: shardwise.clip_grad_norm_(model.parameters(), 1.0)),
                 "loss mean": _stopped_before(pids, lambda: mean_across_ranks(1.0, torch.device("cpu")))}
        planned = SimpleNamespace(plan=SimpleNamespace(peak_bytes=1), measured_peak_bytes=2)
        found["peak"] = _stopped_before(pids, lambda: _peaks(planned, torch.device("cpu")))
        env = DistEnv(dist.get_rank(), 2, torch.device("cpu"), None, owns_process_group=True)
        found["exit"] = _stopped_before(pids, lambda: teardown(env))
        if dist.get_rank() == 0:
            dist.barrier()  # rank 1's teardown goes on to its final (plain) barrier
        return found
    finally:
        dist.destroy_process_group = destroy


def test_a_rank_stopped_before_a_clip_or_a_job_collective_is_named():
    """``clip_grad_norm_``'s norm and the training job's own collectives (loss mean, --auto
    peak, exit barrier) are watched like the library's: a peer that stops is named within
    the deadline, not waited on for gloo's timeout. (On the unwatched collectives rank 0
    hung in the first: the harness's RankTimeout.)"""
    found = run_on_ranks(_job_collectives_with_a_rank_stopped_before_each, 2, pool_pids(2), timeout=TIMEOUT_S)[0]

    labels = {"clip": "shardwise.clip_grad_norm_", "loss mean": "shardwise train's loss mean",
              "peak": "shardwise train's --auto peak memory", "exit": "shardwise train's exit barrier"}
    for scenario, (message, seconds) in found.items():
        assert "shardwise watchdog" in message and labels[scenario] in message, (scenario, message)
        assert "rank 1 has not reported for" in message and "dead or stopped" in message, (scenario, message)
        assert seconds < 4 * DEADLINE_S, (scenario, seconds, message)
    assert list(found) == list(labels)


def _ledger_sizes(steps: tuple[int, ...]) -> list[dict]:
    """A job whose default group is not an FSDP group (as with TP or HSDP): each step clips
    (the FSDP group, and a TP-like group no root marks) and means the loss (the default
    group). After each count in ``steps``: per group, what its ledger holds."""
    from torch.distributed.tensor import Shard, distribute_tensor

    from shardwise.faults.ledger import ledger_for

    faults.configure(order_check=2, watchdog_s=DEADLINE_S, heartbeat_s=0.05)  # reset before each task
    model = _sharded_blocks()
    tp_mesh = DeviceMesh.from_group(dist.new_group(backend="gloo"), "cpu")
    tp_param = nn.Parameter(distribute_tensor(torch.ones(4), tp_mesh, [Shard(0)]))
    groups = {"fsdp": model.a.weight.device_mesh.get_group(), "world": dist.group.WORLD, "tp": tp_mesh.get_group()}
    sizes, done = [], 0
    for count in steps:
        for _ in range(count - done):
            _step(model)
            tp_param.grad = torch.ones_like(tp_param)
            shardwise.clip_grad_norm_([tp_param], 1.0)
        done = count
        time.sleep(0.3)  # a few heartbeats: the step digests are compared
        ledgers = {name: ledger_for(pg) for name, pg in groups.items()}
        sizes.append({name: dict(in_step=len(l.digests.current), filed=len(l.digests.filed),
                                 last_checked=l.last_checked, compared=l.digests.compared)
                      for name, l in ledgers.items()})
    return sizes


def test_groups_no_root_marks_stay_bounded_and_compared():
    """The default group of a TP or HSDP job, and a TP group, carry collectives (the loss
    mean, the clip's norm) but no root's step marks. Their ledgers must not grow with the
    steps (the step's log; the order check is a store round trip per collective, for the
    first steps only), and their digests, like the FSDP group's (the clip's norm issued
    between the end of one step and the next), are compared across ranks without a
    mismatch."""
    for rank, (early, late) in enumerate(run_on_ranks(_ledger_sizes, 2, (4, 10), timeout=TIMEOUT_S)):
        for name in ("fsdp", "world", "tp"):
            assert late[name]["in_step"] == early[name]["in_step"], (rank, name, early, late)  # this step's only
            assert late[name]["last_checked"] == early[name]["last_checked"], (rank, name, early, late)
            assert late[name]["filed"] <= step_digest.KEEP_STEPS, (rank, name, late)
            assert late[name]["compared"] > early[name]["compared"] >= 2, (rank, name, early, late)


# -- the watchdog (the ranks fail: the pool is thrown away) -----------------------------


def _fault(kind: str, pids: list[int]) -> None:
    """Divergence at step 3 (past the 2 checked steps): ``extra`` control flow, rank 1
    stopped (SIGSTOP), or rank 1 killed. Rank 0 reports the detection time."""
    faults.configure(watchdog_s=DEADLINE_S)
    model = _sharded_blocks()
    for step in range(5):
        start = time.monotonic()
        if step == 3 and dist.get_rank() == 1 and kind == "stopped":
            os.kill(os.getpid(), signal.SIGSTOP)
        if step == 3 and dist.get_rank() == 1 and kind == "killed":
            os._exit(17)
        try:
            model(torch.ones(2, 8), order=_order("extra" if kind == "extra" else "same", step, 3)).sum().backward()
        except (faults.CollectiveTimeoutError, faults.CollectiveFailedError) as err:
            detected = time.monotonic() - start
            if kind == "stopped":
                os.kill(pids[1], signal.SIGKILL)
            if kind == "extra":  # the peer reaches its own deadline up to one later: the
                time.sleep(DEADLINE_S)  # harness gives it 1 s after a failure, so report later
            raise type(err)(f"{err} [detected after {detected:.2f} s]") from None


def _digest_fault(at: int) -> None:
    """Same-shape blocks swapped on rank 0 at step ``at``, past the order-checked steps. The
    ranks raise the digest's error where they meet it (a rank may be blocked in the next
    step's collective, which its peer never joins: it raises from the wait), adding the
    seconds since the divergent step; the collective left behind throws the pool away."""
    faults.configure(order_check=2, watchdog_s=DEADLINE_S, heartbeat_s=0.1)
    model = _sharded_blocks()
    diverged = time.monotonic()
    for step in range(at + 50):
        if step == at:
            diverged = time.monotonic()
        try:
            model(torch.ones(2, 8), order=_order("swapped", step, at)).sum().backward()
        except faults.CollectiveMismatchError as err:
            raise type(err)(f"{err} [detected after {time.monotonic() - diverged:.2f} s]") from None
        time.sleep(0.02)


def test_step_digest_names_a_same_shape_divergence_past_the_checked_steps_on_every_rank():
    pool_pids(2)
    with pytest.raises(RankFailure) as info:
        run_on_ranks(_digest_fault, 2, 4, timeout=TIMEOUT_S)

    traces = info.value.tracebacks
    assert set(traces) == {0, 1}, str(info.value)
    for trace in traces.values():
        assert "CollectiveMismatchError: shardwise step digest" in trace and "at step 4" in trace, trace
        assert "rank 0: the forward all-gather of b" in trace and "rank 1: the forward all-gather of a" in trace, trace
        assert _detected_after(trace) < 2 * DEADLINE_S, trace


def _detected_after(trace: str) -> float:
    return float(re.search(r"detected after ([0-9.]+) s", trace).group(1))


def test_watchdog_explains_control_flow_past_the_checked_steps_on_every_rank():
    pool_pids(2)
    with pytest.raises(RankFailure) as info:
        run_on_ranks(_fault, 2, "extra", [], timeout=TIMEOUT_S)

    traces = info.value.tracebacks
    assert set(traces) == {0, 1}, str(info.value)
    for rank, trace in traces.items():
        assert "CollectiveTimeoutError: shardwise watchdog" in trace, trace
        assert "of extra (step 3" in trace and f"rank {1 - rank} is in the" in trace, trace
        assert _detected_after(trace) < 4 * DEADLINE_S, trace


@pytest.mark.parametrize("kind", ["stopped", "killed"])
def test_watchdog_names_a_stopped_or_dead_rank(kind):
    pids = pool_pids(2)
    with pytest.raises(RankFailure) as info:
        run_on_ranks(_fault, 2, kind, pids, timeout=TIMEOUT_S)

    trace = info.value.tracebacks[0]
    if kind == "stopped":
        assert "CollectiveTimeoutError" in trace and "rank 1 has not reported for" in trace, trace
        assert "dead or stopped" in trace, trace
    else:
        assert "CollectiveFailedError" in trace and "rank 1" in trace, trace
    assert _detected_after(trace) < 4 * DEADLINE_S, trace


@pytest.mark.launches
def test_a_beating_rank_exits_cleanly():
    """The beacon's daemon thread is joined at exit: one caught inside a store call while
    the interpreter destroyed the store aborted the process (about half the runs)."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).with_name("_beacon_exit.py")
    done = subprocess.run([sys.executable, str(script), "2"], capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "aborted runs: 0 of 2" in done.stdout, done.stdout + done.stderr[-2000:]
