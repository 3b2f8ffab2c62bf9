"""``shardwise train --fault-tolerance torchft``: replica groups that survive each other.

Each replica group is a real torchrun job of 2 gloo ranks (``tests/_torchft_child.py`` runs
``shardwise train``'s loop and records per-rank losses and local shards); torchft's lighthouse
is its own CLI, started by the test with a 1 s heartbeat timeout so that a failure costs
about a second. Groups die by ``SIGKILL`` of their workers from the inside, at named fault
points (``ft_all_reduce``: mid-step, in the all-reduce across groups; ``step``: between
steps), then their launcher and any leftover worker are killed too; a group is started again
with the same command line, as a scheduler would (its processes are launched ahead and wait
for a file, so that they do not import torch after the kill; alone, the survivor waits until
they are set up, then paces its steps, so that it does not run out of steps before they join).

Synchronous quorum: until the first kill, every step's per-rank loss and, at a dumped step,
every local shard and AdamW state equal the same ranks as one ``--replicate 2`` job, bit for
bit; the survivor discards the failed step and carries on alone; the restarted group heals
from it and holds its exact shards and AdamW state; the survivor then dies between steps and
the healed group finishes alone, AdamW's step count saying no step was applied twice.

Asynchronous quorum (torchtitan's default): two groups started from different seeds end equal
only through the step-0 heal. The root cause of that setting breaking (the state to send built
from the model while the training thread is in forward) has its own deterministic test.

Two hosts (opt-in, ``SHARDWISE_NETNS_TORCHFT=1``, about 30 s; needs root and ``ip netns``): one
group per network namespace; host 1's link is cut, group 0 goes on alone, the link comes back
and the same command heals and trains in step. The root cause of its survivor once dying there
(a cut link reaches the group's ranks one collective timeout apart, and the commit vote waited
only one) has its own deterministic test: one group, a cross-group process group whose chosen
all-reduces meet a silent peer.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.distributed as dist

from _torchft_child import reference
from shardwise.testing import kill_job, run_on_ranks
from shardwise.train import distributed, fault_tolerance, loop
from shardwise.train.config import TrainConfig
from shardwise.train.data import BatchSampler
from shardwise.train.fault_tolerance import HealState, replica_group
from shardwise.train.loop import build_model, build_optimizer, train_step
from shardwise.train.models import model_spec
from shardwise.train.schedule import build_scheduler

pytest.importorskip("torchft")

ROOT = Path(__file__).resolve().parent.parent
CHILD = Path(__file__).resolve().parent / "_torchft_child.py"
HEARTBEAT_MS = 1000
ALONE_STEP_S = 0.5  # a survivor's pace while alone, once the restarted group is set up: it must catch up
TRAIN = ["--model", "nano", "--batch-size", "2", "--seq-len", "16", "--data-bytes", "20000", "--device", "cpu",
         "--lr-schedule", "cosine", "--warmup-steps", "2"]
TIMEOUT = 240


def test_flags_and_torchfts_environment_variables_name_the_replica_group():
    cfg = TrainConfig(fault_tolerance="torchft", replica_groups=3, lighthouse="http://lh:29510")
    environ = {"REPLICA_GROUP_ID": "2", "NUM_REPLICA_GROUPS": "9", "TORCHFT_LIGHTHOUSE": "http://other:1"}
    group = replica_group(cfg, environ)  # the flags win, the environment fills in the rest
    assert (group.group_id, group.groups, group.lighthouse) == (2, 3, "http://lh:29510")
    with pytest.raises(ValueError, match="--lighthouse .*TORCHFT_LIGHTHOUSE"):
        replica_group(TrainConfig(fault_tolerance="torchft"), {"REPLICA_GROUP_ID": "0", "NUM_REPLICA_GROUPS": "2"})
    with pytest.raises(ValueError, match=r"--replica-group-id must be in \[0, --replica-groups=2\)"):
        replica_group(TrainConfig(fault_tolerance="torchft", replica_groups=2, replica_group_id=2, lighthouse="x"), {})
    with pytest.raises(ValueError, match="--replica-groups, --async-quorum configure replica groups: add --fault-tolerance"):
        TrainConfig(replica_groups=2, async_quorum=True)
    with pytest.raises(ValueError, match="drop --replicate / --tp / --auto"):
        TrainConfig(fault_tolerance="torchft", replicate=2)
    with pytest.raises(ValueError, match="--float8 with --fault-tolerance torchft is not supported yet"):
        TrainConfig(fault_tolerance="torchft", float8=True)


def _two_steps(serve_mid_forward: bool) -> dict:
    """Two steps of the nano GPT on this rank; with ``serve_mid_forward`` a second thread asks for
    the heal state in the middle of step 2's forward (inside block 1, between attention and MLP),
    as torchft's quorum thread does with ``--async-quorum``, and copies what it is served."""
    cfg = TrainConfig(model="nano", batch_size=2, seq_len=16, device="cpu")
    env = distributed.setup("cpu")
    spec = model_spec(cfg)
    model = build_model(cfg, env, spec)
    optimizer = build_optimizer(model, cfg.lr)
    tokens = torch.randint(0, 256, (4096,), generator=torch.Generator().manual_seed(1), dtype=torch.uint8)
    sampler = BatchSampler(tokens, 2, 16, 0, env.rank, env.world_size)
    heal = HealState(model, optimizer, build_scheduler(optimizer, "constant", 0, 2), sampler)
    train_step(model, optimizer, *sampler.next_batch())
    heal.stage()
    at_boundary = {k: v.clone() for k, v in heal.state_dict()["model"].items()}
    served: list[dict] = []

    def serve(*_):
        thread = threading.Thread(target=lambda: served.append(
            {k: v.clone() for k, v in heal.state_dict()["model"].items()}))
        thread.start()
        thread.join()

    if serve_mid_forward:
        model.layers[1].attn.register_forward_hook(serve)
    loss, _ = train_step(model, optimizer, *sampler.next_batch())
    return {"loss": loss.item(), "shards": {n: p.to_local().clone() for n, p in model.named_parameters()},
            "served": served, "at_boundary": at_boundary}


