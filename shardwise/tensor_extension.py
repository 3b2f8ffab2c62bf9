"""What a parameter's tensor type gathers, and how its unsharded tensor is rebuilt.

torch's FSDP2 lets a tensor subclass take over its parameter's all-gather (the extension
that torchao's float8 training, NF4 QLoRA, int8 and BitNet training build on)::

    inputs, metadata = shard.fsdp_pre_all_gather(mesh)                        # or
    inputs, metadata = shard.fsdp_pre_all_gather(mesh, outer_size, outer_stride, module, mp_policy)
    ...the group's one all-gather moves every param's inputs (each its own dtype)...
    tensor, inner    = shard.fsdp_post_all_gather(outputs, metadata, param_dtype)   # first unshard
    None             = shard.fsdp_post_all_gather(outputs, metadata, param_dtype, out=unsharded)

``shard`` is the sharded DTensor's local tensor *now* (the optimizer may have replaced its
attributes, e.g. float8's precomputed scale), ``outputs`` are the all-gathered inputs, each
a tensor of its own viewed as ``(-1, *input.shape[1:])``, kept across steps: their storage
(and that of the ``inner`` tensors) is freed at reshard and given back before the next
rebuild, which reuses the first unsharded tensor through ``out=``. No mixed-precision cast
is applied to such a parameter: the subclass gets ``param_dtype`` (and the policy) and
decides.

A plain tensor goes through the same interface trivially: its padded shard is its one
input (cast to ``param_dtype`` on the copy-in), its rows land in the group's unsharded
buffer and the unsharded parameter views them (:class:`PlainGather`). Sharding keeps the
type either way: a shard is what ``torch.chunk`` gives and is padded with ``new_zeros``,
``narrow`` and ``copy_`` (ops a subclass preserves); a subclass that cannot be chunked is
refused at ``fully_shard`` by name (:func:`chunk_for_rank`).

The methods are found as torch finds them, on the sharded local tensor: its type's, or
set on the instance (a plain tensor too). They are looked up when the local tensor is set
(``fully_shard``, adoption after ``to_empty`` / ``.to`` / an assigning load) and at lazy
init (:func:`gather_for`); the step calls what was found. A wrapper subclass owns no
storage: what the extension hands over is freed and restored through its inner tensors
(:func:`free_storage`, ``__tensor_flatten__``), never ``resize_`` on the wrapper.
"""

from __future__ import annotations

import abc
import dataclasses
import inspect
import types
from typing import Any, Callable, Protocol, Sequence

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from shardwise.policies import MixedPrecisionPolicy

_PRE, _POST = "fsdp_pre_all_gather", "fsdp_post_all_gather"


class GatheredParam(Protocol):
    """What a gather reads of its parameter (``param.ShardedParam``; declared here so
    imports flow one way)."""

    fqn: str
    padded_shard: torch.Tensor
    sharded_param: nn.Parameter
    unsharded_param: torch.Tensor | None
    unsharded_size: torch.Size
    orig_stride: tuple[int, ...]
    sites: list

    def finish_copy_out(self, gathered: torch.Tensor) -> None: ...
    def set_unsharded(self, tensor: torch.Tensor) -> None: ...
    def padded_shard_size(self) -> torch.Size: ...
    def shard_mesh(self) -> DeviceMesh: ...


def compute_dtype(mp_policy: MixedPrecisionPolicy, dtype: torch.dtype) -> torch.dtype:
    """The dtype a parameter of ``dtype`` computes in: ``param_dtype`` for floating-point
    params when set (torch leaves integer params as they are), else its own."""
    if mp_policy.param_dtype is None or not dtype.is_floating_point:
        return dtype
    return mp_policy.param_dtype


