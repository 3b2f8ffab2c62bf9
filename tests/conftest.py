"""Shared pytest setup: stop the warm rank pools when the session ends, and the one-rank
process group that in-process training tests run in.

The pools of :func:`shardwise.testing.run_on_ranks` also stop at interpreter exit; doing
it here keeps that out of the time pytest reports and frees the ranks before any other
session hook runs.
"""

import pytest
import torch
import torch.distributed as dist

from shardwise.testing import shutdown_pools
from shardwise.train import distributed


def pytest_sessionfinish(session, exitstatus):
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
