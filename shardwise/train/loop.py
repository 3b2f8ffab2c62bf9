"""The training run of ``shardwise train``, executed by every rank.

One step is plain data parallelism with sharded state: each rank draws its own batch,
runs forward and backward through the ``fully_shard``-ed model (parameters are
all-gathered per block on the way and gradients reduce-scattered back to shards), and
AdamW updates only this rank's shards. Rank 0 draws the progress bar and the summary.

Launch it through the CLI, which starts torchrun for you, or under torchrun directly::

    python -m shardwise train                                   # 2 CPU ranks, tiny model
    python -m shardwise train --nproc 4 --model small --steps 50
    torchrun --standalone --nproc-per-node 2 -m shardwise train

or from Python, inside an already-initialised process group (one rank is enough)::

    import torch.distributed as dist
    from shardwise.train.loop import TrainConfig, train
    from shardwise.train import distributed
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    result = train(TrainConfig(steps=30), distributed.setup("cpu"))
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import TYPE_CHECKING, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from shardwise.train import report
from shardwise.train.data import DEFAULT_MAX_BYTES, VOCAB_SIZE, BatchSampler, load_corpus
from shardwise.train.distributed import DistEnv, setup, teardown
from shardwise.train.model import GPT, PRESETS, GPTConfig, count_params
from shardwise.train.sharding import IMPLS, MIXED_PRECISION, shard_model

if TYPE_CHECKING:
    from shardwise.comm_stats import CommStats

__all__ = [
    "TrainConfig", "TrainResult", "build_model", "build_optimizer", "train_step", "mean_across_ranks", "train", "run",
]

logger = logging.getLogger(__name__)

StepCallback = Callable[[int, float, float], None]
"""Called after each step with ``(step, loss, tokens_per_s)``; ``step`` counts from 1."""


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Everything a run needs; the CLI flags of ``shardwise train`` map onto these fields."""

    model: str = "tiny"
    """Preset of :class:`GPTConfig`: ``tiny`` (~1M), ``small`` (~10M) or ``medium`` (~50M parameters)."""
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

    def model_config(self) -> GPTConfig:
        """The preset, with ``seq_len`` overridden when given, over the byte vocabulary."""
        overrides = {"vocab_size": VOCAB_SIZE}
        if self.seq_len is not None:
            overrides["seq_len"] = self.seq_len
        return GPTConfig.preset(self.model, **overrides)


@dataclasses.dataclass(frozen=True)
class TrainResult:
    """What a run measured; identical on every rank except ``losses`` and ``comm``."""

    steps: int
    world_size: int
    n_params: int  # unsharded parameter count of the model
    tokens_per_step: int  # over all ranks: batch_size * seq_len * world_size
    losses: list[float]  # this rank's loss after each step
    first_loss: float  # step 1's loss, mean over ranks
    final_loss: float  # the last step's loss, mean over ranks
    wall_s: float  # time spent in the steps
    setup_s: float  # corpus, model build and sharding, before the first step
    comm: "CommStats | None"  # this rank's collectives during the steps; None for

    @property
    def tokens_per_s(self) -> float:
        return self.steps * self.tokens_per_step / max(self.wall_s, 1e-9)

    @property
    def wire_bytes_per_step(self) -> float | None:
        """Bytes this rank sent per step (ring model), or ``None`` when nothing was tallied."""
        return None if self.comm is None else self.comm.total_wire_bytes / self.steps


def build_model(cfg: TrainConfig, env: DistEnv) -> GPT:
    """The model for ``cfg``, initialised identically on every rank, moved to ``env.device`` and sharded."""
    torch.manual_seed(cfg.seed)
    model = GPT(cfg.model_config()).to(env.device)
    return shard_model(model, env.mesh, cfg.impl, cfg.mixed_precision)


