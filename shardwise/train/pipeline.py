"""Pipeline parallelism for ``shardwise train --pp N``: stages, which rank holds which, the schedule.

``--pp N`` cuts the model's blocks into stages and lets ``torch.distributed.pipelining`` run
them; every stage is ``fully_shard``ed over the data-parallel mesh, so PP composes with FSDP,
HSDP (``--replicate``) and TP (``--tp``). The world mesh gets a ``pp`` dim, outermost::

    (pp, dp)   (pp, dp_replicate, dp_shard)   (pp, dp, tp)   (pp, dp_replicate, dp_shard, tp)

A single-stage schedule (``GPipe``, ``1F1B``) gives each pp rank one stage; the others give it
two: looped (``Interleaved1F1B``, ``LoopedBFS``, ``InterleavedZeroBubble``: stages ``r`` and
``r + N``) or V-shaped (``ZBVZeroBubble``, ``DualPipeV``: stages ``r`` and ``2N - 1 - r``).
Blocks are split into contiguous runs, earlier stages taking the remainder; the first stage
also embeds, the last also normalises and projects to logits.

**A stage keeps the model's names.** A stage module is a pruned shallow copy of the model
(:func:`pruned`): its blocks sit at their own indices of ``layers`` (a :class:`PassThrough`
holds the place of a block another stage owns), so a parameter's name is the same with
any ``--pp`` or none. Checkpoints therefore load across pipeline layouts, and ``shardwise
export`` reads them unchanged. A rank with two stages trains :func:`merged` of them: one
module whose parameters are both stages' under those names (the optimizer's and the
checkpoint's view), while each stage is its own FSDP root that pipelining drives.

The step: the batch is cut into ``--pp-microbatches`` microbatches (default: the number of
stages), the schedule runs them (gradients averaged over microbatches, synchronised on the
last), and the loss, known on the rank of the last stage, is shared over the ``pp`` group
with one all-reduce. ``--clip-norm`` combines each stage's gradient norm over ``pp`` the
same way before scaling.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from shardwise.clip import clip_grads_with_norm_, get_total_norm
from shardwise.faults import monitor

__all__ = [
    "SCHEDULES", "DEFAULT_SCHEDULE", "V_SHAPED", "stages_per_rank", "stage_ids", "split_blocks", "PassThrough",
    "pruned", "stage_blocks", "merged", "cross_entropy", "build_schedule", "Pipeline",
]

SINGLE_STAGE = ("GPipe", "1F1B")
LOOPED = ("Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble")
V_SHAPED = ("ZBVZeroBubble", "DualPipeV")
SCHEDULES = SINGLE_STAGE + LOOPED + V_SHAPED
"""Values of ``--pp-schedule``: torch 2.13's schedules, by ``get_schedule_class``'s names."""

DEFAULT_SCHEDULE = "1F1B"
"""``--pp-schedule``'s default (torchtitan's)."""


def stages_per_rank(schedule: str) -> int:
    """Stages each pp rank holds under ``schedule``: 1 for GPipe and 1F1B, else 2."""
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {schedule!r}; expected one of {SCHEDULES}")
    return 1 if schedule in SINGLE_STAGE else 2


def stage_ids(schedule: str, pp_rank: int, pp: int) -> list[int]:
    """The stages pp rank ``pp_rank`` of ``pp`` holds, in the order pipelining wants them."""
    if stages_per_rank(schedule) == 1:
        return [pp_rank]
    if schedule in V_SHAPED:
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank, pp_rank + pp]


def split_blocks(n_blocks: int, n_stages: int) -> list[range]:
    """Contiguous runs of block indices, one per stage; the first ``n_blocks % n_stages`` get one more.

    Raises:
        ValueError: fewer blocks than stages (a stage without a block has nothing to pipeline).
    """
    if n_blocks < n_stages:
        raise ValueError(f"{n_blocks} blocks cannot fill {n_stages} pipeline stages")
    base, extra = divmod(n_blocks, n_stages)
    bounds = [0]
    for s in range(n_stages):
        bounds.append(bounds[-1] + base + (1 if s < extra else 0))
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


class PassThrough(nn.Module):
    """The place of a block that another stage owns: returns its first argument, whatever the
    keyword arguments (a Transformers decoder layer is called with masks and rotary embeddings)."""

    def forward(self, hidden: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        return hidden


def pruned(module: nn.Module, children: dict[str, nn.Module | None]) -> nn.Module:
    """A shallow copy of ``module`` (same class, same attributes, the same child objects) with
    the children named in ``children`` replaced; ``module`` itself is unchanged.

    The copy's own tables of children, parameters and buffers are new dicts, so replacing a
    child of the copy never touches the original; everything else is shared.
    """
    copy_ = copy.copy(module)
    copy_._modules = dict(module._modules)
    copy_._parameters = dict(module._parameters)
    copy_._buffers = dict(module._buffers)
    for name, child in children.items():
        if name not in module._modules:
            raise KeyError(f"{type(module).__name__} has no child {name!r}")
        copy_._modules[name] = child
    return copy_


def stage_blocks(blocks: nn.ModuleList, keep: range) -> nn.ModuleList:
    """``blocks`` with every block outside ``keep`` replaced by a :class:`PassThrough` (indices kept)."""
    return nn.ModuleList(block if i in keep else PassThrough() for i, block in enumerate(blocks))


def merged(modules: list[nn.Module]) -> nn.Module:
    """One module whose named parameters and buffers are the union of ``modules``' (stages of
    one model: where two share a name they hold the same object, or one holds a placeholder).

    One module is returned as it is; several are merged child by child into plain containers.
    """
    if len(modules) == 1:
        return modules[0]
    out = nn.Module()
    for m in modules:
        out._parameters.update({n: p for n, p in m._parameters.items() if p is not None})
        out._buffers.update({n: b for n, b in m._buffers.items() if b is not None})
    names = dict.fromkeys(n for m in modules for n in m._modules)
    for name in names:
        kids = {id(k): k for m in modules if (k := m._modules.get(name)) is not None and not isinstance(k, PassThrough)}
        if kids:
            out.add_module(name, merged(list(kids.values())))
    return out


def cross_entropy(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The loss of a microbatch: next-token cross-entropy in fp32, mean over its tokens."""
    return F.cross_entropy(logits.flatten(0, 1).float(), target.flatten())