class ParamGather(abc.ABC):
    """What one parameter contributes to its group's all-gather and how its unsharded
    tensor is rebuilt from what came back."""

    own_outputs: bool  # False: the gathered rows land in the group's unsharded buffer

    @abc.abstractmethod
    def inputs(self, param: GatheredParam, mp_policy: MixedPrecisionPolicy, device: torch.device) -> Sequence[torch.Tensor]:
        """This step's all-gather inputs (any shape; gathered flat), in the order rebuilt."""

    @abc.abstractmethod
    def finish(self, param: GatheredParam, view: torch.Tensor | None) -> None:
        """Rebuild the unsharded parameter once its rows arrived (``view``: its segment of
        the group buffer, for a plain param)."""

    def allocate_outputs(self, numels: Sequence[int], dtypes: Sequence[torch.dtype], num_shards: int,
                         device: torch.device, param_dtype: torch.dtype) -> list[torch.Tensor]:
        """Tensors of its own that the gathered inputs land in (own_outputs only)."""
        raise NotImplementedError

    def alloc(self) -> None:
        """Give the outputs their storage back (before the copy-out)."""

    def free(self) -> None:
        """Free the outputs' and the rebuilt tensor's storage (at reshard)."""

    def reset(self) -> None:
        """Forget the outputs and rebuilt tensor (new sharded param, new layout)."""


class PlainGather(ParamGather):
    """A plain tensor: its padded shard is its one input, the group buffer its output."""

    own_outputs = False

    def inputs(self, param, mp_policy, device):
        return (param.padded_shard,)

    def finish(self, param, view):
        param.finish_copy_out(view)


PLAIN = PlainGather()


class ExtensionGather(ParamGather):
    """A tensor with ``fsdp_pre_all_gather`` / ``fsdp_post_all_gather``, on its type or set
    on the instance (resolved by :func:`gather_for`; the step asks no ``hasattr``: it calls
    the instance's bound methods, or the type's through the shard, see :class:`_Hooks`)."""

    own_outputs = True

    def __init__(self, hooks: "_Hooks"):
        self._hooks = hooks
        self._metadata: Any = None
        self._input_sizes: list[torch.Size] = []
        self._outputs: list[torch.Tensor] = []  # per input: (N*numel,) in its dtype, storage freed when sharded
        self._inner: list[torch.Tensor] = []  # what fsdp_post_all_gather said the unsharded tensor holds
        self._param_dtype: torch.dtype | None = None

    @torch.no_grad()
    def inputs(self, param, mp_policy, device):
        shard = param.sharded_param._local_tensor
        if shard.device != device:  # CPU offload: the extension sees the shard on the device, as in torch
            shard = shard.to(device, non_blocking=True)
        hooks = self._hooks
        if hooks.takes_policy:
            module = param.sites[0].module
            args = (param.shard_mesh(), param.unsharded_size, param.orig_stride, module, mp_policy)
        else:
            args = (param.shard_mesh(),)
        pre = hooks.pre if hooks.pre is not None else getattr(shard, _PRE)  # the type's: through the shard
        inputs, self._metadata = pre(*args)
        padded = param.padded_shard_size()
        if shard.size() != padded and any(t.size() != padded for t in inputs):
            raise ValueError(
                f"parameter {param.fqn!r} is sharded unevenly (shard {tuple(shard.size())}, padded "
                f"{tuple(padded)}): {hooks.owner}.{_PRE} must return all-gather inputs of the padded "
                f"shard size {tuple(padded)} so every rank gathers the same bytes, got "
                f"{[tuple(t.size()) for t in inputs]}"
            )
        self._input_sizes = [t.size() for t in inputs]
        return [t.reshape(-1) for t in inputs]

    def allocate_outputs(self, numels, dtypes, num_shards, device, param_dtype):
        self._param_dtype = param_dtype
        self._outputs = [torch.empty(num_shards * n, dtype=d, device=device) for n, d in zip(numels, dtypes)]
        for t in self._outputs:
            free_storage(t)
        return self._outputs

    def alloc(self) -> None:
        for t in self._outputs:
            alloc_storage(t)

    def free(self) -> None:
        for t in self._outputs:
            free_storage(t)
        for t in self._inner:
            free_storage(t)

    def reset(self) -> None:
        self._outputs, self._inner = [], []

    @torch.no_grad()
    def finish(self, param, view):
        outputs = tuple(t.view(-1, *size[1:]) for t, size in zip(self._outputs, self._input_sizes))
        hooks = self._hooks
        post = hooks.post if hooks.post is not None else getattr(param.sharded_param._local_tensor, _POST)
        if param.unsharded_param is None:
            tensor, inner = post(outputs, self._metadata, self._param_dtype)
            self._inner = list(inner)
            param.set_unsharded(tensor)
        else:
            for t in self._inner:
                alloc_storage(t)
            post(outputs, self._metadata, self._param_dtype, out=param.unsharded_param)
        self._metadata = None