def build_optimizer(model: nn.Module, lr: float) -> torch.optim.Optimizer:
    """AdamW over the (sharded) parameters; each rank keeps moments for its shards only."""
    return torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.01)


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """One forward, backward and optimizer step on ``(x, y)``; returns the detached fp32 loss."""
    logits = model(x)  # (B, T, vocab), bf16 under mixed precision
    loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())  # (B*T, vocab) vs (B*T,)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return loss.detach()


def mean_across_ranks(value: float, device: torch.device) -> float:
    """``value`` averaged over all ranks of the default process group."""
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t.item() / dist.get_world_size()


def _comm_tally(impl: str):
    """``shardwise.comm_stats`` when shardwise does the communication, else ``None``."""
    if impl != "shardwise":
        return None
    from shardwise import comm_stats

    return comm_stats


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _run_steps(
    model: nn.Module, optimizer: torch.optim.Optimizer, sampler: BatchSampler,
    cfg: TrainConfig, env: DistEnv, on_step: StepCallback | None,
) -> tuple[list[float], float]:
    """The step loop; returns this rank's losses and the seconds it took."""
    tokens_per_step = cfg.batch_size * sampler.seq_len * env.world_size
    losses: list[float] = []
    _sync(env.device)
    start = time.perf_counter()
    for step in range(1, cfg.steps + 1):
        x, y = sampler.next_batch(env.device)
        losses.append(train_step(model, optimizer, x, y).item())
        if on_step is not None:
            on_step(step, losses[-1], step * tokens_per_step / (time.perf_counter() - start))
    _sync(env.device)
    return losses, time.perf_counter() - start


def train(cfg: TrainConfig, env: DistEnv, on_step: StepCallback | None = None) -> TrainResult:
    """Train ``cfg`` on the ranks of ``env``; every rank must call this with the same ``cfg``.

    Args:
        cfg: the run's configuration.
        env: this rank's place in the run, from :func:`shardwise.train.distributed.setup`.
        on_step: optional per-step callback ``(step, loss, tokens_per_s)`` (rank 0 draws its bar with it).
    """
    t0 = time.perf_counter()
    tokens = load_corpus(cfg.data, cfg.data_bytes)
    model = build_model(cfg, env)
    optimizer = build_optimizer(model, cfg.lr)
    sampler = BatchSampler(tokens, cfg.batch_size, model.cfg.seq_len, cfg.seed, env.rank)
    tally = _comm_tally(cfg.impl)
    if tally is not None:
        tally.reset()
    setup_s = time.perf_counter() - t0
    losses, wall_s = _run_steps(model, optimizer, sampler, cfg, env, on_step)
    comm = tally.snapshot() if tally is not None else None
    return TrainResult(
        steps=cfg.steps,
        world_size=env.world_size,
        n_params=count_params(model.cfg),
        tokens_per_step=cfg.batch_size * sampler.seq_len * env.world_size,
        losses=losses,
        first_loss=mean_across_ranks(losses[0], env.device),
        final_loss=mean_across_ranks(losses[-1], env.device),
        wall_s=wall_s,
        setup_s=setup_s,
        comm=comm,
    )


def _train_and_report(cfg: TrainConfig, env: DistEnv) -> TrainResult:
    """:func:`train`, with rank 0 printing the header, the progress bar and the summary."""
    if not env.is_main:
        return train(cfg, env)
    report.print_header(cfg, env.world_size, str(env.device), count_params(cfg.model_config()))
    bar = report.ProgressBar(cfg.steps)
    result = train(cfg, env, on_step=bar.update)
    bar.close()
    report.print_summary(result)
    return result


def run(cfg: TrainConfig) -> TrainResult:
    """The whole run on this rank: set up the process group, train, report on rank 0, tear down."""
    env = setup(cfg.device)
    try:
        result = _train_and_report(cfg, env)
    except BaseException:
        teardown(env, wait_for_peers=False)  # the peers may never get here; torchrun stops them
        raise
    teardown(env)
    return result
