"""Checks of a run that need files or the number of ranks, made before any rank starts work.

:class:`~shardwise.train.config.TrainConfig` checks its fields alone when it is built;
:func:`preflight` checks what it cannot see: the mesh against the ranks, the model's
config file, that the model (built on the meta device: no memory) has blocks to shard, a
prepared ``--data`` against the model's vocabulary, the tensor-parallel plan and the
pipeline's stages against the model, the optional TensorBoard and
torchao packages (with a float8-capable GPU), and that ``--resume`` continues a
checkpoint of the same model. The CLI runs it once before launching the ranks (so a
typo costs no process start), and :func:`train` again on every rank under torchrun.
Each failure is a ``ValueError`` (or ``FileNotFoundError`` / ``ImportError``) whose
message names the flag and the fix.
"""

from __future__ import annotations

import torch

from shardwise.train.checkpointing import check_same_model
from shardwise.train.config import TrainConfig
from shardwise.train.fault_tolerance import require_torchft
from shardwise.train.float8 import check_float8_device, require_torchao
from shardwise.train.inputs import check_data
from shardwise.train.models import ModelSpec, model_spec
from shardwise.train.tensorboard import require_tensorboard

__all__ = ["preflight"]


def preflight(cfg: TrainConfig, world_size: int) -> ModelSpec:
    """Raise on anything that would fail once ranks run; returns the model's spec."""
    cfg.check_world(world_size)
    spec = model_spec(cfg)  # reads --hf-config / --hf-model: a missing path fails here
    with torch.device("meta"):
        spec.blocks(spec.build())  # a model with no recognisable blocks fails here, not in every rank
    check_data(cfg, spec)  # a prepared --data: finished, of the model's vocabulary
    if cfg.tp > 1:
        spec.check_tp(cfg.tp)
    if cfg.pp > 1:
        spec.check_pp(cfg.n_stages)
    if cfg.tensorboard is not None:
        require_tensorboard()
    if cfg.float8:
        require_torchao()
        check_float8_device(cfg.device)
    if cfg.fault_tolerance == "torchft":
        require_torchft(cfg)
    if cfg.resume and cfg.checkpoint_dir is not None:
        check_same_model(cfg.checkpoint_dir, spec.card())
    return spec
