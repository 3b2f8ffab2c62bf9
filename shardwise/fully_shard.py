"""fully_shard(): validate → mesh → params → group → state → class swap.

Apply it bottom-up: each call manages the parameters of its module(s) that no earlier
call on a submodule manages, minus ``ignored_params``, and all of them move in one
all-gather and one reduce-scatter — per mesh: a ``shard_placement_fn`` returning a
per-parameter mesh splits the call into one group per distinct mesh (torch's order: by
each mesh's first parameter), driven by the same hooks.
"""

from __future__ import annotations

import collections
import warnings
from typing import Callable

import torch
import torch.nn as nn
from torch.distributed._composable.contract import REGISTRY_KEY, RegistryItem
from torch.distributed._composable_state import _insert_module_state
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard

from shardwise import init_checks
from shardwise.dynamo_compat import implements_forward
from shardwise.errors import InvalidUsageError
from shardwise.faults import init_values, optimizer_check
from shardwise.group import ParamGroup
from shardwise.mesh import MeshInfo, default_mesh, fully_shard_mesh_info, post_forward_group, spmd_mesh_info
from shardwise.module import FSDPModule
from shardwise.param import ParamSite, ShardedParam
from shardwise.policies import DataParallelMeshDims, MixedPrecisionPolicy, OffloadPolicy, check_policies
from shardwise.state import STATE_ATTR, ModuleState, get_state, state_accessor
from shardwise.state_dict import register_state_dict_hooks

__all__ = ["fully_shard", "build_state"]

_DERIVED_CLASSES: dict[tuple[type, type], type] = {}


def fully_shard(
    module: nn.Module | list[nn.Module],
    *,
    mesh: DeviceMesh | None = None,
    reshard_after_forward: bool | int | None = None,
    shard_placement_fn: Callable[[nn.Parameter], Shard | None] | None = None,
    mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
    offload_policy: OffloadPolicy = OffloadPolicy(),
    ignored_params: set[nn.Parameter] | None = None,
    dp_mesh_dims: DataParallelMeshDims | None = None,
):
    """Shard ``module``'s parameters over ``mesh`` and gather them around its forward/backward.

    After this call each managed parameter is an ``nn.Parameter`` wrapping a ``DTensor``
    sharded on dim 0 (like ``torch.chunk``), the module's class becomes ``FSDP<Orig>``
    (an :class:`FSDPModule`), and forward/backward hooks all-gather the parameters before
    they are used, free them afterwards, and reduce-scatter the gradients (the mean over
    the data-parallel ranks) into sharded DTensor ``.grad``s.

    Args:
        module: the module, or a list of modules that communicate as one group.
        mesh: a 1-D DeviceMesh (FSDP) or a 2-D one with named dims (HSDP: replicate,
            shard). Default: 1-D over the default process group.
        reshard_after_forward: True frees the unsharded parameters after forward (they are
            all-gathered again in backward); False keeps them until after backward. None
            (default) means True, except for the root module, which uses False. An int is
            the size of the smaller shard group kept after forward.
        shard_placement_fn: maps a parameter to the ``Shard(dim)`` to use (None: dim 0), or
            to torch's ``ShardPlacementResult`` (a placement and a per-parameter mesh): the
            call then makes one group per distinct mesh (each its own all-gather and
            reduce-scatter, driven by the same hooks), as torch does for MoE experts.
        mp_policy: mixed precision (see :class:`MixedPrecisionPolicy`).
        offload_policy: :class:`OffloadPolicy` (default, none) or :class:`CPUOffloadPolicy`.
        ignored_params: parameters left unmanaged (not sharded, not reduced, not moved).
        dp_mesh_dims: when ``mesh`` is the full SPMD mesh and the params are already DTensors
            on it (``Replicate()`` on the data-parallel dims), names the dims to shard and to
            replicate over; see :class:`DataParallelMeshDims`.

    Returns:
        The same module (or list), now an instance of :class:`FSDPModule`.

    ``fully_shard.state(module)`` returns the call's :class:`~shardwise.state.ModuleState`
    (one per call; None for a module no ``fully_shard`` call was applied to).
    """
    modules = _check_modules(module, "fully_shard")
    mp_policy, offload_policy = check_policies(mp_policy, offload_policy)
    mesh_info = _mesh_info(mesh, dp_mesh_dims, reshard_after_forward)
    reshard_after_forward = _check_reshard_after_forward(reshard_after_forward, mesh_info)
    state = build_state(
        modules, mesh_info, reshard_after_forward, shard_placement_fn, mp_policy, offload_policy, ignored_params
    )
    for m in modules:
        _register_state(m, state, "fully_shard")
        m.__class__ = _derived_class(type(m), FSDPModule, "FSDP")
    return module


