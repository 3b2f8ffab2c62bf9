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

import contextlib
import dataclasses
import logging
import math
import resource
import time
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from shardwise.clip import clip_grad_norm_
from shardwise.faults import monitor
from shardwise.train import summary
from shardwise.train.build import build_pipelined, build_sharded
from shardwise.train.checkpointing import RunCheckpoints
from shardwise.train.config import TrainConfig, TrainResult
from shardwise.train.distributed import DistEnv, leave, setup, teardown
from shardwise.train.fault_tolerance import Replicas, attach, replica_group
from shardwise.train.float8 import precompute_scales
from shardwise.train.inputs import Sampler, run_data
from shardwise.train.metrics import MetricsLog
from shardwise.train.model import GPT
from shardwise.train.models import ModelSpec, model_spec, param_count
from shardwise.train.pipeline import Pipeline, cross_entropy
from shardwise.train.preflight import preflight
from shardwise.train.schedule import build_scheduler
from shardwise.train.signals import StopRequest, stop_on_signals
from shardwise.train.summary import device_peak_flops, step_report
from shardwise.train.tensorboard import TensorBoardLog

__all__ = [
    "TrainConfig", "TrainResult", "build_model", "build_optimizer", "train_step", "mean_across_ranks", "train", "run",
    "restore_model",
]

logger = logging.getLogger(__name__)

StepCallback = Callable[[int, float, float], None]
"""Called after each step with ``(step, loss, tokens_per_s)``; ``step`` counts from 1."""

EVAL_BATCHES = 4
"""Micro-batches of held-out windows per ``--eval-every`` evaluation (the same windows every time)."""

def build_model(cfg: TrainConfig, env: DistEnv, spec: ModelSpec) -> nn.Module:
    """The model of ``spec``, initialised identically on every rank, parallelised and sharded as ``cfg`` says
    (without ``--pp``: see :func:`~shardwise.train.build.build_pipelined`)."""
    if cfg.auto:
        torch.manual_seed(cfg.seed)
        return auto_shard_model(GPT(cfg.model_config()).to(env.device), cfg, env)
    return build_sharded(cfg, env, spec)


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
    """AdamW over the (sharded) parameters; each rank keeps moments for its shards only.

    ``foreach=True``, as torchtitan builds it: one DTensor dispatch per operation for the whole
    parameter list instead of one per parameter. (torch picks foreach by itself only for GPU
    tensors; on CPU the per-parameter loop re-ran DTensor's sharding propagation for every
    parameter every step, the step's learning-rate terms being new scalars each time.)"""
    return torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.01, foreach=True)


@dataclasses.dataclass(frozen=True)
class StepOptions:
    """How one optimizer step runs (from ``--grad-accum``, ``--clip-norm`` and whether a grad norm is logged)."""

    logits: Callable[[nn.Module, torch.Tensor], torch.Tensor] = lambda model, x: model(x)
    grad_accum: int = 1  # micro-batches; the gradient reduction runs on the last only
    clip_norm: float | None = None  # clip the global grad norm to this
    want_norm: bool = False  # compute the global grad norm even without clipping (TensorBoard)
    after_step: Callable[[nn.Module], None] | None = None  # after optimizer.step() (--float8: precompute_scales)
    pipeline: Pipeline | None = None  # --pp: the schedule runs forward and backward over this rank's stages


