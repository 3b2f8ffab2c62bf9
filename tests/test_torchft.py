"""``shardwise train --fault-tolerance torchft``: replica groups that survive each other.

Each replica group is a real torchrun job of 2 gloo ranks (``tests/_torchft_child.py`` runs
``shardwise train``'s loop and records per-rank losses and local shards); torchft's lighthouse
is its own CLI, started by the test with a 1 s heartbeat timeout so that a failure costs
about a second. A group is killed by ``SIGKILL`` of its workers from the inside (the named
fault points ``ft_all_reduce``: mid-step, in the all-reduce across groups; ``step``: between
steps), its launcher and any leftover worker with it, then started again with the same
command line, as a scheduler would (the replacement's processes are launched ahead and wait
for a file, so that the survivor does not run out of steps while they import torch).

Synchronous quorum: until the kill, every step's per-rank loss and, at a dumped step, every
local shard and AdamW state equal a one-job ``--replicate 2`` run (bit for bit); the survivor
discards the failed step and carries on alone; the restarted group heals from it and ends
with the survivor's exact shards and optimizer state, its step count (AdamW's) saying no
step was applied twice.

Asynchronous quorum (torchtitan's default): the two groups start from different seeds, so
only a step-0 heal can make them equal; a group killed between steps is restarted and heals
while the survivor is in its forward (what staging the served state fixes).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from shardwise.testing import run_on_ranks
from shardwise.train import distributed
from shardwise.train.config import TrainConfig
from shardwise.train.data import BatchSampler
from shardwise.train.fault_tolerance import HealState
from shardwise.train.loop import build_model, build_optimizer, train_step
from shardwise.train.models import model_spec
from shardwise.train.schedule import build_scheduler

pytest.importorskip("torchft")

ROOT = Path(__file__).resolve().parent.parent
CHILD = Path(__file__).resolve().parent / "_torchft_child.py"
HEARTBEAT_MS = 1000
ALONE_STEP_S = 0.25  # a survivor's pace while alone: the restarted group (~5-10 s to start) must catch it
TRAIN = ["--model", "nano", "--batch-size", "2", "--seq-len", "16", "--data-bytes", "20000", "--device", "cpu",
         "--lr-schedule", "cosine", "--warmup-steps", "2"]
TIMEOUT = 240


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
        _kill_job(self.proc)


def _descendants(pid: int) -> list[int]:
    """Every process under ``pid`` (torchrun gives each worker its own session: a killpg misses them)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            children = Path(f"/proc/{p}/task/{p}/children").read_text().split()
        except OSError:
            continue
        out += map(int, children)
        todo += map(int, children)
    return out