fully_shard.state = state_accessor("fully_shard")  # torch's composable-API accessor


def build_state(
    modules: list[nn.Module],
    mesh_info: MeshInfo,
    reshard_after_forward: bool | int | None,
    shard_placement_fn: Callable | None,
    mp_policy: MixedPrecisionPolicy,
    offload_policy: OffloadPolicy,
    ignored_params: set | None,
) -> ModuleState:
    """The pipeline shared by fully_shard and replicate: params → groups (one per mesh) → state."""
    params, sites, buffers = _managed_tensors(modules, _ignored_ids(ignored_params))
    read: dict[int, tuple[object, MeshInfo]] = {}  # id(torch's mesh info) -> (it, ours): one each
    placements = [_placement(shard_placement_fn, p, s, mesh_info, read) for p, s in zip(params, sites)]
    by_mesh = _group_by_mesh(placements, sites)
    if len(by_mesh) == 1:  # the state's mesh: the call's, or the one mesh every param chose
        mesh_info = next(iter(by_mesh.values()))[0]
    device = mesh_info.device
    _move_buffers(buffers, device)
    if params:
        init_checks.check_not_sharded_already(params, sites)
    groups = []
    for group_mesh, members in by_mesh.values():
        group = _build_group(
            [params[i] for i in members], [sites[i] for i in members], [placements[i][0] for i in members],
            group_mesh, mp_policy, offload_policy,
        )
        if not isinstance(reshard_after_forward, bool) and isinstance(reshard_after_forward, int):
            group.post_forward = post_forward_group(group_mesh, reshard_after_forward)
        groups.append(group)
    return ModuleState(modules, groups, mesh_info, device, mp_policy, reshard_after_forward)


def _build_group(
    params: list, sites: list, dims: list[int], mesh_info: MeshInfo, mp_policy, offload_policy
) -> ParamGroup:
    """One group: shard its params over ``mesh_info``, claim the originals, hook state dicts."""
    init_values.check_same_init(
        mesh_info.shard_group or mesh_info.replicate_group, [s[0].fqn for s in sites], params, "shardwise"
    )
    sharded = [ShardedParam(p, s, mesh_info, dim) for p, s, dim in zip(params, sites, dims)]
    group = ParamGroup(sharded, params, mesh_info, mesh_info.device, mp_policy, offload_policy)
    for p, sp in zip(params, sharded):
        sp.shared_with = init_checks.claim_original_param(p, sp)
        init_checks.note_sharded(sp)
    optimizer_check.note_sharding()
    register_state_dict_hooks(group)
    return group


def _check_modules(module: object, api: str) -> list[nn.Module]:
    modules = list(module) if isinstance(module, (list, tuple)) else [module]
    if not modules:
        raise ValueError(f"{api} got an empty list of modules")
    for m in modules:
        if not isinstance(m, nn.Module):
            raise ValueError(
                f"{api} expects an nn.Module or a list of them, got {_short_type(m)}; pass the module that "
                "owns the parameters (e.g. model or model.layers[0])"
            )
        if not implements_forward(m):
            raise ValueError(
                f"{api} does not support containers that do not implement forward: {type(m).__name__} "
                "implements no forward(); "
                f"apply it to each child module (for layer in model.layers: {api}(layer)) or to the parent"
            )
        state = get_state(m)
        if state is not None and state.api == api:
            raise InvalidUsageError(
                "Each distinct composable distributed API can only be applied to a module once. "
                f"{api} was already applied to this {type(m).__name__}; apply fully_shard or replicate once per "
                "module"
            )
        if state is not None:
            raise ValueError(
                f"{state.api} was already applied to this {type(m).__name__}; apply fully_shard or replicate "
                "once per module"
            )
    return modules


def _short_type(value: object) -> str:
    """``Tensor of shape (3, 4)``: what a bad argument is, never its contents (a tensor's repr
    would print every element into the error)."""
    shape = getattr(value, "shape", None)
    if shape is not None:
        return f"{type(value).__name__} of shape {tuple(shape)}"
    return type(value).__name__


