"""What a DeviceMesh means for data parallelism.

``fully_shard`` accepts a 1-D mesh (shard over every rank) or a 2-D mesh with named dims
(HSDP: replicate over dim 0, shard over dim 1). ``replicate`` uses a 1-D mesh as a pure
replicate dimension. :class:`MeshInfo` turns the mesh into the few facts the rest of the
library needs: which process group shards, which replicates, their sizes and our ranks
in them, and the device the parameters live on.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from shardwise.errors import InvalidUsageError

if TYPE_CHECKING:
    from shardwise.policies import DataParallelMeshDims


@dataclasses.dataclass(frozen=True)
class MeshInfo:
    """The data-parallel reading of a DeviceMesh.

    Attributes:
        mesh: the mesh parameters' DTensors live on.
        shard_mesh_dim: mesh dim parameters are sharded over (``None``: replicate only).
        replicate_mesh_dim: mesh dim gradients are all-reduced over (``None``: no HSDP).
    """

    mesh: DeviceMesh
    shard_mesh_dim: int | None
    replicate_mesh_dim: int | None

    @functools.cached_property
    def shard_group(self) -> dist.ProcessGroup | None:
        return None if self.shard_mesh_dim is None else self.mesh.get_group(self.shard_mesh_dim)

    @functools.cached_property
    def replicate_group(self) -> dist.ProcessGroup | None:
        return None if self.replicate_mesh_dim is None else self.mesh.get_group(self.replicate_mesh_dim)

    @functools.cached_property
    def shard_size(self) -> int:
        return 1 if self.shard_mesh_dim is None else self.mesh.size(self.shard_mesh_dim)

    @functools.cached_property
    def shard_rank(self) -> int:
        return 0 if self.shard_mesh_dim is None else self.mesh.get_local_rank(self.shard_mesh_dim)

    @functools.cached_property
    def replicate_size(self) -> int:
        return 1 if self.replicate_mesh_dim is None else self.mesh.size(self.replicate_mesh_dim)

    @functools.cached_property
    def shard_mesh(self) -> DeviceMesh:
        """The 1-D mesh of the shard dim (the whole mesh when it is 1-D): what a tensor
        subclass's ``fsdp_pre_all_gather`` receives, as in torch."""
        if self.mesh.ndim == 1:
            return self.mesh
        dim = self.mesh.ndim - 1 if self.shard_mesh_dim is None else self.shard_mesh_dim
        return self.mesh[self.mesh.mesh_dim_names[dim]]

    @functools.cached_property
    def device(self) -> torch.device:
        return device_of_mesh(self.mesh)


def device_of_mesh(mesh: DeviceMesh) -> torch.device:
    """The device a mesh's tensors live on in this process (``cuda:<current>`` for cuda)."""
    if mesh.device_type == "cpu":
        return torch.device("cpu")
    module = getattr(torch, mesh.device_type)
    return torch.device(mesh.device_type, module.current_device())


