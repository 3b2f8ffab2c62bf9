"""Multi-host for real: ``shardwise train`` under torchrun on two "hosts" (network
namespaces joined by a veth pair, c10d rendezvous), 2 ranks each.

Cutting one host's link mid-run makes the other host's ranks exit with a named error (the
watchdog's ``CollectiveTimeoutError``, "has not reported ... dead or stopped") within the
deadline, instead of hanging until gloo's 30 min timeout (always run, ~18 s).

Opt-in (``SHARDWISE_NETNS_RESUME=1``, ~45 s; the suite's single-host torchrun restart
test covers resuming bit-identically): bringing the link back and relaunching the same
command with ``--resume`` (fresh rendezvous port) continues from the last committed
checkpoint, and the loss of every step from there on is bit-identical to an uninterrupted
run of the same job: 4 ranks of one thread each, here on one host (the math depends on the
world size, not on where the ranks live), run beside the cut job.

Needs root and ``ip netns``; skipped with the reason otherwise. The test creates and
removes its namespaces itself.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shardwise.checkpoint.directory import CheckpointDir
from shardwise.testing import kill_job
from shardwise.train.metrics import read_metrics

WATCHDOG_S = 5.0
WATCHDOG_S_CUT_ONLY = 3.0  # the always-run test: no checkpoint I/O competes with the beacons
PORT = 29731  # the reference run, the cut run and the resumed run each get their own port
SUBNET = "10.231.7"
ROOT = Path(__file__).resolve().parent.parent
STEPS = 14  # the cut comes after step 4; the resumed run trains the rest
EVERY = 3  # --checkpoint-every
CUT_AFTER = EVERY + 1  # cut once this step is in the metrics: at least one checkpoint committed
TRAIN = ["--model", "nano", "--steps", str(STEPS), "--batch-size", "2", "--data-bytes", "20000", "--device", "cpu",
         "--lr-schedule", "cosine", "--warmup-steps", "2"]


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=20)


def _namespaces_unavailable() -> str | None:
    """Why this machine cannot host the test, or None."""
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed"
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    probe = f"sw-probe-{os.getpid()}"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"`ip netns add` failed here: {made.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


class Hosts:
    """Two namespaces h0 (10.231.7.1) and h1 (10.231.7.2) joined by veth v0 <-> v1."""

    def __init__(self) -> None:
        tag = os.getpid()
        self.names = [f"sw{tag}h0", f"sw{tag}h1"]
        self.links = [f"sw{tag}v0", f"sw{tag}v1"]
        try:
            for ns in self.names:
                _ip("netns", "add", ns)
            _ip("link", "add", self.links[0], "type", "veth", "peer", "name", self.links[1])
            for i, (ns, link) in enumerate(zip(self.names, self.links)):
                _ip("link", "set", link, "netns", ns)
                self.run_in(i, "ip", "addr", "add", self.addr(i) + "/24", "dev", link)
                self.run_in(i, "ip", "link", "set", link, "up")
                self.run_in(i, "ip", "link", "set", "lo", "up")
        except BaseException:
            self.remove()
            raise

    @staticmethod
    def addr(host: int) -> str:
        return f"{SUBNET}.{host + 1}"

    def run_in(self, host: int, *cmd: str) -> str:
        done = subprocess.run(["ip", "netns", "exec", self.names[host], *cmd], check=True, capture_output=True,
                              text=True, timeout=20)
        return done.stdout

    def cut(self, host: int) -> None:
        self.run_in(host, "ip", "link", "set", self.links[host], "down")

    def bring_back(self, host: int) -> None:
        """Undo :meth:`cut`: the link up again, its address re-added if it went with the link."""
        link = self.links[host]
        if self.addr(host) + "/" not in self.run_in(host, "ip", "-o", "addr", "show", "dev", link):
            self.run_in(host, "ip", "addr", "add", self.addr(host) + "/24", "dev", link)
        self.run_in(host, "ip", "link", "set", link, "up")
        deadline = time.monotonic() + 10
        while "LOWER_UP" not in self.run_in(host, "ip", "-o", "link", "show", "dev", link):
            assert time.monotonic() < deadline, f"{link} did not come back up"
            time.sleep(0.1)

    def remove(self) -> None:
        for ns in self.names:  # deleting a namespace deletes the veth end in it, and so the pair
            _ip("netns", "del", ns, check=False)


def _torchrun(hosts: Hosts, host: int, log: Path, port: int, *train_args: str,
              watchdog_s: float = WATCHDOG_S) -> subprocess.Popen:
    cmd = [
        "ip", "netns", "exec", hosts.names[host],
        sys.executable, "-m", "torch.distributed.run",
        "--nnodes", "2", "--nproc-per-node", "2", "--max-restarts", "0",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{hosts.addr(0)}:{port}", "--rdzv-id", f"i16-{port}",
        "--rdzv-conf", f"is_host={'true' if host == 0 else 'false'}",
        "--local-addr", hosts.addr(host),
        "-m", "shardwise", "train", "-v", *TRAIN, *train_args,
    ]
    env = dict(os.environ, PYTHONPATH=str(ROOT), GLOO_SOCKET_IFNAME=hosts.links[host], OMP_NUM_THREADS="1",
               SHARDWISE_WATCHDOG_S=str(watchdog_s), PYTHONUNBUFFERED="1")
    return subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env, start_new_session=True)


def _reference(log: Path, *train_args: str) -> subprocess.Popen:
    """The uninterrupted job on one host (the root namespace, loopback): 4 ranks, as the 2 x 2 job."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
           "-m", "shardwise", "train", "-v", *TRAIN, *train_args]
    env = dict(os.environ, PYTHONPATH=str(ROOT), GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env, start_new_session=True)


