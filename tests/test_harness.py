"""The multi-rank harness itself: values from every rank, reuse, failures and hangs.

Each ``_name`` function below runs inside the ranks (module level, so it pickles by
reference); each ``test_`` function runs in pytest. The tests that break a pool come
last, so the suite restarts as few pools as possible.
"""

import os
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from shardwise.testing import RankFailure, RankTimeout, kill_job, multirank, pool_pids, run_on_ranks
from shardwise.testing.pool import RankPool

# -- functions that run on the ranks -------------------------------------------------


def _rank_report(tag):
    total = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(total)
    return {"rank": dist.get_rank(), "world_size": dist.get_world_size(), "sum": total.item(), "tag": tag}


def _pid():
    return os.getpid()


def _scaled(tensor, *, factor):
    return tensor * factor * (dist.get_rank() + 1)


def _draw_and_reseed():
    draw = torch.rand(3)
    torch.manual_seed(1234)  # the harness must undo this before the next task
    torch.set_num_threads(2)
    return draw, torch.get_num_threads()


def _threads():
    return torch.get_num_threads()


def _mesh_2d_all_reduce():
    groups_at_start = len(distributed_c10d._world.pg_map)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    value = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(value, group=mesh.get_group("tp"))
    pair = dist.new_group([0, 1])
    if dist.get_rank() in (0, 1):
        dist.barrier(group=pair)
    return groups_at_start, value.item(), mesh["dp"].size()


def _explode_on_rank_1():
    if dist.get_rank() == 1:
        raise ValueError(f"boom from rank {dist.get_rank()}")
    dist.all_reduce(torch.ones(1))  # rank 0 now waits for a peer that is gone
    return "unreachable"


def _rank0_waits_in_all_reduce():
    if dist.get_rank() == 0:
        dist.all_reduce(torch.ones(1))  # rank 1 never enters it
    return dist.get_rank()


def _exit_hard():
    os._exit(3)


def _configure_faults_and_count_on_world():
    from shardwise import faults
    from shardwise.faults import monitor

    faults.configure(watchdog_s=3.5, order_check="always")
    monitor.all_reduce(torch.ones(1), dist.group.WORLD, dist.ReduceOp.SUM, "a test's collective")


def _fault_state_seen():
    from shardwise import faults
    from shardwise.faults.ledger import ledger_for

    return faults.current(), ledger_for(dist.group.WORLD).seq


def _environment_seen():
    from shardwise import faults

    return os.environ.get("SHARDWISE_TEST_MARK"), faults.current().watchdog_s


# -- tests --------------------------------------------------------------------------


@pytest.mark.parametrize("world_size", [1, 2, 4, 8])
def test_every_rank_returns_its_value(world_size):
    reports = run_on_ranks(_rank_report, world_size, "hi", timeout=60)

    assert [r["rank"] for r in reports] == list(range(world_size))
    assert {r["world_size"] for r in reports} == {world_size}
    assert {r["sum"] for r in reports} == {world_size * (world_size + 1) / 2}
    assert {r["tag"] for r in reports} == {"hi"}


def test_ranks_see_the_environment_of_their_start_and_read_fault_settings_from_it(monkeypatch):
    """Ranks are forked from a server that imported torch and shardwise earlier: they must
    still see the environment the parent had when it started them, and shardwise must read
    its ``SHARDWISE_*`` settings from that one (not from the server's, at import)."""
    monkeypatch.setenv("SHARDWISE_TEST_MARK", "started-with-this")
    monkeypatch.setenv("SHARDWISE_WATCHDOG_S", "7.5")
    pool = RankPool(2)
    try:
        assert pool.run(_environment_seen, (), {}, timeout=60) == [("started-with-this", 7.5)] * 2
    finally:
        pool.close()


def test_each_task_starts_from_fresh_fault_state():
    """A task's ``faults.configure()`` and the collectives it numbered on the default group
    (which outlives tasks) must not reach the next task: a test that counts a group's steps
    or collectives would otherwise depend on the tests before it."""
    fresh = run_on_ranks(_fault_state_seen, 2)
    run_on_ranks(_configure_faults_and_count_on_world, 2)
    assert run_on_ranks(_fault_state_seen, 2) == fresh
    assert fresh[0][1] == 0 and fresh[0][0].watchdog_s == 60.0