@dataclasses.dataclass(frozen=True)
class _Hooks:
    """Where a tensor's two extension methods were found. On the instance: the bound
    methods, called as they are. On the type (``pre`` / ``post`` None): called as the
    sharded local tensor's methods at each use, as torch calls them, so the call sees the
    shard of the moment (its device copy under CPU offload, attributes the optimizer set
    since, such as float8's precomputed scale) and a method patched on the class (tests
    that count calls)."""

    pre: Callable | None  # the instance's bound fsdp_pre_all_gather, or None: the type's
    post: Callable | None  # the instance's bound fsdp_post_all_gather, or None: the type's
    takes_policy: bool  # the 5-argument fsdp_pre_all_gather
    owner: str  # for messages: the type, or "<type> instance"


def gather_for(tensor: torch.Tensor, where: str) -> ParamGather:
    """The gather of a parameter whose sharded local tensor is ``tensor``: an
    :class:`ExtensionGather` when ``tensor`` has ``fsdp_pre_all_gather`` and
    ``fsdp_post_all_gather`` (on its type or set on the instance, as torch looks them up),
    else :data:`PLAIN`.

    Called wherever a parameter's local tensor is set or may have gained methods: at
    ``fully_shard``, when ``module._apply`` (``to_empty``, ``.to``) or
    ``load_state_dict(assign=True)`` gave it new data, and at lazy init (so methods set on
    the local tensors after ``fully_shard`` / ``to_empty`` and before the first forward
    count). Whether a parameter uses the extension, and whose methods (the type's or the
    instance's), changes only at these points; the step asks nothing. After the first
    forward (torch leaves this undefined): a type's methods are called through the shard
    at each use, so one replaced on the class is used from the next all-gather; methods
    set on an instance later are not seen, and ones deleted from it keep being called,
    until the next of these points. A half-defined pair or an unknown signature fails
    here, naming the parameter."""
    has_pre, has_post = hasattr(tensor, _PRE), hasattr(tensor, _POST)
    kind = type(tensor).__qualname__
    if has_pre != has_post:
        missing = _POST if has_pre else _PRE
        raise TypeError(
            f"fully_shard: parameter {where} is a {kind} that defines {_PRE if has_pre else _POST} but not "
            f"{missing}; FSDP's all-gather extension needs both (or neither, to gather it as a plain tensor)"
        )
    if not has_pre:
        return PLAIN
    count = len(inspect.signature(getattr(tensor, _PRE)).parameters)
    if count not in (1, 5):
        raise TypeError(
            f"fully_shard: parameter {where} is a {kind} whose {_PRE} takes {count} arguments; FSDP calls "
            f"{_PRE}(mesh) or {_PRE}(mesh, outer_size, outer_stride, module, mp_policy)"
        )
    return ExtensionGather(_resolve(tensor, takes_policy=count == 5))


def _resolve(tensor: torch.Tensor, takes_policy: bool) -> _Hooks:
    """The type's methods unless the instance sets either; then the instance's, bound."""
    own = vars(tensor) if hasattr(tensor, "__dict__") else {}
    if _PRE not in own and _POST not in own:
        return _Hooks(None, None, takes_policy, type(tensor).__qualname__)
    owner = f"{type(tensor).__qualname__} instance"
    return _Hooks(getattr(tensor, _PRE), getattr(tensor, _POST), takes_policy, owner)