def _job(hosts: Hosts, logs: list[Path], port: int, *train_args: str,
         watchdog_s: float = WATCHDOG_S) -> list[subprocess.Popen]:
    return [_torchrun(hosts, h, logs[h], port, *train_args, watchdog_s=watchdog_s) for h in (0, 1)]


def _tail(*logs: Path, n: int = 3000) -> str:
    return "\n".join(f"--- {log.name}:\n{log.read_text(errors='replace')[-n:]}" for log in logs if log.exists())


def _finish(procs: list[subprocess.Popen], logs: list[Path], timeout: float) -> None:
    """Wait for both hosts' torchrun to exit 0."""
    deadline = time.monotonic() + timeout
    for proc in procs:
        try:
            code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the job did not finish within {timeout} s:\n{_tail(*logs)}") from None
        assert code == 0, _tail(*logs)


def _wait_for_step(step: int, metrics: Path, timeout: float, procs, logs) -> None:
    def logged() -> bool:
        return metrics.exists() and max(read_metrics(metrics), default=0) >= step

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not any(p.poll() is not None for p in procs):
        if logged():
            return
        time.sleep(0.05)
    if logged():  # logged just before a process ended
        return
    raise AssertionError(f"step {step} not in {metrics} within {timeout} s:\n{_tail(*logs)}")


def _losses(metrics: Path) -> dict[int, float]:
    return {step: record["loss"] for step, record in read_metrics(metrics).items()}


def _cut_job(hosts: Hosts, tmp_path: Path, procs: list, checkpoints: bool) -> tuple[str, dict[int, float], float]:
    """Start the 2 x 2 job, cut host 1's link, and check host 0 exits with the watchdog's
    named error. With ``checkpoints`` the job saves every ``EVERY`` steps and the cut waits
    for one to be committed (step ``CUT_AFTER``); without, it cuts after step 1 and the
    watchdog's deadline is ``WATCHDOG_S_CUT_ONLY``. Returns host 0's output, the losses
    logged before the cut and the seconds to detection. ``procs`` gets the job's launchers
    (the caller stops them)."""
    run, logs = tmp_path / "run.jsonl", [tmp_path / "cut-h0.log", tmp_path / "cut-h1.log"]
    saving = ["--checkpoint-dir", str(tmp_path / "ckpts"), "--checkpoint-every", str(EVERY)] if checkpoints else []
    watchdog_s = WATCHDOG_S if checkpoints else WATCHDOG_S_CUT_ONLY
    procs += _job(hosts, logs, PORT + 1, "--metrics", str(run), *saving, watchdog_s=watchdog_s)
    _wait_for_step(CUT_AFTER if checkpoints else 1, run, 150, procs, logs)
    cut_at = time.monotonic()
    hosts.cut(1)
    try:
        code = procs[0].wait(timeout=watchdog_s * 6 + 30)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"host 0 still running after the cut:\n{_tail(*logs)}") from None
    detected_s = time.monotonic() - cut_at
    output = logs[0].read_text(errors="replace")
    assert code != 0, output[-3000:]
    assert "CollectiveTimeoutError" in output, output[-4000:]
    assert re.search(r"rank [23] has not reported for \d+ s: dead or stopped", output), output[-4000:]
    before_cut = _losses(run)
    assert before_cut and max(before_cut) < STEPS, "the job ended before the cut: raise STEPS"
    print(f"\nsurvivors exited {detected_s:.1f} s after the cut:", re.search(r"CollectiveTimeoutError: .*", output).group(0))
    return output, before_cut, detected_s


