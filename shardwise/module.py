"""FSDPModule: the verbs and knobs a sharded module gains, plus the small public helpers.

``fully_shard`` swaps a module's class for a generated ``FSDP<Orig>`` that derives from
:class:`FSDPModule` and the original class, so ``isinstance(m, FSDPModule)`` and
``isinstance(m, Orig)`` both hold. Every method here delegates to the module's
:class:`~shardwise.state.ModuleState` and its :class:`~shardwise.group.ParamGroup` objects (one per mesh).
"""

from __future__ import annotations

import functools
import inspect
import warnings
from typing import Any, Callable, NoReturn

import torch
import torch.distributed as dist
import torch.nn as nn

from shardwise.collectives import AllGather, DefaultAllGather, DefaultReduceScatter, ReduceScatter
from shardwise.dynamo_compat import bind_untraced
from shardwise.errors import UnsupportedOperationError
from shardwise.group import ParamGroup
from shardwise.state import ModuleState, get_state

__all__ = ["FSDPModule", "UnshardHandle", "register_fsdp_forward_method", "share_comm_ctx"]


class UnshardHandle:
    """Returned by ``unshard(async_op=True)``; ``wait()`` finishes the all-gathers of the
    module's groups (one per mesh; idempotent)."""

    def __init__(self, groups: tuple[ParamGroup, ...]):
        self._groups = groups

    def wait(self) -> None:
        for group in self._groups:
            group.wait_for_unshard()
        self._groups = ()


