"""What a ``shardwise train`` run is asked to do (:class:`TrainConfig`) and what it measured (:class:`TrainResult`).

Both live below :mod:`~shardwise.train.loop` and :mod:`~shardwise.train.report`, which
each import them, so neither needs the other (the report draws what the loop returns).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from shardwise.train.data import DEFAULT_MAX_BYTES, VOCAB_SIZE
from shardwise.train.model import PRESETS, GPTConfig
from shardwise.train.sharding import IMPLS, MIXED_PRECISION

if TYPE_CHECKING:
    from shardwise.comm_stats import CommStats

__all__ = ["TrainConfig", "TrainResult", "LR_SCHEDULES"]

LR_SCHEDULES = ("constant", "cosine")
"""Values of ``--lr-schedule``."""


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Everything a run needs; the CLI flags of ``shardwise train`` map onto these fields."""

    model: str = "tiny"
    """Preset of :class:`GPTConfig`: ``nano`` (~43K), ``tiny`` (~1M), ``small`` (~10M) or ``medium`` (~50M)."""
    steps: int = 150
    """Optimizer steps to run (150 on the tiny model take about a minute on 2 CPU ranks)."""
    batch_size: int = 16
    """Sequences per rank per step; the global batch is ``batch_size * world_size``."""
    seq_len: int | None = None
    """Tokens per sequence; ``None`` uses the preset's ``seq_len``."""
    lr: float = 1e-3
    """AdamW learning rate (constant)."""
    seed: int = 0
    """Seeds the model's initialisation (same on every rank) and each rank's batch sampler."""
    mixed_precision: str = "none"
    """``none`` (fp32) or ``bf16`` (bf16 parameters and compute, fp32 gradient reduction)."""
    impl: str = "shardwise"
    """Which ``fully_shard``: ``shardwise`` (this project) or ``torch`` (``torch.distributed.fsdp``)."""
    device: str = "auto"
    """``auto`` (a GPU per rank when there are enough, else CPU), ``cpu`` or ``cuda``."""
    data: str | None = None
    """A text file or directory to train on; ``None`` uses the Python standard library's sources."""
    data_bytes: int = DEFAULT_MAX_BYTES
    """Read at most this many bytes of the corpus."""
    lr_schedule: str = "constant"
    """``constant``, or ``cosine``: linear warm-up over ``warmup_steps``, then cosine decay to 10% at ``steps``."""
    warmup_steps: int = 0
    """Steps of linear learning-rate warm-up (``cosine`` schedule only)."""
    metrics: str | None = None
    """Append one JSON line per optimizer step to this file (rank 0 writes it; see :mod:`~shardwise.train.metrics`)."""
    checkpoint_dir: str | None = None
    """Directory of checkpoints (DCP format, see :mod:`shardwise.checkpoint`); ``None`` saves none."""
    checkpoint_every: int = 0
    """Save after every this many steps (and after the last); 0 saves only after the last step."""
    keep_last: int = 2
    """Committed checkpoints to keep in ``checkpoint_dir``; older ones are deleted after each save."""
    resume: bool = False
    """Continue from the newest committed checkpoint in ``checkpoint_dir``; start fresh when it has none."""
    async_checkpoint: bool = False
    """Write checkpoints in a background thread (``dcp.async_save``); training waits only for the copy."""
    stop_after: int | None = None
    """End this invocation after this step (checkpointing it) while the schedule still spans ``steps``."""
    auto: bool = False
    """Shard as ``shardwise.plan`` says (``auto_shard``) and report its predicted peak memory
    against the last step's measured peak live tensor bytes."""

    def __post_init__(self) -> None:
        if self.model not in PRESETS:
            raise ValueError(f"model must be one of {sorted(PRESETS)}, got {self.model!r}")
        if self.impl not in IMPLS:
            raise ValueError(f"impl must be one of {IMPLS}, got {self.impl!r}")
        if self.mixed_precision not in MIXED_PRECISION:
            raise ValueError(f"mixed_precision must be one of {MIXED_PRECISION}, got {self.mixed_precision!r}")
        for name in ("steps", "batch_size", "data_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.seq_len is not None and self.seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {self.seq_len}")
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if self.lr_schedule not in LR_SCHEDULES:
            raise ValueError(f"lr_schedule must be one of {LR_SCHEDULES}, got {self.lr_schedule!r}")
        self._check_checkpointing()

    def _check_checkpointing(self) -> None:
        for name in ("warmup_steps", "checkpoint_every"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.keep_last < 1:
            raise ValueError(f"keep_last must be >= 1, got {self.keep_last}")
        if self.stop_after is not None and not 1 <= self.stop_after <= self.steps:
            raise ValueError(f"stop_after must be in [1, steps={self.steps}], got {self.stop_after}")
        wants_dir = [f for f in ("resume", "async_checkpoint") if getattr(self, f)] + (
            ["checkpoint_every"] if self.checkpoint_every else []
        )
        if wants_dir and self.checkpoint_dir is None:
            flags = ", ".join("--" + f.replace("_", "-") for f in wants_dir)
            raise ValueError(f"{flags} need --checkpoint-dir DIR")

    def model_config(self) -> GPTConfig:
        """The preset, with ``seq_len`` overridden when given, over the byte vocabulary."""
        overrides = {"vocab_size": VOCAB_SIZE}
        if self.seq_len is not None:
            overrides["seq_len"] = self.seq_len
        return GPTConfig.preset(self.model, **overrides)


@dataclasses.dataclass(frozen=True)
class TrainResult:
    """What a run measured; identical on every rank except ``losses`` and ``comm``."""

    steps: int  # optimizer steps this invocation ran (after resuming, fewer than cfg.steps)
    world_size: int
    n_params: int  # unsharded parameter count of the model
    tokens_per_step: int  # over all ranks: batch_size * seq_len * world_size
    losses: list[float]  # this rank's loss after each step
    first_loss: float  # step 1's loss, mean over ranks
    final_loss: float  # the last step's loss, mean over ranks
    wall_s: float  # time spent in the steps
    setup_s: float  # corpus, model build and sharding, before the first step
    comm: "CommStats | None"  # this rank's collectives during the steps; None when nothing tallied them
    resumed_from: int = 0  # the checkpoint step this invocation continued from (0: a fresh start)
    predicted_peak_bytes: int | None = None  # --auto: the plan's per-rank peak
    measured_peak_bytes: int | None = None  # --auto: the last step's peak live tensor bytes, max over ranks

    @property
    def tokens_per_s(self) -> float:
        return self.steps * self.tokens_per_step / max(self.wall_s, 1e-9)

    @property
    def wire_bytes_per_step(self) -> float | None:
        """Bytes this rank sent per step (ring model), or ``None`` when nothing was tallied."""
        return None if self.comm is None else self.comm.total_wire_bytes / max(1, self.steps)