def _register_state(module: nn.Module, state: ModuleState, api: str) -> None:
    """Attach ``state`` to ``module`` where shardwise and torch's composable APIs look for it.

    torch's registry entry under ``api`` ("fully_shard" is the key FSDP2 uses) makes torch's
    own ``replicate`` and other fully_shard-aware helpers skip these parameters.
    """
    state.api = api
    module.__dict__[STATE_ATTR] = state
    _insert_module_state(module, state)
    registry = module.__dict__.setdefault(REGISTRY_KEY, collections.OrderedDict())
    registry[api] = RegistryItem()


def _mesh_info(mesh: DeviceMesh | None, dp_mesh_dims: object, reshard_after_forward: object) -> MeshInfo:
    if dp_mesh_dims is None:
        return fully_shard_mesh_info(mesh if mesh is not None else default_mesh())
    if not isinstance(dp_mesh_dims, DataParallelMeshDims):
        raise TypeError(f"dp_mesh_dims must be a shardwise.DataParallelMeshDims, got {type(dp_mesh_dims).__name__}")
    if not isinstance(reshard_after_forward, bool) and isinstance(reshard_after_forward, int):
        raise NotImplementedError("reshard_after_forward as int is not yet supported with an SPMD mesh (dp_mesh_dims)")
    return spmd_mesh_info(mesh, dp_mesh_dims)


def _check_reshard_after_forward(value: object, mesh_info: MeshInfo) -> bool | None:
    if value is None or isinstance(value, bool):
        return value
    if not isinstance(value, int):
        raise ValueError(
            "reshard_after_forward must be a bool, an int (the size of the shard group kept after "
            f"forward) or None, got {type(value).__name__}: {value!r}"
        )
    size = mesh_info.shard_size
    if value == 1:
        warnings.warn(
            "reshard_after_forward=1 keeps a shard of one rank, i.e. the whole parameter; treating it as False",
            stacklevel=3,
        )
        return False
    if value == size:
        return True
    if value < 1 or value > size or size % value != 0:
        raise ValueError(
            f"reshard_after_forward={value} must divide the shard group size {size} and lie in [1, {size}]"
        )
    return value


def _ignored_ids(ignored: object) -> set[int]:
    """``ignored_params`` as the ids of its tensors (membership by identity: ``p in [...]``
    would compare tensors elementwise)."""
    if ignored is None:
        return set()
    if not isinstance(ignored, (set, frozenset, list, tuple)):
        raise TypeError(f"ignored_params must be a set of nn.Parameters, got {_short_type(ignored)}")
    for item in ignored:
        if not isinstance(item, torch.Tensor):
            raise TypeError(
                f"ignored_params must hold the module's nn.Parameters, got {_short_type(item)}; "
                "pass e.g. {model.scale}"
            )
    return {id(item) for item in ignored}


def _managed_tensors(modules: list[nn.Module], ignored: set[int]) -> tuple[list, list[list[ParamSite]], list]:
    """Params (with every site they are registered at) and buffers of the managed modules.

    Managed modules: the subtrees of ``modules``, stopping at submodules an earlier
    fully_shard call already owns.
    """
    managed: list[nn.Module] = []
    seen: set[int] = set()

    def visit(m: nn.Module, top: bool) -> None:
        if id(m) in seen or (not top and get_state(m) is not None):
            return
        seen.add(id(m))
        managed.append(m)
        for child in m.children():
            visit(child, False)

    for m in modules:
        visit(m, True)
    names = {id(sub): name for top in modules for name, sub in top.named_modules()}
    params: list[nn.Parameter] = []
    sites: dict[int, list[ParamSite]] = {}
    buffers = []
    for m in managed:
        for name, p in m._parameters.items():
            if p is None or id(p) in ignored:
                continue
            if id(p) not in sites:
                params.append(p)
                sites[id(p)] = []
            prefix = names.get(id(m), "")
            sites[id(p)].append(ParamSite(m, name, f"{prefix}.{name}" if prefix else name))
        buffers.extend((m, name) for name, b in m._buffers.items() if b is not None)
    return params, [sites[id(p)] for p in params], buffers


