"""``shardwise.auto_shard``: apply a :class:`~shardwise.planning.plan.Plan` with ``fully_shard``.

The plan's units are wrapped deepest first (the blocks), then the root, each with its
``reshard_after_forward`` and the plan's mixed precision and offload; with
``activation_checkpointing`` every block is checkpointed first
(``torch.distributed._composable.checkpoint``, which keeps parameter names unchanged).
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._composable import checkpoint as composable_checkpoint
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from shardwise.fully_shard import fully_shard
from shardwise.planning.api import plan as make_plan
from shardwise.planning.plan import Plan
from shardwise.planning.setting import parse_dtype
from shardwise.policies import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

__all__ = ["auto_shard"]

logger = logging.getLogger(__name__)


def auto_shard(model: nn.Module, plan: Plan | None = None, *, mesh: DeviceMesh | None = None, **plan_kwargs) -> nn.Module:
    """``fully_shard`` ``model`` as ``plan`` says (planned now from ``plan_kwargs`` if None); returns ``model``.

    Args:
        model: the model the plan was made for (same module names).
        plan: a :class:`Plan` (from :func:`shardwise.plan`, or loaded with ``Plan.load``).
        mesh: the DeviceMesh to shard over; default: the default process group's ranks,
            shaped like ``plan.mesh_shape`` (2-D: dims named ``replicate``, ``shard``).
        **plan_kwargs: arguments of :func:`shardwise.plan` when ``plan`` is None.
    """
    if plan is None:
        plan_kwargs.setdefault("device", _device_type(model))
        plan = make_plan(model, **plan_kwargs)
    elif plan_kwargs:
        raise TypeError(f"auto_shard got a plan and plan arguments {sorted(plan_kwargs)}; pass one or the other")
    modules = dict(model.named_modules())
    missing = [u.fqn for u in plan.units if u.fqn not in modules]
    if missing:
        raise ValueError(
            f"the plan names units {missing} that {type(model).__name__} does not have; "
            "plan again for this model or edit plan.units"
        )
    mesh = mesh if mesh is not None else _mesh(plan)
    mp = MixedPrecisionPolicy(param_dtype=parse_dtype(plan.param_dtype), reduce_dtype=parse_dtype(plan.reduce_dtype))
    offload = CPUOffloadPolicy() if plan.offload else OffloadPolicy()
    blocks = sorted((u for u in plan.units if u.fqn), key=lambda u: -u.fqn.count("."))
    for unit in blocks:
        if plan.activation_checkpointing:
            composable_checkpoint(modules[unit.fqn])
        fully_shard(modules[unit.fqn], mesh=mesh, reshard_after_forward=unit.reshard_after_forward,
                    mp_policy=mp, offload_policy=offload)
    root = next((u for u in plan.units if not u.fqn), None)
    fully_shard(model, mesh=mesh, reshard_after_forward=root.reshard_after_forward if root else None,
                mp_policy=mp, offload_policy=offload)
    logger.info("auto_shard: %d units + root of %s as planned", len(blocks), plan.model)
    return model


def _mesh(plan: Plan) -> DeviceMesh:
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "auto_shard needs torch.distributed initialised (or a mesh=) to apply a plan: call "
            "torch.distributed.init_process_group() first"
        )
    if dist.get_world_size() != plan.world_size:
        raise ValueError(
            f"the plan is for {plan.world_size} ranks but the process group has {dist.get_world_size()}; "
            f"plan again with world_size={dist.get_world_size()}"
        )
    device = "cuda" if plan.device == "cuda" and torch.cuda.is_available() else "cpu"
    names = ("replicate", "shard") if len(plan.mesh_shape) == 2 else None
    return init_device_mesh(device, tuple(plan.mesh_shape), mesh_dim_names=names)


def _device_type(model: nn.Module) -> str:
    p = next(model.parameters(), None)
    return "cuda" if p is not None and p.device.type == "cuda" else "cpu"
