"""A job that ends is a job that exits cleanly.

- When ``shardwise train`` ends, no shardwise thread is left (beacon, poller, the watchdog's
  waiter) before the interpreter finalises: a thread that returns from a native call into a
  finalising interpreter dies in ``std::terminate`` (SIGABRT after a run that trained every step).
- SIGTERM to ``shardwise train`` stops every rank after the same step, writes that step's
  checkpoint (``--checkpoint-dir``), and the job exits with 143 (128 + SIGTERM), with no
  native crash.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from shardwise.checkpoint.directory import CheckpointDir
from shardwise.testing.crash_signs import NATIVE_CRASH
from shardwise.testing.jobs import descendants, kill_job
from shardwise.train.metrics import read_metrics

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


def _run_job(cmd: list[str], cwd: Path, timeout: float) -> tuple[int, str]:
    """(exit code, output) of a launched job; past ``timeout`` it is killed with every rank."""
    log = cwd / "job.log"
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, cwd=cwd, env=_env(), stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            returncode = proc.wait(timeout=timeout)
        finally:
            kill_job(proc)
    return returncode, log.read_text(errors="replace")


def test_job_end_leaves_no_shardwise_thread(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           str(REPO_ROOT / "tests" / "_clean_exit_child.py")]
    returncode, output = _run_job(cmd, tmp_path, TIMEOUT)
    assert returncode == 0, output[-4000:]
    _no_native_crash(output)
    reports = [json.loads(line.split("CLEAN-EXIT ", 1)[1]) for line in output.splitlines() if "CLEAN-EXIT " in line]
    assert sorted(r["rank"] for r in reports) == [0, 1], output[-4000:]
    for report in reports:
        assert report["threads"] == [], report


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


def test_sigterm_stops_after_a_step_writes_its_checkpoint_and_exits_143(tmp_path):
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
            proc.send_signal(signal.SIGTERM)
            returncode = proc.wait(timeout=TIMEOUT / 2)
        finally:
            kill_job(proc)
            for pid in workers:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
    output = log.read_text(errors="replace")
    assert returncode == 128 + signal.SIGTERM, output[-4000:]
    _no_native_crash(output)
    last = max(read_metrics(metrics))
    assert f"stopped       by SIGTERM after step {last} (exit code 143)" in output, output[-4000:]
    assert CheckpointDir(ckpt).latest() is not None and CheckpointDir(ckpt).latest().name == f"step-{last:08d}", \
        (sorted(os.listdir(ckpt)), last)
