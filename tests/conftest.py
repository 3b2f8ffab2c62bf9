"""Shared pytest setup: stop the warm rank pools when the session ends, and the one-rank
process group that in-process training tests run in.

The pools of :func:`shardwise.testing.run_on_ranks` also stop at interpreter exit; doing
it here keeps that out of the time pytest reports and frees the ranks before any other
session hook runs.
"""

import subprocess
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from shardwise.testing import shutdown_pools
from shardwise.testing.pool import preload_in_ranks
from shardwise.train import distributed

# What tests import inside their ranks, imported once by the ranks' fork server instead of
# once per rank per pool (Transformers alone is 2-3 s of CPU a rank).
preload_in_ranks("torch.distributed.fsdp", "transformers", "transformers.models.llama.modeling_llama",
                 "transformers.models.gpt2.modeling_gpt2", "torchao.float8", "torch.distributed.pipelining",
                 "shardwise.train.loop", "shardwise.train.hf", "_models")

_EXIT_STATUS = [0]  # the session's, for pytest_unconfigure


def pytest_addoption(parser):
    parser.addoption("--all", action="store_true",
                     help="also run the tests marked `launches` (whole jobs launched and killed several "
                          "times: torchft heals, torchrun restarts, cut links); CI runs `./dev test --all`")


def pytest_configure(config):
    config.addinivalue_line("markers", "launches: launches and kills whole jobs several times (about a minute "
                            "each); run by `./dev test --all` (CI), skipped by `./dev test`")


CI_ONLY = Path(__file__).with_name("ci_only.txt")


def ci_only_entries() -> list[str]:
    """The node ids (or parameterless test ids) that tests/ci_only.txt lists."""
    lines = (line.split("#", 1)[0].strip() for line in CI_ONLY.read_text().splitlines())
    return [line for line in lines if line]


def _listed(nodeid: str, entries: set[str]) -> bool:
    return nodeid in entries or nodeid.split("[", 1)[0] in entries


def _named_on_command_line(config) -> list[str]:
    """The node ids given as arguments (``tests/test_x.py::test_y``), relative to the repo root."""
    named = []
    for arg in config.args:
        if "::" in arg:
            path, rest = arg.split("::", 1)
            try:
                path = Path(path).resolve().relative_to(config.rootpath).as_posix()
            except ValueError:
                pass
            named.append(f"{path}::{rest}")
    return named


def pytest_collection_modifyitems(config, items):
    """``./dev test`` skips the ``launches`` tests and those tests/ci_only.txt lists (the slow
    ones); ``./dev test --all`` runs everything."""
    if config.getoption("--all"):
        return
    launches = pytest.mark.skip(reason="launches whole jobs: ./dev test --all (CI) runs it")
    slow = pytest.mark.skip(reason="over 2 s (tests/ci_only.txt): ./dev test --all (CI) runs it")
    entries = set(ci_only_entries())
    named = _named_on_command_line(config)  # a test named on the command line runs
    for item in items:
        if any(item.nodeid == n or item.nodeid.startswith((n + "[", n + "::")) for n in named):
            continue
        if "launches" in item.keywords:
            item.add_marker(launches)
        elif _listed(item.nodeid, entries):
            item.add_marker(slow)


def pytest_sessionfinish(session, exitstatus):
    _EXIT_STATUS[0] = int(exitstatus)
    shutdown_pools()


@pytest.fixture
def single_rank():
    """A gloo default group of one rank in this process (torch threads restored after)."""
    if dist.is_initialized():
        pytest.fail("a default process group is already initialised by an earlier test")
    threads = torch.get_num_threads()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield distributed.setup("cpu", num_threads=1)
    finally:
        dist.destroy_process_group()
        torch.set_num_threads(threads)



def pytest_unconfigure(config):
    """A hung thread-rank (torch's threaded process group) is a non-daemon thread: the
    test that timed out has failed, but the interpreter would wait for it forever at exit.
    Name the threads and leave with the session's status (failed, since one test was)."""
    import os
    import sys
    import threading

    # torch's MultiThreadedTestCase names its rank threads "Thread-N (_run)"; other threads
    # (executors, writers) end or are joined at exit as usual
    stuck = [t for t in threading.enumerate() if t.name.endswith("(_run)") and not t.daemon and t.is_alive()]
    if stuck:
        sys.__stderr__.write(f"conftest: {len(stuck)} thread-rank(s) of timed-out tests still running at exit: "
                             f"{[t.name for t in stuck]}; exiting without joining them\n")
        for stream in (sys.__stdout__, sys.__stderr__):
            stream.flush()
        os._exit(_EXIT_STATUS[0] or 1)


@pytest.fixture
def no_launch(monkeypatch):
    """``shardwise train`` from the CLI must fail before launching any rank: launching raises."""
    for var in ("RANK", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)

    def refuse(*args, **kwargs):
        raise AssertionError("ranks were launched")

    monkeypatch.setattr(subprocess, "run", refuse)
    monkeypatch.setattr(subprocess, "Popen", refuse)
