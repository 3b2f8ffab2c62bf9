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

Every manifest also records the model's *card* (:meth:`ModelSpec.card`: the GPT preset's
config, or the Transformers config), which ``shardwise export`` turns into a loadable
directory and which a resume compares first: a checkpoint of another model is refused by
name (:func:`check_same_model`) before any tensor is read. A tokenizer the run trained
with is saved once, as ``D/tokenizer/``, for the export.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn

from shardwise.checkpoint import CheckpointPolicy, Checkpointer
from shardwise.checkpoint.directory import MANIFEST, CheckpointDir
from shardwise.checkpoint.faults import maybe_kill
from shardwise.train.config import TrainConfig
from shardwise.train.data import BatchSampler
from shardwise.train.distributed import DistEnv
from shardwise.train.models import ModelSpec

__all__ = ["RunCheckpoints", "CARD_KEY", "TOKENIZER_DIR", "check_same_model", "saved_card"]

CARD_KEY = "model_card"
"""Where a manifest's ``meta`` holds the model's card."""

TOKENIZER_DIR = "tokenizer"
"""``D/tokenizer/``: the tokenizer of a run that had one (written once by rank 0)."""

_VOLATILE = ("transformers_version", "_name_or_path", "use_cache", "dtype", "torch_dtype")


def _comparable(card: dict[str, Any]) -> dict[str, Any]:
    """The card as JSON reads it back, less fields that do not change the model."""
    card = json.loads(json.dumps(card))
    card.pop("tokenizer_dir", None)
    for key in _VOLATILE:
        card.get("config", {}).pop(key, None)
    return card


def saved_card(checkpoint_dir: str | Path) -> dict[str, Any] | None:
    """The model card of the newest committed checkpoint in ``checkpoint_dir`` (``None``: none
    there, or its manifest cannot be read: the resume's own verification names that damage)."""
    path = CheckpointDir(checkpoint_dir).latest()
    if path is None:
        return None
    try:
        meta = json.loads((path / MANIFEST).read_text()).get("meta", {})
    except (OSError, ValueError):
        return None
    return meta.get(CARD_KEY)


def check_same_model(checkpoint_dir: str | Path, card: dict[str, Any]) -> None:
    """Raise ``ValueError`` when the newest checkpoint in ``checkpoint_dir`` is of another model."""
    saved = saved_card(checkpoint_dir)
    if saved is None:
        return
    old, new = _comparable(saved), _comparable(card)
    if old == new:
        return
    if old.get("kind") != new.get("kind"):
        diff = f"a {old.get('kind')} model, this run a {new.get('kind')} model"
    else:
        keys = sorted(k for k in old.get("config", {}).keys() | new.get("config", {}).keys()
                      if old.get("config", {}).get(k) != new.get("config", {}).get(k))
        diff = ", ".join(f"{k}={old['config'].get(k)!r} there, {new['config'].get(k)!r} here" for k in keys[:4])
    raise ValueError(f"--resume: the checkpoint in {checkpoint_dir} is of another model ({diff}); "
                     "resume with the model it was saved with, or choose another --checkpoint-dir")

logger = logging.getLogger(__name__)


class RunCheckpoints:
    """The run's checkpointing, or a no-op without ``--checkpoint-dir``; every rank makes the same calls."""

    checkpointer: Checkpointer | None  # None: checkpointing is off
    card: dict  # the model's card (ModelSpec.card), recorded in every manifest
    rank: int
    last_step: int  # the step this invocation ends after (--stop-after or --steps)

    def __init__(
        self, cfg: TrainConfig, env: DistEnv, model: nn.Module, optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler, sampler: BatchSampler, spec: ModelSpec,
    ) -> None:
        self.rank = env.rank
        self.last_step = cfg.stop_after or cfg.steps
        self.checkpointer = None
        self.card = spec.card()
        if cfg.checkpoint_dir is not None:
            policy = CheckpointPolicy(cfg.checkpoint_dir, cfg.checkpoint_every, cfg.keep_last, cfg.async_checkpoint)
            stateful = {"lr_scheduler": scheduler, "sampler": sampler}
            meta = {**dataclasses.asdict(cfg), CARD_KEY: self.card}
            self.checkpointer = Checkpointer(policy, model, optimizer, stateful, meta=meta)
            tokenizer = getattr(spec, "tokenizer", None)
            if tokenizer is not None and env.is_main:
                tokenizer.save_pretrained(str(Path(cfg.checkpoint_dir) / TOKENIZER_DIR))

    def resume(self, wanted: bool) -> int:
        """The step to continue after: the newest checkpoint's with ``wanted`` (``--resume``), else 0.

        Without ``--resume`` the checkpoint directory must hold no committed checkpoint.
        """
        if self.checkpointer is None:
            return 0
        if not wanted:
            self.checkpointer.check_unused()
            return 0
        check_same_model(self.checkpointer.dir.root, self.card)
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