def test_the_heal_state_served_mid_forward_is_the_step_boundarys_and_leaves_the_step_alone():
    """The root of "asynchronous quorum breaks with a step-0 heal": torchft's quorum thread builds
    the state to send while the training thread is in forward. A ``model.state_dict()`` there
    reshards every group under the running forward (this test then fails: the block's MLP meets
    its sharded parameters); the staged state is only read."""
    plain, served = run_on_ranks(_two_steps, 2, False), run_on_ranks(_two_steps, 2, True)
    for rank in range(2):
        assert served[rank]["loss"] == plain[rank]["loss"]
        assert all(torch.equal(t, plain[rank]["shards"][n]) for n, t in served[rank]["shards"].items())
        (what,) = served[rank]["served"]
        assert list(what) == list(served[rank]["at_boundary"])
        assert all(torch.equal(t, served[rank]["at_boundary"][n]) for n, t in what.items())


class _SilentPeer(dist._Work):
    """A collective across replica groups whose peer went silent (a cut link): ``wait`` gives up
    after ``seconds`` with gloo's error, as gloo's own timeout does."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds

    def wait(self, timeout=None) -> bool:
        time.sleep(self.seconds)
        raise RuntimeError(f"Timed out waiting {self.seconds:.1f}s for recv operation to complete (a silent peer)")


def _cut_link_group(timeout, fail: dict[int, float]):
    """torchft's gloo group across replica groups, whose ``n``-th all-reduce meets a silent peer
    for ``fail[n]`` seconds."""
    from torchft.process_group import ProcessGroupGloo

    class CutLink(ProcessGroupGloo):
        calls = 0

        def allreduce(self, tensors, opts):
            self.calls += 1
            if self.calls in fail:
                return _SilentPeer(fail[self.calls])
            return super().allreduce(tensors, opts)

    return CutLink(timeout=timeout)


def _one_group_through_a_cut(timeout_s: float, late_s: float | None) -> list[tuple[int, float]]:
    """``(step, loss)`` of four steps of one replica group of 2 ranks: the real loop, torchft's
    Manager, an in-process lighthouse. With ``late_s``, step 3 meets a cut link as the netns
    test's survivor did: rank 1's second-to-last all-reduce across groups times out (its data was
    lost at the cut) while rank 0's went through; rank 0 then waits for rank 1 in the group's next
    reduce-scatter, and only then its own last all-reduce times out, and it gets to the vote
    ``late_s`` after that timeout (the rest of its step: logging the error, the backward after the
    hook). Rank 1 votes one collective timeout plus ``late_s`` before rank 0."""
    from torchft.coordination import LighthouseServer

    env = distributed.setup("cpu")
    cfg = TrainConfig(model="nano", batch_size=2, seq_len=16, data_bytes=20000, device="cpu", steps=4,
                      fault_tolerance="torchft", replica_groups=1, replica_group_id=0, lighthouse="-",
                      ft_timeout_s=timeout_s)
    hooks = sum(hasattr(m, "set_all_reduce_hook") for m in build_model(cfg, env, model_spec(cfg)).modules())
    last = 3 * hooks  # step 3's last all-reduce across groups (not steps 1-2: shardwise's order check
    # lines the ranks up at the end of their backward there)
    fail = {} if late_s is None else {last - 1: timeout_s} if env.rank == 1 else {last: timeout_s + late_s}
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=100) if env.rank == 0 else None
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False) if env.rank == 0 else None
    where = [(lighthouse.address(), store.port) if env.rank == 0 else None]
    dist.broadcast_object_list(where, src=0)
    (address, port), = where
    records: list[tuple[int, float]] = []
    try:
        with mock.patch.dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)), mock.patch.object(
                fault_tolerance, "_process_group", lambda device, timeout: _cut_link_group(timeout, fail)):
            loop.train(dataclasses.replace(cfg, lighthouse=address), env,
                       on_step=lambda step, loss, _: records.append((step, loss)))
    finally:
        if lighthouse is not None:
            lighthouse.shutdown()
    return records


def test_a_survivor_waits_at_the_commit_vote_for_a_group_peer_one_collective_timeout_late():
    """The root of the netns test's survivor dying when the other host's link was cut: its ranks
    reached ``should_commit`` one collective timeout apart (an all-reduce lost on rank 1 only, then
    rank 0's next one), and the vote waited only one collective timeout: rank 1's vote raised
    ``TimeoutError`` out of the step. The step must be discarded and run again: every loss equals a
    run without the cut, bit for bit."""
    timeout_s, late_s = 1.0, 0.5
    start = time.monotonic()
    cut = run_on_ranks(_one_group_through_a_cut, 2, timeout_s, late_s, timeout=120)
    assert time.monotonic() - start > 2 * timeout_s + late_s  # it did wait out both timeouts
    assert cut == run_on_ranks(_one_group_through_a_cut, 2, timeout_s, None, timeout=120)
    assert [step for step, _ in cut[0]] == [1, 2, 3, 4]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class Lighthouse:
    """``torchft_lighthouse`` on a free port, as the README starts it."""

    def __init__(self, log: Path) -> None:
        exe = shutil.which("torchft_lighthouse", path=str(Path(sys.executable).parent)) or shutil.which(
            "torchft_lighthouse")
        if exe is None:
            pytest.skip("torchft's lighthouse CLI (torchft_lighthouse) is not installed")
        port = _free_port()
        self.address = f"http://localhost:{port}"
        self.proc = subprocess.Popen(
            [exe, "--min_replicas", "1", "--bind", f"[::]:{port}", "--heartbeat_timeout_ms", str(HEARTBEAT_MS),
             "--join_timeout_ms", "10000", "--quorum_tick_ms", "20"],
            stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)

    def stop(self) -> None:
        kill_job(self.proc)


class Run:
    """Jobs launched into ``tmp``, each with its own output directory and log."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.jobs: list[subprocess.Popen] = []

    def launch(self, name: str, nproc: int, steps: int, dumps: list[int], *flags: str, fault: str | None = None,
               go: Path | None = None, alone_step_s: float = 0.0, ready: Path | None = None,
               peer_ready: Path | None = None, gloo_ifname: str | None = None,
               wrap=lambda cmd: cmd) -> subprocess.Popen:
        out = self.tmp / name
        out.mkdir()
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "SHARDWISE_FAULT")}
        env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", TEST_ALONE_STEP_S=str(alone_step_s), RUST_LOG="warn")
        if fault:
            env["SHARDWISE_FAULT"] = fault
        for key, path in (("TEST_GO_FILE", go), ("TEST_READY_FILE", ready), ("TEST_PEER_READY_FILE", peer_ready)):
            if path:
                env[key] = str(path)
        if gloo_ifname:
            env["GLOO_SOCKET_IFNAME"] = gloo_ifname
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               "--max-restarts=0", str(CHILD), str(out), ",".join(map(str, dumps)), *TRAIN, "--steps", str(steps),
               *flags]
        job = subprocess.Popen(wrap(cmd), env=env, stdout=(self.tmp / f"{name}.log").open("w"), stderr=subprocess.STDOUT,
                               start_new_session=True)
        self.jobs.append(job)
        return job

    def wait(self, job: subprocess.Popen, ok: bool = True) -> None:
        try:
            code = job.wait(timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"a job did not finish within {TIMEOUT} s:\n{self.tail()}") from None
        assert (code == 0) == ok, f"exit code {code}:\n{self.tail()}"

    def tail(self, n: int = 2500) -> str:
        return "\n".join(f"--- {log.name}:\n{log.read_text(errors='replace')[-n:]}" for log in sorted(self.tmp.glob("*.log")))

    def stop(self) -> None:
        for job in self.jobs:
            kill_job(job)

    def records(self, name: str, dp: int) -> list[dict]:
        return [json.loads(line) for line in (self.tmp / name / f"dp{dp}.jsonl").read_text().splitlines()]

    def losses(self, name: str, dp: int) -> dict[int, float]:
        return {r["step"]: r["loss"] for r in self.records(name, dp)}

    def state(self, name: str, dp: int, step: int) -> dict:
        return torch.load(self.tmp / name / f"dp{dp}-step{step}.pt")


