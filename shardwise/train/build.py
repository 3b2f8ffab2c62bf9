"""Build the run's model without ever holding it whole: meta device, parallelise, shard, then materialise.

::

    with torch.device("meta"):
        model = spec.build()                       # shapes only: no memory
    convert_to_float8(blocks)                      # --float8: see train/float8.py
    apply_tp / apply_ac / apply_compile (blocks)   # see train/parallel.py
    shard_model(model, blocks, mesh, options)      # fully_shard per block, then the root
    materialize(model, spec, device, seed)         # each rank allocates its shards only

:func:`materialize` gives each parameter its values one at a time: a full-size temporary
tensor is initialised by the model's own rule (or read from safetensors), each rank copies
its shard out of it, and the temporary is dropped. A rank's set-up peak is therefore its
shards plus the largest single parameter, not the model. Every rank draws the same random
numbers in the same order (parameter by parameter, in module order, from ``seed``), so the
model equals the one an unsharded run initialises, whatever the mesh or ``--impl``: TP and
FSDP parity runs start from identical weights.
"""

from __future__ import annotations

import logging
from typing import Callable

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from shardwise.train.config import TrainConfig
from shardwise.train.distributed import DistEnv
from shardwise.train.float8 import convert_to_float8, float8_tp_plan
from shardwise.train.models import ModelSpec
from shardwise.train.parallel import apply_ac, apply_compile, apply_tp, plain_name
from shardwise.train.pipeline import Pipeline, build_schedule, merged, split_blocks, stage_ids
from shardwise.train.sharding import ShardOptions, shard_model

__all__ = ["build_sharded", "sharded_on_meta", "build_pipelined", "materialize"]

logger = logging.getLogger(__name__)

Weights = Callable[[str], torch.Tensor]
"""Full tensor by (plain) parameter name, and ``name in weights``, e.g. :class:`~shardwise.train.hf.SafetensorsWeights`."""


def build_sharded(cfg: TrainConfig, env: DistEnv, spec: ModelSpec) -> nn.Module:
    """The model of ``spec``, parallelised and sharded as ``cfg`` says, with its values on ``env.device``."""
    model = sharded_on_meta(cfg, env, spec)
    materialize(model, spec, env.device, cfg.seed, spec.weights())
    return model


def sharded_on_meta(cfg: TrainConfig, env: DistEnv, spec: ModelSpec) -> nn.Module:
    """The model of ``spec``, parallelised and sharded, still on the meta device (no memory)."""
    model, blocks = _parallelized_on_meta(cfg, env, spec)
    return shard_model(model, list(blocks), env.mesh, _shard_options(cfg))


def _parallelized_on_meta(cfg: TrainConfig, env: DistEnv, spec: ModelSpec) -> tuple[nn.Module, nn.ModuleList]:
    """The model of ``spec`` on the meta device and its blocks, each converted, tensor-parallel,
    checkpointed and compiled as ``cfg`` says (not yet sharded)."""
    with torch.device("meta"):
        model = spec.build()
    blocks = spec.blocks(model)
    if cfg.float8:
        convert_to_float8(blocks)  # before TP and sharding: both keep the float8 weight type
    if env.tp_mesh is not None:
        spec.check_tp(env.tp_size)
        plan = spec.tp_plan()
        apply_tp(blocks, env.tp_mesh, float8_tp_plan(plan, blocks[0]) if cfg.float8 else plan)
    apply_ac(blocks, cfg.ac)
    if cfg.compile:
        apply_compile(blocks, cfg.compile_backend)
    return model, blocks


def _shard_options(cfg: TrainConfig) -> ShardOptions:
    return ShardOptions(cfg.impl, cfg.mixed_precision, cfg.reshard_after_forward, cfg.cpu_offload)


def build_pipelined(cfg: TrainConfig, env: DistEnv, spec: ModelSpec) -> tuple[nn.Module, Pipeline]:
    """``--pp``: this rank's stages of the model of ``spec``, each sharded over the data-parallel
    mesh, with their values on ``env.device``; returns the stages' union (the optimizer's and the
    checkpoint's view, under the model's own parameter names) and the :class:`Pipeline`."""
    model, blocks = _parallelized_on_meta(cfg, env, spec)
    pp, pp_rank = env.pp_mesh.size(), env.pp_mesh.get_local_rank()
    ids = stage_ids(cfg.pp_schedule, pp_rank, pp)
    n_stages = pp * len(ids)
    runs = split_blocks(len(blocks), n_stages)
    stages = []
    for i in ids:
        stage = spec.stage_module(model, runs[i], first=i == 0, last=i == n_stages - 1)
        stages.append(shard_model(stage, [blocks[b] for b in runs[i]], env.mesh, _shard_options(cfg)))
    logger.info("pipeline stages %s of %d on pp rank %d: blocks %s", ids, n_stages, pp_rank,
                [list(runs[i]) for i in ids])
    materialize(model, spec, env.device, cfg.seed, spec.weights(), parts=stages)
    schedule = build_schedule(stages, ids, n_stages, env.device, env.pp_mesh, cfg.pp_schedule, cfg.n_microbatches)
    pipe = Pipeline(stages, schedule, env.pp_mesh, has_first=0 in ids, has_last=n_stages - 1 in ids,
                    switch=cfg.impl == "shardwise")
    return merged(stages), pipe


