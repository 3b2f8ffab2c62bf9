"""Pipeline parallelism: torch's ``torch.distributed.pipelining`` schedules driving ``fully_shard``ed stages.

Each stage module (a few residual MLP blocks; the first also embeds, the last also projects)
has every block and the stage itself ``fully_shard``ed over the data-parallel mesh, on meshes
made as torchtitan makes them (``pp`` and ``fsdp`` unflattened from one ``world`` mesh). The
schedules call FSDP2 by hand: per microbatch ``set_requires_gradient_sync(False)`` and
``set_reshard_after_backward(False)``; after the last, ``group.post_backward()`` for every group
of every state and ``state._root_post_backward_final_callback()``; looped schedules also
``unshard(async_op=True)`` / ``reshard()`` per stage. The switch puts shardwise's names into
pipelining's modules (``isinstance(stage.submod, FSDPModule)``) while it is on.

Every schedule of torch 2.13 trains PP 2 x FSDP 2 (4 ranks) bit-equal to torch's
``fully_shard`` on the same ranks, seed and data: losses, every param's and grad's
placements and local shard after every step, and the collectives of each step per kind.
GPipe and Interleaved1F1B also at PP 2 x HSDP (2, 2) on 8 ranks.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed import pipelining
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.pipelining.schedules import PipelineScheduleSingle

import shardwise
from _nd_helpers import TIMEOUT, same_as_torch, tally, titan_meshes
from shardwise.testing import CommCounter, run_on_ranks

DIM = 8
BLOCKS_PER_STAGE = 2
MICROBATCHES = 4
STEPS = 2
LR = 0.1
SINGLE = ["ScheduleGPipe", "Schedule1F1B"]
MULTI = ["ScheduleInterleaved1F1B", "ScheduleLoopedBFS", "ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble", "ScheduleDualPipeV"]
V_SHAPED = {"ScheduleZBVZeroBubble", "ScheduleDualPipeV"}  # rank r holds stages r and 2*pp-1-r


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.proj = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.proj(self.norm(x)))


class Stage(nn.Module):
    """One pipeline stage: blocks, plus the input projection (first) or the head (last)."""

    def __init__(self, first: bool, last: bool):
        super().__init__()
        self.inp = nn.Linear(DIM, DIM) if first else None
        self.layers = nn.ModuleList(Block() for _ in range(BLOCKS_PER_STAGE))
        self.head = nn.Linear(DIM, DIM) if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.inp is not None:
            x = self.inp(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x) if self.head is not None else x


def _stage_ids(schedule: str, pp_rank: int, pp: int) -> list[int]:
    if schedule in SINGLE:
        return [pp_rank]
    if schedule in V_SHAPED:
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank, pp_rank + pp]  # looped: stage i on rank i % pp


def _build(schedule: str, fully_shard_fn, meshes: dict) -> tuple[object, list]:
    pp_mesh, dp_mesh = meshes["pp"], meshes["dp"]
    pp = pp_mesh.size()
    ids = _stage_ids(schedule, pp_mesh.get_local_rank(), pp)
    n_stages = pp * len(ids)
    stages, modules = [], []
    for i in ids:
        torch.manual_seed(100 + i)  # the same weights for ours and torch's
        module = Stage(first=i == 0, last=i == n_stages - 1)
        for layer in module.layers:
            fully_shard_fn(layer, mesh=dp_mesh)
        fully_shard_fn(module, mesh=dp_mesh)
        modules.append(module)
        stages.append(pipelining.PipelineStage(module, i, n_stages, torch.device("cpu"), group=pp_mesh.get_group()))
    cls = getattr(pipelining, schedule)
    loss_fn = lambda out, target: F.mse_loss(out, target)  # noqa: E731
    if issubclass(cls, PipelineScheduleSingle):
        return cls(stages[0], n_microbatches=MICROBATCHES, loss_fn=loss_fn), modules
    return cls(stages, n_microbatches=MICROBATCHES, loss_fn=loss_fn), modules


def _run_step(schedule, modules: list, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """One schedule step (its microbatches), counting the data-parallel collectives."""
    stages = getattr(schedule, "_stages", None) or [schedule._stage]
    first = any(s.is_first for s in stages)
    last = any(s.is_last for s in stages)
    losses: list = []
    args = (x,) if first else ()
    kwargs = dict(target=y, losses=losses) if last else {}
    with CommCounter() as counter:
        schedule.step(*args, **kwargs)
    counts = {k: v for k, v in tally(counter.events).items() if k in ("all_gather", "reduce_scatter", "all_reduce")}
    return (torch.stack(losses) if losses else torch.zeros(0)), counts


def _sgd(modules: list) -> None:
    with torch.no_grad():
        for module in modules:
            for p in module.parameters():
                if p.grad is not None:
                    p.add_(p.grad, alpha=-LR)
                    p.grad = None


def _train(schedule_name: str, degrees: dict) -> list[list[float]]:
    meshes = titan_meshes(pp=2, **degrees)
    theirs, torch_modules = _build(schedule_name, torch_fully_shard, meshes)
    ours, our_modules = _build(schedule_name, shardwise.fully_shard, meshes)
    dp_rank = meshes["dp"].mesh.flatten().tolist().index(dist.get_rank())
    gen = torch.Generator().manual_seed(dp_rank)
    history = []
    for step in range(STEPS):
        x, y = torch.randn(2 * MICROBATCHES, DIM, generator=gen), torch.randn(2 * MICROBATCHES, DIM, generator=gen)
        torch_losses, torch_counts = _run_step(theirs, torch_modules, x, y)
        with shardwise.install_as_torch_fsdp():
            losses, counts = _run_step(ours, our_modules, x, y)
        assert torch.equal(losses, torch_losses), f"step {step}: losses {losses.tolist()} vs torch {torch_losses.tolist()}"
        assert counts == torch_counts, f"step {step}: collectives {counts} vs torch {torch_counts}"
        for mine, torchs in zip(our_modules, torch_modules):
            same_as_torch(f"{schedule_name} step {step}", mine, torchs)
        _sgd(our_modules)
        _sgd(torch_modules)
        history.append(losses.tolist())
    return history


@pytest.mark.parametrize("schedule", SINGLE + MULTI)
def test_schedule_trains_fsdp_stages_like_torch(schedule):
    histories = run_on_ranks(_train, 4, schedule, dict(dp_shard=2), timeout=TIMEOUT)
    assert any(h and h[0] for h in histories), "no rank computed a loss"


@pytest.mark.parametrize("schedule", ["ScheduleGPipe", "ScheduleInterleaved1F1B"])
def test_schedule_trains_hsdp_stages_like_torch(schedule):
    run_on_ranks(_train, 8, schedule, dict(dp_replicate=2, dp_shard=2), timeout=TIMEOUT)


def test_switch_rebinds_pipelinings_fsdp_names_and_restores_torchs():
    """pipelining bound torch's names at its import (above): the switch rebinds them while on
    and puts torch's back on uninstall."""
    from torch.distributed.pipelining import schedules, stage

    torch_names = (stage.FSDPModule, stage.fully_shard, schedules.FSDPModule, schedules.UnshardHandle)
    with shardwise.install_as_torch_fsdp():
        assert stage.FSDPModule is shardwise.FSDPModule and schedules.FSDPModule is shardwise.FSDPModule
        assert stage.fully_shard is shardwise.fully_shard and schedules.UnshardHandle is shardwise.UnshardHandle
        assert stage.replicate is shardwise.replicate and stage.ReplicateModule is shardwise.ReplicateModule
    assert (stage.FSDPModule, stage.fully_shard, schedules.FSDPModule, schedules.UnshardHandle) == torch_names
