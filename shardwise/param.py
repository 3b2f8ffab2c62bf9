"""ShardedParam: one original parameter, its shard, and its unsharded view.

Layout (N = shard-group size, r = our rank in it, d = the shard dim, usually 0)::

    original        (D0, *rest)                         the user's parameter
    chunks          torch.chunk(original, N, dim=d)     rank r owns chunk r (maybe empty)
    padded shard    (ceil(D0 / N), *rest) rows          what every rank sends in the all-gather;
                                                        rows past the real chunk are padding
    gathered        (N, padded_numel)                   the all-gather output for this param
    unsharded       (D0, *rest)                         gathered[:D0 rows], a view in the group's buffer

Each param owns its padded shard: a tensor of its own storage, as FSDP2 keeps one per
parameter. The sharded ``nn.Parameter`` the optimizer holds is a DTensor whose local
tensor is the *unpadded* leading rows of that storage (storage offset 0): padding is never
visible, and a state dict's values share no storage with one another, so ``torch.save``
(which cannot pickle a DTensor whose local tensor starts inside its storage) and
safetensors take them as they are. The group copies the padded shards into the
all-gather's input (see group.py). For ``Shard(d)`` with ``d != 0`` the dim must divide
evenly; the shard is stored contiguously in the original layout and gathered chunks are
concatenated along ``d`` on copy-out.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import typing
import weakref

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

from shardwise import spmd_mesh, tensor_extension
from shardwise.mesh import MeshInfo
from shardwise.torch_names import TorchParamNames

_T = typing.TypeVar("_T")


class ShardedState(enum.Enum):
    """Which tensor is registered on the module for this parameter."""

    SHARDED = "sharded"  # the sharded DTensor parameter
    SHARDED_POST_FORWARD = "sharded_post_forward"  # a smaller shard kept after forward (int reshard)
    UNSHARDED = "unsharded"  # the plain unsharded tensor (a view into the group's buffer)


# The members as module constants, for the hot path (see ``group.TrainingState``'s); in
# definition order.
SHARDED, SHARDED_POST_FORWARD, UNSHARDED = ShardedState


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


class ShardedParam(TorchParamNames):
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
    padded_shard: torch.Tensor  # (padded_rows, *rest) on dim d; own storage, original dtype and type, host when offloaded
    gather: tensor_extension.ParamGather  # what the tensor type all-gathers and how it is rebuilt
    sharded_param: nn.Parameter  # DTensor over padded_shard's real rows; the object the optimizer holds
    unsharded_param: torch.Tensor | None  # plain leaf tensor aliasing the group's unsharded buffer
    unsharded_accumulated_grad: torch.Tensor | None  # grads kept while gradient sync is off

    def __init__(self, param: nn.Parameter, sites: list[ParamSite], mesh_info: MeshInfo, shard_dim: int):
        if param.dim() == 0:
            raise ValueError(
                f"fully_shard doesn't support scalar parameters. Change {sites[0].name} to a 1D tensor with "
                f"numel equal to 1. {sites[0].fqn or sites[0].name!r} of {type(sites[0].module).__name__} is 0-d: "
                "reshape it to shape (1,) or pass it in ignored_params"
            )
        self.sites = sites
        self.fqn = sites[0].fqn or sites[0].name
        self.mesh_info = mesh_info
        self.requires_grad = param.requires_grad
        self.orig_size = param.size()
        self.orig_stride = _contiguous_stride(param.shape)
        self.tp_spec = param._spec if isinstance(param, DTensor) else None
        local = param._local_tensor if isinstance(param, DTensor) else param
        self.gather = tensor_extension.gather_for(local, self._where())
        self.unsharded_size = local.size()
        self.shard_dim = shard_dim
        if shard_dim != 0 and self.gather.own_outputs:
            raise NotImplementedError(
                f"shard_placement_fn returned Shard({shard_dim}) for parameter {self._where()}, a "
                f"{type(local).__qualname__} that gathers through fsdp_pre_all_gather: shardwise rebuilds such "
                "a parameter from Shard(0) only; return Shard(0) for it"
            )
        self.num_shards = mesh_info.shard_size
        self._init_shape(local, mesh_info.shard_rank)
        self._spmd_mesh, self._placements = spmd_mesh.spmd_layout(mesh_info, self.tp_spec, shard_dim, self.fqn)
        self._grad_dp_dims = spmd_mesh.grad_dp_dims(mesh_info, self.tp_spec)
        self.unsharded_param = None
        self._own_unsharded: torch.Tensor | None = None  # Shard(d != 0) only: (D0, *rest)
        self.unsharded_accumulated_grad: torch.Tensor | None = None  # (D0, *rest) in reduce dtype, sync off
        self.shared_with: weakref.ref | None = None  # an earlier ShardedParam of the same nn.Parameter

    def _init_shape(self, param: torch.Tensor, rank: int) -> None:
        d, n = self.shard_dim, self.num_shards
        dim_size = param.size(d)
        if d != 0 and dim_size % n != 0:
            raise NotImplementedError(
                f"FSDP does not support uneven sharding on dim {d}: shard_placement_fn returned Shard({d}) "
                f"for parameter {self.fqn!r} of shape "
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
        """This rank's unpadded chunk of ``param`` (a plain tensor or a DTensor's local part),
        as ``torch.chunk`` gives it: a tensor subclass keeps its type."""
        data = param._local_tensor if isinstance(param, DTensor) else param
        return tensor_extension.chunk_for_rank(
            data.detach(), self.num_shards, self.shard_dim, self.mesh_info.shard_rank, self._where()
        )

    def _where(self) -> str:
        site = self.sites[0]
        return f"{self.fqn!r} of {type(site.module).__name__}"

    def shard_mesh(self):
        """The mesh dim this param is sharded over (the extension's ``mesh`` argument)."""
        return self.mesh_info.shard_mesh

    def padded_shard_size(self) -> torch.Size:
        return self._padded_shape

    def shard_view(self, padded_flat: torch.Tensor) -> torch.Tensor:
        """The real (unpadded) rows of a padded segment (a reduced gradient buffer), as a view."""
        if self.shard_dim == 0 and self.local_size[0] != self.padded_rows:
            return padded_flat.view(self._padded_shape)[: self.local_size[0]]
        return padded_flat.view(self.local_size)  # no padding rows: the segment is the shard

    def placements(self) -> tuple:
        return self._placements

    def init_sharded_param(self, chunk: torch.Tensor, device: torch.device, pin_memory: bool) -> None:
        """Copy this rank's unpadded ``chunk`` into a new padded shard on ``device`` (meta
        stays meta), wrap its real rows as the sharded DTensor parameter and register it."""
        self.padded_shard = self._new_padded_shard(chunk, device, pin_memory)
        # Not DTensor.from_local: it moves a host tensor to the mesh's device, and an
        # offloaded param's local tensor must stay the (pinned host) padded shard itself.
        dtensor = DTensor(self._real_rows(), self._sharded_spec(chunk.dtype), requires_grad=False)
        self.sharded_param = nn.Parameter(dtensor, requires_grad=self.requires_grad)
        self.resolve_gather()
        self._refresh_spec()
        self.register_sharded()

    def _new_padded_shard(self, chunk: torch.Tensor, device: torch.device, pin_memory: bool) -> torch.Tensor:
        """A zero-padded ``(padded_rows, *rest)`` tensor of its own (and ``chunk``'s type)
        holding ``chunk``'s rows."""
        return tensor_extension.new_padded(chunk, self._padded_shape, self.shard_dim, device, pin_memory)

    def _real_rows(self) -> torch.Tensor:
        """The padded shard's real rows: the DTensor's local tensor (storage offset 0)."""
        return self.padded_shard.narrow(self.shard_dim, 0, self.local_size[self.shard_dim])

    def adopt(self, param: nn.Parameter, device: torch.device, pin_memory: bool) -> None:
        """Make ``param`` (what the module holds now) the sharded parameter, its local tensor
        the shard storage: after ``module._apply`` (``.to(dtype)``, ``to_empty``: the same
        object, new data) or ``load_state_dict(assign=True)`` (a new object, adopted as the
        parameter, as FSDP2 does).

        A local tensor that already is a padded shard of its own (storage offset 0, exactly
        the padded bytes, on ``device``) is kept as is; any other is copied into a new
        zero-padded shard. The parameter is registered on every site (tied weights again
        share the first site's). Raises when ``param`` is not a DTensor laid out like ours.
        """
        self.check_adoptable(param)
        local = param._local_tensor
        if self._is_padded_shard(local, device, pin_memory):  # kept: the same object, as torch keeps it
            self.padded_shard = local
        else:
            if self._owns_padded_storage(local, device, pin_memory):
                padded = local.new_empty(0).set_(local.untyped_storage(), 0, self._padded_shape)
            else:
                padded = self._new_padded_shard(local, device, pin_memory)
            self.padded_shard = padded
            param._local_tensor = self._real_rows()
            tensor_extension.carry_instance_hooks(local, param._local_tensor)
        self.sharded_param = param
        self.resolve_gather()
        self._refresh_spec()
        self.register_sharded()

    def resolve_gather(self) -> bool:
        """Choose the gather from the sharded local tensor as it is now (its type's or its
        instance's extension methods, :func:`tensor_extension.gather_for`). Returns whether
        the group must lay out again: an extension gather before or after (a new one owns no
        outputs yet), the plain one both times being the one case that changes nothing."""
        was = self.gather.own_outputs
        self.gather = tensor_extension.gather_for(self.sharded_param._local_tensor, self._where())
        return was or self.gather.own_outputs

    def _is_padded_shard(self, local: torch.Tensor, device: torch.device, pin_memory: bool) -> bool:
        """Whether ``local`` can stay the local tensor and be the padded shard itself: no
        padding rows, on ``device`` (pinned when asked), contiguous, and for a plain tensor
        the sole user of its storage from offset 0 (a wrapper subclass's bytes are its inner
        tensors')."""
        if local.is_meta or local.size() != self._padded_shape or not local.is_contiguous():
            return False
        if type(local) is torch.Tensor:
            return self._owns_padded_storage(local, device, pin_memory)
        return local.device == device and (not pin_memory or local.is_pinned())

    def _owns_padded_storage(self, local: torch.Tensor, device: torch.device, pin_memory: bool) -> bool:
        if local.is_meta or type(local) is not torch.Tensor:  # a subclass is padded again, as torch does
            return False
        return (
            local.device == device
            and local.storage_offset() == 0
            and local.is_contiguous()
            and local.untyped_storage().nbytes() == self.padded_numel * local.element_size()
            and (not pin_memory or local.is_pinned())
        )

    def check_adoptable(self, param: torch.Tensor) -> None:
        """Raise, naming the parameter, unless ``param`` is a DTensor laid out as ours (mesh,
        placements, global and local shape): what :meth:`adopt` can take as this param."""
        where = f"parameter {self.fqn!r} (managed by fully_shard)"
        if not isinstance(param, DTensor):
            raise ValueError(
                f"{where} was replaced by a plain {type(param).__name__} of shape {tuple(param.shape)}: "
                "a parameter assigned after fully_shard (or by load_state_dict(assign=True)) must be a DTensor "
                "sharded as the one it replaces (model.state_dict()'s, or computed from sharded parameters); "
                "load a full state dict with torch.distributed.checkpoint.state_dict.set_model_state_dict(..., "
                "StateDictOptions(full_state_dict=True)) or without assign=True"
            )
        if param._spec.mesh != self._spmd_mesh or tuple(param.placements) != tuple(self.placements()):
            raise ValueError(
                f"{where} was assigned a DTensor with placements {param.placements} on {param._spec.mesh}; "
                f"fully_shard holds it as {self.placements()} on {self._spmd_mesh}: redistribute it first "
                "or load without assign=True"
            )
        if param.shape != self.orig_size or param._local_tensor.shape != self.local_size:
            raise ValueError(
                f"{where} was assigned a DTensor of shape {tuple(param.shape)} (local "
                f"{tuple(param._local_tensor.shape)}); expected {tuple(self.orig_size)} (local {tuple(self.local_size)})"
            )

    def _sharded_spec(self, dtype: torch.dtype) -> DTensorSpec:
        """The DTensor spec of our sharded param (or a grad) in ``dtype``."""
        meta = TensorMeta(self.orig_size, self.orig_stride, dtype)
        return DTensorSpec(self._spmd_mesh, self.placements(), tensor_meta=meta)

    def _refresh_spec(self) -> None:
        """The spec our grads carry: the sharded param's own spec object when it says what
        ours would (as FSDP2's grads share it). DTensor's sharding-propagation cache compares
        an op's specs by identity first: ``param.add_(grad)`` with one spec object on both
        sides skips a field-by-field ``DTensorSpec.__eq__`` per parameter and optimizer step."""
        expected = self._sharded_spec(self.sharded_param.dtype)
        own = self.sharded_param._spec
        self._spec = own if own == expected else expected
        self._spec_dtype = self._spec.tensor_meta.dtype

    def accumulate_grad(self, local: torch.Tensor) -> None:
        """Store ``local`` (our rank's reduced gradient shard, on the sharded param's device) as
        the sharded param's DTensor ``.grad`` with our placements, or add it to the ``.grad``
        there is; then run the post-accumulate-grad hooks a user registered on the sharded param.

        The sharded param is no autograd leaf of the backward (the unsharded one is), so
        those hooks (an optimizer step per parameter) run here, once its reduced gradient
        is in ``.grad``, as torch's FSDP2 runs them. Every tensor has the hooks' slot (None
        until a hook is registered). The reducer calls this through :func:`with_grad_access`.
        """
        sharded = self.sharded_param
        grad = sharded.grad
        if grad is not None:
            grad._local_tensor.add_(local)
        else:
            spec = self._spec if local.dtype == self._spec_dtype else self._sharded_spec(local.dtype)
            # DTensor's own __new__ (C++) sets the local tensor and spec; DTensor.__init__
            # does nothing in eager mode (it only intercepts torch.export) and costs more
            # than the construction itself behind its two wrappers: one per param and step.
            sharded.grad = DTensor.__new__(DTensor, local, spec, requires_grad=False)
        hooks = sharded._post_accumulate_grad_hooks
        if hooks:
            for hook in hooks.values():
                hook(sharded)

    def register_sharded(self) -> None:
        """Every site holds the sharded parameter (a group swaps all its params in one loop
        instead: ``ParamGroup._free_unsharded``)."""
        for site in self.sites:
            site.set(self.sharded_param)

    @property
    def sharded_state(self) -> ShardedState:
        """Which tensor the modules hold (read from the first site, which every swap writes):
        UNSHARDED while the unsharded tensor is registered, else SHARDED."""
        site = self.sites[0]
        held = site.module._parameters.get(site.name)
        return UNSHARDED if held is not None and held is self.unsharded_param else SHARDED

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
        self._register_unsharded_tensor(tensor)

    def set_unsharded(self, tensor: torch.Tensor) -> None:
        """Make ``tensor`` (what a tensor subclass's ``fsdp_post_all_gather`` rebuilt) the
        unsharded parameter, viewed in the unsharded shape as torch does."""
        size = self.unsharded_size
        self._register_unsharded_tensor(torch.as_strided(tensor, size, _contiguous_stride(size), 0))

    def _register_unsharded_tensor(self, tensor: torch.Tensor) -> None:
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


def with_grad_access(params: typing.Sequence[ShardedParam], fn: typing.Callable[..., _T], *args: typing.Any) -> _T:
    """``fn(*args)``, which reads and writes many ``.grad``s of ``params`` (their unsharded
    params' and their sharded DTensors'), without the ``__torch_function__`` lookup of each
    access, unless a sharded param has a post-accumulate-grad hook.

    A ``.grad`` read or write of a tensor that is not exactly ``torch.Tensor`` (an
    ``nn.Parameter``, a DTensor) first looks its type up for ``__torch_function__``: about
    0.25 µs on CPU, five times per param in a hand-over. Both types disable theirs, so
    ``DisableTorchFunctionSubclass`` skips the lookup and changes nothing else. Hooks are
    user code and run with torch functions on: with any, ``fn`` runs without the context.
    """
    with torch._C.DisableTorchFunctionSubclass():
        if not any_post_accumulate_grad_hook(params):
            return fn(*args)
    return fn(*args)


def any_post_accumulate_grad_hook(params: typing.Iterable[ShardedParam]) -> bool:
    """Whether a post-accumulate-grad hook is registered on any of ``params``' sharded params."""
    for p in params:
        if p.sharded_param._post_accumulate_grad_hooks:
            return True
    return False
