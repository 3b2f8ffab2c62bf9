"""torch FSDP2's private names for the state objects, as read-only aliases of shardwise's.

torch's own FSDP2 tests (and a few frameworks) reach into the object ``fully_shard.state(module)``
returns: ``state._lazy_init()``, ``state._is_root``, ``state._state_ctx.all_states``,
``state._fsdp_param_group`` and its ``_module_fqn`` and ``fsdp_params``, each param's
``_param_fqn``. ``torch.distributed.pipelining`` drives FSDP2 through two more, after the last
microbatch of a step (``perform_reduce_grad``): ``group.post_backward()`` on every group of
every state, then ``state._root_post_backward_final_callback()`` on the stage's root; they
call the same verbs shardwise's own hooks call at those points. These mixins give shardwise's :class:`~shardwise.state.ModuleState`,
:class:`~shardwise.state.IterationContext`, :class:`~shardwise.group.ParamGroup` and
:class:`~shardwise.param.ShardedParam` those names as views of their own attributes: no second
copy of any state, nothing to keep in sync. They are torch's names, not shardwise's API; new code
uses the public ones (``is_root``, ``lazy_init()``, ``ctx.states``, ``group``, ``fqn``, ``params``).

Each mixin reads attributes its class declares in its own typed inventory (named below), so
this module imports nothing from shardwise.
"""

from __future__ import annotations

from typing import Any

__all__ = ["TorchStateNames", "TorchContextNames", "TorchGroupNames", "TorchParamNames"]


class TorchStateNames:
    """torch's ``FSDPState`` names on a ``ModuleState`` (reads ``is_root``, ``ctx``, ``groups``,
    ``group``, ``lazy_init``)."""

    @property
    def _is_root(self) -> bool | None:
        return self.is_root

    def _lazy_init(self) -> None:
        self.lazy_init()

    @property
    def _state_ctx(self) -> Any:
        return self.ctx

    @property
    def _fsdp_param_group(self) -> Any:
        return self.group

    @property
    def _fsdp_param_groups(self) -> list:
        return list(self.groups)

    def _root_post_backward_final_callback(self) -> None:
        """torch's end-of-backward callback, called by hand (pipelining calls it after the
        explicit ``post_backward()`` of every group): wait for the reductions, reshard, go
        IDLE. A state never run forward has nothing to finish."""
        if self.ctx is not None:
            self.ctx.final_callback()


class TorchContextNames:
    """torch's ``FSDPStateContext`` names on an ``IterationContext`` (reads ``states``)."""

    @property
    def all_states(self) -> list:
        return self.states


class TorchGroupNames:
    """torch's ``FSDPParamGroup`` names on a ``ParamGroup`` (reads ``fqn``, ``params``,
    ``owner``)."""

    def post_backward(self, *unused: Any) -> None:
        """torch's ``FSDPParamGroup.post_backward()``: this group's gradients are complete, so
        reshard it (if ``reshard_after_backward``) and reduce them (accumulate them while
        gradient sync is off), through the owning state as shardwise's own post-backward does."""
        state = self.owner() if self.owner is not None else None
        if state is None:
            raise RuntimeError(f"{self!r} has no live fully_shard state to run its post_backward() through")
        state.post_backward_group(self)

    @property
    def _module_fqn(self) -> str:
        return self.fqn

    @property
    def fsdp_params(self) -> list:
        return self.params


class TorchParamNames:
    """torch's ``FSDPParam`` names on a ``ShardedParam`` (reads ``fqn``)."""

    @property
    def _param_fqn(self) -> str:
        return self.fqn
