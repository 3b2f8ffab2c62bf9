"""Checks and naming done once, at lazy init, before any collective can hang.

* :func:`assign_fqns` names every state, group and parameter relative to the root.
* :func:`claim_original_param` / :func:`check_no_param_in_two_groups`: a parameter object
  handed to two ``fully_shard`` calls (e.g. tied weights split across groups) would be
  sharded twice and trained wrong silently; the second claim is remembered and reported
  with both FQNs. Claims are weak, so a freed parameter whose ``id`` is reused later
  (layer-by-layer sharding with ``gc.collect()``) never looks shared.
* :func:`check_ranks_agree`: ranks that built different models would issue collectives
  of different sizes and hang or corrupt data. Every rank publishes its parameter
  shapes/dtypes in the c10d store (no collective) and compares with the others; a rank
  that never arrives is a timeout error naming it, not a hang. Keys are counted per rank
  in the store, so ranks that are threads of one process (the "threaded" backend) agree.
"""

from __future__ import annotations

import datetime
import os
import pickle
import weakref
from typing import Protocol, Sequence

import torch.distributed as dist
import torch.nn as nn
from torch.utils.weak import WeakIdKeyDictionary

from shardwise.mesh import MeshInfo
from shardwise.param import ShardedParam


class _CheckedGroup(Protocol):
    fqn: str
    params: list[ShardedParam]


class CheckedState(Protocol):
    """What the checks read from a ``state.ModuleState`` (declared here, below state.py,
    so imports flow one way)."""

    modules: tuple[nn.Module, ...]
    fqn: str
    groups: Sequence[_CheckedGroup]  # one per mesh; empty when the state has no params
    mesh_info: MeshInfo

# Keyed by identity (tensors' __eq__ is elementwise) and weak, so freed params drop out.
_CLAIMS: "WeakIdKeyDictionary" = WeakIdKeyDictionary()
# id(sharded DTensor parameter) -> weakref(its ShardedParam). Keyed by id, never by a weak
# reference to the parameter: a weakref on it would make module._apply's swap_tensors fail.
_SHARDED: dict[int, weakref.ref] = {}


def claim_original_param(param: nn.Parameter, sharded: ShardedParam) -> "weakref.ref | None":
    """Record that ``sharded`` now manages ``param``; return the earlier claimant, if any."""
    earlier = _CLAIMS.get(param)
    _CLAIMS[param] = weakref.ref(sharded)
    return earlier


def note_sharded(sharded: "ShardedParam") -> None:
    """Remember ``sharded``'s DTensor parameter, so a second fully_shard call that meets it
    (a submodule registered under two sharded modules) says so instead of failing later."""
    if len(_SHARDED) > 1024 and len(_SHARDED) & (len(_SHARDED) - 1) == 0:  # now and then: drop the dead
        for key in [k for k, ref in _SHARDED.items() if ref() is None]:
            del _SHARDED[key]
    _SHARDED[id(sharded.sharded_param)] = weakref.ref(sharded)


def check_not_sharded_already(params: list[nn.Parameter], sites: list) -> None:
    """Raise if a parameter about to be managed is already a shardwise-sharded parameter."""
    for param, param_sites in zip(params, sites):
        ref = _SHARDED.get(id(param))
        owner = None if ref is None else ref()
        if owner is None or owner.sharded_param is not param:  # a freed parameter's id reused
            continue
        site, first = param_sites[0], owner.sites[0]
        raise ValueError(
            f"parameter {site.fqn!r} (in {type(site.module).__name__}) is already sharded by an earlier "
            f"fully_shard call, as {first.fqn!r}: its module is registered under two fully_shard-ed modules, "
            "and a parameter belongs to one group only. Call fully_shard on the shared module itself first, "
            "or only on a common ancestor of both"
        )


def claimant(param: object) -> "ShardedParam | None":
    """The ShardedParam that replaced ``param`` (an original, pre-shard parameter), if alive."""
    ref = _CLAIMS.get(param) if isinstance(param, nn.Parameter) else None
    return None if ref is None else ref()


