"""torch FSDP2's private names for the state objects, as read-only aliases of shardwise's.

torch's own FSDP2 tests (and a few frameworks) reach into the object ``fully_shard.state(module)``
returns: ``state._lazy_init()``, ``state._is_root``, ``state._state_ctx.all_states``,
``state._fsdp_param_group`` and its ``_module_fqn`` and ``fsdp_params``, each param's
``_param_fqn``. These mixins give shardwise's :class:`~shardwise.state.ModuleState`,
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


class TorchContextNames:
    """torch's ``FSDPStateContext`` names on an ``IterationContext`` (reads ``states``)."""

    @property
    def all_states(self) -> list:
        return self.states


class TorchGroupNames:
    """torch's ``FSDPParamGroup`` names on a ``ParamGroup`` (reads ``fqn``, ``params``)."""

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
