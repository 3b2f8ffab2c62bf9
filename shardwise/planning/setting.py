"""The facts of one training setup that the memory and communication models read.

A :class:`Setting` is everything about a run except the wrapping itself: how many ranks
shard and replicate, which dtypes gather and reduce, which device and backend (they
decide the prefetch depth and the kind of the gradient reduction), which optimizer.
"""

from __future__ import annotations

import dataclasses

import torch

__all__ = ["Setting", "DTYPES", "dtype_name", "parse_dtype", "OPTIMIZER_STATES"]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}

OPTIMIZER_STATES = {"adamw": 2, "adam": 2, "sgd": 1, "none": 0}
"""Tensors of optimizer state per parameter (exp_avg and exp_avg_sq; momentum)."""


def dtype_name(dtype: torch.dtype | None) -> str | None:
    return None if dtype is None else str(dtype).removeprefix("torch.")


def parse_dtype(name: str | None) -> torch.dtype | None:
    if name is None:
        return None
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; expected one of {sorted(DTYPES)}")
    return DTYPES[name]


@dataclasses.dataclass(frozen=True)
class Setting:
    """One run's parallel layout, precision and optimizer (what the wrapping does not decide)."""

    shard_size: int
    """Ranks a parameter is sharded over (the mesh's shard dim; the world size for FSDP)."""
    replicate_size: int = 1
    """Ranks of the replicate dim (HSDP); 1 for plain FSDP."""
    device: str = "cuda"
    """``cpu`` (gloo: implicit forward prefetch, all-to-all reduce) or ``cuda`` (NCCL)."""
    param_dtype: str | None = None
    """MixedPrecisionPolicy.param_dtype: the dtype gathered and computed in; None keeps the params'."""
    reduce_dtype: str | None = None
    """MixedPrecisionPolicy.reduce_dtype; None: param_dtype, else the gradients'."""
    optimizer: str = "adamw"
    """``adamw``, ``adam``, ``sgd`` (with momentum) or ``none``: how many state tensors per parameter."""
    foreach: bool | None = None
    """Multi-tensor optimizer step (one temporary of all shards at once); None: torch's default
    (foreach on CUDA, a per-parameter loop on CPU)."""
    offload: bool = False
    """CPUOffloadPolicy: sharded params, grads and optimizer state live in host memory."""

    def __post_init__(self) -> None:
        if self.shard_size < 1 or self.replicate_size < 1:
            raise ValueError(f"shard_size and replicate_size must be >= 1, got {self.shard_size}, {self.replicate_size}")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {self.device!r}")
        if self.optimizer not in OPTIMIZER_STATES:
            raise ValueError(f"optimizer must be one of {sorted(OPTIMIZER_STATES)}, got {self.optimizer!r}")
        parse_dtype(self.param_dtype)
        parse_dtype(self.reduce_dtype)

    @property
    def world_size(self) -> int:
        return self.shard_size * self.replicate_size

    def param_itemsize(self, orig: int) -> int:
        """Bytes per element gathered (and computed in)."""
        dtype = parse_dtype(self.param_dtype)
        return orig if dtype is None else dtype.itemsize

    def reduce_itemsize(self, orig: int) -> int:
        """Bytes per element reduced: reduce_dtype, else param_dtype, else the gradients' own."""
        dtype = parse_dtype(self.reduce_dtype) or parse_dtype(self.param_dtype)
        return orig if dtype is None else dtype.itemsize

    @property
    def uses_foreach(self) -> bool:
        return self.device == "cuda" if self.foreach is None else self.foreach
