"""Configuration objects for :func:`shardwise.fully_shard`: frozen, validated on construction.

They mirror ``torch.distributed.fsdp``'s policies field for field, so a training script can
switch imports without touching its configuration.
"""

from __future__ import annotations

import dataclasses

import torch

__all__ = ["MixedPrecisionPolicy", "OffloadPolicy", "CPUOffloadPolicy", "DataParallelMeshDims"]


def _check_float_dtype(field: str, dtype: torch.dtype | None) -> None:
    if dtype is None:
        return
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"MixedPrecisionPolicy.{field} must be a torch.dtype or None, got {dtype!r}")
    if not dtype.is_floating_point:
        raise ValueError(
            f"MixedPrecisionPolicy.{field} must be a floating-point dtype "
            f"(torch.float32, torch.bfloat16, torch.float16, ...), got {dtype}"
        )


@dataclasses.dataclass(frozen=True)
class MixedPrecisionPolicy:
    """How parameters, gradients and activations are cast around the collectives.

    Attributes:
        param_dtype: dtype of the unsharded parameters used in forward/backward. The
            shard is cast *before* the all-gather, so bf16/fp16 halve the bytes on the
            wire. ``None`` keeps the original dtype. The sharded parameters (what the
            optimizer updates) always keep their original dtype.
        reduce_dtype: dtype of the gradient reduction. ``None`` means ``param_dtype``.
            Reduced gradients are stored on the sharded parameter in its original dtype.
        output_dtype: if set, floating-point forward outputs are cast to it.
        cast_forward_inputs: cast floating-point forward inputs to ``param_dtype``.
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True

    def __post_init__(self) -> None:
        for field in ("param_dtype", "reduce_dtype", "output_dtype"):
            _check_float_dtype(field, getattr(self, field))
        if not isinstance(self.cast_forward_inputs, bool):
            raise TypeError(
                f"MixedPrecisionPolicy.cast_forward_inputs must be a bool, got {self.cast_forward_inputs!r}"
            )


@dataclasses.dataclass(frozen=True)
class OffloadPolicy:
    """The default: no offloading; sharded state lives on the mesh's device."""


@dataclasses.dataclass(frozen=True)
class CPUOffloadPolicy(OffloadPolicy):
    """Keep sharded parameters, their gradients (and so the optimizer state) in host memory.

    Each unshard copies the shard to the device before the all-gather; each reduction
    copies the reduced gradient back, so the optimizer steps on the host.

    Attributes:
        pin_memory: pin the host copies so host-device copies can overlap compute. Only
            meaningful when an accelerator exists; on a CPU-only machine there is nothing
            to pin and the flag is accepted and ignored.
    """

    pin_memory: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.pin_memory, bool):
            raise TypeError(f"CPUOffloadPolicy.pin_memory must be a bool, got {self.pin_memory!r}")


@dataclasses.dataclass(frozen=True)
class DataParallelMeshDims:
    """Which dims of a full SPMD mesh are data parallel, for params already DTensors on it.

    Pass it as ``fully_shard(module, mesh=spmd_mesh, dp_mesh_dims=...)`` when the model was
    parallelized on the whole mesh (e.g. ``(dp_replicate, dp_shard, tp)``) and its params are
    ``Replicate()`` on the data-parallel dims: fully_shard then shards over ``shard`` and
    reduces over ``replicate``, leaving the other placements as they are.

    Attributes:
        shard: mesh dim name FSDP shards parameters over.
        replicate: mesh dim name gradients are all-reduced over (HSDP).
    """

    shard: str | tuple[str, ...] | None = None
    replicate: str | tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if self.shard is None and self.replicate is None:
            raise ValueError("DataParallelMeshDims needs at least one of shard= and replicate=")

    @property
    def shard_names(self) -> tuple[str, ...]:
        return _names(self.shard)

    @property
    def replicate_names(self) -> tuple[str, ...]:
        return _names(self.replicate)


def _names(value: str | tuple[str, ...] | None) -> tuple[str, ...]:
    if value is None:
        return ()
    return (value,) if isinstance(value, str) else tuple(value)


def check_policies(mp_policy: object, offload_policy: object) -> tuple[MixedPrecisionPolicy, OffloadPolicy]:
    """The policies as shardwise objects; torch's own policy objects are converted field by
    field, anything else is a TypeError naming the argument."""
    return _as_mp_policy(mp_policy), _as_offload_policy(offload_policy)


def _as_mp_policy(policy: object) -> MixedPrecisionPolicy:
    if isinstance(policy, MixedPrecisionPolicy):
        return policy
    fields = ("param_dtype", "reduce_dtype", "output_dtype", "cast_forward_inputs")
    if type(policy).__name__ == "MixedPrecisionPolicy" and all(hasattr(policy, f) for f in fields):
        return MixedPrecisionPolicy(**{f: getattr(policy, f) for f in fields})
    raise TypeError(
        f"mp_policy must be a shardwise.MixedPrecisionPolicy, got {type(policy).__name__}: {policy!r}"
    )


def _as_offload_policy(policy: object) -> OffloadPolicy:
    if isinstance(policy, OffloadPolicy):
        return policy
    name = type(policy).__name__
    if name == "CPUOffloadPolicy" and hasattr(policy, "pin_memory"):
        return CPUOffloadPolicy(pin_memory=policy.pin_memory)
    if name == "OffloadPolicy":
        return OffloadPolicy()
    raise TypeError(
        f"offload_policy must be a shardwise.OffloadPolicy or CPUOffloadPolicy, got {name}: {policy!r}"
    )
