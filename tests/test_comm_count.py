"""CommCounter sees every collective at the dispatcher: eager calls, async calls, calls
from backward, DTensor's functional collectives, and torch's own fully_shard.

Each ``_name`` function runs on 2 gloo ranks through ``run_on_ranks``.
"""

import math
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Shard, distribute_tensor

from shardwise.testing import CommCounter, run_on_ranks

WORLD = 2
F32 = 4  # bytes per float32 element

# -- functions that run on the ranks -------------------------------------------------


def _eager_collectives():
    shard = torch.ones(4)
    full = torch.empty(4 * WORLD)
    with CommCounter() as comm, warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # all_gather_into_tensor is deprecated in 2.13
        dist.all_gather_into_tensor(full, shard)
        dist.all_gather_single(full, shard, async_op=True).wait()
        dist.all_gather([torch.empty(4) for _ in range(WORLD)], shard)
        dist.reduce_scatter_tensor(torch.empty(4), full)
        dist.reduce_scatter_single(torch.empty(4), full, async_op=True).wait()
        dist.all_reduce(shard)
        dist.all_to_all_single(torch.empty(4), shard)
        dist.broadcast(shard, src=0)
        dist.barrier()
    return comm.counts, comm.snapshot().bytes, [(e.kind, e.group_size) for e in comm.events]


class _AllReduceGrad(torch.autograd.Function):
    """Identity forward; all-reduces the gradient in backward."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad)
        return grad


def _collective_in_backward():
    x = torch.randn(5, 3, requires_grad=True)
    with CommCounter() as comm:
        loss = _AllReduceGrad.apply(x).sum()
        forward = comm.snapshot()
        loss.backward()
        backward = comm.snapshot() - forward
    return forward.count(), backward.counts, backward.payload_bytes("all_reduce")


def _dtensor_full_tensor():
    mesh = init_device_mesh("cpu", (WORLD,))
    sharded = distribute_tensor(torch.arange(12.0).view(6, 2), mesh, [Shard(0)])
    with CommCounter() as comm:
        full = sharded.full_tensor()
    return comm.counts, comm.payload_bytes("all_gather"), full.sum().item()


def _reset_and_unknown_kind():
    with CommCounter() as comm:
        dist.all_reduce(torch.ones(2))
        before = comm.count("all_reduce")
        comm.reset()
        after = comm.count("all_reduce")
    try:
        comm.count("allgather")
    except ValueError as exc:
        return before, after, str(exc)
    return before, after, "no error"


class _TwoLayers(nn.Module):
    """Two separately sharded layers plus a head owned by the root's fully_shard."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(8, 16), nn.Linear(16, 6)])
        self.head = nn.Linear(6, 3)

    def forward(self, x):
        for layer in self.layers:
            x = torch.relu(layer(x))
        return self.head(x)


def _padded_bytes(params, world_size):
    """Bytes of one fully_shard group's all-gather output: each param padded on dim 0."""
    total = 0
    for p in params:
        rows = math.ceil(p.shape[0] / world_size) * world_size
        total += rows * math.prod(p.shape[1:]) * F32
    return total


def _torch_fully_shard_counts():
    model = _TwoLayers()
    layer_bytes = [_padded_bytes(layer.parameters(), WORLD) for layer in model.layers]
    root_bytes = _padded_bytes(model.head.parameters(), WORLD)  # the root group's only params
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    with CommCounter() as comm:
        loss = model(torch.randn(4, 8)).sum()
        forward = comm.snapshot()
        loss.backward()
        backward = comm.snapshot() - forward
    return {
        "forward": forward.counts,
        "forward_bytes": forward.payload_bytes("all_gather"),
        "backward": backward.counts,
        "backward_ag_bytes": backward.payload_bytes("all_gather"),
        "backward_rs_bytes": backward.payload_bytes("reduce_scatter"),
        "expected": {"layers": sum(layer_bytes), "root": root_bytes},
    }


# -- tests --------------------------------------------------------------------------


def test_eager_collectives_are_counted_with_payload_bytes():
    counts, payload, events = run_on_ranks(_eager_collectives, WORLD)[0]

    assert counts == {
        "all_gather": 3,
        "reduce_scatter": 2,
        "all_reduce": 1,
        "all_to_all": 1,
        "broadcast": 1,
        "barrier": 1,
    }
    full_bytes = 4 * WORLD * F32
    assert payload["all_gather"] == 3 * full_bytes  # the gathered output
    assert payload["reduce_scatter"] == 2 * full_bytes  # the unsharded input
    assert payload["all_reduce"] == payload["all_to_all"] == payload["broadcast"] == 4 * F32
    assert {size for _, size in events} == {WORLD}


def test_collective_issued_during_backward_is_counted_in_backward():
    forward, backward, all_reduce_bytes = run_on_ranks(_collective_in_backward, WORLD)[0]

    assert forward == 0
    assert backward == {"all_reduce": 1}
    assert all_reduce_bytes == 5 * 3 * F32


def test_dtensor_functional_all_gather_is_counted_once():
    counts, gathered, total = run_on_ranks(_dtensor_full_tensor, WORLD)[0]

    assert counts == {"all_gather": 1}
    assert gathered == 12 * F32
    assert total == sum(range(12))


def test_reset_starts_a_new_phase_and_unknown_kinds_are_rejected():
    before, after, error = run_on_ranks(_reset_and_unknown_kind, WORLD)[0]

    assert (before, after) == (1, 0)
    assert "unknown collective kind 'allgather'" in error


def test_torch_fully_shard_two_layers_forward_and_backward_counts():
    result = run_on_ranks(_torch_fully_shard_counts, WORLD)[0]
    expected = result["expected"]

    # forward: one all-gather per fully_shard call (2 layers + root)
    assert result["forward"] == {"all_gather": 3}
    assert result["forward_bytes"] == expected["layers"] + expected["root"]
    # backward: the layers resharded after forward and gather again; the root kept its
    # parameters (root default reshard_after_forward=False); every group reduce-scatters
    assert result["backward"] == {"all_gather": 2, "reduce_scatter": 3}
    assert result["backward_ag_bytes"] == expected["layers"]
    assert result["backward_rs_bytes"] == expected["layers"] + expected["root"]


@pytest.mark.parametrize("kind", ["all_gather", "reduce_scatter", "all_reduce", "all_to_all", "broadcast"])
def test_counter_outside_any_collective_reports_zero(kind):
    with CommCounter() as comm:
        torch.ones(3).sum()
    assert comm.count(kind) == 0 and comm.payload_bytes(kind) == 0 and comm.counts == {}
