"""What a ``shardwise train`` run is asked to do (:class:`TrainConfig`) and what it measured (:class:`TrainResult`).

Both live below :mod:`~shardwise.train.loop` and :mod:`~shardwise.train.summary`, which
each import them, so neither needs the other (the report draws what the loop returns).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from shardwise.train.data import DEFAULT_MAX_BYTES, VOCAB_SIZE
from shardwise.train.distributed import mesh_dims
from shardwise.train.fault_tolerance import FAULT_TOLERANCE
from shardwise.train.model import PRESETS, GPTConfig
from shardwise.train.pipeline import DEFAULT_SCHEDULE, stages_per_rank
from shardwise.train.sharding import IMPLS, MIXED_PRECISION

if TYPE_CHECKING:
    from shardwise.comm_stats import CommStats

__all__ = ["TrainConfig", "TrainResult", "LR_SCHEDULES", "AC_MODES", "parse_reshard"]

LR_SCHEDULES = ("constant", "cosine")
"""Values of ``--lr-schedule``."""

AC_MODES = ("none", "full", "selective")
"""Values of ``--ac``: no activation checkpointing, every block recomputed in backward, or
every block recomputed except the outputs of its matmuls and attention (see :mod:`~shardwise.train.parallel`)."""


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
    """A directory written by ``shardwise data prepare`` (memory-mapped, see :mod:`~shardwise.train.inputs`), or a
    text file or directory read into memory; ``None`` uses the Python standard library's sources."""
    data_bytes: int = DEFAULT_MAX_BYTES
    """Read at most this many bytes of a text ``data`` (a prepared directory is memory-mapped whole)."""
    lr_schedule: str = "constant"
    """``constant``, or ``cosine``: linear warm-up over ``warmup_steps``, then cosine decay to 10% at ``steps``."""
    warmup_steps: int = 0
    """Steps of linear learning-rate warm-up (``cosine`` schedule only)."""
    metrics: str | None = None
    """Append one JSON line per optimizer step to this file (rank 0 writes it; see :mod:`~shardwise.train.metrics`)."""
    reshard_after_forward: bool | int = True
    """``fully_shard``'s ``reshard_after_forward`` for every block (the root keeps torch's default):
    ``True``, ``False``, or an int ``k`` (keep a copy sharded over ``k`` ranks between forward and backward)."""
    report: str | None = None
    """Write a step report (timing, overlap, memory, plots) into this directory; see :func:`shardwise.report`."""
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
    # ---- models from Transformers (see train/hf.py); either replaces --model
    hf_config: str | None = None
    """A Transformers ``config.json`` (or a directory holding one): a causal LM built from it, randomly initialised."""
    hf_model: str | None = None
    """A directory of a Transformers causal LM (``config.json``, safetensors weights, tokenizer if any) to fine-tune."""
    # ---- parallelism and memory knobs (see train/parallel.py)
    replicate: int = 1
    """HSDP: shard within groups of ``world / (replicate * tp)`` ranks, replicate across ``replicate`` of them."""
    tp: int = 1
    """Tensor-parallel degree inside each block (heads and MLP hidden units split); 1 is off."""
    pp: int = 1
    """Pipeline-parallel degree: the blocks cut into stages over a ``pp`` mesh dim (see :mod:`~shardwise.train.pipeline`); 1 is off."""
    pp_schedule: str = DEFAULT_SCHEDULE
    """``--pp``'s schedule, one of :data:`~shardwise.train.pipeline.SCHEDULES` (single-stage: one stage per rank; else two)."""
    pp_microbatches: int | None = None
    """Microbatches per step under ``--pp`` (each ``batch_size / pp_microbatches`` sequences); ``None``: the number of stages."""
    ac: str = "none"
    """Activation checkpointing of every block: ``none``, ``full`` or ``selective``."""
    compile: bool = False
    """``torch.compile`` every block (before sharding, as torchtitan does)."""
    compile_backend: str = "inductor"
    """The ``torch.compile`` backend for ``compile`` (``aot_eager`` compiles fast, for tests)."""
    grad_accum: int = 1
    """Micro-batches per optimizer step; ``batch_size`` is split into this many, gradients sync on the last only."""
    clip_norm: float | None = None
    """Clip the global gradient norm to this (``shardwise.clip_grad_norm_``); ``None`` clips nothing."""
    cpu_offload: bool = False
    """Keep sharded parameters, gradients and optimizer state in host memory (``CPUOffloadPolicy``)."""
    float8: bool = False
    """torchao float8 training of the blocks' linears, all-gathered in float8, scales precomputed after
    each optimizer step (see :mod:`~shardwise.train.float8`)."""
    # ---- watching the run
    tensorboard: str | None = None
    """Write TensorBoard scalars (loss, lr, grad norm, tokens/s, step time, peak memory, wire bytes) here."""
    eval_every: int = 0
    """Every this many steps, report the loss on held-out data (a prepared ``data``'s held-out split, else
    the text's last 10%); 0 is off."""
    # ---- fault tolerance across replica groups (see train/fault_tolerance.py)
    fault_tolerance: str = "none"
    """``torchft``: this job is one replica group of torchft's fault-tolerant HSDP; ``none`` is off."""
    replica_groups: int | None = None
    """Replica groups the job starts with (R); ``None`` reads ``$NUM_REPLICA_GROUPS``."""
    replica_group_id: int | None = None
    """Which replica group this job is, ``0 <= id < R``; ``None`` reads ``$REPLICA_GROUP_ID``."""
    lighthouse: str | None = None
    """torchft's lighthouse, ``http://HOST:PORT``; ``None`` reads ``$TORCHFT_LIGHTHOUSE``."""
    async_quorum: bool = False
    """Compute each step's quorum (and a heal's transfer) in a thread during forward, as torchtitan does."""
    ft_timeout_s: float = 60.0
    """torchft's timeout for a quorum, a collective across groups and a heal's transfer; the commit
    vote waits twice this (``fault_tolerance.VOTE_TIMEOUTS``)."""

    def __post_init__(self) -> None:
        self._check_model()
        self._check_parallelism()
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
        self._check_fault_tolerance()
        self._check_pipeline()

    def _check_pipeline(self) -> None:
        stages_per_rank(self.pp_schedule)  # a known schedule
        named = [f for f, on in (("--pp-schedule", self.pp_schedule != DEFAULT_SCHEDULE),
                                 ("--pp-microbatches", self.pp_microbatches is not None)) if on]
        if self.pp == 1:
            if named:
                raise ValueError(f"{', '.join(named)} configure pipeline parallelism: add --pp N")
            return
        clashes = [flag for flag, on in (("--grad-accum", self.grad_accum > 1), ("--auto", self.auto),
                                         ("--fault-tolerance", self.fault_tolerance != "none"),
                                         ("--float8", self.float8), ("--report", self.report is not None)) if on]
        if clashes:
            raise ValueError(f"--pp with {', '.join(clashes)} is not supported: a pipeline's microbatches are its "
                             "gradient accumulation (--pp-microbatches); drop one of them")
        m = self.n_microbatches
        if m < 1 or self.batch_size % m:
            raise ValueError(f"--pp-microbatches {m} must divide --batch-size {self.batch_size} "
                             "(each microbatch is batch_size / pp_microbatches sequences)")

    @property
    def n_stages(self) -> int:
        """Pipeline stages in all (``pp`` x stages per rank of the schedule)."""
        return self.pp * stages_per_rank(self.pp_schedule)

    @property
    def n_microbatches(self) -> int:
        """Microbatches per step of ``--pp`` (``pp_microbatches``, else one per stage)."""
        return self.pp_microbatches if self.pp_microbatches is not None else self.n_stages

    def _check_model(self) -> None:
        if self.hf_config is not None and self.hf_model is not None:
            raise ValueError("--hf-config and --hf-model are exclusive: build from a config, or load a model")
        if self.auto and (self.is_hf or self.tp > 1 or self.replicate > 1 or self.ac != "none" or self.compile
                          or self.cpu_offload or self.grad_accum > 1 or self.float8):
            raise ValueError("--auto plans a GPT preset on a 1-D mesh only; drop --auto or the other "
                             "model / parallelism flags")

    def _check_parallelism(self) -> None:
        for name in ("replicate", "tp", "pp", "grad_accum"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.batch_size % self.grad_accum:
            raise ValueError(f"--grad-accum {self.grad_accum} must divide --batch-size {self.batch_size} "
                             "(each micro-batch is batch_size / grad_accum sequences)")
        if self.ac not in AC_MODES:
            raise ValueError(f"ac must be one of {AC_MODES}, got {self.ac!r}")
        if self.clip_norm is not None and not self.clip_norm > 0:
            raise ValueError(f"clip_norm must be > 0, got {self.clip_norm}")
        raf = self.reshard_after_forward
        if not isinstance(raf, bool) and (not isinstance(raf, int) or raf < 2):
            raise ValueError(f"reshard_after_forward must be true, false or an int >= 2, got {raf!r}")
        if self.eval_every < 0:
            raise ValueError(f"eval_every must be >= 0, got {self.eval_every}")
        if self.float8 and not isinstance(raf, bool):
            raise ValueError(f"--float8 with --reshard-after-forward {raf}: a float8 weight has no post-forward "
                             "shard (torch's FSDP2 refuses it too); use true or false")

    def _check_fault_tolerance(self) -> None:
        if self.fault_tolerance not in FAULT_TOLERANCE:
            raise ValueError(f"fault_tolerance must be one of {FAULT_TOLERANCE}, got {self.fault_tolerance!r}")
        if self.fault_tolerance == "none":
            named = [f for f in ("replica_groups", "replica_group_id", "lighthouse") if getattr(self, f) is not None]
            named += ["async_quorum"] if self.async_quorum else []
            if named:
                flags = ", ".join("--" + f.replace("_", "-") for f in named)
                raise ValueError(f"{flags} configure replica groups: add --fault-tolerance torchft")
            return
        if self.replicate > 1 or self.tp > 1 or self.auto:
            raise ValueError("--fault-tolerance torchft shards each replica group over its own ranks (1-D FSDP): "
                             "drop --replicate / --tp / --auto; the replica groups are the replicate dim")
        if self.float8:
            raise ValueError("--float8 with --fault-tolerance torchft is not supported yet: a heal replaces the "
                             "weights outside the optimizer step, where float8's scales are precomputed; drop one")
        if self.replica_groups is not None and self.replica_groups < 1:
            raise ValueError(f"replica_groups must be >= 1, got {self.replica_groups}")
        if not self.ft_timeout_s > 0:
            raise ValueError(f"ft_timeout_s must be > 0, got {self.ft_timeout_s}")

    @property
    def is_hf(self) -> bool:
        """Whether the model comes from Transformers (``--hf-config`` / ``--hf-model``)."""
        return self.hf_config is not None or self.hf_model is not None

    @property
    def micro_batch_size(self) -> int:
        return self.batch_size // self.grad_accum

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

    def check_world(self, world_size: int) -> None:
        """What depends on the number of ranks; raises ``ValueError`` before any rank starts work."""
        dims = mesh_dims(world_size, self.replicate, self.tp, self.pp)
        shard = dims.get("dp", dims.get("dp_shard"))
        raf = self.reshard_after_forward
        if not isinstance(raf, bool) and shard % raf:
            raise ValueError(f"--reshard-after-forward {raf} must divide the {shard} ranks each parameter is "
                             f"sharded over (mesh {dims}); use a divisor of {shard}, true or false")

    def model_config(self) -> GPTConfig:
        """The preset, with ``seq_len`` overridden when given, over the byte vocabulary."""
        overrides = {"vocab_size": VOCAB_SIZE}
        if self.seq_len is not None:
            overrides["seq_len"] = self.seq_len
        return GPTConfig.preset(self.model, **overrides)


def parse_reshard(text: str) -> bool | int:
    """``--reshard-after-forward`` from the command line: ``true``, ``false`` or an int."""
    lowered = text.strip().lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    try:
        return int(lowered)
    except ValueError:
        raise ValueError(f"--reshard-after-forward takes true, false or an int, got {text!r}") from None


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
    dp_size: int = 0  # data-parallel ranks (world_size / tp); 0: same as world_size
    flops_per_token: float = 0.0  # forward + backward model FLOPs per token (6N + attention); 0: unknown
    peak_flops: float | None = None  # the device's peak FLOP/s per rank at the run's precision; None: unknown
    eval_losses: dict[int, float] = dataclasses.field(default_factory=dict)  # --eval-every: step -> held-out loss
    stopped_by: int = 0  # the signal (SIGTERM, SIGINT) that ended the run early; 0: it ran to its end

    @property
    def exit_code(self) -> int:
        """The job's exit status: 128 + the signal that stopped it (the shell's convention), 0 when it ran to its end."""
        return 128 + self.stopped_by if self.stopped_by else 0

    @property
    def tokens_per_s(self) -> float:
        return self.steps * self.tokens_per_step / max(self.wall_s, 1e-9)

    @property
    def mfu(self) -> float | None:
        """Model FLOPs utilisation over all ranks, or ``None`` when the device's peak is not known."""
        if not self.peak_flops or not self.flops_per_token:
            return None
        return self.tokens_per_s * self.flops_per_token / (self.peak_flops * self.world_size)

    @property
    def wire_bytes_per_step(self) -> float | None:
        """Bytes this rank sent per step (ring model), or ``None`` when nothing was tallied."""
        return None if self.comm is None else self.comm.total_wire_bytes / max(1, self.steps)
