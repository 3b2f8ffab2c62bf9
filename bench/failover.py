"""What a dead replica costs: torchft's per-step fault tolerance against torchrun restart + resume.

Runs ``shardwise train`` end to end (the CLI, 2 ranks per job) and watches each job's
``--metrics`` file, stamping every record with the wall clock as it appears:

- ``ft``: ``torchft_lighthouse`` (``--heartbeat-ms``) and two replica groups
  (``--fault-tolerance torchft``, synchronous quorum). Group 1 is killed at step ``--kill``
  (``SHARDWISE_FAULT``: inside the all-reduce across groups, ``mid``, or after the optimizer
  step, ``between``), then started again with the same command line. Reported: the seconds
  group 0 lost (steps ``kill`` and ``kill + 1`` above the median step), and the restarted
  group's heal (bytes received, seconds of its first quorum: fetch and load) with the time
  from its launch to its first step.
- ``restart``: one job of the same 2 ranks under ``torchrun --max-restarts 1`` with
  ``--checkpoint-every`` and ``--resume``, rank 1 killed after step ``--kill``. Reported: the
  time from the last step before the kill to the first step after the restart, and the
  steps run again (since the last checkpoint).

::

    .venv/bin/python -m bench.failover                                 # nano GPT, 1 s heartbeat
    .venv/bin/python -m bench.failover --model tiny --heartbeat-ms 2000 --kill between
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TRAIN = ["--nproc", "2", "--batch-size", "2", "--seq-len", "32", "--data-bytes", "200000", "--device", "cpu"]
FAULT = {"mid": "ft_all_reduce", "between": "step"}


class Watched:
    """A launched job and its metrics file, each new record stamped with the time it was seen."""

    def __init__(self, cmd: list[str], metrics: Path, env: dict[str, str], log: Path) -> None:
        self.metrics, self.records, self._pos = metrics, [], 0
        self.launched = time.time()
        self.proc = subprocess.Popen(cmd, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def poll(self) -> None:
        if not self.metrics.exists():
            return
        with self.metrics.open() as f:
            f.seek(self._pos)
            for line in f:
                if not line.endswith("\n"):
                    break
                self._pos += len(line)
                self.records.append((time.time(), json.loads(line)))

    def first(self) -> dict[int, tuple[float, dict]]:
        """``step -> (time seen, record)`` of each step's first record."""
        out: dict[int, tuple[float, dict]] = {}
        for t, record in self.records:
            out.setdefault(record["step"], (t, record))
        return out

    def stop(self) -> None:
        """SIGKILL the workers (torchrun gives each its own session), then the launcher's group."""
        for pid in _descendants(self.proc.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


def _descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        for children in Path(f"/proc/{todo.pop()}/task").glob("*/children"):
            try:
                found = [int(c) for c in children.read_text().split()]
            except OSError:
                continue
            out += found
            todo += found
    return out


def _wait(jobs: list[Watched], done, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() > deadline:
            raise SystemExit(f"bench.failover: nothing happened within {timeout} s; see the logs")
        for job in jobs:
            job.poll()
        time.sleep(0.01)


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "SHARDWISE_FAULT")}
    return {**env, "RUST_LOG": "warn", **extra}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def run_ft(args: argparse.Namespace, work: Path) -> dict[str, float]:
    port = _free_port()
    exe = shutil.which("torchft_lighthouse", path=str(Path(sys.executable).parent)) or "torchft_lighthouse"
    lighthouse = subprocess.Popen(
        [exe, "--min_replicas", "1", "--bind", f"[::]:{port}", "--heartbeat_timeout_ms",
         str(args.heartbeat_ms), "--quorum_tick_ms", "20"], stdout=(work / "lighthouse.log").open("w"),
        stderr=subprocess.STDOUT, start_new_session=True)

    def group(name: str, gid: int, fault: str | None = None) -> Watched:
        cmd = [sys.executable, "-m", "shardwise", "train", *TRAIN, "--model", args.model, "--steps", str(args.steps),
               "--fault-tolerance", "torchft", "--replica-groups", "2", "--replica-group-id", str(gid),
               "--lighthouse", f"http://localhost:{port}", "--metrics", str(work / f"{name}.jsonl")]
        env = _env(SHARDWISE_FAULT=f"{FAULT[args.kill_at]}@{args.kill}") if fault else _env()
        return Watched(cmd, work / f"{name}.jsonl", env, work / f"{name}.log")

    survivor, victim = group("g0", 0), group("g1", 1, fault="yes")
    jobs = [survivor, victim]
    try:
        _wait(jobs, lambda: victim.proc.poll() is not None, 600)
        victim.stop()
        restarted = group("g1b", 1)
        jobs.append(restarted)
        _wait(jobs, lambda: restarted.records, 600)
    finally:
        for job in jobs:
            job.stop()
        lighthouse.kill()
    steps = {s: r for s, (_, r) in survivor.first().items()}
    normal = statistics.median(r["step_s"] for s, r in steps.items() if 1 < s < args.kill)
    seen_at, first = restarted.records[0]
    healed_at = first["step"]
    lost = sum(steps[s]["step_s"] - normal for s in (args.kill, args.kill + 1))  # a kill between steps: the next
    return {"step_s": normal, "lost_s": lost, "heal_bytes": first["heal_bytes"],
            "heal_s": first["quorum_s"], "launch_to_first_step_s": seen_at - restarted.launched,
            "healed_at": healed_at}