def build_schedule(
    modules: list[nn.Module], ids: list[int], n_stages: int, device: torch.device, pp_mesh: DeviceMesh,
    schedule: str, n_microbatches: int,
) -> object:
    """``schedule`` (a name of :data:`SCHEDULES`) over this rank's stage ``modules`` (stages ``ids`` of ``n_stages``)."""
    from torch.distributed import pipelining
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class

    stages = [pipelining.PipelineStage(m, i, n_stages, device, group=pp_mesh.get_group()) for m, i in zip(modules, ids)]
    cls = get_schedule_class(schedule)
    if issubclass(cls, PipelineScheduleSingle):
        return cls(stages[0], n_microbatches=n_microbatches, loss_fn=cross_entropy)
    return cls(stages, n_microbatches=n_microbatches, loss_fn=cross_entropy)


@dataclasses.dataclass
class Pipeline:
    """This rank's stages and the schedule that runs them."""

    stages: list[nn.Module]  # this rank's stage modules, each an FSDP root
    schedule: object  # a torch.distributed.pipelining schedule over them
    pp_mesh: DeviceMesh
    has_first: bool  # this rank holds stage 0 (it feeds the tokens)
    has_last: bool  # this rank holds the last stage (it computes the loss)
    switch: bool = False  # run the schedule with shardwise's names in torch's FSDP homes (--impl shardwise)

    def fsdp_names(self) -> contextlib.AbstractContextManager:
        """Around the steps: pipelining asks ``isinstance(stage.submod, FSDPModule)`` and calls
        ``fully_shard.state``, so under ``--impl shardwise`` its FSDP names must be shardwise's
        (the switch, installed once for the run: installing it costs milliseconds)."""
        if not self.switch:
            return contextlib.nullcontext()
        from shardwise.switch import install_as_torch_fsdp

        return install_as_torch_fsdp()

    def run(self, x: torch.Tensor, y: torch.Tensor, train: bool = True) -> torch.Tensor:
        """The schedule over ``(x, y)`` (forward only when not ``train``); the mean microbatch
        loss, the same on every rank of the ``pp`` group. Call it inside :meth:`fsdp_names`."""
        losses: list[torch.Tensor] = []
        args = (x,) if self.has_first else ()
        kwargs = dict(target=y, losses=losses) if self.has_last else {}
        if train:
            self.schedule.step(*args, return_outputs=False, **kwargs)
        else:
            with torch.no_grad():
                self.schedule.eval(*args, **kwargs)
        loss = torch.stack(losses).float().mean() if losses else torch.zeros((), device=x.device)
        return monitor.all_reduce(loss.reshape(1), self.pp_mesh.get_group(), dist.ReduceOp.SUM,
                                  "shardwise train's pipeline loss")[0]

    def clip(self, params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
        """Clip the gradients of every stage to a global 2-norm of ``max_norm``; the norm before clipping."""
        grads = [p.grad for p in params if p.grad is not None]
        local = get_total_norm(grads, 2.0) if grads else torch.zeros(())
        squared = local.reshape(1).double().to(self.pp_mesh.device_type) ** 2
        total = monitor.all_reduce(squared, self.pp_mesh.get_group(), dist.ReduceOp.SUM,
                                   "shardwise train's pipeline grad norm").sqrt()[0].float().cpu()
        if not math.isinf(max_norm):
            clip_grads_with_norm_(params, max_norm, total)
        return total