def _copy_shard(param: torch.Tensor, full: torch.Tensor) -> None:
    """Write this rank's part of ``full`` into ``param`` (a sharded DTensor or a plain tensor).

    ``full`` is always a plain tensor; ``param``'s local tensor may be a subclass (``--float8``:
    torchao's weight), whose ``copy_`` writes into the high-precision tensor it wraps.
    """
    if isinstance(param, DTensor):
        # src_data_rank=None: every rank holds ``full`` already, so each slices its own part (no collective)
        part = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
        param.to_local().copy_(part.to_local())
    else:
        param.copy_(full)


@torch.no_grad()
def materialize(
    model: nn.Module, spec: ModelSpec, device: torch.device, seed: int, weights: Weights | None = None,
    parts: list[nn.Module] | None = None,
) -> None:
    """Give every parameter of the (sharded, meta) ``model`` its values, one full tensor at a time.

    Args:
        model: after ``fully_shard``: its parameters are DTensors (or plain) on the meta device.
        spec: initialises one module (``spec.init_module``) on full-size temporary parameters.
        device: where the shards go.
        seed: the random stream of the initialisation, the same on every rank.
        weights: values by plain parameter name instead of the initialisation (``--hf-model``).
        parts: the pieces of ``model`` this rank holds, each sharded as its own root under
            ``model``'s names (``--pp``: its stages); ``None``: all of ``model``. The random
            stream still runs through every module of ``model`` in order, the draws of the
            modules not held thrown away, so each value is the one the whole model gets.
    """
    for root in parts or [model]:
        root.to_empty(device=device)  # through each FSDP root: its sharded parameters move with it
    torch.manual_seed(seed)
    names = _names_by_param(model)  # a tied parameter's every name: a checkpoint may hold any one of them
    seen: set[int] = set()  # tied parameters are set once, through their first name
    held = None if parts is None else {id(m) for part in parts for m in part.modules()}
    for name, module in model.named_modules():
        if held is not None and id(module) not in held:
            if weights is None:
                _draw_and_drop(spec, model, plain_name(name), module, device)
            continue
        name = plain_name(name)
        params = {n: p for n, p in module._parameters.items() if p is not None and id(p) not in seen}
        if not params:
            if any(b is not None for b in module._buffers.values()):
                spec.init_module(model, name, module)  # buffers (rotary frequencies) are never sharded
            continue
        seen.update(id(p) for p in params.values())
        if weights is not None:
            for p in params.values():
                _copy_shard(p, _loaded(weights, names[id(p)], p).to(device=device, dtype=p.dtype))
            continue
        temps = _initialised(spec, model, name, module, params, device)
        for n, p in params.items():
            _copy_shard(p, temps[n])
        del temps  # before the next module's are made: one module's full tensors at a time


def _draw_and_drop(spec: ModelSpec, root: nn.Module, name: str, module: nn.Module, device: torch.device) -> None:
    """Initialise ``module`` (another rank's) on full-size temporaries and drop them: only the
    random numbers its initialisation draws matter, so that the next module's are the whole model's."""
    params = {n: p for n, p in module._parameters.items() if p is not None}
    if params:
        _initialised(spec, root, name, module, params, device)


def _initialised(
    spec: ModelSpec, root: nn.Module, name: str, module: nn.Module, params: dict[str, torch.Tensor], device: torch.device,
) -> dict[str, nn.Parameter]:
    """Full-size temporaries of ``module``'s ``params``, initialised by the model's own rule
    (``module`` keeps its own parameters afterwards)."""
    temps = {n: nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=device)) for n, p in params.items()}
    module._parameters.update(temps)
    try:
        spec.init_module(root, name, module)
    finally:
        module._parameters.update(params)
    return temps


def _names_by_param(model: nn.Module) -> dict[int, list[str]]:
    """Every plain name of each parameter (tied ones have several), first name first."""
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(plain_name(name))
    return names


def _loaded(weights: Weights, names: list[str], param: torch.Tensor) -> torch.Tensor:
    """The tensor of the first of ``names`` the weights hold (Transformers saves one name of tied weights)."""
    name = next((n for n in names if n in weights), names[0])
    tensor = weights(name)
    if tuple(tensor.shape) != tuple(param.shape):
        raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)} in the model directory, "
                         f"{tuple(param.shape)} in the model its config builds")
    return tensor
