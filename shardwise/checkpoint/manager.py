"""Checkpointer: when to save, blocking or in the background, and how a run resumes.

Every rank calls the same methods at the same steps (they run collectives)::

    ckpt = Checkpointer(CheckpointPolicy("ckpts", every=100, keep_last=2), model, optim,
                        stateful={"lr_scheduler": sched, "sampler": sampler})
    start = ckpt.resume() if resume else 0      # 0: nothing committed yet, a fresh start
    for step in range(start + 1, steps + 1):
        train_step(...)
        ckpt.poll()                             # commits a finished background save
        if ckpt.due(step, steps):
            ckpt.save(step)                     # blocks only for the copy when async
    ckpt.close()                                # waits for and commits the last save

A save is: each rank writes its JSON (:mod:`~shardwise.checkpoint.trainer_state`) and its
DCP shards into the staging directory, DCP's final gather tells rank 0 that every rank is
done, and rank 0 commits (:mod:`~shardwise.checkpoint.directory`). With ``async_save`` the
DCP part runs in a background thread (``dcp.async_save``) over a process group of its own,
so its collectives never interleave with the training step's; the model and optimizer
state are copied first, so later steps cannot change what is written. At most one save is
in flight: the next one waits for it.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Mapping

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from shardwise.checkpoint.directory import CheckpointDir, CheckpointError
from shardwise.checkpoint.trainer_state import (
    Stateful, check_shapes, load_sharded_state, read_rank_state, sharded_state, tensor_shapes, write_rank_state,
)

__all__ = ["CheckpointPolicy", "Checkpointer"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class CheckpointPolicy:
    """Where and how often a run checkpoints."""

    directory: str
    """The checkpoint directory (``--checkpoint-dir``); created when missing."""
    every: int = 0
    """Save after every this many steps; 0 saves only after the last step."""
    keep_last: int = 2
    """Committed checkpoints to keep; older ones are deleted after each commit."""
    async_save: bool = False
    """Write in a background thread with ``dcp.async_save`` (training waits only for the copy)."""

    def __post_init__(self) -> None:
        if self.every < 0:
            raise ValueError(f"CheckpointPolicy.every must be >= 0, got {self.every}")
        if self.keep_last < 1:
            raise ValueError(f"CheckpointPolicy.keep_last must be >= 1, got {self.keep_last}")


@dataclasses.dataclass
class _PendingSave:
    step: int
    future: Future  # dcp.async_save's: done once every rank's shards are written
    manifest: dict


class Checkpointer:
    """Saves and restores one run's model, optimizer, ``stateful`` objects and RNG streams."""

    policy: CheckpointPolicy
    dir: CheckpointDir
    model: nn.Module
    optimizer: torch.optim.Optimizer
    stateful: Mapping[str, Stateful]  # JSON-able extras: LR scheduler, data sampler...
    meta: dict  # JSON-able facts recorded in every manifest (the run's configuration)
    rank: int
    world_size: int
    _pg: dist.ProcessGroup | None  # gloo group of the background saves (async only)
    _pending: _PendingSave | None  # the background save in flight, at most one

    def __init__(
        self, policy: CheckpointPolicy, model: nn.Module, optimizer: torch.optim.Optimizer,
        stateful: Mapping[str, Stateful], meta: Mapping[str, Any] | None = None,
    ) -> None:
        self.policy, self.model, self.optimizer = policy, model, optimizer
        self.dir = CheckpointDir(policy.directory)
        self.stateful, self.meta = dict(stateful), dict(meta or {})
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self._pending = None
        self._pg = dist.new_group(backend="gloo") if policy.async_save else None
        if self.rank == 0:
            self.dir.root.mkdir(parents=True, exist_ok=True)
            self.dir.clean_leftovers()
        dist.barrier()  # leftovers are gone before any rank stages into the directory

    def __repr__(self) -> str:
        return f"Checkpointer({self.dir.root}, rank={self.rank}/{self.world_size}, {self.policy})"

    def due(self, step: int, last_step: int) -> bool:
        """Whether ``step`` is a save step: every ``policy.every`` steps, and the last one."""
        return step == last_step or (self.policy.every > 0 and step % self.policy.every == 0)

    def resume(self) -> int:
        """Restore the newest committed checkpoint; returns its step, or 0 when there is none.

        Raises:
            CheckpointError (on every rank alike): the pointer names a missing or damaged
            checkpoint, or one of another model shape.
        """
        path, manifest = self._resolve_latest()
        if path is None:
            logger.info("no checkpoint in %s: starting fresh", self.dir.root)
            return 0
        check_shapes(manifest["tensors"], _job_shapes(get_model_state_dict(self.model)), path)
        load_sharded_state(self.model, self.optimizer, path)
        step = read_rank_state(path, self.rank, manifest["world_size"], self.stateful)
        if step != manifest["step"]:
            raise CheckpointError(f"checkpoint {path}: rank state says step {step}, manifest {manifest['step']}")
        logger.info("resumed from %s (step %d, saved by %d ranks)", path, step, manifest["world_size"])
        return step

    def check_unused(self) -> None:
        """Raise (on every rank alike) if the directory already holds a committed checkpoint.

        A run that does not resume must not mix its checkpoints with another run's, and its
        retention would delete them.
        """
        path, _ = self._resolve_latest(verify=False)
        if path is not None:
            raise CheckpointError(
                f"{self.dir.root} already holds checkpoints (latest: {path.name}); pass --resume to continue "
                f"from it, or choose another --checkpoint-dir"
            )

    def _resolve_latest(self, verify: bool = True) -> tuple[Path | None, dict]:
        """Rank 0 reads the pointer and verifies the checkpoint; every rank gets the answer or the error."""
        outcome: list[Any] = [None]
        if self.rank == 0:
            try:
                path = self.dir.latest()
                manifest = self.dir.verify(path) if path is not None and verify else {}
                outcome[0] = (None if path is None else str(path), manifest)
            except CheckpointError as e:
                outcome[0] = e.args[0]
        dist.broadcast_object_list(outcome, src=0)
        if isinstance(outcome[0], str):
            raise CheckpointError(outcome[0])
        path, manifest = outcome[0]
        return (None if path is None else Path(path)), manifest

    def save(self, step: int) -> float:
        """Save ``step``; returns the seconds the caller was held (the whole save, or the copy if async)."""
        start = time.perf_counter()
        self._finish_pending()
        staging = self.dir.staging(step)
        write_rank_state(staging, self.rank, step, self.stateful)
        state = sharded_state(self.model, self.optimizer)
        manifest = {"world_size": self.world_size, "tensors": _job_shapes(state["model"]), "meta": self.meta}
        writer = dcp.FileSystemWriter(str(staging), sync_files=True)
        if self.policy.async_save:
            future = dcp.async_save(state, storage_writer=writer, process_group=self._pg)
            self._pending = _PendingSave(step, future, manifest)
        else:
            dcp.save(state, storage_writer=writer)
            self._commit(step, manifest)
        return time.perf_counter() - start

    def poll(self) -> None:
        """Commit the background save if it has finished (cheap; call once per step)."""
        if self._pending is not None and self._pending.future.done():
            self._finish_pending()

    def close(self) -> None:
        """Wait for the background save, commit it, and release the save process group."""
        self._finish_pending()
        if self._pg is not None:
            dist.destroy_process_group(self._pg)
            self._pg = None

    def _finish_pending(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.future.result()  # re-raises a failed write here, on the training thread
            self._commit(pending.step, pending.manifest)

    def _commit(self, step: int, manifest: dict) -> None:
        if self.rank == 0:
            self.dir.commit(step, manifest)
            self.dir.prune(self.policy.keep_last, step)


def _job_shapes(model_sd: Mapping[str, Any]) -> dict[str, list[int]]:
    """``{key: global shape}`` of the whole job's model: every rank's keys (one all-gather of
    small dicts). Under pipeline parallelism a rank holds only its stages' keys."""
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, tensor_shapes(model_sd))
    return {key: shape for shapes in gathered for key, shape in shapes.items()}
