"""replicate(): data parallelism without sharding, on the fully_shard machinery.

Parameters become ``DTensor``s placed ``(Replicate(),)`` on a 1-D mesh; the unsharded
parameters *are* that storage (nothing is gathered, copied or freed), and each group's
gradients are all-reduced to the mean, issued asynchronously as soon as the group's
backward is done so the all-reduce overlaps the rest of backward. Every FSDPModule knob
(gradient sync, prefetch setters, mixed precision, offload, ...) applies unchanged.
"""

from __future__ import annotations

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from shardwise.fully_shard import _check_modules, _derived_class, _register_state, build_state
from shardwise.mesh import MeshInfo, check_mesh_device, default_mesh, spmd_mesh_info
from shardwise.module import FSDPModule
from shardwise.policies import DataParallelMeshDims, MixedPrecisionPolicy, OffloadPolicy, check_policies
from shardwise.state import get_state, state_accessor

__all__ = ["replicate", "ReplicateModule"]


class ReplicateModule(FSDPModule):
    """Mixin of every module ``replicate`` was applied to (MRO: Replicate<Orig>, ReplicateModule,
    FSDPModule, Orig)."""

    _orig_cls_mro_index = 3


def replicate(
    module: nn.Module | list[nn.Module],
    *,
    mesh: DeviceMesh | None = None,
    mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
    offload_policy: OffloadPolicy = OffloadPolicy(),
    ignored_params: set[nn.Parameter] | None = None,
    dp_mesh_dims: DataParallelMeshDims | None = None,
):
    """Replicate ``module``'s parameters over ``mesh`` and all-reduce their gradients (DDP).

    Args:
        module: the module, or a list of modules whose gradients reduce together.
        mesh: a 1-D DeviceMesh (default: the whole world, dim name "replicate").
        mp_policy: mixed precision (see :class:`MixedPrecisionPolicy`).
        offload_policy: :class:`OffloadPolicy` or :class:`CPUOffloadPolicy`.
        ignored_params: parameters left alone (not replicated, not reduced).
        dp_mesh_dims: when ``mesh`` is the full SPMD mesh and the params are already DTensors
            on it, names the data-parallel dim to all-reduce over (``replicate=`` only:
            a ``shard=`` dim is refused, as torch does; use fully_shard to shard).

    Returns:
        The same module (or list), now an instance of :class:`ReplicateModule`.
    """
    modules = _check_replicate_modules(module)
    mp_policy, offload_policy = check_policies(mp_policy, offload_policy)
    mesh = mesh if mesh is not None else default_mesh("replicate")
    mesh_info = _replicate_mesh_info(mesh, dp_mesh_dims)
    state = build_state(modules, mesh_info, False, None, mp_policy, offload_policy, ignored_params)
    for m in modules:
        _register_state(m, state, "replicate")
        m.__class__ = _derived_class(type(m), ReplicateModule, "Replicate")
    return module


replicate.state = state_accessor("replicate")  # torch's composable-API accessor


def _replicate_mesh_info(mesh: DeviceMesh, dp_mesh_dims: object) -> MeshInfo:
    """A 1-D mesh, or the replicate-only data-parallel dims of a full SPMD mesh."""
    if dp_mesh_dims is not None:
        if not isinstance(dp_mesh_dims, DataParallelMeshDims):
            raise TypeError(f"dp_mesh_dims must be a shardwise.DataParallelMeshDims, got {type(dp_mesh_dims).__name__}")
        if dp_mesh_dims.shard_names:
            raise ValueError(
                f"replicate() with dp_mesh_dims requires replicate-only dims (no shard dims), got {dp_mesh_dims}. "
                "Use fully_shard() for sharding."
            )
        return spmd_mesh_info(mesh, dp_mesh_dims)
    if not isinstance(mesh, DeviceMesh) or mesh.ndim != 1:
        raise ValueError(
            f"replicate expects a 1-D DeviceMesh but got {mesh!r}; pass mesh['dp_replicate'] or a 1-D "
            "init_device_mesh(...), or dp_mesh_dims=DataParallelMeshDims(replicate=...) for a full SPMD "
            "mesh. For replicate + shard use fully_shard with a 2-D mesh (HSDP)."
        )
    check_mesh_device(mesh, "replicate")
    return MeshInfo(mesh, shard_mesh_dim=None, replicate_mesh_dim=0)


def _check_replicate_modules(module: object) -> list[nn.Module]:
    candidates = module if isinstance(module, (list, tuple)) else [module]
    for m in candidates:
        state = get_state(m) if isinstance(m, nn.Module) else None
        if state is not None and state.api == "fully_shard":
            raise RuntimeError(
                f"Cannot apply replicate() on a {type(m).__name__} already managed by fully_shard; "
                "use one of them per module (fully_shard with a 2-D mesh gives replicate + shard)"
            )
    return _check_modules(module, "replicate")
