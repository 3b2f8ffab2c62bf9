"""Gradient clipping across shards and meshes.

``torch.nn.utils.clip_grad_norm_`` works on sharded DTensor gradients as long as every
gradient lives on one mesh. A model that mixes meshes — tensor-parallel blocks on
``(dp, tp)`` next to plain FSDP params on ``(dp,)`` — makes torch's helper fail (it stacks
per-parameter norms from different meshes). :func:`clip_grad_norm_` groups gradients by
mesh and placements, reduces each group's norm to a replicated scalar, combines those
scalars, and scales every gradient in place::

    total = (sum over groups of ||g_group||_p^p)^(1/p)     (max for p = inf)
    g *= min(1, max_norm / (total + 1e-6))
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Iterable

import torch
from torch.distributed.tensor import DTensor

__all__ = ["clip_grad_norm_"]


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
    norm_type = float(norm_type)
    if not grads:
        return torch.tensor(0.0)
    total = _total_norm(grads, norm_type)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(
            f"the total norm of order {norm_type} of the gradients is non-finite ({total.item()}); "
            "pass error_if_nonfinite=False to clip anyway"
        )
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for grad in grads:
        local = grad.to_local() if isinstance(grad, DTensor) else grad
        local.mul_(coef.to(local.device, local.dtype))
    return total


def _total_norm(grads: list[torch.Tensor], norm_type: float) -> torch.Tensor:
    """The norm over all grads: one reduced scalar per (mesh, placements) group, then combined."""
    groups: dict[object, list[torch.Tensor]] = defaultdict(list)
    for grad in grads:
        key = (grad.device_mesh, tuple(grad.placements)) if isinstance(grad, DTensor) else None
        groups[key].append(grad)
    norms = []
    for key, members in groups.items():
        per_param = torch.stack([torch.linalg.vector_norm(g, norm_type) for g in members])
        norm = torch.linalg.vector_norm(per_param, norm_type)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        norms.append(norm.float().cpu())
    stacked = torch.stack(norms)
    if math.isinf(norm_type):
        return stacked.max()
    return stacked.pow(norm_type).sum().pow(1.0 / norm_type)