def _placement(fn: Callable | None, param: nn.Parameter, sites: list[ParamSite], default: MeshInfo, read: dict):
    """``(shard dim, MeshInfo)`` of one param: what ``shard_placement_fn`` says, as torch reads it.

    The function may return None (``Shard(0)`` on the call's mesh), a ``Shard``, or torch's
    ``ShardPlacementResult`` (a placement plus a per-parameter ``FSDPMeshInfo``), read by
    its fields (``placement``, ``mesh_info.mesh``/``shard_mesh_dim``/``replicate_mesh_dim``).
    Each of torch's mesh-info objects is read once (``read``): params that returned the same
    object get the same ``MeshInfo``, and only those may share process groups.
    """
    result = None if fn is None else fn(param)
    mesh_info = default
    if result is not None and not isinstance(result, Shard) and hasattr(result, "mesh_info"):
        source = result.mesh_info
        if id(source) not in read:
            read[id(source)] = (source, _read_mesh_info(source, sites))
        mesh_info = read[id(source)][1]
        result = result.placement
    if result is None:
        return 0, mesh_info
    if not isinstance(result, Shard):
        raise ValueError(
            "shard_placement_fn must return a torch.distributed.tensor.Shard, a ShardPlacementResult or None, "
            f"got {result!r} for parameter {sites[0].name!r} of {type(sites[0].module).__name__}"
        )
    dim = result.dim + param.dim() if result.dim < 0 else result.dim
    if not 0 <= dim < param.dim():
        raise InvalidUsageError(
            f"Shard dim {result.dim} is invalid for {param.dim()}D tensor: shard_placement_fn returned {result} "
            f"for the {param.dim()}-d parameter {sites[0].name!r}; return a dim below {param.dim()}"
        )
    return dim, mesh_info


def _read_mesh_info(info: object, sites: list[ParamSite]) -> MeshInfo:
    mesh = getattr(info, "mesh", None)
    if not isinstance(mesh, DeviceMesh) or getattr(info, "shard_mesh_dim", None) is None:
        raise ValueError(
            f"shard_placement_fn returned a ShardPlacementResult for {sites[0].name!r} whose mesh_info {info!r} "
            "has no DeviceMesh with a shard_mesh_dim; pass FSDPMeshInfo(mesh=..., shard_mesh_dim=...)"
        )
    if getattr(info, "dp_mesh_dims", None) is not None:
        raise NotImplementedError("a per-parameter mesh with dp_mesh_dims (an SPMD mesh) is not supported yet")
    return MeshInfo(mesh, shard_mesh_dim=info.shard_mesh_dim, replicate_mesh_dim=getattr(info, "replicate_mesh_dim", None))


def _group_by_mesh(placements: list[tuple[int, MeshInfo]], sites: list[list[ParamSite]]) -> dict:
    """Param indices per group: one group per distinct pair of (shard, replicate) process
    groups, in the order of each pair's first param, as torch keys and orders its param groups.

    Params on the same process groups must have named them through the same mesh-info object
    (the call's own, or one ``FSDPMeshInfo`` returned for each of them); torch raises
    otherwise, and so do we, with torch's words.
    """
    groups: dict[tuple, tuple[MeshInfo, list[int]]] = {}
    for i, (_, info) in enumerate(placements):
        key = (info.shard_group, info.replicate_group)
        if key not in groups:
            groups[key] = (info, [])
        elif groups[key][0] is not info:
            first = sites[groups[key][1][0]][0]
            raise ValueError(
                "Params sharing the same process group must use the same FSDPMeshInfo object, but got different "
                f"objects for {first.fqn or first.name!r} and {sites[i][0].fqn or sites[i][0].name!r}: create the "
                "FSDPMeshInfo once, outside shard_placement_fn, and return it for every parameter on that mesh "
                "(a parameter on the call's own mesh returns a plain Shard or None)"
            )
        groups[key][1].append(i)
    return groups


def _move_buffers(buffers: list, device: torch.device) -> None:
    for module, name in buffers:
        buffer = module._buffers[name]
        if not buffer.is_meta and buffer.device != device:
            module._buffers[name] = buffer.to(device)


def _derived_class(cls: type, mixin: type, prefix: str) -> type:
    """``<prefix><Orig>`` deriving from ``mixin`` then ``cls``, made once per pair."""
    key = (cls, mixin)
    if key not in _DERIVED_CLASSES:
        _DERIVED_CLASSES[key] = type(f"{prefix}{cls.__name__}", (mixin, cls), {})
    return _DERIVED_CLASSES[key]