def _ft(group: int, lighthouse: Lighthouse, *more: str) -> list[str]:
    return ["--fault-tolerance", "torchft", "--replica-groups", "2", "--replica-group-id", str(group),
            "--lighthouse", lighthouse.address, "--ft-timeout-s", "30", *more]


def _assert_same_state(a: dict, b: dict, what: str) -> None:
    assert list(a["model"]) == list(b["model"]) and len(a["model"]) > 0, what
    for name, t in a["model"].items():
        assert torch.equal(t, b["model"][name]), f"{what}: shard of {name} differs"
    assert list(a["optimizer"]) == list(b["optimizer"]) and len(a["optimizer"]) == len(a["model"]), what
    for name, state in a["optimizer"].items():
        for key, t in state.items():
            assert torch.equal(t, b["optimizer"][name][key]), f"{what}: AdamW {key} of {name} differs"


def _adam_steps(state: dict) -> set[float]:
    return {float(s["step"]) for s in state["optimizer"].values()}


def _assert_contiguous(records: list[dict], first: int, last: int, who: str) -> None:
    steps = [r["step"] for r in records]
    assert steps == list(range(first, last + 1)), f"{who} committed steps {steps}: one step twice, or one skipped"


@pytest.mark.launches
def test_sync_quorum_survives_a_kill_mid_step_and_one_between_steps_and_heals_exactly(tmp_path):
    kill, dump = 6, 5  # group 1 dies inside step 6's all-reduce across groups, then restarts
    # group 0 dies after step 22's optimizer step: the healed group finishes alone. Alone, group 0
    # waits for the restarted group's Manager, then paces its steps: that group joins well before.
    kill2 = kill + 16
    steps = kill2 + 6
    lighthouse = Lighthouse(tmp_path / "lighthouse.log")
    run, go, ready = Run(tmp_path), tmp_path / "go", tmp_path / "g1b-ready"
    try:
        first = run.launch("g0", 2, steps, [dump, kill2 - 1], *_ft(0, lighthouse), fault=f"step@{kill2}",
                           alone_step_s=ALONE_STEP_S, peer_ready=ready)
        victim = run.launch("g1", 2, steps, [dump], *_ft(1, lighthouse), fault=f"ft_all_reduce@{kill}")
        restarted = run.launch("g1b", 2, steps, [kill2 - 1, steps], *_ft(1, lighthouse), go=go, ready=ready)
        run.wait(victim, ok=False)
        kill_job(victim)  # its launcher and any worker left
        go.touch()  # the same command line again, as a scheduler would restart it
        # meanwhile, the same ranks as one job without fault tolerance, in the pool of 4 ranks
        one_job = run_on_ranks(reference, 4, [*TRAIN, "--steps", str(steps), "--stop-after", str(kill),
                                              "--replicate", "2"], [dump], timeout=TIMEOUT)
        run.wait(first, ok=False)
        kill_job(first)
        run.wait(restarted)
    finally:
        run.stop()
        lighthouse.stop()

    # Until the kill: bit-identical to one --replicate 2 job, loss by loss and shard by shard.
    for dp, ref_losses, ref_dumps in one_job:
        name = "g0" if dp < 2 else "g1"
        assert {s: v for s, v in run.losses(name, dp).items() if s < kill} == {s: ref_losses[s] for s in range(1, kill)}
        _assert_same_state(ref_dumps[dump], run.state(name, dp, dump), f"dp{dp} at step {dump}")

    # The survivor of the mid-step kill: every step committed once, the failed one again without group 1.
    records = run.records("g0", 0)
    _assert_contiguous(records, 1, kill2 - 1, "group 0")
    by_step = {r["step"]: r for r in records}
    assert all(by_step[s]["groups"] == 2 for s in range(1, kill)) and by_step[kill]["groups"] == 1, by_step[kill]
    lost_mid = by_step[kill]["t"] - by_step[kill - 1]["t"]
    assert lost_mid < 10 * HEARTBEAT_MS / 1000, f"the survivor took {lost_mid:.1f} s over the failed step"

    # The restarted group heals from it and trains in step: the same shards and AdamW state.
    healed = run.records("g1b", 2)
    first_step = healed[0]
    assert first_step["healed"] and kill < first_step["step"] < kill2 - 1, f"healed too late (slow start?): {first_step}"
    assert by_step[first_step["step"]]["groups"] == 2
    for a, b in ((0, 2), (1, 3)):
        _assert_same_state(run.state("g0", a, kill2 - 1), run.state("g1b", b, kill2 - 1),
                           f"group 0 dp{a} vs healed group 1 dp{b} at step {kill2 - 1}")

    # Group 0 killed between steps: the healed group goes on alone, to the end, each step once.
    _assert_contiguous(healed, first_step["step"], steps, "the restarted group")
    after = {r["step"]: r for r in healed}
    assert after[kill2]["groups"] == 2 and all(after[s]["groups"] == 1 for s in range(kill2 + 1, steps + 1))
    lost_between = after[kill2 + 1]["t"] - after[kill2]["t"]
    for b in (2, 3):
        assert _adam_steps(run.state("g1b", b, steps)) == {float(steps)}  # AdamW stepped once per step
    print(f"\nlost by the survivor: {lost_mid:.2f} s (mid-step kill), {lost_between:.2f} s (between steps), "
          f"heartbeat timeout {HEARTBEAT_MS} ms; healed {first_step['heal_bytes']} B at step {first_step['step']} "
          f"in {first_step['quorum_s']:.2f} s")