def train_step(
    model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor, opts: StepOptions = StepOptions(),
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One optimizer step on ``(x, y)`` in ``opts.grad_accum`` micro-batches; the detached fp32 loss
    (mean over the batch) and the global gradient norm before clipping (``None`` when not asked for).

    Micro-batches before the last skip the gradient reduction (``set_requires_gradient_sync(False)``:
    gradients accumulate unsharded); the last reduces the sum once. Each micro-batch's loss is
    divided by ``grad_accum``, so the step equals one over the whole batch up to float rounding.
    """
    optimizer.zero_grad(set_to_none=True)
    if opts.pipeline is not None:
        total = opts.pipeline.run(x, y)
    else:
        total = _accumulated_backward(model, x, y, opts)
    norm = None
    if opts.clip_norm is not None or opts.want_norm:
        max_norm = opts.clip_norm if opts.clip_norm is not None else math.inf
        if opts.pipeline is not None:
            norm = opts.pipeline.clip(list(model.parameters()), max_norm)
        else:
            norm = clip_grad_norm_(model.parameters(), max_norm)
    optimizer.step()
    if opts.after_step is not None:
        opts.after_step(model)
    return total, norm


def _accumulated_backward(model: nn.Module, x: torch.Tensor, y: torch.Tensor, opts: StepOptions) -> torch.Tensor:
    """Forward and backward over ``opts.grad_accum`` micro-batches; the mean loss (detached)."""
    k = opts.grad_accum
    total = torch.zeros((), device=x.device)
    for i, (xm, ym) in enumerate(zip(x.chunk(k), y.chunk(k))):
        if k > 1:
            model.set_requires_gradient_sync(i == k - 1)
        logits = opts.logits(model, xm)  # (b, T, vocab), bf16 under mixed precision
        loss = cross_entropy(logits, ym)  # (b*T, vocab) vs (b*T,), in fp32
        (loss / k if k > 1 else loss).backward()
        total += loss.detach() / k
    return total


def mean_across_ranks(value: float, device: torch.device) -> float:
    """``value`` averaged over all ranks of the default process group.

    Issued through the fault monitor like the library's own collectives: a peer that dies
    or whose link is cut while this rank waits here (right after the step's last gradient
    reduction) is named within the watchdog's deadline, not waited on for gloo's timeout."""
    t = torch.tensor([value], dtype=torch.float64, device=device)
    monitor.all_reduce(t, dist.group.WORLD, dist.ReduceOp.SUM, "shardwise train's loss mean")
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


def _peak_memory_gb(device: torch.device) -> float:
    """This step's peak allocated CUDA memory (then reset), or the process's peak RSS on CPU."""
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        return peak / 1e9
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9  # Linux reports KiB


@dataclasses.dataclass
class _Run:
    """What the step loop drives; built by :func:`train`."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    sampler: Sampler
    checkpoints: RunCheckpoints
    metrics: MetricsLog
    tensorboard: TensorBoardLog
    step_opts: StepOptions
    held_out: Callable[[int], Sampler] | None  # --eval-every: micro-batch size -> a fresh held-out sampler
    eval_losses: dict[int, float] = dataclasses.field(default_factory=dict)
    replicas: Replicas | None = None  # --fault-tolerance torchft; ``optimizer`` is then its commit gate


def _evaluate(job: _Run, cfg: TrainConfig, env: DistEnv) -> float:
    """Mean loss over ranks on :data:`EVAL_BATCHES` fixed held-out micro-batches."""
    sampler = job.held_out(cfg.micro_batch_size)
    total = 0.0
    pipeline = job.step_opts.pipeline
    with torch.no_grad():
        for _ in range(EVAL_BATCHES):
            x, y = sampler.next_batch(env.device)
            if pipeline is not None:
                total += pipeline.run(x, y, train=False).item()
                continue
            logits = job.step_opts.logits(job.model, x)
            total += cross_entropy(logits, y).item()
    return mean_across_ranks(total / EVAL_BATCHES, env.device)


def _observe(job: _Run, cfg: TrainConfig, env: DistEnv, step: int, loss: float, fields: dict) -> None:
    """Per-step records: --metrics, --tensorboard, and --eval-every's held-out loss."""
    if job.metrics.path is not None or job.tensorboard.enabled:
        mean_loss = mean_across_ranks(loss, env.device)
        job.metrics.log(step, mean_loss, **fields)
        job.tensorboard.log(step, {"loss": mean_loss, **fields})
    if cfg.eval_every and (step % cfg.eval_every == 0 or step == job.checkpoints.last_step):
        job.eval_losses[step] = _evaluate(job, cfg, env)
        job.tensorboard.log(step, {"loss": job.eval_losses[step]}, prefix="eval/")
        if env.is_main:
            summary.print_eval(step, job.eval_losses[step])


def _one_step(job: _Run, cfg: TrainConfig, env: DistEnv, step: int) -> tuple[float, float | None]:
    x, y = job.sampler.next_batch(env.device)
    if cfg.auto and step == job.checkpoints.last_step:  # --auto: measure the last step against the plan
        loss, norm = _measured_step(job.model, job.optimizer, x, y, job.step_opts)
    else:
        loss, norm = train_step(job.model, job.optimizer, x, y, job.step_opts)
    return loss.item(), None if norm is None else norm.item()


def _attempt_step(job: _Run, cfg: TrainConfig, env: DistEnv, step: int) -> tuple[int, float, float | None] | None:
    """Step ``step``: ``(the step committed, loss, grad norm)``, or ``None`` when fault tolerance
    discarded it (a replica group failed during it: it runs again). A group that heals takes
    the job's step from its peer, so the committed step may be later than ``step``."""
    replicas = job.replicas
    if replicas is None:
        return (step, *_one_step(job, cfg, env, step))
    replicas.begin_step()
    loss, norm = _one_step(job, cfg, env, replicas.step + 1)
    if not replicas.end_step():
        return None
    return replicas.step, loss, norm


def _ft_fields(replicas: Replicas | None) -> dict:
    """Per-step records of --fault-tolerance: replica groups in the quorum, its seconds, a heal's bytes."""
    if replicas is None:
        return {}
    healed = replicas.healed_this_step
    return dict(replica_groups=replicas.participants, quorum_s=replicas.quorum_s, healed=healed,
                heal_bytes=replicas.heal.last_heal_bytes if healed else 0)


def _run_steps(
    job: _Run, cfg: TrainConfig, env: DistEnv, start_step: int, on_step: StepCallback | None,
    stop: StopRequest | None = None,
) -> tuple[list[float], float]:
    """Steps ``start_step + 1 ..`` to ``--stop-after`` or ``--steps`` (or the step a stop
    signal ends, see :mod:`~shardwise.train.signals`); this rank's losses and the seconds taken."""
    tokens_per_step = cfg.batch_size * job.sampler.seq_len * env.dp_size
    tally = _comm_tally(cfg.impl)
    losses: list[float] = []
    _sync(env.device)
    start = last = time.perf_counter()
    sent = 0 if tally is None else tally.snapshot().total_wire_bytes
    step = start_step
    with step_report(cfg, env) as rep:
        while step < job.checkpoints.last_step:
            attempt = _attempt_step(job, cfg, env, step + 1)
            if attempt is None:
                continue
            step, loss, norm = attempt
            lr = job.optimizer.param_groups[0]["lr"]  # the step's: the schedule moves on below
            losses.append(loss)
            job.scheduler.step()
            if job.replicas is not None:
                job.replicas.heal.stage()
            if stop is not None and stop.should_stop(env.device):
                job.checkpoints.last_step = step  # the run's last step now: its checkpoint is due
            held_s = job.checkpoints.after_step(step)
            if rep is not None:
                rep.step(losses[-1])
            _sync(env.device)
            now = time.perf_counter()
            step_s, last = now - last, now
            wire_mb = None
            if tally is not None:
                total = tally.snapshot().total_wire_bytes
                wire_mb, sent = (total - sent) / 1e6, total
            fields = dict(tokens_per_s=tokens_per_step / step_s, step_s=step_s, lr=lr, checkpoint_s=held_s,
                          grad_norm=norm, peak_memory_gb=_peak_memory_gb(env.device), wire_mb=wire_mb,
                          **_ft_fields(job.replicas))
            _observe(job, cfg, env, step, losses[-1], fields)
            if on_step is not None:
                on_step(step, losses[-1], len(losses) * tokens_per_step / (now - start))
        job.checkpoints.close()
        _sync(env.device)
        wall_s = time.perf_counter() - start
    return losses, wall_s


def _measured_step(
    model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor, opts: StepOptions,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`train_step` under PeakMemory; the peak goes to ``model.measured_peak_bytes``."""
    from shardwise.testing.memory import PeakMemory, tensors_of

    with PeakMemory(tensors_of(model, optimizer) + [x, y]) as memory:
        out = train_step(model, optimizer, x, y, opts)
    model.measured_peak_bytes = memory.peak_bytes
    return out


def _peaks(model: nn.Module, device: torch.device) -> tuple[int | None, int | None]:
    """(predicted, measured max over ranks) under --auto, else (None, None)."""
    plan = getattr(model, "plan", None)
    if plan is None:
        return None, None
    t = torch.tensor([getattr(model, "measured_peak_bytes", 0)], dtype=torch.int64, device=device)
    monitor.all_reduce(t, dist.group.WORLD, dist.ReduceOp.MAX, "shardwise train's --auto peak memory")
    return plan.peak_bytes, int(t.item())


def _setup_run(cfg: TrainConfig, env: DistEnv, spec: ModelSpec) -> tuple[_Run, int]:
    """The model, optimizer, data and observers of a run, resumed when asked; and the step to start after."""
    data = run_data(cfg, env, spec)
    sampler = data.sampler
    if cfg.pp > 1:  # this rank's stages (their union) and the schedule that runs them
        model, pipeline = build_pipelined(cfg, env, spec)
    else:
        model, pipeline = build_model(cfg, env, spec), None
    optimizer = build_optimizer(model, cfg.lr)
    scheduler = build_scheduler(optimizer, cfg.lr_schedule, cfg.warmup_steps, cfg.steps)
    checkpoints = RunCheckpoints(cfg, env, model, optimizer, scheduler, sampler, spec)
    start_step = checkpoints.resume(cfg.resume)
    tensorboard = TensorBoardLog(cfg.tensorboard, env.is_main)
    opts = StepOptions(spec.logits, cfg.grad_accum, cfg.clip_norm, want_norm=tensorboard.enabled,
                       after_step=precompute_scales if cfg.float8 else None, pipeline=pipeline)
    replicas = None
    if cfg.fault_tolerance == "torchft":
        replicas = attach(cfg, env, model, optimizer, scheduler, sampler, start_step)
    job = _Run(model, optimizer if replicas is None else replicas.gate, scheduler, sampler, checkpoints,
               MetricsLog(cfg.metrics, env.is_main), tensorboard, opts, data.held_out, replicas=replicas)
    return job, start_step


def train(
    cfg: TrainConfig, env: DistEnv, on_step: StepCallback | None = None, stop: StopRequest | None = None,
) -> TrainResult:
    """Train ``cfg`` on the ranks of ``env``; every rank must call this with the same ``cfg``.

    With ``cfg.resume`` the run continues after the newest checkpoint in ``cfg.checkpoint_dir``
    (see :mod:`~shardwise.train.checkpointing`), and the result counts this invocation's steps.

    Args:
        cfg: the run's configuration.
        env: this rank's place in the run, from :func:`shardwise.train.distributed.setup`.
        on_step: optional per-step callback ``(step, loss, tokens_per_s)`` (rank 0 draws its bar with it).
        stop: ends the run after the step a stop signal came in (one collective per step);
            ``None``: the run ends at ``--stop-after`` or ``--steps`` only.
    """
    t0 = time.perf_counter()
    spec = preflight(cfg, env.world_size)
    if cfg.fault_tolerance == "torchft":  # the data is split over every replica group's ranks
        group = replica_group(cfg)
        env = dataclasses.replace(env, replica_group=group.group_id, replica_groups=group.groups)
    job, start_step = _setup_run(cfg, env, spec)
    tally = _comm_tally(cfg.impl)
    if tally is not None:
        tally.reset()
    setup_s = time.perf_counter() - t0
    pipeline = job.step_opts.pipeline
    try:
        with pipeline.fsdp_names() if pipeline is not None else contextlib.nullcontext():
            losses, wall_s = _run_steps(job, cfg, env, start_step, on_step, stop)
    finally:
        job.metrics.close()
        job.tensorboard.close()
        if job.replicas is not None:
            job.replicas.shutdown()
    comm = tally.snapshot() if tally is not None else None
    predicted, measured = _peaks(job.model, env.device)
    n_params = param_count(spec)
    return TrainResult(
        steps=len(losses),
        world_size=env.world_size,
        n_params=n_params,
        tokens_per_step=cfg.batch_size * spec.seq_len * env.dp_size,
        losses=losses,
        first_loss=mean_across_ranks(losses[0] if losses else math.nan, env.device),
        final_loss=mean_across_ranks(losses[-1] if losses else math.nan, env.device),
        wall_s=wall_s,
        setup_s=setup_s,
        comm=comm,
        resumed_from=start_step,
        predicted_peak_bytes=predicted,
        measured_peak_bytes=measured,
        dp_size=env.dp_size,
        flops_per_token=spec.flops_per_token(n_params),
        peak_flops=device_peak_flops(env.device, cfg.mixed_precision),
        eval_losses=job.eval_losses,
        stopped_by=0 if stop is None else stop.agreed,
    )


def _train_and_report(cfg: TrainConfig, env: DistEnv, stop: StopRequest) -> TrainResult:
    """:func:`train`, with rank 0 printing the header, the progress bar and the summary."""
    if not env.is_main:
        return train(cfg, env, stop=stop)
    spec = model_spec(cfg)
    summary.print_header(cfg, spec.describe(param_count(spec)), spec.seq_len, env, str(env.device))
    bar = summary.ProgressBar(cfg.steps)
    result = train(cfg, env, on_step=bar.update, stop=stop)
    bar.close()
    summary.print_summary(result)
    return result


def run(cfg: TrainConfig) -> TrainResult:
    """The whole run on this rank: set up the process group, train, report on rank 0, tear
    down; SIGTERM and SIGINT stop it after a step (``result.stopped_by``; see
    :mod:`~shardwise.train.signals`).

    Every way out tears down in order (:func:`~shardwise.train.distributed.teardown`): no
    shardwise thread is left inside a native call when the interpreter finalises. Should one
    be (a waiter inside a collective that never completes), the process ends at once with
    the exit code it would have had (:func:`~shardwise.train.distributed.leave`).
    """
    env = setup(cfg.device, replicate=cfg.replicate, tp=cfg.tp, pp=cfg.pp)
    with stop_on_signals() as stop:
        try:
            result = _train_and_report(cfg, env, stop)
        except BaseException as err:
            stuck = teardown(env, wait_for_peers=False)  # the peers may never get here; torchrun stops them
            if stuck:
                logger.error("shardwise train failed", exc_info=err)
            leave(stuck, exit_code_of(err))
            raise
    leave(teardown(env), result.exit_code)
    return result


def exit_code_of(err: BaseException) -> int:
    """The exit status Python gives ``err`` when it ends the process (SystemExit's own, 130
    for KeyboardInterrupt, else 1)."""
    if isinstance(err, SystemExit):
        return err.code if isinstance(err.code, int) else (0 if err.code is None else 1)
    return 130 if isinstance(err, KeyboardInterrupt) else 1


def restore_model(cfg: TrainConfig, env: DistEnv) -> nn.Module:
    """The sharded model of ``cfg`` holding the newest checkpoint in ``cfg.checkpoint_dir`` (for evaluation)."""
    if cfg.checkpoint_dir is None:
        raise ValueError("restore_model needs cfg.checkpoint_dir")
    spec = preflight(cfg, env.world_size)
    job, _ = _setup_run(dataclasses.replace(cfg, resume=True, tensorboard=None, metrics=None), env, spec)
    return job.model
