"""ShardedParam: one original parameter, its shard, and its unsharded view.

Layout (N = shard-group size, r = our rank in it, d = the shard dim, usually 0)::

    original        (D0, *rest)                         the user's parameter
    chunks          torch.chunk(original, N, dim=d)     rank r owns chunk r (maybe empty)
    padded shard    (ceil(D0 / N), *rest) rows          what every rank sends in the all-gather;
                                                        rows past the real chunk are padding
    gathered        (N, padded_numel)                   the all-gather output for this param
    unsharded       (D0, *rest)                         gathered[:D0 rows], a view in the group's buffer

The padded shard lives inside the group's flat shard buffer (see group.py), so the
all-gather needs no copy-in when no cast is required. The sharded ``nn.Parameter`` the
optimizer holds is a DTensor whose local tensor is the *unpadded* view of that storage:
padding is never visible. For ``Shard(d)`` with ``d != 0`` the dim must divide evenly;
the shard is stored contiguously in the original layout and gathered chunks are
concatenated along ``d`` on copy-out.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import weakref

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

from shardwise.mesh import MeshInfo


class ShardedState(enum.Enum):
    """Which tensor is registered on the module for this parameter."""

    SHARDED = "sharded"  # the sharded DTensor parameter
    SHARDED_POST_FORWARD = "sharded_post_forward"  # a smaller shard kept after forward (int reshard)
    UNSHARDED = "unsharded"  # the plain unsharded tensor (a view into the group's buffer)


@dataclasses.dataclass(frozen=True)
class ParamSite:
    """One place the parameter is registered: ``getattr(module, name)``. Tied params have several."""

    module: nn.Module
    name: str
    fqn: str = ""  # relative to the module fully_shard was called on (for messages before lazy init)

    def set(self, tensor: torch.Tensor) -> None:
        # Direct dict write: nn.Module.__setattr__ would reject a plain tensor for a parameter slot.
        self.module._parameters[self.name] = tensor


def shard_rows(dim_size: int, num_shards: int) -> tuple[int, list[int]]:
    """``(padded_rows, rows_per_rank)`` for splitting ``dim_size`` like ``torch.chunk``."""
    padded = math.ceil(dim_size / num_shards) if dim_size else 0
    rows = [max(0, min(padded, dim_size - i * padded)) for i in range(num_shards)]
    return padded, rows


class ShardedParam:
    """One managed parameter: shard metadata, the sharded DTensor and the unsharded view."""

    sites: list[ParamSite]
    fqn: str  # filled in at lazy init, relative to the root
    orig_size: torch.Size  # the user's (global) shape
    orig_stride: tuple[int, ...]
    unsharded_size: torch.Size  # what one all-gather rebuilds: orig_size, or the TP-local shape
    tp_spec: DTensorSpec | None  # spec of a param that already was a DTensor (TP); the unsharded param's
    shard_dim: int
    num_shards: int  # N
    padded_rows: int  # rows of one padded shard on shard_dim
    local_size: torch.Size  # this rank's real shard shape (0 rows possible)
    padded_numel: int  # numel of one padded shard (same on every rank)
    sharded_param: nn.Parameter  # DTensor; the object the optimizer holds
    unsharded_param: torch.Tensor | None  # plain leaf tensor aliasing the group's unsharded buffer
    unsharded_accumulated_grad: torch.Tensor | None  # grads kept while gradient sync is off
    sharded_state: ShardedState

    def __init__(self, param: nn.Parameter, sites: list[ParamSite], mesh_info: MeshInfo, shard_dim: int):
        if param.dim() == 0:
            raise ValueError(
                f"fully_shard cannot shard 0-d (scalar) parameter {sites[0].fqn or sites[0].name!r} of "
                f"{type(sites[0].module).__name__}: reshape it to shape (1,) or pass it in ignored_params"
            )
        self.sites = sites
        self.fqn = sites[0].fqn or sites[0].name
        self.mesh_info = mesh_info
        self.requires_grad = param.requires_grad
        self.orig_size = param.size()
        self.orig_stride = _contiguous_stride(param.shape)
        self.tp_spec = param._spec if isinstance(param, DTensor) else None
        local = param.to_local() if isinstance(param, DTensor) else param
        self.unsharded_size = local.size()
        self.shard_dim = shard_dim
        self.num_shards = mesh_info.shard_size
        self._init_shape(local, mesh_info.shard_rank)
        self._spmd_mesh, self._placements = spmd_layout(mesh_info, self.tp_spec, shard_dim, sites[0].name)
        self._grad_dp_dims = _dp_dims_of(mesh_info, self.tp_spec)
        self.unsharded_param = None
        self._own_unsharded: torch.Tensor | None = None  # Shard(d != 0) only: (D0, *rest)
        self.unsharded_accumulated_grad: torch.Tensor | None = None  # (D0, *rest) in reduce dtype, sync off
        self.sharded_state = ShardedState.SHARDED
        self.shared_with: weakref.ref | None = None  # an earlier ShardedParam of the same nn.Parameter

    def _init_shape(self, param: torch.Tensor, rank: int) -> None:
        d, n = self.shard_dim, self.num_shards
        dim_size = param.size(d)
        if d != 0 and dim_size % n != 0:
            raise NotImplementedError(
                f"shard_placement_fn returned Shard({d}) for parameter {self.fqn!r} of shape "
                f"{tuple(param.shape)}, but dim {d} (size {dim_size}) does not divide evenly over "
                f"{n} shards; return Shard(0) or a dim whose size is a multiple of {n}"
            )
        self.padded_rows, rows = shard_rows(dim_size, n)
        local = list(param.shape)
        local[d] = rows[rank]
        self.local_size = torch.Size(local)
        padded = list(param.shape)
        padded[d] = self.padded_rows
        self.padded_numel = math.prod(padded)
        self._padded_shape = torch.Size(padded)

    def __repr__(self) -> str:
        return f"ShardedParam({self.fqn!r}, {tuple(self.orig_size)}, Shard({self.shard_dim}) over {self.num_shards})"

    # ---- the sharded side -------------------------------------------------------------

    def local_chunk(self, param: torch.Tensor) -> torch.Tensor:
        """This rank's unpadded chunk of ``param`` (a plain tensor or a DTensor's local part)."""
        data = param.to_local() if isinstance(param, DTensor) else param
        start = self.mesh_info.shard_rank * self.padded_rows
        length = self.local_size[self.shard_dim]
        start = min(start, data.size(self.shard_dim))
        return data.detach().narrow(self.shard_dim, start, length)

    def shard_view(self, padded_flat: torch.Tensor) -> torch.Tensor:
        """The real (unpadded) shard as a view of its padded segment of the flat shard buffer."""
        if self.shard_dim == 0:
            return padded_flat.view(self._padded_shape)[: self.local_size[0]]
        return padded_flat.view(self.local_size)

    def placements(self) -> tuple:
        return self._placements

    def init_sharded_param(self, local_view: torch.Tensor) -> None:
        """Create the sharded DTensor parameter around ``local_view`` and register it."""
        dtensor = DTensor.from_local(
            local_view,
            self._spmd_mesh,
            self.placements(),
            run_check=False,
            shape=self.orig_size,
            stride=self.orig_stride,
        )
        self.sharded_param = nn.Parameter(dtensor, requires_grad=self.requires_grad)
        self._refresh_spec()
        self.register_sharded()

    def repoint_local(self, local_view: torch.Tensor) -> None:
        """Point the existing DTensor parameter at new storage, keeping the object's identity."""
        self.sharded_param._local_tensor = local_view
        self._refresh_spec()

    def _refresh_spec(self) -> None:
        meta = TensorMeta(self.orig_size, self.orig_stride, self.sharded_param.dtype)
        self._spec = DTensorSpec(self._spmd_mesh, self.placements(), tensor_meta=meta)

    def to_sharded_dtensor(self, local: torch.Tensor) -> DTensor:
        """Wrap a local shard-shaped tensor (a gradient) as a DTensor with our placements."""
        if local.dtype != self._spec.tensor_meta.dtype:
            meta = TensorMeta(self.orig_size, self.orig_stride, local.dtype)
            spec = DTensorSpec(self._spmd_mesh, self.placements(), tensor_meta=meta)
        else:
            spec = self._spec
        return DTensor(local, spec, requires_grad=False)

    def register_sharded(self) -> None:
        for site in self.sites:
            site.set(self.sharded_param)
        self.sharded_state = ShardedState.SHARDED

    # ---- the unsharded side -----------------------------------------------------------

    def gathered_numel(self) -> int:
        """Elements this param occupies in the all-gather output (N padded shards)."""
        return self.num_shards * self.padded_numel

    def init_unsharded_param(self, gathered: torch.Tensor) -> None:
        """Create the unsharded leaf tensor aliasing ``gathered`` (N*padded_numel, flat).

        The leaf is made with ``set_`` so it has its own version counter: refilling the
        buffer in a later unshard must not look like an in-place change to tensors autograd
        saved from it (the data really is the same parameter again).
        """
        if self.shard_dim == 0:
            source = gathered
            self._own_unsharded = None
        else:  # chunks along d != 0 are concatenated on copy-out into storage of its own
            source = torch.empty(self.unsharded_size, dtype=gathered.dtype, device=gathered.device)
            self._own_unsharded = source
        tensor = torch.empty(0, dtype=gathered.dtype, device=gathered.device)
        size = self.unsharded_size
        tensor.set_(source.untyped_storage(), source.storage_offset(), size, _contiguous_stride(size))
        if self.tp_spec is not None:  # the unsharded param is the TP DTensor again
            meta = TensorMeta(self.orig_size, self.orig_stride, tensor.dtype)
            spec = DTensorSpec(self.tp_spec.mesh, self.tp_spec.placements, tensor_meta=meta)
            tensor = DTensor(tensor, spec, requires_grad=False)
        self.unsharded_param = nn.Parameter(tensor, requires_grad=self.requires_grad)

    def finish_copy_out(self, gathered: torch.Tensor) -> None:
        """For ``Shard(d != 0)``: concatenate the gathered chunks along d into the param."""
        own = self._own_unsharded
        if own is None:
            return
        if own.untyped_storage().size() == 0:
            own.untyped_storage().resize_(own.numel() * own.element_size())
        chunks = gathered.view(self.num_shards, *self.local_size)  # (N, *local)
        torch.cat(chunks.unbind(0), dim=self.shard_dim, out=own)

    def free_own_unsharded(self) -> None:
        """Free the storage a ``Shard(d != 0)`` param owns (d == 0 params live in the group buffer)."""
        if self._own_unsharded is not None:
            self._own_unsharded.untyped_storage().resize_(0)

    def register_unsharded(self) -> None:
        for site in self.sites:
            site.set(self.unsharded_param)
        self.sharded_state = ShardedState.UNSHARDED

    def local_grad(self, grad: torch.Tensor) -> torch.Tensor:
        """The unsharded gradient as a plain tensor (a TP param's grad in its TP placements).

        Only the non-data-parallel dims are redistributed. A param on the full SPMD mesh
        (``dp_mesh_dims``) whose batch is sharded over dp gets a ``Partial()`` grad there:
        that partial sum is what our reduce-scatter sums, exactly once (redistributing it to
        the param's ``Replicate()`` first would all-reduce it and double the sum).
        """
        if not isinstance(grad, DTensor):
            return grad
        if self.tp_spec is not None:
            target = tuple(
                grad.placements[i] if i in self._grad_dp_dims else placement
                for i, placement in enumerate(self.tp_spec.placements)
            )
            if grad.placements != target:
                grad = grad.redistribute(placements=target)
        return grad.to_local()

    def grad_as_chunks(self, grad: torch.Tensor) -> torch.Tensor:
        """The unsharded gradient laid out so that chunk i along dim 0 is rank i's shard."""
        if self.shard_dim == 0:
            return grad
        d, n = self.shard_dim, self.num_shards
        return torch.stack(grad.chunk(n, dim=d))  # (N, *local)


