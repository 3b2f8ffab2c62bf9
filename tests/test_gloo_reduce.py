"""shardwise's opt-in gloo reduce-scatter (``SHARDWISE_GLOO_REDUCE_SCATTER=all_to_all``): an
all-to-all of the other ranks' chunks plus a local sum.

``shardwise.collectives.reduce_scatter`` on gloo must give what a SUM reduce-scatter
gives: bit-identical to gloo's own at 2 ranks (one addition, a + b == b + a), within
fp32 rounding of an fp64 reference at more ranks (every rank position: first, middle,
last, since the middle ones shift their rows to close the gap their own row leaves).
Its own row never travels, yet CommCounter reads the payload of the reduce-scatter it
replaces (N chunks), so the ring wire model ((N-1)/N of it) stays what really moves.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from shardwise import collectives
from shardwise.testing import CommCounter, run_on_ranks

TIMEOUT = 60
ENV = "SHARDWISE_GLOO_REDUCE_SCATTER"
PG = 1031  # elements per rank's chunk: odd, so nothing lines up by accident


def _every_input() -> list[torch.Tensor]:
    """Each rank's (N*PG,) input, the same on every rank (seeded by the source rank)."""
    n = dist.get_world_size()
    return [torch.randn(n * PG, generator=torch.Generator().manual_seed(100 + r)) for r in range(n)]


def _matches_a_reduce_scatter(async_op: bool) -> None:
    saved = os.environ.get(ENV)
    os.environ[ENV] = "all_to_all"  # opt in, on this rank for this task only
    try:
        _all_to_all_matches(async_op)
    finally:
        if saved is None:
            del os.environ[ENV]
        else:
            os.environ[ENV] = saved


def _all_to_all_matches(async_op: bool) -> None:
    n, rank = dist.get_world_size(), dist.get_rank()
    inputs = _every_input()
    ours = torch.empty(PG)
    mine = inputs[rank].clone()
    with CommCounter() as comm:
        work = collectives.reduce_scatter(ours, mine, dist.group.WORLD, async_op=async_op)
    if async_op:
        work.wait()
    assert comm.counts == {"all_to_all": 1}, comm.counts
    assert comm.payload_bytes("all_to_all") == n * PG * 4, "payload is the N-chunk exchange"

    native = torch.empty(PG)
    dist.reduce_scatter_tensor(native, inputs[rank].clone(), op=dist.ReduceOp.SUM)
    reference = sum(x.double().view(n, PG)[rank] for x in inputs)  # (PG,) fp64
    where = f"rank {rank} of {n}"
    if n == 2:
        assert torch.equal(ours, native), f"{where}: differs from gloo's reduce-scatter"
    torch.testing.assert_close(ours.double(), reference, rtol=1e-6, atol=1e-6, msg=lambda m: f"{where}: {m}")


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("async_op", [True, False])
def test_all_to_all_reduce_equals_a_reduce_scatter(world_size, async_op):
    run_on_ranks(_matches_a_reduce_scatter, world_size, async_op, timeout=TIMEOUT)


def _counter_adds_back_the_own_chunk() -> None:
    n, rank = dist.get_world_size(), dist.get_rank()
    splits = [3] * n
    splits[rank] = 0
    with CommCounter() as comm:
        dist.all_to_all_single(torch.empty(3 * (n - 1)), torch.ones(3 * (n - 1)), splits, splits)
        dist.all_to_all_single(torch.empty(3 * n), torch.ones(3 * n))  # no splits: the input as it is
    assert [e.payload_bytes for e in comm.events] == [3 * n * 4] * 2


def test_counter_reads_a_self_less_all_to_all_as_the_full_exchange():
    run_on_ranks(_counter_adds_back_the_own_chunk, 4, timeout=TIMEOUT)