def assign_fqns(root: nn.Module, states: list[CheckedState]) -> None:
    names = {id(module): name for name, module in root.named_modules()}
    for state in states:
        state.fqn = ", ".join(names.get(id(m), type(m).__name__) for m in state.modules)
        for group in state.groups:
            group.fqn = state.fqn  # as torch's module FQN: every group of a call shares it
        for p in _params(state):
            prefix = names.get(id(p.sites[0].module), "")
            p.fqn = f"{prefix}.{p.sites[0].name}" if prefix else p.sites[0].name


def _params(state: CheckedState) -> list[ShardedParam]:
    """The state's params, group by group."""
    return [p for group in state.groups for p in group.params]


def check_no_param_in_two_groups(states: list[CheckedState]) -> None:
    for state in states:
        for p in _params(state):
            other = p.shared_with() if p.shared_with is not None else None
            if other is not None:
                raise ValueError(  # torch's phrase first: users' tests match on it
                    f"parameter {p.fqn!r} is shared with a parameter already managed by another "
                    f"fully_shard group: it is the same nn.Parameter as {other.fqn!r}, and a parameter "
                    "can belong to only one group; apply fully_shard to a common ancestor of both "
                    "modules, or group them with fully_shard([module_a, module_b])"
                )


def _signature(states: list[CheckedState]) -> list[tuple]:
    rows = []
    for state in states:
        for p in _params(state):
            rows.append((p.fqn, tuple(p.orig_size), str(p.sharded_param.dtype)))
    return rows


def check_ranks_agree(states: list[CheckedState]) -> None:
    """Compare parameter names, shapes and dtypes across the root mesh's ranks via the store."""
    ranks = states[0].mesh_info.mesh.mesh.flatten().tolist()
    if len(ranks) == 1:
        return
    store = dist.distributed_c10d._get_default_store()
    prefix = f"shardwise/init/{_check_round(store, ranks)}/{'-'.join(map(str, ranks))}"
    mine = _signature(states)
    store.set(f"{prefix}/{dist.get_rank()}", pickle.dumps(mine))
    keys = [f"{prefix}/{r}" for r in ranks]
    timeout = float(os.environ.get("SHARDWISE_INIT_TIMEOUT_S", "300"))
    try:
        store.wait(keys, datetime.timedelta(seconds=timeout))
    except Exception as err:  # c10d raises DistStoreError/RuntimeError depending on the store
        missing = [r for r, k in zip(ranks, keys) if not store.check([k])]
        raise RuntimeError(
            f"shardwise lazy init: ranks {missing} did not reach the first forward of the root within "
            f"{timeout:.0f}s (rank {dist.get_rank()} waited); every rank must run the same model code"
        ) from err
    for rank, key in zip(ranks, keys):
        _compare(mine, pickle.loads(store.get(key)), rank)


def _check_round(store: dist.Store, ranks: list[int]) -> int:
    """How many checks over ``ranks`` this rank has started, counted in the store itself.

    Every rank of the mesh runs the same sequence of checks, so the n-th check of each
    rank meets the others' n-th under the same keys. The count is per rank, not per
    process: with ``init_process_group("threaded")`` the ranks are threads of one process,
    and a process-wide counter would give each thread a different round (and a hang).
    Kept in the store, it starts afresh with each new store (a new process group).
    """
    key = f"shardwise/init/rounds/{'-'.join(map(str, ranks))}/{dist.get_rank()}"
    return store.add(key, 1)


def _compare(mine: list[tuple], theirs: list[tuple], rank: int) -> None:
    me = dist.get_rank()
    for a, b in zip(mine, theirs):
        if a != b:
            raise ValueError(
                f"ranks disagree on a sharded parameter: rank {me} has {a[0]!r} shape {a[1]} {a[2]}, "
                f"rank {rank} has {b[0]!r} shape {b[1]} {b[2]}; every rank must build the same model "
                "(same shapes and dtypes) before fully_shard"
            )
    if len(mine) != len(theirs):
        raise ValueError(
            f"ranks disagree on the number of sharded parameters: rank {me} has {len(mine)}, rank {rank} "
            f"has {len(theirs)}; every rank must build the same model and call fully_shard the same way"
        )
