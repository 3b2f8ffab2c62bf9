"""FSDPModule: the verbs and knobs a sharded module gains, plus the small public helpers.

``fully_shard`` swaps a module's class for a generated ``FSDP<Orig>`` that derives from
:class:`FSDPModule` and the original class, so ``isinstance(m, FSDPModule)`` and
``isinstance(m, Orig)`` both hold. Every method here delegates to the module's
:class:`~shardwise.state.ModuleState` and its :class:`~shardwise.group.ParamGroup`.
"""

from __future__ import annotations

import functools
from typing import Any, NoReturn

import torch.nn as nn

from shardwise.group import ParamGroup
from shardwise.state import ModuleState, get_state

__all__ = ["FSDPModule", "UnshardHandle", "register_fsdp_forward_method", "share_comm_ctx"]


class UnshardHandle:
    """Returned by ``unshard(async_op=True)``; ``wait()`` finishes the all-gather (idempotent)."""

    def __init__(self, group: ParamGroup | None):
        self._group = group

    def wait(self) -> None:
        if self._group is not None:
            self._group.wait_for_unshard()
            self._group = None


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
        raise RuntimeError(
            f"cannot deepcopy {type(self).__name__}: it is sharded by shardwise.fully_shard and its "
            "parameters are views into communication buffers; deepcopy the model before fully_shard, "
            "or build a new one and load a state dict"
        )

    def _shardwise_state(self) -> ModuleState:
        state = get_state(self)
        if state is None:
            raise RuntimeError(f"{type(self).__name__} has no shardwise state; was fully_shard applied to it?")
        return state

    def _groups(self) -> list[ParamGroup]:
        group = self._shardwise_state().group
        return [] if group is None else [group]

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
        handle = UnshardHandle(groups[0] if groups else None)
        if async_op:
            return handle
        handle.wait()
        return None

    # ---- knobs ------------------------------------------------------------------------

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        """Whether to free the unsharded params after forward (re-gathered in backward)."""
        _check_bool("reshard_after_forward", reshard_after_forward)
        for state in self._states(recurse):
            state.reshard_after_forward = reshard_after_forward
            if state.group is not None:
                state.group.reshard_after_forward = reshard_after_forward

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        """Whether to free the unsharded params after backward (False keeps them for the next forward)."""
        _check_bool("reshard_after_backward", reshard_after_backward)
        for state in self._states(recurse):
            if state.group is not None:
                state.group.reshard_after_backward = reshard_after_backward

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide reduced gradients by ``factor`` instead of the data-parallel world size."""
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or factor <= 0:
            raise ValueError(f"set_gradient_divide_factor expects a positive number, got {factor!r}")
        for state in self._states(recurse=True):
            if state.group is not None:
                state.group.gradient_divide_factor = float(factor)

    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        """Alias of :meth:`set_gradient_divide_factor` kept for torch compatibility."""
        self.set_gradient_divide_factor(factor)

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """Reduce with a plain SUM (no division at all)."""
        _check_bool("enable", enable)
        for state in self._states(recurse=True):
            if state.group is not None:
                state.group.force_sum_reduction = enable

    def set_modules_to_forward_prefetch(self, modules: list["FSDPModule"]) -> None:
        """In this module's pre-forward, start the all-gathers of ``modules`` (explicit prefetch)."""
        self._shardwise_state().forward_prefetch = [_state_of(m, "set_modules_to_forward_prefetch") for m in modules]

    def set_modules_to_backward_prefetch(self, modules: list["FSDPModule"]) -> None:
        """In this module's pre-backward, start the all-gathers of ``modules`` (replaces the implicit one)."""
        states = [_state_of(m, "set_modules_to_backward_prefetch") for m in modules]
        self._shardwise_state().backward_prefetch = states

    # ---- torch compatibility ----------------------------------------------------------

    def _apply(self, *args: Any, **kwargs: Any) -> Any:
        # ``.to(dtype)`` / ``to_empty`` swap the sharded DTensor params' data in place
        # (identity kept); the group then rebuilds its flat shard around the new data.
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


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """Run ``module.<method_name>`` with the same unshard/reshard hooks as ``forward``.

    For methods such as ``generate`` or ``forward_features`` that call submodules directly.
    A no-op for modules that fully_shard was not applied to.
    """
    if not isinstance(module, FSDPModule):
        return
    if not hasattr(module, method_name):
        raise ValueError(f"{type(module).__name__} does not have a method {method_name!r}")
    method = getattr(module, method_name)
    state = get_state(module)

    @functools.wraps(method)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        args, kwargs = state._pre_forward_hook(module, args, kwargs)
        output = method(*args, **kwargs)
        return state._post_forward_hook(module, args, kwargs, output)

    setattr(module, method_name, wrapped)


def share_comm_ctx(modules: list[FSDPModule]) -> None:
    """Let several roots share communication resources (streams). On CPU nothing is shared;
    the call validates its arguments so code written for GPUs runs unchanged."""
    if not isinstance(modules, (list, tuple)):
        raise ValueError(f"share_comm_ctx expects a list of FSDPModules, got {type(modules).__name__}")
    for module in modules:
        _state_of(module, "share_comm_ctx")
