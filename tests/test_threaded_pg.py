"""Ranks that are threads of one process: torch's ``MultiThreadedTestCase`` and
``init_process_group("threaded")`` (FSDP2's own tests and many users' unit tests use it).

Lazy init's rank-agreement check meets the other ranks under keys in the c10d store; the
keys must be counted per rank, not per process, or the threads never wait on the same
keys and the first forward hangs. The test trains shardwise and torch's FSDP2 side by side
in the same threaded group for a few steps, comparing losses, parameters and gradients
every step (bit-equal: same collectives, same math).

Timeouts: the init check gives up after ``SHARDWISE_INIT_TIMEOUT_S`` (a RuntimeError, not
a hang), and the threads are joined within ``TIMEOUT`` s (torch's runner reads its
module-level ``TIMEOUT_DEFAULT`` at join time; the test sets it for its own run).
"""

from __future__ import annotations

import copy
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.testing._internal import common_distributed
from torch.testing._internal.common_distributed import MultiThreadedTestCase

import shardwise

TIMEOUT = 60
STEPS = 3


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(6, 8)
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
        self.out = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for layer in self.layers:
            h = h + torch.tanh(layer(h))
        return self.out(h)


def _shard(model: _Net, fully_shard_fn, mesh) -> _Net:
    for layer in model.layers:
        fully_shard_fn(layer, mesh=mesh)
    return fully_shard_fn(model, mesh=mesh)


class TestThreadedProcessGroup(MultiThreadedTestCase):
    @property
    def world_size(self) -> int:
        return 2

    def setUp(self) -> None:
        super().setUp()
        self._saved = common_distributed.TIMEOUT_DEFAULT, os.environ.get("SHARDWISE_INIT_TIMEOUT_S")
        common_distributed.TIMEOUT_DEFAULT = TIMEOUT
        os.environ["SHARDWISE_INIT_TIMEOUT_S"] = "30"
        self._spawn_threads()

    def tearDown(self) -> None:
        timeout, init_timeout = self._saved
        common_distributed.TIMEOUT_DEFAULT = timeout
        if init_timeout is None:
            os.environ.pop("SHARDWISE_INIT_TIMEOUT_S", None)
        else:
            os.environ["SHARDWISE_INIT_TIMEOUT_S"] = init_timeout
        super().tearDown()

    def test_trains_like_torch_fsdp2(self) -> None:
        mesh = init_device_mesh("cpu", (self.world_size,))
        torch.manual_seed(0)  # per thread: the same initialisation on every rank
        base = _Net()
        theirs = _shard(copy.deepcopy(base), torch_fully_shard, mesh)
        ours = _shard(base, shardwise.fully_shard, mesh)
        opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ours, theirs)]
        gen = torch.Generator().manual_seed(dist.get_rank())
        for step in range(STEPS):
            x, y = torch.randn(4, 6, generator=gen), torch.randn(4, 3, generator=gen)
            losses = []
            for model, opt in zip((ours, theirs), opts):
                opt.zero_grad()
                loss = F.mse_loss(model(x), y)
                loss.backward()
                losses.append(loss.detach())
            assert torch.equal(*losses), f"rank {dist.get_rank()} step {step}: losses {losses}"
            for (name, p), q in zip(ours.named_parameters(), theirs.parameters()):
                where = f"rank {dist.get_rank()} step {step}: {name}"
                assert p.placements == q.placements and torch.equal(p.to_local(), q.to_local()), where
                assert torch.equal(p.grad.to_local(), q.grad.to_local()), f"{where}.grad"
            for opt in opts:
                opt.step()
