"""``shardwise train``: a GPT preset or a Transformers causal LM trained on the Python standard library's
sources with ``fully_shard`` (HSDP, tensor parallel, activation checkpointing, compile, ...), and
``shardwise export`` to a directory Transformers loads.

One module per concept:

- :mod:`~shardwise.train.model` — the GPT and its size presets (nano ~43K for tests, tiny ~1M, small ~10M, medium ~50M).
- :mod:`~shardwise.train.data` — the byte-level corpus and per-rank batch sampling.
- :mod:`~shardwise.train.hf` / :mod:`~shardwise.train.models` — Transformers models; the ModelSpec every run sees.
- :mod:`~shardwise.train.distributed` — process group, device and meshes for this rank.
- :mod:`~shardwise.train.parallel` — tensor parallel, activation checkpointing and compile per block.
- :mod:`~shardwise.train.sharding` — ``fully_shard`` per block then root, shardwise's or torch's.
- :mod:`~shardwise.train.build` — meta device, parallelise, shard, materialise one tensor at a time.
- :mod:`~shardwise.train.preflight` — checks made before any rank starts.
- :mod:`~shardwise.train.tensorboard` — ``--tensorboard``: the step scalars as event files.
- :mod:`~shardwise.train.export` — ``shardwise export``: a checkpoint as config + safetensors.
- :mod:`~shardwise.train.config` — :class:`TrainConfig` (the flags) and :class:`TrainResult`.
- :mod:`~shardwise.train.schedule` — the learning-rate schedule (constant, warm-up + cosine).
- :mod:`~shardwise.train.metrics` — ``--metrics``: one JSON line per step, crash-safe.
- :mod:`~shardwise.train.checkpointing` — the checkpoint flags, wired to :mod:`shardwise.checkpoint`.
- :mod:`~shardwise.train.fault_tolerance` — ``--fault-tolerance torchft``: replica groups that survive each other.
- :mod:`~shardwise.train.loop` — the step and the run every rank executes.
- :mod:`~shardwise.train.summary` — progress bar and summary on rank 0.

Launch::

    python -m shardwise train                                      # 2 CPU ranks via torchrun
    python -m shardwise train --nproc 1 --steps 30                 # a single rank
    torchrun --standalone --nproc-per-node 4 -m shardwise train --model small
"""

from shardwise.train.config import TrainConfig, TrainResult
from shardwise.train.loop import run, train
from shardwise.train.model import GPT, GPTConfig

__all__ = ["GPT", "GPTConfig", "TrainConfig", "TrainResult", "train", "run"]
