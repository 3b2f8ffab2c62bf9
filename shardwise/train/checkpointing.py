"""``shardwise train``'s checkpoint flags, wired to :mod:`shardwise.checkpoint`.

``--checkpoint-dir D --checkpoint-every K --keep-last N [--resume] [--async-checkpoint]``:
the run saves after every ``K`` steps and after its last one, keeps the ``N`` newest, and
with ``--resume`` continues from the newest committed checkpoint in ``D``, or starts fresh
when ``D`` has none. The same command line therefore serves the first launch and every
torchrun restart (``--max-restarts``)::

    torchrun --standalone --nproc-per-node 2 --max-restarts 3 -m shardwise train \\
        --checkpoint-dir ckpts --checkpoint-every 50 --resume --metrics metrics.jsonl

A checkpoint holds the model, AdamW, the LR scheduler, the data sampler's position and
every RNG stream, so the loss curve after a resume is the uninterrupted run's, bit for bit,
at the same world size (``--metrics`` shows it).
"""

from __future__ import annotations

import dataclasses
import logging

import torch
from torch import nn

from shardwise.checkpoint import CheckpointPolicy, Checkpointer
from shardwise.checkpoint.faults import maybe_kill
from shardwise.train.config import TrainConfig
from shardwise.train.data import BatchSampler
from shardwise.train.distributed import DistEnv

__all__ = ["RunCheckpoints"]

logger = logging.getLogger(__name__)


class RunCheckpoints:
    """The run's checkpointing, or a no-op without ``--checkpoint-dir``; every rank makes the same calls."""

    checkpointer: Checkpointer | None  # None: checkpointing is off
    rank: int
    last_step: int  # the step this invocation ends after (--stop-after or --steps)

    def __init__(
        self, cfg: TrainConfig, env: DistEnv, model: nn.Module, optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler, sampler: BatchSampler,
    ) -> None:
        self.rank = env.rank
        self.last_step = cfg.stop_after or cfg.steps
        self.checkpointer = None
        if cfg.checkpoint_dir is not None:
            policy = CheckpointPolicy(cfg.checkpoint_dir, cfg.checkpoint_every, cfg.keep_last, cfg.async_checkpoint)
            stateful = {"lr_scheduler": scheduler, "sampler": sampler}
            self.checkpointer = Checkpointer(policy, model, optimizer, stateful, meta=dataclasses.asdict(cfg))

    def resume(self, wanted: bool) -> int:
        """The step to continue after: the newest checkpoint's with ``wanted`` (``--resume``), else 0.

        Without ``--resume`` the checkpoint directory must hold no committed checkpoint.
        """
        if self.checkpointer is None:
            return 0
        if not wanted:
            self.checkpointer.check_unused()
            return 0
        return self.checkpointer.resume()

    def after_step(self, step: int) -> float:
        """Commit a finished background save, then save ``step`` if due; returns seconds held by it."""
        maybe_kill("step", step, self.rank)
        if self.checkpointer is None:
            return 0.0
        self.checkpointer.poll()
        if not self.checkpointer.due(step, self.last_step):
            return 0.0
        return self.checkpointer.save(step)

    def close(self) -> None:
        """Wait for and commit a background save still in flight."""
        if self.checkpointer is not None:
            self.checkpointer.close()