class FSDPModule:
    """Mixin of every module ``fully_shard`` was applied to."""

    _orig_cls_mro_index = 2  # MRO: [FSDP<Orig>, FSDPModule, Orig, ...]

    def __new__(cls, *args: Any, **kwargs: Any):
        # Containers build new instances of their own class (``ModuleList[1:]``): those must
        # be plain ``Orig`` modules, not FSDP ones without state.
        orig_cls = cls.__mro__[cls._orig_cls_mro_index]
        self = orig_cls.__new__(orig_cls, *args, **kwargs)
        self.__init__(*args, **kwargs)
        return self

    def __deepcopy__(self, memo: dict) -> NoReturn:
        raise UnsupportedOperationError(
            f"FSDP does not support deepcopy: cannot deepcopy {type(self).__name__}: it is sharded by "
            "shardwise.fully_shard and its parameters are views into communication buffers; deepcopy the model "
            "before fully_shard, or build a new one and load a state dict"
        )

    def _shardwise_state(self) -> ModuleState:
        state = get_state(self)
        if state is None:
            raise RuntimeError(f"{type(self).__name__} has no shardwise state; was fully_shard applied to it?")
        return state

    def _groups(self) -> tuple[ParamGroup, ...]:
        """This call's groups: one per mesh its params resolved to (usually one)."""
        return self._shardwise_state().groups

    def _single_group_setter(self, setter: str) -> tuple[ParamGroup, ...]:
        """The groups a per-call comm or hook applies to: refused with several groups, as torch
        (its words: the setting would be ambiguous across groups with different meshes)."""
        groups = self._groups()
        if len(groups) > 1:
            raise ValueError(
                f"{setter} is not supported with multiple param groups (from per-param mesh via "
                f"shard_placement_fn): {type(self).__name__} has {len(groups)}, on meshes "
                f"{[str(g.mesh_info.mesh) for g in groups]}. The setting would be ambiguous across groups "
                "with different meshes."
            )
        return groups

    def _states(self, recurse: bool) -> list[ModuleState]:
        if not recurse:
            return [self._shardwise_state()]
        seen: dict[int, ModuleState] = {}
        for module in self.modules():
            state = get_state(module)
            if state is not None:
                seen.setdefault(id(state), state)
        return list(seen.values())

    # ---- unshard / reshard ------------------------------------------------------------

    def reshard(self) -> None:
        """Free the unsharded parameters and register the sharded ones. Not recursive."""
        for group in self._groups():
            group.reshard()

    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """All-gather this module's parameters (following ``param_dtype``). Not recursive.

        Args:
            async_op: if True, return an :class:`UnshardHandle` to ``wait()`` on; the module's
                next pre-forward/pre-backward waits for it anyway. If False, wait here and
                return None.
        """
        groups = self._groups()
        for group in groups:
            group.unshard(async_op=True)
        handle = UnshardHandle(groups)
        if async_op:
            return handle
        handle.wait()
        return None

    # ---- knobs ----------------------------------------------------------------------

    def _groups_of(self, recurse: bool) -> list[ParamGroup]:
        return [group for state in self._states(recurse) for group in state.groups]

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        """Whether to free the unsharded params after forward (re-gathered in backward).

        Use it to make the root reshard too, or to keep params gathered during evaluation.
        """
        if not isinstance(reshard_after_forward, bool):
            raise ValueError(f"reshard_after_forward should be a bool, got {type(reshard_after_forward).__name__}")
        for state in self._states(recurse):
            state.reshard_after_forward = reshard_after_forward
            for group in state.groups:
                group.reshard_after_forward = reshard_after_forward

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        """Whether to free the unsharded params after backward; False saves the next forward's
        all-gather during gradient accumulation, at the cost of memory."""
        _check_bool("reshard_after_backward", reshard_after_backward)
        for group in self._groups_of(recurse):
            group.reshard_after_backward = reshard_after_backward

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """Whether backward reduces gradients. False accumulates unsharded gradients locally
        (no communication) until a backward with sync on (FSDP1's ``no_sync``). For HSDP this
        controls the reduce-scatter and the all-reduce together."""
        _check_bool("requires_gradient_sync", requires_gradient_sync)
        for group in self._groups_of(recurse):
            group.reducer.requires_gradient_sync = requires_gradient_sync

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """HSDP: whether backward all-reduces over the replicate dim. False keeps reduce-scattering
        and accumulates the shard locally until a backward that all-reduces."""
        _check_bool("requires_all_reduce", requires_all_reduce)
        for group in self._groups_of(recurse):
            group.reducer.requires_all_reduce = requires_all_reduce

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """Whether the next backward is the last of the step: only then does the end of backward
        wait for every reduction (microbatching leaves them in flight otherwise)."""
        _check_bool("is_last_backward", is_last_backward)
        state = self._shardwise_state()
        state.lazy_init()
        state.ctx.is_last_backward = is_last_backward

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """Whether backward needs this module's params gathered (False for e.g. embeddings)."""
        _check_bool("unshard_in_backward", unshard_in_backward)
        for group in self._groups():
            group.unshard_in_backward = unshard_in_backward

    def set_modules_to_forward_prefetch(self, modules: list["FSDPModule"]) -> None:
        """In this module's pre-forward, start the all-gathers of ``modules`` (explicit prefetch)."""
        self._shardwise_state().forward_prefetch = _states_of(modules, "set_modules_to_forward_prefetch")

    def set_modules_to_backward_prefetch(self, modules: list["FSDPModule"]) -> None:
        """In this module's pre-backward, start the all-gathers of ``modules`` (replaces the
        implicit reverse-forward-order prefetch)."""
        self._shardwise_state().backward_prefetch = _states_of(modules, "set_modules_to_backward_prefetch")

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide reduced gradients by ``factor`` instead of the data-parallel world size.

        Works on every backend: shardwise sums and scales itself (gloo has no PREMUL_SUM).
        """
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor > 0:
            raise ValueError(f"set_gradient_divide_factor expects a positive number, got {factor!r}")
        for group in self._groups():
            group.reducer.divide_factor = float(factor)

    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        """Deprecated alias of :meth:`set_gradient_divide_factor`."""
        warnings.warn(
            "set_reduce_scatter_divide_factor is deprecated; use set_gradient_divide_factor",
            FutureWarning,
            stacklevel=2,
        )
        self.set_gradient_divide_factor(factor)

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """Use only SUM collectives, scaling separately; gradients stay the mean (or / the divide
        factor). shardwise's collectives are always SUMs, so numerics never change."""
        _check_bool("enable", enable)
        for group in self._groups():
            group.reducer.force_sum = enable

    def set_reduce_scatter_unused_params(self, reduce_scatter_unused_params: bool, *, recurse: bool = True) -> None:
        """Reduce zeros for params that got no gradient, so ranks whose control flow used
        different params still issue identical reduce-scatters (DDP's find_unused_parameters)."""
        _check_bool("reduce_scatter_unused_params", reduce_scatter_unused_params)
        for group in self._groups_of(recurse):
            group.reducer.reduce_scatter_unused_params = reduce_scatter_unused_params

    def set_reduce_scatter_max_input_buffers(self, max_input_buffers: int, *, recurse: bool = True) -> None:
        """How many packed gradient buffers may be in flight at once (memory vs overlap).

        A scheduling knob that never changes numerics; shardwise bounds in-flight reductions
        to one per group plus the next group's anyway.
        """
        if isinstance(max_input_buffers, bool) or not isinstance(max_input_buffers, int):
            raise TypeError(f"max_input_buffers must be an int, got {type(max_input_buffers).__name__}")
        if max_input_buffers < 1:
            raise ValueError(f"max_input_buffers must be a positive int, got {max_input_buffers}")
        for group in self._groups_of(recurse):
            group.reducer.max_input_buffers = max_input_buffers

    def set_separate_reduce_scatter_group(self, enable: bool = True, *, recurse: bool = True) -> None:
        """Run reduce-scatters on a process group of their own so they can progress while
        all-gathers run (collective: call it the same way on every rank)."""
        _check_bool("enable", enable)
        created: dict[tuple[int, ...], object] = {}
        for group in self._groups_of(recurse):
            group.reducer.reduce_scatter_group = _separate_group(group, created) if enable else None

    def set_custom_all_gather(self, comm: AllGather) -> None:
        """Replace the all-gather: ``comm.allocate(size, dtype=, device=)`` makes the output and
        ``comm(output, input, group, async_op)`` runs it."""
        _check_comm(comm, AllGather, "set_custom_all_gather")
        # overrides process-group allocation, as torch's does
        for group in self._single_group_setter("set_custom_all_gather"):
            group.all_gather_comm = comm

    def set_custom_reduce_scatter(self, comm: ReduceScatter) -> None:
        """Replace the reduce-scatter: ``comm.allocate(...)`` makes the output and
        ``comm(output, input, group, op, async_op)`` runs it (op is always SUM)."""
        _check_comm(comm, ReduceScatter, "set_custom_reduce_scatter")
        # overrides process-group allocation, as torch's does
        for group in self._single_group_setter("set_custom_reduce_scatter"):
            group.reducer.reduce_scatter_comm = comm

    def set_all_reduce_hook(self, hook: Callable[[torch.Tensor], None], *, stream: Any = None) -> None:
        """Call ``hook(reduced)`` on each group's reduced gradient shard (after the HSDP
        all-reduce and the averaging), before it is stored in ``.grad``.

        ``stream``: the hook runs with it as the current stream (a stream of the group's
        device: ``torch.cuda.Stream``, ``torch.cpu.Stream`` or ``torch.Stream``). As in torch,
        it cannot be set on a native HSDP mesh (a 2-D mesh that shards and replicates).
        """
        if not callable(hook):
            raise TypeError(f"set_all_reduce_hook expects a callable, got {type(hook).__name__}")
        for group in self._single_group_setter("set_all_reduce_hook"):
            info = group.mesh_info
            if stream is not None and info.shard_mesh_dim is not None and info.replicate_mesh_dim is not None:
                raise ValueError("stream cannot be set when using native HSDP")  # torch's words, exactly
            group.reducer.all_reduce_hook = hook
            group.reducer.all_reduce_hook_stream = stream

    def set_post_optim_event(self, event: Any) -> None:
        """The event the next all-gather waits on (recorded after the optimizer step). On CUDA
        this avoids a false dependency on the whole current stream; on CPU the optimizer step
        has finished when this returns, so the event is only waited on. ``None`` (what
        ``current_stream().record_event()`` gives on CPU) means nothing to wait on."""
        if event is not None and not hasattr(event, "wait"):
            raise TypeError(f"set_post_optim_event expects a torch.Event or None, got {type(event).__name__}")
        for group in self._groups_of(recurse=True):
            group.post_optim_event = event

    def set_allocate_memory_from_process_group_for_comm(self, enable: bool) -> None:
        """Let the ProcessGroup allocate the staging buffers (NCCL zero-copy). On gloo there is no
        such allocator: the flag is accepted and buffers come from torch as usual.

        As torch's: a custom all-gather/reduce-scatter set afterwards overrides it; set before,
        it makes this call raise ``AssertionError``."""
        _check_bool("enable", enable)
        for group in self._groups():
            _check_no_custom_comm(group, "set_allocate_memory_from_process_group_for_comm")
            group.allocate_from_process_group = enable

    def set_symm_mem_for_comm(self, backend: str = "NCCL") -> None:
        """Allocate all-gather buffers in symmetric memory (NCCL only)."""
        if backend != "NCCL":
            raise ValueError(f"set_symm_mem_for_comm supports only backend='NCCL', got {backend!r}")
        for group in self._groups():
            pg = group.mesh_info.shard_group
            if pg is None or dist.get_backend(pg) != "nccl":
                raise RuntimeError(
                    f"set_symm_mem_for_comm needs an NCCL process group; {group.fqn or 'this module'} "
                    f"communicates over {dist.get_backend(pg) if pg is not None else 'no group'}"
                )
            _check_no_custom_comm(group, "set_symm_mem_for_comm")
            group.symm_mem = True

    def _set_unshard_async_op(self, async_op: bool) -> None:
        """torch's semi-private knob (recursive). shardwise always issues unshards async and waits
        at the named points, so this only records the choice."""
        _check_bool("async_op", async_op)
        for state in self._states(recurse=True):
            state.unshard_async_op = async_op

    def reset_iter_state(self) -> None:
        """Recover after an exception aborted forward/backward: waits for in-flight collectives,
        reshards everything, clears per-iteration state (that iteration's grads are lost).
        Call it on the root module; a non-root raises RuntimeError."""
        self._shardwise_state().reset_iter_state()

    # ---- torch compatibility ----------------------------------------------------------

    def _apply(self, *args: Any, **kwargs: Any) -> Any:
        # ``.to(dtype)`` / ``to_empty`` swap the sharded DTensor params' data in place
        # (identity kept); the group adopts the new data as its padded shards on its next
        # use, once every member of a grouped call is converted (see reset_sharded_params).
        groups = self._groups()
        for group in groups:
            group.reshard()
        result = super()._apply(*args, **kwargs)
        for group in groups:
            group.reset_sharded_params()
        return result


