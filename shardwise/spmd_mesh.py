"""A sharded parameter's SPMD mesh: its data-parallel dims composed with its own dims.

A plain parameter lives on the data-parallel mesh ``fully_shard`` was given. A parameter
that already is a DTensor (tensor, expert or context parallel) keeps its own mesh dims and
gains the data-parallel ones in front::

    dp mesh   (dp_replicate?, dp_shard)        the mesh fully_shard got (or a per-param one)
    own mesh  (tp | ep | ep, tp ...)           the DTensor's mesh before fully_shard
    SPMD mesh (dp_replicate?, dp_shard, own...) DeviceMesh._concatenate([dp, own])

The composition goes through DeviceMesh's own API, which reads the meshes' layouts over one
rank map, so it works however torch made them: ``init_device_mesh`` with names, slices,
``_unflatten`` of a 1-D world mesh (torchtitan builds every mesh so: the root mesh then has
none of the names ``fsdp``/``tp``/``ep``), ``_flatten``ed dims. Meshes that cannot be
composed (derived from different roots, e.g. two ``DeviceMesh.from_group`` meshes, or
overlapping) are refused at ``fully_shard`` naming the parameter and both meshes.

A DTensor parameter already on the *full* SPMD mesh (``dp_mesh_dims``; its mesh holds the
data-parallel dims by name) keeps that mesh and must be ``Replicate()`` on the data-parallel
dims. When a model-parallel dim already shards the dim FSDP shards, the data-parallel shard of
the local tensor is a *strided* shard of the global one (``_StridedShard`` with the split
factor of those dims), so ``full_tensor()`` reassembles it exactly.
"""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.distributed.tensor.placement_types import _StridedShard

from shardwise.mesh import MeshInfo

__all__ = ["spmd_layout", "grad_dp_dims", "compose"]


def spmd_layout(mesh_info: MeshInfo, param_spec: DTensorSpec | None, shard_dim: int, name: str):
    """``(mesh, placements)`` of the sharded parameter ``name``.

    Plain params: the data-parallel mesh, ``Shard(d)`` on the shard dim and ``Replicate()``
    on a replicate dim. DTensor params: on the full SPMD mesh (see :func:`_on_full_mesh`),
    or the data-parallel mesh composed with their own (:func:`compose`).
    """
    if param_spec is None:
        return mesh_info.mesh, _dp_placements(mesh_info, Shard(shard_dim))
    if _on_full_mesh(mesh_info, param_spec):
        return _full_mesh_layout(mesh_info, param_spec, shard_dim, name)
    own = list(zip(param_spec.mesh.shape, param_spec.placements))
    spmd_mesh = compose(mesh_info.mesh, param_spec.mesh, name)
    return spmd_mesh, _dp_placements(mesh_info, _dp_shard(shard_dim, own)) + tuple(param_spec.placements)


def compose(dp_mesh: DeviceMesh, own_mesh: DeviceMesh, name: str) -> DeviceMesh:
    """The mesh of ``dp_mesh``'s dims followed by ``own_mesh``'s, as one DeviceMesh.

    Raises ValueError for a mesh without dim names, and RuntimeError (torch's type for this
    refusal) naming the parameter and both meshes when they do not form one mesh.
    """
    unnamed = [m for m in (dp_mesh, own_mesh) if m.mesh_dim_names is None]
    if unnamed:
        raise ValueError(
            f"fully_shard cannot compose the mesh of DTensor parameter {name!r}: {unnamed[0]} has no dim "
            f"names (data-parallel mesh {dp_mesh}, the parameter's mesh {own_mesh}); build both meshes with "
            "named dims, e.g. slices of one init_device_mesh(..., mesh_dim_names=('dp', 'tp'))"
        )
    try:
        return DeviceMesh._concatenate([dp_mesh, own_mesh])
    except RuntimeError as e:
        raise RuntimeError(
            f"fully_shard cannot compose the mesh of DTensor parameter {name!r}: the data-parallel mesh "
            f"{dp_mesh} and the parameter's mesh {own_mesh} do not form one mesh ({e}); both must be "
            "slices (or _unflatten / _flatten results) of one root mesh, over disjoint dims"
        ) from e


def grad_dp_dims(mesh_info: MeshInfo, param_spec: DTensorSpec | None) -> frozenset[int]:
    """The dims of a DTensor param's own mesh that are data-parallel dims (params on the
    full SPMD mesh); empty for plain params and params on a mesh of their own."""
    if param_spec is None or not _on_full_mesh(mesh_info, param_spec):
        return frozenset()
    dp_names = set(mesh_info.mesh.mesh_dim_names or ())
    return frozenset(i for i, n in enumerate(param_spec.mesh.mesh_dim_names) if n in dp_names)


def _on_full_mesh(mesh_info: MeshInfo, param_spec: DTensorSpec) -> bool:
    """Whether the param's own mesh already holds the data-parallel dims (``dp_mesh_dims``):
    some dim name of the data-parallel mesh is a dim name of the param's mesh."""
    dp_names = set(mesh_info.mesh.mesh_dim_names or ())
    return bool(dp_names & set(param_spec.mesh.mesh_dim_names or ()))


def _full_mesh_layout(mesh_info: MeshInfo, param_spec: DTensorSpec, shard_dim: int, name: str):
    """The param keeps its full SPMD mesh; the data-parallel dims go from ``Replicate()`` to
    the shard / replicate placements. Only model-parallel dims after the dp shard dim split
    the tensor before the dp shard does (torch's rule for ``_StridedShard``)."""
    dp_names = mesh_info.mesh.mesh_dim_names
    names = param_spec.mesh.mesh_dim_names
    for n, pl in zip(names, param_spec.placements):
        if n in dp_names and not isinstance(pl, Replicate):
            raise ValueError(
                f"parameter {name!r} is {pl} on data-parallel mesh dim {n!r}; with dp_mesh_dims the "
                "parameters must be Replicate() on the data-parallel dims"
            )
    shard_name = dp_names[mesh_info.shard_mesh_dim] if mesh_info.shard_mesh_dim is not None else None
    after = names[names.index(shard_name) + 1 :] if shard_name in names else ()
    own_after = [
        (size, pl) for n, size, pl in zip(names, param_spec.mesh.shape, param_spec.placements) if n in after and n not in dp_names
    ]
    dp = dict(zip(dp_names, _dp_placements(mesh_info, _dp_shard(shard_dim, own_after))))
    return param_spec.mesh, tuple(dp.get(n, pl) for n, pl in zip(names, param_spec.placements))


def _dp_shard(shard_dim: int, own: list[tuple]) -> Shard:
    """``Shard(d)``, or ``_StridedShard(d, split)`` when ``own`` dims (size, placement) already
    split dim d ``split`` ways."""
    split = 1
    for size, placement in own:
        if isinstance(placement, Shard) and placement.dim == shard_dim:
            split *= size
    return _StridedShard(shard_dim, split_factor=split) if split > 1 else Shard(shard_dim)


def _dp_placements(mesh_info: MeshInfo, shard: Shard) -> tuple:
    return tuple(shard if d == mesh_info.shard_mesh_dim else Replicate() for d in range(mesh_info.mesh.ndim))