def _stop_all(procs: list) -> None:
    for proc in procs:
        kill_job(proc)
    procs.clear()


@pytest.mark.launches
def test_cut_link_gives_a_named_error(tmp_path):
    reason = _namespaces_unavailable()
    if reason:
        pytest.skip(reason)
    hosts, procs = Hosts(), []
    try:
        _cut_job(hosts, tmp_path, procs, checkpoints=False)
    finally:
        _stop_all(procs)
        hosts.remove()


@pytest.mark.skipif(os.environ.get("SHARDWISE_NETNS_RESUME") != "1",
                    reason="opt-in (about 45 s): SHARDWISE_NETNS_RESUME=1 resumes the cut two-host job")
def test_the_job_resumes_bit_identically_once_the_link_is_back(tmp_path):
    reason = _namespaces_unavailable()
    if reason:
        pytest.skip(reason)
    ckpts, ref, resumed = tmp_path / "ckpts", tmp_path / "ref.jsonl", tmp_path / "resumed.jsonl"
    ref_log, resume_logs = tmp_path / "ref.log", [tmp_path / "resume-h0.log", tmp_path / "resume-h1.log"]
    hosts, procs, reference_job = Hosts(), [], None
    try:
        # The uninterrupted reference (one host, no checkpoints, no cut) runs beside the cut job.
        reference_job = _reference(ref_log, "--metrics", str(ref))
        _, before_cut, _ = _cut_job(hosts, tmp_path, procs, checkpoints=True)
        _stop_all(procs)  # the cut host cannot reach the store on host 0; its job is gone with its node
        _finish([reference_job], [ref_log], 240)
        reference = _losses(ref)
        assert sorted(reference) == list(range(1, STEPS + 1))

        # The link back, the same command with --resume on a fresh rendezvous port.
        latest = CheckpointDir(ckpts).latest()
        assert latest is not None, f"no checkpoint committed before the cut: {sorted(os.listdir(ckpts))}"
        last_ckpt = int(latest.name.split("-")[1])
        # blocking saves: step k is logged after its checkpoint is committed
        assert last_ckpt >= max(before_cut) // EVERY * EVERY > 0, (last_ckpt, max(before_cut))
        hosts.bring_back(1)
        back_at = time.monotonic()
        procs += _job(hosts, resume_logs, PORT + 2, "--metrics", str(resumed), "--checkpoint-dir", str(ckpts),
                      "--checkpoint-every", str(EVERY), "--resume")
        _wait_for_step(last_ckpt + 1, resumed, 150, procs, resume_logs)
        first_step_s = time.monotonic() - back_at
        _finish(procs, resume_logs, 240)
        resume_s = time.monotonic() - back_at
        said_text = "".join(log.read_text(errors="replace") for log in resume_logs)
        said = set(re.findall(r"resumed from \S+ \(step (\d+), saved by 4 ranks\)", said_text))
        assert said == {str(last_ckpt)}, _tail(*resume_logs)
        after = _losses(resumed)
        assert sorted(after) == list(range(last_ckpt + 1, STEPS + 1)), sorted(after)
        # bit for bit (== on floats): the resumed steps, and the steps run before the cut
        assert after == {s: reference[s] for s in after}
        assert before_cut == {s: reference[s] for s in before_cut}
        print(f"resumed from step {last_ckpt} (cut after step {max(before_cut)} was logged); link back -> "
              f"first resumed step logged in {first_step_s:.1f} s, all {STEPS - last_ckpt} done in {resume_s:.1f} s")
    finally:
        _stop_all([*procs, *([reference_job] if reference_job else [])])
        hosts.remove()