def _check_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}: {value!r}")


def _state_of(module: object, setter: str) -> ModuleState:
    state = get_state(module) if isinstance(module, nn.Module) else None
    if not isinstance(module, FSDPModule) or state is None:
        raise ValueError(f"{setter} expects a list of FSDPModules (fully_shard applied), got {type(module).__name__}")
    return state


def _states_of(modules: object, setter: str) -> list[ModuleState]:
    if not isinstance(modules, (list, tuple)):
        raise ValueError(f"{setter} expects a list of FSDPModules, got {type(modules).__name__}")
    return [_state_of(m, setter) for m in modules]


def _check_comm(comm: object, interface: type, setter: str) -> None:
    if not callable(comm) or not callable(getattr(comm, "allocate", None)):
        raise TypeError(
            f"{setter} expects a shardwise.collectives.{interface.__name__} (with allocate() and __call__()), "
            f"got {type(comm).__name__}"
        )


def _has_custom_comm(group: ParamGroup) -> bool:
    return not isinstance(group.all_gather_comm, DefaultAllGather) or not isinstance(
        group.reducer.reduce_scatter_comm, DefaultReduceScatter
    )


def _check_no_custom_comm(group: ParamGroup, setter: str) -> None:
    """torch raises ``AssertionError`` here (its phrase: "when ... comm is custom")."""
    if _has_custom_comm(group):
        comm = group.all_gather_comm
        if isinstance(comm, DefaultAllGather):
            comm = group.reducer.reduce_scatter_comm
        raise AssertionError(
            f"cannot call {setter}() when all gather or reduce scatter comm is custom: "
            f"{type(comm).__name__} on {group.fqn or 'this module'}; call {setter} before "
            "set_custom_all_gather / set_custom_reduce_scatter (the custom comm then overrides it)"
        )


