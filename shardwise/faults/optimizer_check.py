"""The classic mistake: an optimizer that holds the parameters fully_shard replaced.

``fully_shard`` swaps each managed ``nn.Parameter`` for a new one wrapping a sharded
DTensor. An optimizer created before it (or before a later ``fully_shard`` call) still
holds the originals: it steps tensors the model no longer uses, the weights never change,
and nothing complains. A global optimizer step pre-hook, installed by the first
``fully_shard``, checks each optimizer's parameters against the originals shardwise
replaced (:func:`shardwise.init_checks.claimant`) at its first step after any
``fully_shard`` call, and raises naming the parameter. Later steps cost one integer
comparison.
"""

from __future__ import annotations

import weakref

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from shardwise import init_checks

__all__ = ["note_sharding"]

_GENERATION = [0]  # fully_shard/replicate calls so far in this process
_CHECKED: "weakref.WeakKeyDictionary[torch.optim.Optimizer, int]" = weakref.WeakKeyDictionary()
_HOOK: list = []


def note_sharding() -> None:
    """A fully_shard/replicate call replaced parameters: optimizers are checked again."""
    _GENERATION[0] += 1
    if not _HOOK:
        _HOOK.append(register_optimizer_step_pre_hook(_check_step))


def _check_step(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    if _CHECKED.get(optimizer) == _GENERATION[0]:
        return
    stale = [sp for group in optimizer.param_groups for sp in map(init_checks.claimant, group["params"]) if sp]
    if stale:
        raise RuntimeError(_message(optimizer, stale))
    _CHECKED[optimizer] = _GENERATION[0]


def _message(optimizer: torch.optim.Optimizer, stale: list) -> str:
    names = [sp.fqn or sp.sites[0].fqn for sp in stale]
    shown = ", ".join(repr(n) for n in names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    kind = type(optimizer).__name__
    return (
        f"{kind}.step(): this optimizer holds parameters that fully_shard replaced ({shown}): they are the "
        "unsharded originals, which the model no longer uses, so the weights would never change. The optimizer "
        f"was created before fully_shard (or fully_shard was applied after it): create it after every fully_shard "
        f"call, e.g. optim = torch.optim.{kind}(model.parameters(), ...)"
    )