def _kill_job(proc: subprocess.Popen) -> None:
    """SIGKILL a launched job: its workers, then the launcher's process group."""
    if proc.poll() is None:
        for pid in _descendants(proc.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait(timeout=30)


class Run:
    """Jobs launched into ``tmp``, each with its own output directory and log."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.jobs: list[subprocess.Popen] = []

    def launch(self, name: str, nproc: int, steps: int, dumps: list[int], *flags: str,
               fault: str | None = None, go: Path | None = None) -> subprocess.Popen:
        out = self.tmp / name
        out.mkdir()
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "SHARDWISE_FAULT")}
        env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", TEST_ALONE_STEP_S=str(ALONE_STEP_S))
        if fault:
            env["SHARDWISE_FAULT"] = fault
        if go:
            env["TEST_GO_FILE"] = str(go)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               "--max-restarts=0", str(CHILD), str(out), ",".join(map(str, dumps)), *TRAIN, "--steps", str(steps),
               *flags]
        job = subprocess.Popen(cmd, env=env, stdout=(self.tmp / f"{name}.log").open("w"), stderr=subprocess.STDOUT,
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
            _kill_job(job)

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


def _first_healed(records: list[dict]) -> dict:
    return next(r for r in records if r["healed"])


def test_sync_quorum_a_group_killed_mid_step_is_dropped_then_heals_exactly(tmp_path):
    kill, dump, steps = 6, 5, 40  # group 1 dies inside step 6's all-reduce across groups
    lighthouse = Lighthouse(tmp_path / "lighthouse.log")
    run = Run(tmp_path)
    try:
        survivor = run.launch("g0", 2, steps, [dump, steps], *_ft(0, lighthouse))
        victim = run.launch("g1", 2, steps, [dump], *_ft(1, lighthouse), fault=f"ft_all_reduce@{kill}")
        reference = run.launch("ref", 4, steps, [dump], "--replicate", "2", "--stop-after", str(kill))  # no FT
        restarted = run.launch("g1b", 2, steps, [steps], *_ft(1, lighthouse), go=tmp_path / "go")
        run.wait(victim, ok=False)
        _kill_job(victim)  # its launcher and any worker left
        (tmp_path / "go").touch()  # the same command line again, as a scheduler would restart it
        for job in (reference, survivor, restarted):
            run.wait(job)
    finally:
        run.stop()
        lighthouse.stop()

    # Until the kill: bit-identical to one --replicate 2 job, loss by loss and shard by shard.
    for dp, name in ((0, "g0"), (1, "g0"), (2, "g1"), (3, "g1")):
        ref = run.losses("ref", dp)
        assert {s: v for s, v in run.losses(name, dp).items() if s < kill} == {s: ref[s] for s in range(1, kill)}
        _assert_same_state(run.state("ref", dp, dump), run.state(name, dp, dump), f"dp{dp} at step {dump}")

    # The survivor: every step committed once, the failed one again without the dead group.
    records = run.records("g0", 0)
    _assert_contiguous(records, 1, steps, "the survivor")
    by_step = {r["step"]: r for r in records}
    assert all(by_step[s]["groups"] == 2 for s in range(1, kill))
    assert by_step[kill]["groups"] == 1, by_step[kill]
    lost_s = by_step[kill]["t"] - by_step[kill - 1]["t"]
    assert lost_s < 10 * HEARTBEAT_MS / 1000, f"the survivor took {lost_s:.1f} s over the failed step"

    # The restarted group heals from the survivor, then trains in step: the same shards and AdamW at the end.
    healed = run.records("g1b", 2)
    first = _first_healed(healed)
    assert first is healed[0] and first["step"] > kill and first["heal_bytes"] > 0, healed[:2]
    _assert_contiguous(healed, first["step"], steps, "the restarted group")
    assert by_step[first["step"] + 1]["groups"] == 2, "the survivor did not see the restarted group back"
    for a, b in ((0, 2), (1, 3)):
        end, end_b = run.state("g0", a, steps), run.state("g1b", b, steps)
        _assert_same_state(end, end_b, f"survivor dp{a} vs healed dp{b} at step {steps}")
        assert _adam_steps(end) == _adam_steps(end_b) == {float(steps)}  # no step applied twice
    print(f"\nsurvivor lost {lost_s:.2f} s at the mid-step kill (heartbeat timeout {HEARTBEAT_MS} ms); "
          f"healed {first['heal_bytes']} B at step {first['step']} in {first['quorum_s']:.2f} s")


def test_async_quorum_heals_at_step_0_and_after_a_kill_between_steps(tmp_path):
    kill, dump, steps = 5, 4, 35  # group 1 dies after step 5's optimizer step
    lighthouse = Lighthouse(tmp_path / "lighthouse.log")
    run = Run(tmp_path)
    try:
        survivor = run.launch("g0", 2, steps, [dump, steps], *_ft(0, lighthouse, "--async-quorum", "--seed", "0"))
        flags = _ft(1, lighthouse, "--async-quorum", "--seed", "1")  # other weights and data: only a heal makes them equal
        victim = run.launch("g1", 2, steps, [dump], *flags, fault=f"step@{kill}")
        restarted = run.launch("g1b", 2, steps, [steps], *flags, go=tmp_path / "go")
        run.wait(victim, ok=False)
        _kill_job(victim)
        (tmp_path / "go").touch()
        for job in (survivor, restarted):
            run.wait(job)
    finally:
        run.stop()
        lighthouse.stop()

    # Step 0: group 1 took group 0's state during the first step (torchft's init_sync), and from then on they agree.
    assert _first_healed(run.records("g1", 2))["step"] == 1
    assert not any(r["healed"] for r in run.records("g0", 0))
    for a, b in ((0, 2), (1, 3)):
        _assert_same_state(run.state("g0", a, dump), run.state("g1", b, dump), f"dp{a} vs dp{b} at step {dump}")

    # The kill between steps costs the survivor no step; the restarted group heals during its forward.
    records = run.records("g0", 0)
    _assert_contiguous(records, 1, steps, "the survivor")
    healed = run.records("g1b", 2)
    first = _first_healed(healed)
    assert first is healed[0] and first["step"] > kill, healed[:2]
    _assert_contiguous(healed, first["step"], steps, "the restarted group")
    for a, b in ((0, 2), (1, 3)):
        end, end_b = run.state("g0", a, steps), run.state("g1b", b, steps)
        _assert_same_state(end, end_b, f"survivor dp{a} vs healed dp{b} at step {steps}")
        assert _adam_steps(end) == _adam_steps(end_b) == {float(steps)}
