"""Apply FSDP2-style sharding to a :class:`~shardwise.train.model.GPT`.

The library never imports torch's own FSDP; to compare this job's model against
``torch.distributed.fsdp.fully_shard`` step for step, run the benchmark
(``python -m bench``), which drives both implementations on the same presets.

The wrapping is the usual one for transformers: one FSDP unit per block, so only one
block's full parameters need exist at a time, then the root for what is left (embeddings,
final norm, output head)::

    for block in model.layers:
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
"""

from __future__ import annotations

import logging
from typing import Any, Callable, NamedTuple

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

__all__ = ["IMPLS", "MIXED_PRECISION", "FSDPApi", "load_fsdp_api", "shard_model"]

logger = logging.getLogger(__name__)

IMPLS = ("shardwise",)
"""Values of ``--impl``."""

MIXED_PRECISION = ("none", "bf16")
"""Values of ``--mixed-precision``: fp32 throughout, or bf16 compute with fp32 gradient reduction."""


class FSDPApi(NamedTuple):
    """The two names a training loop needs from an FSDP2 implementation."""

    fully_shard: Callable[..., Any]
    MixedPrecisionPolicy: type


def _import_shardwise() -> FSDPApi:
    from shardwise import MixedPrecisionPolicy, fully_shard

    return FSDPApi(fully_shard, MixedPrecisionPolicy)


def load_fsdp_api(impl: str) -> FSDPApi:
    """``fully_shard`` and ``MixedPrecisionPolicy`` of the implementation named ``impl``."""
    if impl == "shardwise":
        return _import_shardwise()
    raise ValueError(f"unknown FSDP implementation {impl!r}; expected one of {IMPLS}")


def _mp_policy(api: FSDPApi, mixed_precision: str) -> Any:
    if mixed_precision == "none":
        return api.MixedPrecisionPolicy()
    if mixed_precision == "bf16":
        return api.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    raise ValueError(f"unknown mixed precision {mixed_precision!r}; expected one of {MIXED_PRECISION}")


def shard_model(
    model: nn.Module, mesh: DeviceMesh, impl: str, mixed_precision: str = "none", reshard_after_forward: bool = True
) -> nn.Module:
    """Shard every block of ``model.layers``, then ``model`` itself; returns ``model``.

    Args:
        model: a module with a ``layers`` ``nn.ModuleList`` (a :class:`GPT`), already on the mesh's device.
        mesh: the 1-D data-parallel mesh to shard over.
        impl: ``"shardwise"`` (the only implementation the library ships).
        mixed_precision: ``"none"`` or ``"bf16"`` (bf16 parameters and compute, fp32 gradient reduction).
        reshard_after_forward: passed to every block's ``fully_shard``; the root keeps the default
            (its parameters stay gathered after forward, as backward needs them first).
    """
    api = load_fsdp_api(impl)
    mp = _mp_policy(api, mixed_precision)
    for block in model.layers:
        api.fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    api.fully_shard(model, mesh=mesh, mp_policy=mp)
    n_blocks = len(model.layers)
    logger.info("sharded %d blocks + root with %s fully_shard (mixed precision %s)", n_blocks, impl, mixed_precision)
    return model