def default_mesh(dim_name: str | None = None) -> DeviceMesh:
    """A 1-D mesh over the default process group on this process's device type."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "shardwise needs torch.distributed initialised before fully_shard/replicate when no mesh is "
            "given: call torch.distributed.init_process_group() (torchrun sets the environment), "
            "or pass mesh=init_device_mesh(...)."
        )
    device_type = "cpu"
    if dist.get_backend() != "gloo" and torch.cuda.is_available():
        device_type = "cuda"
    names = (dim_name,) if dim_name else None
    return init_device_mesh(device_type, (dist.get_world_size(),), mesh_dim_names=names)


def fully_shard_mesh_info(mesh: object) -> MeshInfo:
    """Validate ``mesh`` for fully_shard and read it: 1-D shards, 2-D is (replicate, shard)."""
    if not isinstance(mesh, DeviceMesh):
        raise ValueError(
            f"fully_shard expects mesh to be a torch.distributed.device_mesh.DeviceMesh, got "
            f"{type(mesh).__name__}: build one with init_device_mesh('cpu' or 'cuda', (world_size,))"
        )
    check_mesh_device(mesh, "fully_shard")
    if mesh.ndim == 1:
        return MeshInfo(mesh, shard_mesh_dim=0, replicate_mesh_dim=None)
    if mesh.ndim == 2:
        if mesh.mesh_dim_names is None:
            raise InvalidUsageError(
                "Please init the 2D mesh for HSDP with mesh_dim_names specified: fully_shard got a 2-D "
                f"mesh without dim names {mesh}; a 2-D mesh means HSDP "
                "(replicate over dim 0, shard over dim 1), so name its dims, e.g. "
                "init_device_mesh(device, (r, s), mesh_dim_names=('replicate', 'shard')), or pass a 1-D "
                "mesh such as mesh['dp']."
            )
        return MeshInfo(mesh, shard_mesh_dim=1, replicate_mesh_dim=0)
    raise ValueError(
        f"fully_shard expects a 1D or 2D DeviceMesh but got {mesh} (a {mesh.ndim}-D mesh); "
        "slice the data-parallel dims out of it, e.g. mesh['dp'] or mesh['dp_replicate', 'dp_shard']."
    )


def check_mesh_device(mesh: DeviceMesh, api: str) -> None:
    """A mesh names where communication happens: a real device type this process can use.

    A ``"meta"`` mesh (meant for meta-device parameters) or one on an accelerator this
    build or machine lacks would fail later with ``module 'torch' has no attribute ...``.
    """
    device_type = mesh.device_type
    if device_type == "cpu":
        return
    if device_type == "meta":
        raise ValueError(
            f"{api} got a DeviceMesh on the 'meta' device; the mesh says where ranks communicate, so build it "
            "on 'cpu' or 'cuda' (init_device_mesh('cuda', ...)); to create parameters without memory, build the "
            "module under torch.device('meta') and call module.to_empty(device=...) after fully_shard"
        )
    backend = getattr(torch, device_type, None)
    if backend is None or not hasattr(backend, "is_available") or not backend.is_available():
        raise ValueError(
            f"{api} got a DeviceMesh on device type {device_type!r}, which this process cannot use "
            f"(torch.{device_type} is missing or not available); build the mesh with init_device_mesh('cpu', ...) "
            "or on an accelerator this machine has"
        )


@dataclasses.dataclass(frozen=True)
class PostForwardGroup:
    """The smaller group an ``int`` ``reshard_after_forward=k`` keeps its shard over.

    The shard group's ranks are cut into consecutive blocks of ``k`` (e.g. the GPUs of one
    node); after forward each rank keeps ``1/k`` of the unsharded params and backward
    all-gathers over its block only.
    """

    group: dist.ProcessGroup
    size: int  # k
    rank: int  # our index in the block


_POST_FORWARD_GROUPS: dict[tuple[DeviceMesh, int], PostForwardGroup] = {}


def post_forward_group(mesh_info: MeshInfo, k: int) -> PostForwardGroup:
    """The blocks of ``k`` ranks, created once per (mesh, k) while the group lives (every
    rank of the mesh must call this). A job that destroys its process groups and makes
    them again (equal meshes) gets a new group, not the destroyed one."""
    key = (mesh_info.mesh, k)
    cached = _POST_FORWARD_GROUPS.get(key)
    if cached is None or not _alive(cached.group):
        cached = _POST_FORWARD_GROUPS[key] = _new_post_forward_group(mesh_info, k)
    return cached


def _alive(group: dist.ProcessGroup) -> bool:
    """Whether ``group`` is still registered (torch forgets a group it destroyed)."""
    try:
        dist.get_process_group_ranks(group)
    except KeyError:
        return False
    return True


def _new_post_forward_group(mesh_info: MeshInfo, k: int) -> PostForwardGroup:
    """Our block's group, made by the block's ranks alone (``use_local_synchronization``).

    A mesh may be a sub-mesh that lists only our slice of the world (an expert mesh sliced
    from a larger one: ranks {0, 2} see [0, 2], ranks {1, 3} see [1, 3]); a group built
    from it with a world-wide ``new_group`` per block would have each slice issue different
    creations, and the ranks wait on each other forever.
    """
    blocks = mesh_info.mesh.mesh.reshape(-1, k).tolist()  # consecutive blocks inside each shard group
    rank = dist.get_rank()
    block = next(b for b in blocks if rank in b)
    group = dist.new_group(block, use_local_synchronization=True)
    return PostForwardGroup(group, k, block.index(rank))


def spmd_mesh_info(mesh: object, dims: "DataParallelMeshDims") -> MeshInfo:
    """Read the data-parallel part of a full SPMD mesh named by ``dims``."""
    if not isinstance(mesh, DeviceMesh) or mesh.mesh_dim_names is None:
        raise ValueError(f"dp_mesh_dims needs a DeviceMesh with named dims, got {mesh!r}")
    names = dims.replicate_names + dims.shard_names
    unknown = [n for n in names if n not in mesh.mesh_dim_names]
    if unknown:
        raise ValueError(f"dp_mesh_dims names {unknown} are not dims of {mesh}")
    if len(dims.shard_names) > 1 or len(dims.replicate_names) > 1:
        raise NotImplementedError(
            f"dp_mesh_dims with several names per field ({dims}) is not supported yet: flatten them "
            "into one named dim first (mesh[('a', 'b')]._flatten('ab'))"
        )
    dp_mesh = mesh[names]
    if not dims.shard_names:
        return MeshInfo(dp_mesh, shard_mesh_dim=None, replicate_mesh_dim=0)
    if not dims.replicate_names:
        return MeshInfo(dp_mesh, shard_mesh_dim=0, replicate_mesh_dim=None)
    return MeshInfo(dp_mesh, shard_mesh_dim=1, replicate_mesh_dim=0)