def _contiguous_stride(shape: torch.Size) -> tuple[int, ...]:
    stride, acc = [], 1
    for size in reversed(shape):
        stride.append(acc)
        acc *= max(size, 1)
    return tuple(reversed(stride))


def spmd_layout(mesh_info: MeshInfo, param_spec: DTensorSpec | None, shard_dim: int, name: str):
    """The mesh and placements of a sharded parameter.

    Plain params: the data-parallel mesh, ``Shard(d)`` on the shard dim and ``Replicate()``
    on a replicate dim. Params already DTensors (tensor parallel) keep their placements on
    their own dims and gain the data-parallel ones: on the root mesh's (dp..., tp...) submesh
    when TP used a separate mesh, or on their own full SPMD mesh (``dp_mesh_dims``), where
    they must be ``Replicate()`` on the data-parallel dims. When TP already shards dim d, the
    dp shard of the TP-local tensor is a *strided* shard of the global one (``_StridedShard``
    with the TP split factor), so ``full_tensor()`` reassembles it exactly.
    """
    dp_mesh = mesh_info.mesh
    dp_names = dp_mesh.mesh_dim_names or ()
    if param_spec is None:
        return dp_mesh, _dp_placements(mesh_info, Shard(shard_dim))
    names = param_spec.mesh.mesh_dim_names or ()
    if set(dp_names) & set(names):  # params on the full SPMD mesh
        # Only TP dims after the dp shard dim split the tensor before the dp shard does.
        shard_name = dp_names[mesh_info.shard_mesh_dim] if mesh_info.shard_mesh_dim is not None else None
        after = names[names.index(shard_name) + 1 :] if shard_name in names else ()
        tp = [
            (n, size, pl)
            for n, size, pl in zip(names, param_spec.mesh.shape, param_spec.placements)
            if n in after and n not in dp_names
        ]
        for n, pl in zip(names, param_spec.placements):
            if n in dp_names and not isinstance(pl, Replicate):
                raise ValueError(
                    f"parameter {name!r} is {pl} on data-parallel mesh dim {n!r}; with dp_mesh_dims the "
                    "parameters must be Replicate() on the data-parallel dims"
                )
        dp = dict(zip(dp_names, _dp_placements(mesh_info, _dp_shard(shard_dim, tp))))
        return param_spec.mesh, tuple(dp.get(n, pl) for n, pl in zip(names, param_spec.placements))
    if len(dp_names) + len(names) != dp_mesh.ndim + param_spec.mesh.ndim:
        raise ValueError(
            f"fully_shard on tensor-parallel DTensor parameter {name!r} needs named mesh dims so the (dp, tp) "
            f"mesh can be formed: got dp mesh {dp_mesh} and tp mesh {param_spec.mesh}; build both from one "
            "init_device_mesh(..., mesh_dim_names=('dp', 'tp'))"
        )
    tp = list(zip(names, param_spec.mesh.shape, param_spec.placements))
    spmd_mesh = dp_mesh._get_root_mesh()[dp_names + names]
    return spmd_mesh, _dp_placements(mesh_info, _dp_shard(shard_dim, tp)) + tuple(param_spec.placements)


def _dp_dims_of(mesh_info: MeshInfo, param_spec: DTensorSpec | None) -> frozenset[int]:
    """The dims of a DTensor param's own mesh that are data-parallel dims (params on the
    full SPMD mesh); empty for plain params and TP params on a separate TP mesh."""
    if param_spec is None:
        return frozenset()
    dp_names = set(mesh_info.mesh.mesh_dim_names or ())
    names = param_spec.mesh.mesh_dim_names or ()
    return frozenset(i for i, name in enumerate(names) if name in dp_names)


def _dp_shard(shard_dim: int, tp: list[tuple]) -> Shard:
    split = 1
    for _, size, placement in tp:
        if isinstance(placement, Shard) and placement.dim == shard_dim:
            split *= size
    return _StridedShard(shard_dim, split_factor=split) if split > 1 else Shard(shard_dim)


def _dp_placements(mesh_info: MeshInfo, shard: Shard) -> tuple:
    return tuple(shard if d == mesh_info.shard_mesh_dim else Replicate() for d in range(mesh_info.mesh.ndim))