@pytest.mark.launches
def test_async_quorum_heals_at_step_0(tmp_path):
    steps = 3
    lighthouse = Lighthouse(tmp_path / "lighthouse.log")
    run = Run(tmp_path)
    try:  # groups of one rank: the cheapest launch that has a step-0 heal
        jobs = [run.launch(f"g{g}", 1, steps, [steps], *_ft(g, lighthouse, "--async-quorum", "--seed", str(g)))
                for g in (0, 1)]  # other weights and data: only a heal makes them equal
        for job in jobs:
            run.wait(job)
    finally:
        run.stop()
        lighthouse.stop()
    # torchft's init_sync: group 1 takes group 0's state during the first step; from then on they agree
    assert [r["healed"] for r in run.records("g1", 1)] == [True, False, False]
    assert not any(r["healed"] for r in run.records("g0", 0))
    _assert_same_state(run.state("g0", 0, steps), run.state("g1", 1, steps), f"the groups at step {steps}")


def _wait_for(predicate, timeout: float, what: str, run: Run) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} within {timeout} s:\n{run.tail()}")
        time.sleep(0.05)


def _logged(run: Run, name: str, dp: int) -> list[dict]:
    path = run.tmp / name / f"dp{dp}.jsonl"
    return run.records(name, dp) if path.exists() and path.read_text().endswith("\n") else []


