"""Gradient clipping across shards and meshes.

``torch.nn.utils.clip_grad_norm_`` works on sharded DTensor gradients as long as every
gradient lives on one mesh. A model that mixes meshes — tensor-parallel blocks on
``(dp, tp)`` next to plain FSDP params on ``(dp,)`` — makes torch's helper fail (it stacks
per-parameter norms from different meshes). :func:`clip_grad_norm_` groups gradients by
mesh and placements, reduces each group's norm to a replicated scalar, combines those
scalars, and scales every gradient in place::

    total = (sum over groups of ||g_group||_p^p)^(1/p)     (max for p = inf)
    g *= min(1, max_norm / (total + 1e-6))

A group's norm is reduced across ranks as DTensor reduces a partial norm: for each mesh
dim its gradients are sharded on, in mesh order, ``x^p``, a SUM all-reduce on that dim's
process group, ``x^(1/p)`` (MAX / MIN for p = inf / -inf, a plain SUM for p = 0). With one
sharded dim (FSDP, HSDP) the result is ``full_tensor()``'s, bit for bit; with two (FSDP x
TP) it can differ from it in the last bit (DTensor reduces the vector of per-parameter
norms there, we reduce their norm). Each all-reduce goes through the fault monitor
(:func:`shardwise.faults.monitor.all_reduce`), like the library's gradient reductions: a
peer that died or stopped before clipping is named within the watchdog's deadline instead
of being waited on for the process group's timeout. A gradient that is itself ``Partial``
(no FSDP or TP gradient is) is reduced through DTensor, unwatched.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Iterable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Placement

from shardwise.faults import monitor

__all__ = ["clip_grad_norm_", "get_total_norm", "clip_grads_with_norm_"]


def clip_grad_norm_(
    parameters: Iterable[torch.Tensor] | torch.Tensor,
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> torch.Tensor:
    """Clip gradients to a global norm of ``max_norm``; return the total norm (a plain tensor).

    Same arguments and result as ``torch.nn.utils.clip_grad_norm_``, correct for sharded
    DTensor gradients on any mix of meshes.
    """
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.tensor(0.0)
    total = get_total_norm(grads, norm_type, error_if_nonfinite)
    clip_grads_with_norm_(params, max_norm, total)
    return total


def get_total_norm(
    tensors: Iterable[torch.Tensor], norm_type: float = 2.0, error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> torch.Tensor:
    """The ``norm_type`` norm of all of ``tensors`` together (a plain scalar tensor on the CPU):
    ``torch.nn.utils.get_total_norm``, correct for sharded DTensors on any mix of meshes."""
    norm_type = float(norm_type)
    total = _total_norm(list(tensors), norm_type)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(
            f"the total norm of order {norm_type} of the gradients is non-finite ({total.item()}); "
            "pass error_if_nonfinite=False to clip anyway"
        )
    return total


def clip_grads_with_norm_(
    parameters: Iterable[torch.Tensor] | torch.Tensor, max_norm: float, total_norm: torch.Tensor,
    foreach: bool | None = None,
) -> None:
    """Scale the gradients of ``parameters`` in place by ``min(1, max_norm / (total_norm + 1e-6))``
    (``torch.nn.utils.clip_grads_with_norm_``; each rank scales its own shards)."""
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
    for grad in (p.grad for p in params if p.grad is not None):
        local = grad.to_local() if isinstance(grad, DTensor) else grad
        local.mul_(coef.to(local.device, local.dtype))


def _total_norm(grads: list[torch.Tensor], norm_type: float) -> torch.Tensor:
    """The norm over all grads: one reduced scalar per (mesh, placements) group, then combined."""
    groups: dict[object, list[torch.Tensor]] = defaultdict(list)
    for grad in grads:
        key = (grad.device_mesh, tuple(grad.placements)) if isinstance(grad, DTensor) else None
        groups[key].append(grad)
    norms = []
    for key, members in groups.items():
        if key is None or any(p.is_partial() for p in key[1]):  # plain tensors; a Partial gradient
            norm = _norm(members, norm_type)
            norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
        else:
            norm = _reduce_over_shards(_norm([g.to_local() for g in members], norm_type), *key, norm_type)
        norms.append(norm.float().cpu())
    stacked = torch.stack(norms)
    if math.isinf(norm_type):
        return stacked.max()
    return stacked.pow(norm_type).sum().pow(1.0 / norm_type)


def _norm(tensors: list[torch.Tensor], norm_type: float) -> torch.Tensor:
    """The ``norm_type`` norm of all of ``tensors``' elements (one per tensor, then of those)."""
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(t, norm_type) for t in tensors]), norm_type)


def _reduce_over_shards(
    norm: torch.Tensor, mesh: DeviceMesh, placements: tuple[Placement, ...], norm_type: float
) -> torch.Tensor:
    """This rank's ``norm`` of its shards reduced over every mesh dim they are sharded on,
    dim by dim in mesh order: DTensor's reduction of a partial norm (``full_tensor()``), each
    all-reduce watched by the fault monitor."""
    for dim, placement in enumerate(placements):
        if placement.is_replicate():
            continue
        pg = mesh.get_group(dim)
        if math.isinf(norm_type):
            monitor.all_reduce(norm, pg, dist.ReduceOp.MAX if norm_type > 0 else dist.ReduceOp.MIN, _WHAT)
        elif norm_type == 0:
            monitor.all_reduce(norm, pg, dist.ReduceOp.SUM, _WHAT)
        else:
            norm = monitor.all_reduce(norm**norm_type, pg, dist.ReduceOp.SUM, _WHAT) ** (1.0 / norm_type)
    return norm


_WHAT = "shardwise.clip_grad_norm_"
"""How the norm's all-reduces read in the fault monitor's messages."""
