"""The two implementations of a case, built from the same initial weights.

Each :class:`Contender` is a wrapped GPT with its AdamW optimizer. Both sides of a case
start from ``torch.manual_seed(seed); GPT(cfg)``, so their weights, data and optimizer
are identical and only the wrapper differs::

    fsdp:       for block in model.layers: fully_shard(block, mesh=..., reshard_after_forward=rs, mp_policy=mp)
                fully_shard(model, ...)                          # shardwise's, then torch's
    replicate:  for block in model.layers: replicate(block, mesh=...); replicate(model, mesh=...)
                vs DistributedDataParallel(model)                # torch's bucketed all-reduce
    torch_replicate: the same shardwise.replicate vs torch's replicate (replicate_with_fsdp),
                applied per block and root in the same way       # the API shardwise reimplements
    ddp_matched: the same shardwise.replicate vs DistributedDataParallel(model, bucket_cap_mb=
                model bytes / replicate calls)                   # as many all-reduces as the API
    report:     shardwise fully_shard with the step report's recorder active from the root's
                forward to the end of optimizer.step(), vs the same model without  # the overhead
"""

from __future__ import annotations

import time
from typing import NamedTuple

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from bench.cases import Case
from shardwise.train.model import GPT, GPTConfig

__all__ = ["Contender", "build_pair", "build_plain", "make_optimizer", "DTYPE_BYTES"]

DTYPE_BYTES = {"fp32": 4, "bf16": 2}
"""Bytes per element of a case's ``param_dtype``; gradients are always reduced in fp32."""


class Contender(NamedTuple):
    """One implementation under test."""

    name: str  # "shardwise.fully_shard", "torch.fully_shard", "shardwise.replicate", "torch.DDP", "torch.replicate"
    model: nn.Module
    optimizer: torch.optim.Optimizer


def make_optimizer(model: nn.Module, kind: str) -> torch.optim.Optimizer:
    """AdamW with the training job's hyper-parameters (each rank steps only what it holds);
    ``kind`` is :attr:`bench.cases.Settings.optimizer`."""
    return torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.01, foreach=kind == "foreach")


def build_plain(model_name: str, seed: int) -> GPT:
    """The unwrapped GPT preset, initialised from ``seed`` (the same weights on every call)."""
    torch.manual_seed(seed)
    return GPT(GPTConfig.preset(model_name))


def _mp_policy(policy_cls: type, dtype: str):
    if dtype == "bf16":
        return policy_cls(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return policy_cls()


def _fully_shard_with(fully_shard, policy_cls: type, case: Case, mesh: DeviceMesh, seed: int) -> nn.Module:
    model = build_plain(case.model, seed)
    kwargs = dict(mesh=mesh, reshard_after_forward=case.reshard, mp_policy=_mp_policy(policy_cls, case.dtype))
    for block in model.layers:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    return model


def _shardwise_fsdp(case: Case, mesh: DeviceMesh, seed: int, optimizer: str) -> Contender:
    from shardwise import MixedPrecisionPolicy, fully_shard

    model = _fully_shard_with(fully_shard, MixedPrecisionPolicy, case, mesh, seed)
    return Contender("shardwise.fully_shard", model, make_optimizer(model, optimizer))


def _torch_fsdp(case: Case, mesh: DeviceMesh, seed: int, optimizer: str) -> Contender:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = _fully_shard_with(fully_shard, MixedPrecisionPolicy, case, mesh, seed)
    return Contender("torch.fully_shard", model, make_optimizer(model, optimizer))


def _shardwise_fsdp_reported(case: Case, mesh: DeviceMesh, seed: int, optimizer: str) -> Contender:
    """shardwise's fully_shard, recording a step report during each of its steps (and only then).

    The recorder is what ``shardwise.report`` activates; it becomes active at the root's
    forward pre-hook and closes the step (``end_step``, the per-step summary) after
    ``optimizer.step()``, so the other contender's interleaved steps are not recorded.
    Writing the files at the end of a run is a one-time cost and is not measured.
    """
    from shardwise import tracing
    from shardwise.step_report.memory import sampler_for
    from shardwise.step_report.recorder import StepRecorder

    c = _shardwise_fsdp(case, mesh, seed, optimizer)
    recorder = StepRecorder(sampler_for(torch.device("cpu")), time.monotonic_ns())
    active = []

    def start(module, args):
        if not active:
            active.append(tracing.recording(recorder))
            active[0].__enter__()

    def finish(opt, args, kwargs):
        if active:
            recorder.end_step()
            active.pop().__exit__(None, None, None)

    c.model.register_forward_pre_hook(start)
    c.optimizer.register_step_post_hook(finish)
    return Contender("shardwise.fully_shard+report", c.model, c.optimizer)


def _replicate_with(replicate, case: Case, mesh: DeviceMesh, seed: int) -> nn.Module:
    model = build_plain(case.model, seed)
    for block in model.layers:
        replicate(block, mesh=mesh)
    replicate(model, mesh=mesh)
    return model


def _shardwise_replicate(case: Case, mesh: DeviceMesh, seed: int, optimizer: str) -> Contender:
    from shardwise import replicate

    model = _replicate_with(replicate, case, mesh, seed)
    return Contender("shardwise.replicate", model, make_optimizer(model, optimizer))


def _torch_replicate(case: Case, mesh: DeviceMesh, seed: int, optimizer: str) -> Contender:
    from torch.distributed._composable.replicate_with_fsdp import replicate

    model = _replicate_with(replicate, case, mesh, seed)
    return Contender("torch.replicate", model, make_optimizer(model, optimizer))


def _torch_ddp(case: Case, mesh: DeviceMesh, seed: int, optimizer: str) -> Contender:
    from torch.nn.parallel import DistributedDataParallel

    model = DistributedDataParallel(build_plain(case.model, seed), process_group=mesh.get_group())
    return Contender("torch.DDP", model, make_optimizer(model, optimizer))


def _torch_ddp_matched(case: Case, mesh: DeviceMesh, seed: int, optimizer: str) -> Contender:
    """DDP with its bucket cap at the model's bytes over the number of ``replicate`` calls
    (blocks + root): about one all-reduce per call, as the replicate API issues. Buckets
    follow DDP's own order and size rule, so the count is close, not equal (the JSON's
    ``comm_counts`` has both)."""
    from torch.nn.parallel import DistributedDataParallel

    model = build_plain(case.model, seed)
    calls = len(model.layers) + 1
    cap_mb = sum(p.numel() * p.element_size() for p in model.parameters()) / calls / 2**20
    model = DistributedDataParallel(model, process_group=mesh.get_group(), bucket_cap_mb=cap_mb)
    return Contender("torch.DDP matched", model, make_optimizer(model, optimizer))


_REPLICATE_PEER = {"replicate": _torch_ddp, "torch_replicate": _torch_replicate, "ddp_matched": _torch_ddp_matched}


def build_pair(case: Case, mesh: DeviceMesh, seed: int, optimizer: str) -> tuple[Contender, Contender]:
    """``(shardwise, torch)`` for ``case`` on the 1-D CPU ``mesh``, from identical weights
    (for ``report``: ``(shardwise with the report recording, shardwise without)``)."""
    if case.kind == "fsdp":
        return _shardwise_fsdp(case, mesh, seed, optimizer), _torch_fsdp(case, mesh, seed, optimizer)
    if case.kind == "report":
        return _shardwise_fsdp_reported(case, mesh, seed, optimizer), _shardwise_fsdp(case, mesh, seed, optimizer)
    return _shardwise_replicate(case, mesh, seed, optimizer), _REPLICATE_PEER[case.kind](case, mesh, seed, optimizer)