def carry_instance_hooks(old: torch.Tensor, new: torch.Tensor) -> None:
    """Give ``new`` (a re-padded copy that replaces the local tensor ``old``) the extension
    methods set on ``old``'s instance, re-bound to ``new`` when they were bound to ``old``:
    the methods belong to the parameter's shard, not to one tensor object of it."""
    own = vars(old) if hasattr(old, "__dict__") else {}
    for name in (_PRE, _POST):
        if name in own:
            method = own[name]
            if isinstance(method, types.MethodType) and method.__self__ is old:
                method = types.MethodType(method.__func__, new)
            setattr(new, name, method)


def chunk_for_rank(data: torch.Tensor, num_shards: int, dim: int, rank: int, where: str) -> torch.Tensor:
    """Rank ``rank``'s chunk of ``data`` as ``torch.chunk`` gives it (a subclass keeps its
    type), or an empty slice when ``torch.chunk`` returns fewer chunks."""
    try:
        chunks = torch.chunk(data, num_shards, dim=dim)
    except Exception as err:  # a subclass whose dispatch lacks aten.split / aten.slice
        raise TypeError(
            f"fully_shard cannot shard parameter {where}: its tensor type {type(data).__qualname__} does not "
            f"support torch.chunk(dim={dim}) ({type(err).__name__}: {err}). FSDP shards a parameter with "
            "torch.chunk and pads the shard with new_zeros / narrow / copy_: implement them for the type "
            f"(and {_PRE} / {_POST} to choose what is gathered), or pass the parameter in ignored_params"
        ) from err
    if rank < len(chunks):
        return chunks[rank]
    return data.narrow(dim, data.size(dim), 0) if type(data) is torch.Tensor else chunks[0].new_zeros(_empty(chunks[0], dim))


def _empty(chunk: torch.Tensor, dim: int) -> list[int]:
    shape = list(chunk.shape)
    shape[dim] = 0
    return shape


def new_padded(chunk: torch.Tensor, shape: torch.Size, dim: int, device: torch.device, pin: bool) -> torch.Tensor:
    """A zero-padded tensor of ``shape`` on ``device`` holding ``chunk``'s rows on ``dim``,
    of ``chunk``'s type (a subclass pads through ops it preserves: ``new_zeros``,
    ``narrow``, ``copy_``, ``to``, ``pin_memory``)."""
    device = chunk.device if chunk.is_meta else device
    if type(chunk) is torch.Tensor:
        padded = torch.zeros(shape, dtype=chunk.dtype, device=device)
    else:
        padded = chunk.new_zeros(shape)
        if padded.device != device:
            padded = padded.to(device)
    if pin and not padded.is_meta:
        padded = padded.pin_memory()
    if not padded.is_meta and chunk.numel() > 0:
        with torch.no_grad():
            padded.narrow(dim, 0, chunk.size(dim)).copy_(chunk)
    return padded


def alloc_storage(t: torch.Tensor) -> None:
    """Give ``t`` its bytes back (after :func:`free_storage`). A wrapper subclass has no
    storage of its own: its inner tensors (``__tensor_flatten__``) get theirs back."""
    for inner in storage_holders(t):
        size = inner.numel() * inner.element_size()
        storage = inner.untyped_storage()
        if storage.size() != size:
            storage.resize_(size)


def free_storage(t: torch.Tensor) -> None:
    """Free ``t``'s bytes, keeping the tensor (its metadata) for :func:`alloc_storage`;
    through the inner tensors of a wrapper subclass, never ``resize_`` on the wrapper."""
    for inner in storage_holders(t):
        storage = inner.untyped_storage()
        if storage.size() != 0:
            storage.resize_(0)


def storage_holders(t: torch.Tensor) -> list[torch.Tensor]:
    """The tensors that own ``t``'s bytes: ``t`` itself, or, for a traceable wrapper
    subclass (``__tensor_flatten__``, as torch's TwoTensor, float8, NF4), its inner
    tensors, recursively."""
    if type(t) is torch.Tensor or not is_traceable_wrapper_subclass(t):
        return [t]
    names, _ = t.__tensor_flatten__()
    return [leaf for name in names for leaf in storage_holders(getattr(t, name))]