def run_restart(args: argparse.Namespace, work: Path) -> dict[str, float]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "--max-restarts=1",
           "-m", "shardwise", "train", *TRAIN[2:], "--model", args.model, "--steps", str(args.steps),
           "--checkpoint-dir", str(work / "ckpt"), "--checkpoint-every", str(args.every), "--resume",
           "--metrics", str(work / "restart.jsonl")]
    env = _env(SHARDWISE_FAULT=f"step@{args.kill}:1", PYTHONPATH=str(Path(__file__).resolve().parent.parent))
    job = Watched(cmd, work / "restart.jsonl", env, work / "restart.log")
    resumed_at = (args.kill - 1) // args.every * args.every + 1  # the kill comes before step kill's save
    mark = args.kill - 1  # the last step surely logged before the kill

    def times(step: int) -> list[float]:
        return [t for t, record in job.records if record["step"] == step]

    try:
        _wait([job], lambda: len(times(mark)) > 1, 600)
    finally:
        job.stop()
    first_back = times(resumed_at)[1]
    return {"down_s": first_back - times(mark)[0], "lost_s": times(mark)[1] - times(mark)[0],
            "steps_redone": args.kill - resumed_at + 1}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.failover", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="nano")
    p.add_argument("--steps", type=int, default=3000, help="long enough for the restarted group to find a survivor")
    p.add_argument("--kill", type=int, default=10, help="the step group 1 (rank 1 of the restart job) dies in")
    p.add_argument("--kill-at", choices=sorted(FAULT), default="mid")
    p.add_argument("--heartbeat-ms", type=int, default=1000, help="the lighthouse's heartbeat timeout")
    p.add_argument("--every", type=int, default=5, help="--checkpoint-every of the restart job")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="failover-") as tmp:
        ft = run_ft(args, Path(tmp))
        restart = run_restart(args, Path(tmp))
    print(f"model {args.model}, kill {args.kill_at} step {args.kill}, heartbeat timeout {args.heartbeat_ms} ms, "
          f"median step {ft['step_s'] * 1e3:.0f} ms")
    print(f"torchft   survivor lost {ft['lost_s']:.2f} s, no step redone; restarted group: first step "
          f"{ft['launch_to_first_step_s']:.1f} s after launch (step {ft['healed_at']}), healed "
          f"{ft['heal_bytes'] / 1e6:.2f} MB in {ft['heal_s']:.2f} s")
    print(f"restart   whole job: first resumed step {restart['down_s']:.1f} s after the last one before the kill, "
          f"back where it was after {restart['lost_s']:.1f} s ({restart['steps_redone']} step(s) redone since the "
          f"checkpoint, --checkpoint-every {args.every})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
