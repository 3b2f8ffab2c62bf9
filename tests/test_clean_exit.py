"""A job that ends is a job that exits cleanly.

- When a job ends, no shardwise thread is left (beacon, poller, the watchdog's waiter) before
  the interpreter finalises: a thread that returns from a native call into a finalising
  interpreter dies in ``std::terminate`` (SIGABRT after a run that trained every step). One
  inside a collective that completes late is joined too (tests/_waiter_exit.py).
- A stop signal on any rank stops every rank after the same step (one all-reduce per step),
  with that step's checkpoint (at 2 and 4 ranks, in the warm ranks).
- SIGTERM to ``shardwise train`` (the CLI forwards it to torchrun, torchrun to the ranks), or
  Ctrl-C's SIGINT to the terminal's process group, stops the job after a step, writes that
  step's checkpoint, and the job exits with 128 + the signal (143, 130), with no native crash
  (launches: ``./dev test --all``).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from shardwise.checkpoint.directory import CheckpointDir
from shardwise.faults import monitor
from shardwise.testing import run_on_ranks
from shardwise.testing.crash_signs import NATIVE_CRASH
from shardwise.testing.jobs import descendants, kill_job
from shardwise.train import distributed
from shardwise.train.config import TrainConfig
from shardwise.train.loop import train
from shardwise.train.metrics import read_metrics
from shardwise.train.signals import StopRequest

REPO_ROOT = Path(__file__).resolve().parent.parent
TIMEOUT = 240
RUN = ["--model", "nano", "--batch-size", "2", "--seq-len", "16", "--data-bytes", "20000"]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE") and not k.startswith("SHARDWISE_")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), str(REPO_ROOT / "tests"), env.get("PYTHONPATH")) if p)
    return env


def _no_native_crash(output: str) -> None:
    crashes = [line for line in output.splitlines() if NATIVE_CRASH.search(line)]
    assert not crashes, "\n".join(crashes) + "\n" + output[-4000:]


def _train_then_shut_down(fields: dict) -> list[str]:
    """A short run on this rank, then what a job's end does before destroying the process
    group (:func:`shardwise.faults.monitor.shutdown`); the shardwise threads still alive."""
    train(TrainConfig(**fields), distributed.setup("cpu", num_threads=1))
    monitor.shutdown()
    return [t.name for t in threading.enumerate() if t.name.startswith("shardwise-") and t.is_alive()]


def test_job_end_leaves_no_shardwise_thread():
    """Beacon, poller and the watchdog's waiter (the one left alive at exit, every run,
    before it could be stopped) are all joined at the end of a job."""
    fields = dict(model="nano", steps=2, batch_size=2, seq_len=16, data_bytes=20_000)
    for world in (2, 4):
        assert run_on_ranks(_train_then_shut_down, world, fields, timeout=TIMEOUT) == [[]] * world


def _train_with_a_signal_on_one_rank(fields: dict, signum: int, signalled_rank: int, at_step: int) -> tuple[int, int, int]:
    """Train with a stop request; ``signalled_rank`` gets ``signum`` (its handler's call) after
    ``at_step``. Returns (steps this rank ran, the signal the ranks stopped on, the exit code)."""
    env = distributed.setup("cpu", num_threads=1)
    request = StopRequest()

    def on_step(step: int, loss: float, tokens_per_s: float) -> None:
        if step == at_step and env.rank == signalled_rank:
            request.handle(signum, None)

    result = train(TrainConfig(**fields), env, on_step=on_step, stop=request)
    return result.steps, result.stopped_by, result.exit_code


def test_a_signal_on_one_rank_stops_every_rank_after_the_same_step_with_its_checkpoint(tmp_path):
    """The agreement after each step: a rank signalled after step 2 (while the others
    already run step 3) stops them all after step 3, whose checkpoint is written; the exit
    code is 128 + the signal (SIGTERM from a scheduler at 2 ranks, SIGINT at 4)."""
    for world, signum in ((2, signal.SIGTERM), (4, signal.SIGINT)):
        ckpt = tmp_path / f"ckpt{world}"
        fields = dict(model="nano", steps=50, batch_size=2, seq_len=16, data_bytes=20_000, checkpoint_dir=str(ckpt))
        results = run_on_ranks(_train_with_a_signal_on_one_rank, world, fields, signum, world - 1, 2, timeout=TIMEOUT)
        assert results == [(3, signum, 128 + signum)] * world, results
        assert CheckpointDir(ckpt).latest().name == "step-00000003", sorted(os.listdir(ckpt))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_waiter_inside_a_collective_is_joined_before_the_interpreter_finalises(tmp_path):
    """tests/_waiter_exit.py: rank 1 leaves on an error while the watchdog's waiter is inside
    the collective's wait(), which returns (rank 0 joins late) while rank 1 finalises."""
    port, procs, logs = _free_port(), [], []
    try:
        for rank in (0, 1):
            logs.append((tmp_path / f"rank{rank}.log").open("w"))
            procs.append(subprocess.Popen([sys.executable, str(REPO_ROOT / "tests" / "_waiter_exit.py"), str(rank), str(port)],
                                          cwd=tmp_path, env=_env(), stdout=logs[-1], stderr=subprocess.STDOUT,
                                          start_new_session=True))
        codes = [proc.wait(timeout=TIMEOUT / 2) for proc in procs]
    finally:
        for proc in procs:
            kill_job(proc)
        for log in logs:
            log.close()
    outputs = [(tmp_path / f"rank{rank}.log").read_text(errors="replace") for rank in (0, 1)]
    assert codes == [0, 1], f"exit codes {codes}:\n" + "\n".join(o[-3000:] for o in outputs)
    assert "rank 1 leaves its watched all-reduce" in outputs[1], outputs[1][-3000:]
    _no_native_crash(outputs[1])


def _wait_for_steps(metrics: Path, proc: subprocess.Popen, steps: int, timeout: float) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        done = read_metrics(metrics) if metrics.exists() else {}
        if len(done) >= steps:
            return max(done)
        time.sleep(0.2)
    raise AssertionError(f"the job did not reach step {steps} in {timeout} s (exit {proc.poll()})")


def _send_stop(proc: subprocess.Popen, how: str) -> int:
    """Stop the job as a scheduler does (SIGTERM to the launcher) or as Ctrl-C does (SIGINT
    to the terminal's process group: the CLI and torchrun; torchrun's ranks run in sessions
    of their own, so torchrun hands it on). The signal sent."""
    if how == "sigterm_to_the_cli":
        proc.send_signal(signal.SIGTERM)
        return signal.SIGTERM
    os.killpg(proc.pid, signal.SIGINT)  # the job started a session of its own: its group is its pid
    return signal.SIGINT


@pytest.mark.launches
@pytest.mark.parametrize("how", ["sigterm_to_the_cli", "ctrl_c_to_the_terminal_group"])
def test_a_stop_signal_ends_the_job_after_a_step_with_its_checkpoint_and_exit_128_plus_it(tmp_path, how):
    ckpt, metrics, log = tmp_path / "ckpt", tmp_path / "metrics.jsonl", tmp_path / "out.log"
    cmd = [sys.executable, "-m", "shardwise", "train", "--nproc", "2", *RUN, "--steps", "100000",
           f"--checkpoint-dir={ckpt}", f"--metrics={metrics}"]
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, cwd=tmp_path, env=_env(), stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
        workers: list[int] = []
        try:
            _wait_for_steps(metrics, proc, 2, TIMEOUT / 2)
            workers = descendants(proc.pid)  # on a launcher that dies of the signal they would be orphans
            signum = _send_stop(proc, how)
            returncode = proc.wait(timeout=TIMEOUT / 2)
        finally:
            kill_job(proc)
            for pid in workers:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
    output = log.read_text(errors="replace")
    assert returncode == 128 + signum, output[-4000:]
    _no_native_crash(output)
    last = max(read_metrics(metrics))
    name = signal.Signals(signum).name
    assert f"stopped       by {name} after step {last} (exit code {128 + signum})" in output, output[-4000:]
    assert CheckpointDir(ckpt).latest() is not None and CheckpointDir(ckpt).latest().name == f"step-{last:08d}", \
        (sorted(os.listdir(ckpt)), last)