def test_pool_is_reused_across_calls():
    first = run_on_ranks(_pid, 2)
    second = run_on_ranks(_pid, 2)

    assert first == second == pool_pids(2)
    assert len(set(first)) == 2 and os.getpid() not in first


def test_tensors_and_keyword_arguments_round_trip():
    out = run_on_ranks(_scaled, 2, torch.arange(4.0), factor=2.0)

    torch.testing.assert_close(out[0], torch.arange(4.0) * 2)
    torch.testing.assert_close(out[1], torch.arange(4.0) * 4)


def test_each_task_starts_from_seed_zero_and_one_thread():
    first, _ = run_on_ranks(_draw_and_reseed, 2)[0]
    second, threads_inside = run_on_ranks(_draw_and_reseed, 2)[0]

    torch.manual_seed(0)
    torch.testing.assert_close(first, torch.rand(3))
    torch.testing.assert_close(second, first)
    assert threads_inside == 2
    assert run_on_ranks(_threads, 2) == [1, 1]


def test_meshes_and_new_groups_work_and_are_destroyed_after_each_task():
    first = run_on_ranks(_mesh_2d_all_reduce, 4)
    second = run_on_ranks(_mesh_2d_all_reduce, 4)

    # tp groups are {0,1} and {2,3}; only the default group outlives a task
    assert [value for _, value, _ in first] == [1.0, 1.0, 5.0, 5.0]
    assert [r[0] for r in first] == [r[0] for r in second] == [1, 1, 1, 1]
    assert {dp_size for _, _, dp_size in second} == {2}


def test_locally_synchronized_groups_can_be_recreated_in_later_tasks():
    # new_group(use_local_synchronization=True) names a group after its ranks and the number
    # of live groups, so once the harness destroys it the next task's group gets the same
    # name; its gloo rendezvous must not read the destroyed group's addresses from the store.
    for _ in range(3):
        assert run_on_ranks(_local_group_all_reduce, 2, timeout=30) == [2.0, 2.0]


def _local_group_all_reduce():
    if dist.get_rank() == 1:
        time.sleep(0.5)  # rank 0 rendezvouses first, while rank 1's old address is in the store
    group = dist.new_group([0, 1], use_local_synchronization=True)
    total = torch.ones(1)
    dist.all_reduce(total, group=group)
    return total.item()


@pytest.mark.parametrize("value", [3])
@multirank(2, timeout=30)
def test_multirank_decorator_runs_the_body_on_every_rank(value):
    total = torch.tensor([value])
    dist.all_reduce(total)
    assert total.item() == value * dist.get_world_size(), total


def test_unpicklable_function_is_a_type_error_and_keeps_the_pool():
    pids = pool_pids(2)

    with pytest.raises(TypeError, match="module level"):
        run_on_ranks(lambda: 1, 2)
    assert run_on_ranks(_pid, 2) == pids


# -- tests that break a pool (kept last, ordered so only one pool restarts) ---------


def test_hang_is_a_rank_timeout_with_stacks_and_the_next_call_works():
    before = pool_pids(2)
    start = time.monotonic()

    with pytest.raises(RankTimeout) as info:
        run_on_ranks(_rank0_waits_in_all_reduce, 2, timeout=2.0)

    elapsed = time.monotonic() - start
    message = str(info.value)
    assert 2.0 <= elapsed < 2.0 + 8.0, f"RankTimeout after {elapsed:.1f} s"  # + stack dump and kill
    assert "did not finish within 2 s" in message
    assert "--- rank 0 stacks ---" in message
    assert "in _rank0_waits_in_all_reduce" in message and "in all_reduce" in message
    assert info.value.finished == (1,) and set(info.value.stacks) == {0}
    _assert_gone(before)
    after = run_on_ranks(_pid, 2)
    assert set(after).isdisjoint(before)


def test_rank_exception_surfaces_with_traceback_and_peer_stacks():
    before = pool_pids(2)

    with pytest.raises(RankFailure) as info:
        run_on_ranks(_explode_on_rank_1, 2, timeout=30)

    message = str(info.value)
    assert "failed on rank 1 of 2" in message
    assert "Traceback (most recent call last)" in message
    assert "in _explode_on_rank_1" in message
    assert "ValueError: boom from rank 1" in message
    assert "rank 0 still running" in message and "in all_reduce" in message
    assert set(info.value.tracebacks) == {1} and set(info.value.stacks) == {0}
    _assert_gone(before)  # the poisoned pool is killed; the next call starts a fresh one