def _separate_group(group: ParamGroup, created: dict) -> dist.ProcessGroup:
    """One group per distinct set of shard ranks; a group that already has one keeps it
    (enabling twice creates nothing new)."""
    ranks = tuple(dist.get_process_group_ranks(group.mesh_info.shard_group))
    if ranks not in created:
        existing = group.reducer.reduce_scatter_group
        created[ranks] = existing or dist.new_group(list(ranks), use_local_synchronization=True)
    return created[ranks]


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """Run ``module.<method_name>`` with the same unshard/reshard hooks as ``forward``.

    For methods such as ``generate`` or ``forward_features`` that call submodules directly.
    A no-op for modules that fully_shard was not applied to.

    Under ``torch.compile`` the hooks run eagerly and the method's body is compiled: the
    wrapper is a frame Dynamo skips (:func:`~shardwise.dynamo_compat.bind_untraced`), so
    entering it costs no graph break, and a root method whose body calls no other sharded
    module compiles with ``fullgraph=True``.
    """
    if not isinstance(module, FSDPModule):
        return
    if not hasattr(module, method_name):
        raise ValueError(f"{type(module).__name__} does not have a method {method_name!r}")
    method = getattr(module, method_name)
    state = get_state(module)

    def with_hooks(_bound_to: nn.Module, *args: Any, **kwargs: Any) -> Any:
        # `module`, not `_bound_to` (they differ only in a deepcopy, which rebinds): the
        # state and the method belong to `module`.
        args, kwargs = state.pre_forward_hook(module, args, kwargs)
        output = method(*args, **kwargs)
        return state.post_forward_hook(module, args, kwargs, output)

    functools.update_wrapper(with_hooks, method)
    # inspect.signature of the bound wrapper drops `self`: give it the method's parameters.
    signature = inspect.signature(method)
    self_param = inspect.Parameter("_bound_to", inspect.Parameter.POSITIONAL_ONLY)
    with_hooks.__signature__ = signature.replace(parameters=[self_param, *signature.parameters.values()])
    setattr(module, method_name, bind_untraced(with_hooks, module))


def share_comm_ctx(modules: list[FSDPModule]) -> None:
    """Let several roots share communication resources (streams). On CPU nothing is shared;
    the call validates its arguments so code written for GPUs runs unchanged."""
    if not isinstance(modules, (list, tuple)):
        raise ValueError(f"share_comm_ctx expects a list of FSDPModules, got {type(modules).__name__}")
    for module in modules:
        _state_of(module, "share_comm_ctx")
