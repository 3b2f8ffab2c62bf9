"""The state-dict contract of a sharded module: what ``state_dict()`` and ``load_state_dict()`` see.

FSDP2's contract, in every state a user can be in (after init, after an eval or a
training forward, mid-accumulation, with any policy):

- **Save.** ``state_dict()`` returns the sharded DTensor parameters: the original dtype
  (never ``param_dtype`` compute copies), each on its own storage (see param.py), so
  ``torch.save`` / ``torch.load(weights_only=True)``, DCP and safetensors take them as
  they are. A group kept gathered (``reshard_after_forward=False`` after a no-grad
  forward: always the root) would otherwise expose its unsharded views, which share one
  buffer: so each group reshards first (a state-dict pre-hook on every module holding
  one of its parameters). The next forward gathers again.
- **Load.** ``load_state_dict()`` reshards the same way first, so a copying load writes
  into the sharded parameters themselves (not into unsharded views the next reshard
  discards). With ``assign=True`` the module afterwards holds new objects: a post-hook
  checks their layout (a wrong one fails in this load, naming the parameter) and the
  group adopts them as its sharded parameters on its next use, once every member of a
  grouped call is loaded (their local tensors become the shard storage, padded into
  storage of their own when needed), as FSDP2 does. As there, the parameter objects
  change: build the optimizer after such a load.
  This is how a model sharded on the meta device is loaded (Accelerate's
  ``cpu_ram_efficient_loading``; DCP's ``set_model_state_dict(..., full_state_dict=True,
  broadcast_from_rank0=True)``).

Tied parameters registered under several names take the first name's value on an
``assign=True`` load (the others are registered as the same parameter again).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch.nn as nn

from shardwise.group import ParamGroup

__all__ = ["register_state_dict_hooks"]


def register_state_dict_hooks(group: ParamGroup) -> None:
    """Hook every module holding one of ``group``'s params: reshard before ``state_dict()``
    and ``load_state_dict()``; adopt assigned params after ``load_state_dict()``."""
    ref = weakref.ref(group)  # modules -> hooks -> group would otherwise pin the group
    modules: dict[int, nn.Module] = {}
    for p in group.params:
        for site in p.sites:
            modules.setdefault(id(site.module), site.module)
    for module in modules.values():
        module.register_state_dict_pre_hook(_ReshardHook(ref))
        module.register_load_state_dict_pre_hook(_ReshardHook(ref))
        module.register_load_state_dict_post_hook(_AdoptHook(ref))


class _ReshardHook:
    """``state_dict`` / ``load_state_dict`` pre-hook: register the sharded params."""

    def __init__(self, ref: weakref.ref):
        self._ref = ref

    def __call__(self, *unused: Any) -> None:
        group = self._ref()
        if group is not None:
            group.reshard()


class _AdoptHook:
    """``load_state_dict`` post-hook: have the group adopt params that ``assign=True``
    replaced (checked now, adopted on the group's next use)."""

    def __init__(self, ref: weakref.ref):
        self._ref = ref

    def __call__(self, module: nn.Module, incompatible_keys: Any) -> None:
        group = self._ref()
        if group is not None:
            group.adopt_if_replaced()
