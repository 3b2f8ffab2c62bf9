"""What to benchmark: one :class:`Case` per row of the report, and the grids of them.

A case pairs shardwise with the torch API it reimplements, on one model, world size and
precision:

- ``kind="fsdp"``: ``shardwise.fully_shard`` vs ``torch.distributed.fsdp.fully_shard``,
  each applied per transformer block and then to the root, with ``reshard_after_forward``
  passed explicitly to every call (so the root reshards too when it is True).
- ``kind="replicate"``: ``shardwise.replicate`` per block and root vs torch's
  ``DistributedDataParallel`` on the whole model; fp32 only, no resharding.
- ``kind="torch_replicate"``: the same ``shardwise.replicate`` vs the API it reimplements,
  torch's ``replicate`` (``torch.distributed._composable.replicate_with_fsdp``), applied
  the same way, per block and root; fp32 only.
- ``kind="ddp_matched"``: the same ``shardwise.replicate`` vs DDP with buckets sized so it
  issues about as many all-reduces as there are ``replicate`` calls (opt-in peer
  ``ddp-matched``): what the API's one all-reduce per call costs DDP itself, apart from
  the wrapper.
- ``kind="report"``: ``shardwise.fully_shard`` with the step report recording
  (``shardwise.report``'s recorder active during its steps) vs the same without: the
  report's overhead (``--report-overhead``).

The full grid is model x world size x reshard x dtype for fsdp, plus model x world size
x peer (DDP, torch's replicate) for replicate; ``--quick`` is the small corner of it that
finishes in under two minutes.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable

from shardwise.train.model import PRESETS

__all__ = ["KINDS", "REPLICATE_PEERS", "REPLICATE_KINDS", "DTYPES", "Case", "Settings", "fsdp_cases", "replicate_cases", "report_cases"]

KINDS = ("fsdp", "replicate", "torch_replicate", "ddp_matched", "report")
REPLICATE_PEERS = {"ddp": "replicate", "torch": "torch_replicate", "ddp-matched": "ddp_matched"}
"""``--replicate-peers`` value -> the case kind comparing shardwise.replicate with that peer."""
REPLICATE_KINDS = tuple(REPLICATE_PEERS.values())
"""The kinds whose shardwise side is ``replicate``: fp32, no reshard, one gradient all-reduce."""
DTYPES = ("fp32", "bf16")


@dataclasses.dataclass(frozen=True)
class Case:
    """One side-by-side comparison; validated on construction."""

    kind: str
    """``fsdp`` (fully_shard vs torch fully_shard), ``replicate`` (replicate vs DDP),
    ``torch_replicate`` (replicate vs torch's replicate) or ``ddp_matched`` (replicate vs
    DDP issuing as many all-reduces)."""
    model: str
    """GPT preset: ``tiny`` (~1M), ``small`` (~10M) or ``medium`` (~50M parameters)."""
    world_size: int
    """Number of gloo ranks."""
    reshard: bool | None = None
    """``reshard_after_forward`` for every fully_shard call; None for replicate (nothing is sharded)."""
    dtype: str = "fp32"
    """``fp32``, or ``bf16``: MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)."""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"Case.kind must be one of {KINDS}, got {self.kind!r}")
        if self.model not in PRESETS:
            raise ValueError(f"Case.model must be one of {sorted(PRESETS)}, got {self.model!r}")
        if self.world_size < 2:
            raise ValueError(f"Case.world_size must be >= 2, got {self.world_size}")
        if self.dtype not in DTYPES:
            raise ValueError(f"Case.dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.kind in ("fsdp", "report") and not isinstance(self.reshard, bool):
            raise ValueError(f"an {self.kind} Case needs reshard=True/False, got {self.reshard!r}")
        if self.kind in REPLICATE_KINDS and (self.reshard is not None or self.dtype != "fp32"):
            raise ValueError(f"a {self.kind} Case is fp32 with reshard=None, got dtype={self.dtype}, reshard={self.reshard}")

    @property
    def label(self) -> str:
        """Short row name for the table, e.g. ``small ws4 rs=T bf16``, ``tiny ws2 replicate``
        (vs DDP) or ``tiny ws2 vs torch replicate``."""
        if self.kind == "replicate":
            return f"{self.model} ws{self.world_size} replicate"
        if self.kind == "torch_replicate":
            return f"{self.model} ws{self.world_size} vs torch replicate"
        if self.kind == "ddp_matched":
            return f"{self.model} ws{self.world_size} vs DDP matched buckets"
        label = f"{self.model} ws{self.world_size} rs={'T' if self.reshard else 'F'} {self.dtype}"
        return f"{label} report" if self.kind == "report" else label


OPTIMIZERS = ("foreach", "loop")


@dataclasses.dataclass(frozen=True)
class Settings:
    """How every case is measured; the same for all cases of a run."""

    warmup: int = 2
    """Untimed steps per implementation before timing (lazy init, DDP bucket rebuild, allocator)."""
    steps: int = 10
    """Timed steps per implementation, interleaved with the other implementation's."""
    batch_size: int = 1
    """Sequences per rank per step (each of the preset's ``seq_len`` tokens)."""
    seed: int = 0
    """Seeds the model initialisation (identical for both implementations) and the data."""
    profile: bool = False
    """Also run one cProfile'd step per implementation on rank 0 and keep its top costs."""
    optimizer: str = "foreach"
    """AdamW's implementation for every contender: ``foreach`` (torch's default on GPUs: a
    few multi-tensor kernels per step) or ``loop`` (torch's default on CPU: ~15 ops per
    parameter, each through DTensor dispatch for sharded/replicated parameters)."""

    def __post_init__(self) -> None:
        if self.warmup < 0:
            raise ValueError(f"Settings.warmup must be >= 0, got {self.warmup}")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"Settings.optimizer must be one of {OPTIMIZERS}, got {self.optimizer!r}")
        for name in ("steps", "batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"Settings.{name} must be >= 1, got {getattr(self, name)}")


def fsdp_cases(models: Iterable[str], world_sizes: Iterable[int], reshards: Iterable[bool], dtypes: Iterable[str]) -> list[Case]:
    """The fully_shard grid, ordered world size, model, dtype, reshard (one launch per world size)."""
    return [
        Case("fsdp", m, ws, rs, dt)
        for ws in world_sizes
        for m in models
        for dt in dtypes
        for rs in reshards
    ]  # fmt: skip


def replicate_cases(models: Iterable[str], world_sizes: Iterable[int], peers: Iterable[str] = ("ddp",)) -> list[Case]:
    """replicate vs each peer (``ddp``, ``torch``: :data:`REPLICATE_PEERS`) for each model and world size (fp32)."""
    return [Case(REPLICATE_PEERS[peer], m, ws) for ws in world_sizes for m in models for peer in peers]


def report_cases(models: Iterable[str], world_sizes: Iterable[int], reshards: Iterable[bool]) -> list[Case]:
    """fully_shard with the step report recording vs without, fp32 (``--report-overhead``)."""
    return [Case("report", m, ws, rs) for ws in world_sizes for m in models for rs in reshards]