@pytest.mark.skipif(os.environ.get("SHARDWISE_NETNS_TORCHFT") != "1",
                    reason="opt-in (about 30 s): SHARDWISE_NETNS_TORCHFT=1 runs the two-host torchft test")
def test_two_hosts_a_cut_link_drops_a_group_which_rejoins_by_healing(tmp_path):
    """Two network namespaces (tests/test_multihost.py's hosts), one replica group of 2 ranks on
    each, each namespace with its own host name (torchft advertises ``hostname``). Cutting host
    1's link drops its group (the survivor's collective across groups times out, the quorum goes
    on without it); with the link back, the same command heals from the survivor and trains in step."""
    from test_multihost import Hosts, _namespaces_unavailable

    reason = _namespaces_unavailable()
    if reason:
        pytest.skip(reason)
    steps, ft_timeout = 40, 5
    hosts = Hosts()
    names = [f"{ns}-host" for ns in hosts.names]
    etc = [Path("/etc/netns") / ns for ns in hosts.names]  # `ip netns exec` mounts these over /etc
    run, port = Run(tmp_path), _free_port()
    lighthouse = None
    try:
        for d in etc:
            d.mkdir(parents=True, exist_ok=True)
            (d / "hosts").write_text("127.0.0.1 localhost\n" + "".join(
                f"{hosts.addr(i)} {n}\n" for i, n in enumerate(names)))

        def on_host(h: int, *cmd: str) -> list[str]:
            return ["ip", "netns", "exec", hosts.names[h], "unshare", "--uts", "sh", "-c",
                    f'hostname {names[h]} && exec "$0" "$@"', *cmd]

        exe = shutil.which("torchft_lighthouse", path=str(Path(sys.executable).parent))
        lighthouse = subprocess.Popen(
            on_host(0, exe, "--min_replicas", "1", "--bind", f"[::]:{port}", "--heartbeat_timeout_ms",
                    str(HEARTBEAT_MS)), stdout=(tmp_path / "lighthouse.log").open("w"), stderr=subprocess.STDOUT,
            start_new_session=True)
        flags = lambda h: ["--fault-tolerance", "torchft", "--replica-groups", "2", "--replica-group-id", str(h),
                           "--lighthouse", f"http://{hosts.addr(0)}:{port}", "--ft-timeout-s", str(ft_timeout)]

        def group(h: int, name: str, alone_step_s: float = 0.0) -> subprocess.Popen:
            job = run.launch(name, 2, steps, [steps], *flags(h), alone_step_s=alone_step_s,
                             gloo_ifname=hosts.links[h], wrap=lambda cmd: on_host(h, *cmd))
            return job

        survivor, cut = group(0, "g0", alone_step_s=ALONE_STEP_S), group(1, "g1")
        _wait_for(lambda: len(_logged(run, "g0", 0)) >= 5, TIMEOUT, "group 0 did not log 5 steps", run)
        hosts.cut(1)
        _wait_for(lambda: sum(r["groups"] == 1 for r in _logged(run, "g0", 0)) >= 3, 6 * ft_timeout + 30,
                  "group 0 did not go on alone", run)
        kill_job(cut)  # if its own timeouts have not ended it yet
        hosts.bring_back(1)
        back = group(1, "g1b")
        for job in (survivor, back):
            run.wait(job)
    finally:
        run.stop()
        if lighthouse is not None:
            kill_job(lighthouse)
        hosts.remove()
        for d in etc:
            shutil.rmtree(d, ignore_errors=True)

    records = run.records("g0", 0)
    _assert_contiguous(records, 1, steps, "group 0")
    healed = run.records("g1b", 2)
    assert healed[0]["healed"], healed[0]
    _assert_contiguous(healed, healed[0]["step"], steps, "the group that came back")
    for a, b in ((0, 2), (1, 3)):
        _assert_same_state(run.state("g0", a, steps), run.state("g1b", b, steps), f"dp{a} vs dp{b} at the end")
    slowest = max(b["t"] - a["t"] for a, b in zip(records, records[1:]) if b["groups"] == 1)
    print(f"\ngroup 0's slowest step alone: {slowest:.1f} s (collective timeout {ft_timeout} s); "
          f"group 1 healed at step {healed[0]['step']}")
