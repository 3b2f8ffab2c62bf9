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
import math
import time
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from shardwise.train import report
from shardwise.train.checkpointing import RunCheckpoints
from shardwise.train.config import TrainConfig, TrainResult
from shardwise.train.data import BatchSampler, load_corpus
from shardwise.train.distributed import DistEnv, setup, teardown
from shardwise.train.metrics import MetricsLog
from shardwise.train.model import GPT, count_params
from shardwise.train.schedule import build_scheduler
from shardwise.train.sharding import shard_model

__all__ = [
    "TrainConfig", "TrainResult", "build_model", "build_optimizer", "train_step", "mean_across_ranks", "train", "run",
]

logger = logging.getLogger(__name__)

StepCallback = Callable[[int, float, float], None]
"""Called after each step with ``(step, loss, tokens_per_s)``; ``step`` counts from 1."""


def build_model(cfg: TrainConfig, env: DistEnv) -> GPT:
    """The model for ``cfg``, initialised identically on every rank, moved to ``env.device`` and sharded."""
    torch.manual_seed(cfg.seed)
    model = GPT(cfg.model_config()).to(env.device)
    if cfg.auto:
        return auto_shard_model(model, cfg, env)
    return shard_model(model, env.mesh, cfg.impl, cfg.mixed_precision)


def auto_shard_model(model: GPT, cfg: TrainConfig, env: DistEnv) -> GPT:
    """``--auto``: plan for this run (ranks, precision, batch) and apply the plan; the plan
    stays on ``model.plan`` for the summary."""
    import shardwise

    mp = shardwise.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if cfg.mixed_precision == "bf16" else None
    plan = shardwise.plan(model, mesh_shape=tuple(env.mesh.shape), mp_policy=mp, device=env.device.type,
                          batch=(cfg.batch_size, model.cfg.seq_len))
    logger.info("plan:\n%s", plan)
    model.plan = plan
    return shardwise.auto_shard(model, plan, mesh=env.mesh)


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


@dataclasses.dataclass
class _Run:
    """What the step loop drives; built by :func:`train`."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    sampler: BatchSampler
    checkpoints: RunCheckpoints
    metrics: MetricsLog


def _run_steps(
    job: _Run, cfg: TrainConfig, env: DistEnv, start_step: int, on_step: StepCallback | None,
) -> tuple[list[float], float]:
    """Steps ``start_step + 1 ..`` to ``--stop-after`` or ``--steps``; this rank's losses and the seconds taken."""
    tokens_per_step = cfg.batch_size * job.sampler.seq_len * env.world_size
    losses: list[float] = []
    _sync(env.device)
    start = last = time.perf_counter()
    for step in range(start_step + 1, job.checkpoints.last_step + 1):
        x, y = job.sampler.next_batch(env.device)
        lr = job.optimizer.param_groups[0]["lr"]
        if cfg.auto and step == job.checkpoints.last_step:  # --auto: measure the last step against the plan
            losses.append(_measured_step(job.model, job.optimizer, x, y).item())
        else:
            losses.append(train_step(job.model, job.optimizer, x, y).item())
        job.scheduler.step()
        held_s = job.checkpoints.after_step(step)
        now = time.perf_counter()
        step_s, last = now - last, now
        job.metrics.log(step, losses[-1], tokens_per_s=tokens_per_step / step_s, step_s=step_s, lr=lr,
                        checkpoint_s=held_s)
        if on_step is not None:
            on_step(step, losses[-1], len(losses) * tokens_per_step / (now - start))
    job.checkpoints.close()
    _sync(env.device)
    return losses, time.perf_counter() - start


def _measured_step(model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """:func:`train_step` under PeakMemory; the peak goes to ``model.measured_peak_bytes``."""
    from shardwise.testing.memory import PeakMemory, tensors_of

    with PeakMemory(tensors_of(model, optimizer) + [x, y]) as memory:
        loss = train_step(model, optimizer, x, y)
    model.measured_peak_bytes = memory.peak_bytes
    return loss


def _peaks(model: nn.Module, device: torch.device) -> tuple[int | None, int | None]:
    """(predicted, measured max over ranks) under --auto, else (None, None)."""
    plan = getattr(model, "plan", None)
    if plan is None:
        return None, None
    t = torch.tensor([getattr(model, "measured_peak_bytes", 0)], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return plan.peak_bytes, int(t.item())


def train(cfg: TrainConfig, env: DistEnv, on_step: StepCallback | None = None) -> TrainResult:
    """Train ``cfg`` on the ranks of ``env``; every rank must call this with the same ``cfg``.

    With ``cfg.resume`` the run continues after the newest checkpoint in ``cfg.checkpoint_dir``
    (see :mod:`~shardwise.train.checkpointing`), and the result counts this invocation's steps.

    Args:
        cfg: the run's configuration.
        env: this rank's place in the run, from :func:`shardwise.train.distributed.setup`.
        on_step: optional per-step callback ``(step, loss, tokens_per_s)`` (rank 0 draws its bar with it).
    """
    t0 = time.perf_counter()
    tokens = load_corpus(cfg.data, cfg.data_bytes)
    model = build_model(cfg, env)
    optimizer = build_optimizer(model, cfg.lr)
    scheduler = build_scheduler(optimizer, cfg.lr_schedule, cfg.warmup_steps, cfg.steps)
    sampler = BatchSampler(tokens, cfg.batch_size, model.cfg.seq_len, cfg.seed, env.rank, env.world_size)
    checkpoints = RunCheckpoints(cfg, env, model, optimizer, scheduler, sampler)
    start_step = checkpoints.resume(cfg.resume)
    metrics = MetricsLog(cfg.metrics, env.device, env.is_main)
    tally = _comm_tally(cfg.impl)
    if tally is not None:
        tally.reset()
    setup_s = time.perf_counter() - t0
    try:
        losses, wall_s = _run_steps(_Run(model, optimizer, scheduler, sampler, checkpoints, metrics),
                                    cfg, env, start_step, on_step)
    finally:
        metrics.close()
    comm = tally.snapshot() if tally is not None else None
    predicted, measured = _peaks(model, env.device)
    return TrainResult(
        steps=len(losses),
        world_size=env.world_size,
        n_params=count_params(model.cfg),
        tokens_per_step=cfg.batch_size * sampler.seq_len * env.world_size,
        losses=losses,
        first_loss=mean_across_ranks(losses[0] if losses else math.nan, env.device),
        final_loss=mean_across_ranks(losses[-1] if losses else math.nan, env.device),
        wall_s=wall_s,
        setup_s=setup_s,
        comm=comm,
        resumed_from=start_step,
        predicted_peak_bytes=predicted,
        measured_peak_bytes=measured,
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