def test_a_rank_process_that_dies_is_a_rank_failure():
    with pytest.raises(RankFailure, match=r"rank 0 process \(pid \d+\) died with exit code 3"):
        run_on_ranks(_exit_hard, 1, timeout=30)


def test_a_rank_that_crashes_shows_where_it_was():
    with pytest.raises(RankFailure) as info:
        run_on_ranks(_segfault, 1, timeout=30)
    message = str(info.value)
    assert "died with exit code -11" in message
    assert "Segmentation fault" in message and "in _segfault" in message, message


def _segfault():
    import ctypes

    ctypes.string_at(0)  # reads address 0: SIGSEGV


def _assert_gone(pids):
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_kill_job_reaches_workers_in_sessions_of_their_own():
    """torchrun starts each worker in a session of its own: :func:`kill_job` stops them with
    the launcher (a ``killpg`` of the launcher's group left them running as orphans)."""
    worker = "import time; time.sleep(600)"
    launcher = (
        "import subprocess, sys, time\n"
        f"w = subprocess.Popen([sys.executable, '-c', {worker!r}], start_new_session=True)\n"
        "print(w.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", launcher], stdout=subprocess.PIPE, text=True, start_new_session=True)
    worker_pid = int(proc.stdout.readline())
    kill_job(proc)
    try:
        for _ in range(100):  # reaped by init shortly after its SIGKILL
            if not _alive(worker_pid):
                return
            time.sleep(0.05)
        raise AssertionError(f"worker {worker_pid} outlived kill_job")
    finally:
        if _alive(worker_pid):
            os.kill(worker_pid, 9)


def _alive(pid: int) -> bool:
    """Running (not gone, not a zombie awaiting its reaper)."""
    try:
        state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_ci_only_names_only_tests_that_exist():
    """Every entry of tests/ci_only.txt (what ``./dev test`` skips) is a test function of its
    file: a renamed or deleted test leaves no stale entry behind."""
    import ast

    from conftest import CI_ONLY, ci_only_entries

    entries = ci_only_entries()
    assert entries, "tests/ci_only.txt lists no test"
    stale = []
    for entry in entries:
        path, *names = entry.split("[", 1)[0].split("::")
        file = CI_ONLY.parent.parent / path
        if not file.is_file():
            stale.append(entry)
            continue
        defined = {node.name for node in ast.walk(ast.parse(file.read_text())) if isinstance(node, (ast.FunctionDef, ast.ClassDef))}
        if not set(names) <= defined:
            stale.append(entry)
    assert not stale, f"tests/ci_only.txt names tests that do not exist: {stale}"


def _sharded_op_on_a_group_the_task_destroys_itself() -> None:
    """A task that makes a group, runs a DTensor op on it (DTensor caches the sharding,
    mesh included) and destroys the group itself, as a job re-initialising its groups does."""
    from torch.distributed.tensor import Shard, distribute_tensor

    group = dist.new_group(backend="gloo", use_local_synchronization=True)
    mesh = DeviceMesh.from_group(group, "cpu")
    (distribute_tensor(torch.ones(4, 4), mesh, [Shard(0)]) * 2).to_local()
    dist.destroy_process_group(group)


def _sharded_op_on_a_new_group_of_the_same_ranks() -> str:
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = DeviceMesh.from_group(dist.new_group(backend="gloo"), "cpu")
    out = distribute_tensor(torch.ones(4, 4), mesh, [Shard(0)]) * 2
    return out.device_mesh.get_group().group_name  # raises if the mesh is the destroyed group's


def test_a_task_that_destroys_its_own_groups_leaves_no_cached_mesh_behind():
    """DTensor's sharding cache keys meshes by shape and names, not by their groups: after a
    task destroyed a group itself, the next task's op on an equal mesh must not be handed the
    dead group's mesh (it was: 'Could not resolve the process group registered under the
    name ...')."""
    run_on_ranks(_sharded_op_on_a_group_the_task_destroys_itself, 2)
    names = run_on_ranks(_sharded_op_on_a_new_group_of_the_same_ranks, 2)
    assert names[0] == names[1]
