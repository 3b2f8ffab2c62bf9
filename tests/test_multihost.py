"""Multi-host for real: ``shardwise train`` under torchrun on two "hosts" (network
namespaces joined by a veth pair, c10d rendezvous), 2 ranks each. Cutting one host's link
mid-run makes the other host's ranks exit with a named error (the watchdog's
``CollectiveTimeoutError``, "has not reported ... dead or stopped") within the deadline,
instead of hanging until gloo's 30 min timeout.

Needs root and ``ip netns``; skipped with the reason otherwise. The test creates and
removes its namespaces itself. (Resuming from the last checkpoint once the link is back
waits for the checkpoint/resume options of ``shardwise train``.)
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

WATCHDOG_S = 5.0
PORT = 29731
SUBNET = "10.231.7"
ROOT = Path(__file__).resolve().parent.parent


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
        for ns in self.names:
            _ip("netns", "add", ns)
        _ip("link", "add", self.links[0], "type", "veth", "peer", "name", self.links[1])
        for i, (ns, link) in enumerate(zip(self.names, self.links)):
            _ip("link", "set", link, "netns", ns)
            self.run_in(i, "ip", "addr", "add", f"{SUBNET}.{i + 1}/24", "dev", link)
            self.run_in(i, "ip", "link", "set", link, "up")
            self.run_in(i, "ip", "link", "set", "lo", "up")

    def run_in(self, host: int, *cmd: str) -> None:
        subprocess.run(["ip", "netns", "exec", self.names[host], *cmd], check=True, capture_output=True, timeout=20)

    def cut(self, host: int) -> None:
        self.run_in(host, "ip", "link", "set", self.links[host], "down")

    def remove(self) -> None:
        for ns in self.names:
            _ip("netns", "del", ns, check=False)


def _torchrun(hosts: Hosts, host: int, log: Path) -> subprocess.Popen:
    cmd = [
        "ip", "netns", "exec", hosts.names[host],
        sys.executable, "-m", "torch.distributed.run",
        "--nnodes", "2", "--nproc-per-node", "2", "--max-restarts", "0",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{SUBNET}.1:{PORT}", "--rdzv-id", "i16",
        "--rdzv-conf", f"is_host={'true' if host == 0 else 'false'}",
        "--local-addr", f"{SUBNET}.{host + 1}",
        "-m", "shardwise", "train", "--steps", "100000", "--model", "tiny", "--batch-size", "2",
        "--data-bytes", "200000", "--device", "cpu",
    ]
    env = dict(os.environ, PYTHONPATH=str(ROOT), GLOO_SOCKET_IFNAME=hosts.links[host], OMP_NUM_THREADS="1",
               SHARDWISE_WATCHDOG_S=str(WATCHDOG_S), PYTHONUNBUFFERED="1")
    return subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env, start_new_session=True)


def _wait_for(pattern: str, log: Path, timeout: float, procs) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if re.search(pattern, log.read_text(errors="replace")):
            return
        if any(p.poll() is not None for p in procs):
            break
        time.sleep(0.2)
    raise AssertionError(f"no {pattern!r} in {log} within {timeout} s:\n{log.read_text(errors='replace')[-3000:]}")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)


def test_cut_link_makes_the_surviving_host_exit_with_a_named_error(tmp_path):
    reason = _namespaces_unavailable()
    if reason:
        pytest.skip(reason)
    hosts = Hosts()
    logs = [tmp_path / "h0.log", tmp_path / "h1.log"]
    procs = []
    try:
        procs = [_torchrun(hosts, h, logs[h]) for h in (0, 1)]
        _wait_for(r"\b1/100000\b", logs[0], 150, procs)  # rank 0 finished step 1
        time.sleep(1.0)
        cut_at = time.monotonic()
        hosts.cut(1)
        code = procs[0].wait(timeout=WATCHDOG_S * 6 + 30)
        exited_after = time.monotonic() - cut_at
        output = logs[0].read_text(errors="replace")
        assert code != 0, output[-3000:]
        assert "CollectiveTimeoutError" in output, output[-4000:]
        assert re.search(r"rank [23] has not reported for \d+ s: dead or stopped", output), output[-4000:]
        assert exited_after < WATCHDOG_S * 6 + 30, exited_after
        print(f"survivors exited {exited_after:.1f} s after the cut:", re.search(r"CollectiveTimeoutError: .*", output).group(0))
    finally:
        for proc in procs:
            _stop(proc)
        hosts.remove()
