"""Apply FSDP2-style sharding to the blocks of a model, with shardwise's ``fully_shard`` or torch's.

The wrapping is the usual one for transformers: one FSDP unit per block, so only one
block's full parameters need exist at a time, then the root for what is left (embeddings,
final norm, output head)::

    for block in blocks:
        fully_shard(block, mesh=mesh, mp_policy=mp, offload_policy=offload, reshard_after_forward=raf)
    fully_shard(model, mesh=mesh, mp_policy=mp, offload_policy=offload)

``--impl torch`` runs the same calls on ``torch.distributed.fsdp.fully_shard`` (read through
:func:`shardwise.switch.torch_objects`, the library's one door to torch's FSDP), so one
command compares the two. ``mesh`` is 1-D for FSDP and 2-D ``(dp_replicate, dp_shard)`` for
HSDP; tensor-parallel blocks arrive already holding DTensors on the ``tp`` mesh.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Iterable, NamedTuple

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

__all__ = ["IMPLS", "MIXED_PRECISION", "FSDPApi", "ShardOptions", "load_fsdp_api", "shard_model"]

logger = logging.getLogger(__name__)

IMPLS = ("shardwise", "torch")
"""Values of ``--impl``: this project's ``fully_shard``, or torch's (``torch.distributed.fsdp``)."""

MIXED_PRECISION = ("none", "bf16")
"""Values of ``--mixed-precision``: fp32 throughout, or bf16 compute with fp32 gradient reduction."""


class FSDPApi(NamedTuple):
    """The names a training loop needs from an FSDP2 implementation."""

    fully_shard: Callable[..., Any]
    MixedPrecisionPolicy: type
    CPUOffloadPolicy: type


class ShardOptions(NamedTuple):
    """How every ``fully_shard`` call of a run is made (the flags of the same names)."""

    impl: str = "shardwise"
    mixed_precision: str = "none"
    reshard_after_forward: bool | int = True  # the blocks'; the root keeps the implementation's default
    cpu_offload: bool = False


def load_fsdp_api(impl: str) -> FSDPApi:
    """``fully_shard`` and the policies of the implementation named ``impl``."""
    if impl == "shardwise":
        import shardwise

        return FSDPApi(shardwise.fully_shard, shardwise.MixedPrecisionPolicy, shardwise.CPUOffloadPolicy)
    if impl == "torch":
        from shardwise.switch import torch_objects

        objs = torch_objects()
        return FSDPApi(objs["fully_shard"], objs["MixedPrecisionPolicy"], objs["CPUOffloadPolicy"])
    raise ValueError(f"unknown FSDP implementation {impl!r}; expected one of {IMPLS}")


def _mp_policy(api: FSDPApi, mixed_precision: str) -> Any:
    if mixed_precision == "none":
        return api.MixedPrecisionPolicy()
    if mixed_precision == "bf16":
        return api.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    raise ValueError(f"unknown mixed precision {mixed_precision!r}; expected one of {MIXED_PRECISION}")


def _offload_policy(api: FSDPApi, cpu_offload: bool, device: torch.device) -> dict[str, Any]:
    if not cpu_offload:
        return {}
    return {"offload_policy": api.CPUOffloadPolicy(pin_memory=device.type == "cuda")}


def shard_model(model: nn.Module, blocks: Iterable[nn.Module], mesh: DeviceMesh, opts: ShardOptions) -> nn.Module:
    """Shard every module of ``blocks``, then ``model`` itself; returns ``model``.

    Args:
        model: the root (a GPT or a Transformers causal LM), on the meta device or its own.
        blocks: its transformer blocks, in forward order (each becomes one FSDP unit).
        mesh: the data-parallel mesh: 1-D (FSDP) or 2-D ``(dp_replicate, dp_shard)`` (HSDP).
        opts: implementation, mixed precision, the blocks' ``reshard_after_forward``, CPU offload.
    """
    api = load_fsdp_api(opts.impl)
    common = {"mesh": mesh, "mp_policy": _mp_policy(api, opts.mixed_precision),
              **_offload_policy(api, opts.cpu_offload, torch.device(mesh.device_type))}
    n_blocks = 0
    for block in blocks:
        api.fully_shard(block, reshard_after_forward=opts.reshard_after_forward, **common)
        n_blocks += 1
    api.fully_shard(model, **common)
    logger.info("sharded %d blocks + root with %s fully_shard on %s (%s)", n_blocks, opts.impl, mesh, opts)
    return model
