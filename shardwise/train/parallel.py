"""What happens to each block before it is sharded: tensor parallelism, activation checkpointing, compile.

The order is torchtitan's, and each step's reason is the next one::

    parallelize_module(block, tp_mesh, plan)   # --tp: params become DTensors on the tp mesh
    block = checkpoint_wrapper(block)          # --ac: recompute the block in backward
    block.compile()                            # --compile: the block's forward (FSDP hooks stay eager)
    fully_shard(block, mesh=dp_mesh)           # then sharding, over the data-parallel mesh

**Tensor parallel** splits heads and MLP hidden units inside each block (Megatron): the
first projections column-wise, the second row-wise, so a block needs one all-reduce in
forward and one in backward. Embeddings, final norm and head stay replicated over ``tp``.

**Activation checkpointing** (``--ac``): ``full`` keeps only each block's input and
recomputes the block in backward; ``selective`` also keeps the outputs of the block's
matmuls and attention (:data:`SAVED_OPS`) and recomputes the cheap ops between them
(norms, activations, adds), torchtitan's op-level policy without its every-other-matmul
twist. The wrapper's ``_checkpoint_wrapped_module.`` prefix is stripped from state-dict
keys by the wrapper's own hooks, so checkpoints with and without ``--ac`` are one format.
"""

from __future__ import annotations

import functools
import logging

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    _CHECKPOINT_PREFIX,
    CheckpointImpl,
    checkpoint_wrapper,
)
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import parallelize_module
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

__all__ = ["SAVED_OPS", "apply_tp", "apply_ac", "apply_compile", "plain_name"]

logger = logging.getLogger(__name__)

_aten = torch.ops.aten
SAVED_OPS = frozenset({
    _aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten.linear.default,
    _aten._scaled_dot_product_flash_attention.default, _aten._scaled_dot_product_efficient_attention.default,
    _aten._scaled_dot_product_flash_attention_for_cpu.default, _aten._scaled_dot_product_cudnn_attention.default,
})
"""Ops whose outputs ``--ac selective`` keeps; everything else in a block is recomputed."""


def plain_name(name: str) -> str:
    """A module or parameter name without activation checkpointing's wrapper prefix."""
    return name.replace(_CHECKPOINT_PREFIX, "")


def apply_tp(blocks: nn.ModuleList, tp_mesh: DeviceMesh | None, plan: dict) -> None:
    """``parallelize_module`` every block on ``tp_mesh`` with ``plan`` (nothing without a mesh)."""
    if tp_mesh is None:
        return
    for block in blocks:
        parallelize_module(block, tp_mesh, plan)
    logger.info("tensor parallel over %d ranks in %d blocks: %s", tp_mesh.size(), len(blocks), sorted(plan))


def _selective_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def apply_ac(blocks: nn.ModuleList, mode: str) -> None:
    """Replace each block of ``blocks`` by its checkpoint wrapper (``mode``: ``none``, ``full``, ``selective``)."""
    if mode == "none":
        return
    kwargs = {}
    if mode == "selective":
        kwargs["context_fn"] = functools.partial(create_selective_checkpoint_contexts, _selective_policy)
    elif mode != "full":
        raise ValueError(f"unknown activation checkpointing mode {mode!r}")
    for i, block in enumerate(blocks):
        blocks[i] = checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT, **kwargs)


def apply_compile(blocks: nn.ModuleList, backend: str) -> None:
    """``torch.compile`` each block in place (names unchanged, so checkpoints are the same format)."""
    for block in blocks:
        block.compile(backend=backend)
