"""``--float8``: torchao's float8 training of the blocks' linears, with the float8 all-gather.

torchtitan's recipe (its float8 converter), applied to the meta-device model before any
other parallelism::

    convert_to_float8(blocks)                 # nn.Linear -> Float8Linear, weights cast in the all-gather
    apply_tp(blocks, tp_mesh, float8_tp_plan(plan, blocks))   # --tp: torchao's float8 TP styles
    apply_ac / apply_compile / fully_shard / materialize      # unchanged
    ...each step: optimizer.step(); precompute_scales(model)   # one amax all-reduce for all weights

**Which linears.** Only those inside the blocks whose both dimensions are multiples of 16
(:func:`converts`; float8 matmuls need them): the embeddings, the final norm and the
output head stay in high precision, as torchtitan leaves ``output`` out. GPT-2's
``Conv1D`` (a linear whose weight is stored ``(in, out)``, the transpose of ``nn.Linear``'s)
is not an ``nn.Linear`` and stays in high precision too: torchao converts ``nn.Linear``
only, and swapping the layer would change the weights' shapes in checkpoints and exports.

**The all-gather.** ``Float8LinearConfig(enable_fsdp_float8_all_gather=True)`` makes each
converted weight a ``WeightWithDynamicFloat8CastTensor``, which both ``fully_shard``\\ s keep
as the sharded DTensor's local tensor: its ``fsdp_pre_all_gather`` casts this rank's fp32
(or bf16) shard to float8, so a block's all-gather moves one byte per weight element. A
block group holds norms (and biases) next to its float8 weights, so the group's inputs
differ in dtype and are gathered as bytes (uint8), as torch's FSDP2 does; gloo cannot
gather a group of float8 inputs alone.

**The scale.** A float8 cast needs the weight's amax over all its shards. Without
:func:`precompute_scales` every weight's pre-all-gather all-reduces its own amax; with it,
one all-reduce after the optimizer step computes every weight's scale (from the updated
weights, so the values are the same) and the pre-all-gathers reuse them.

Float8 needs torchao (:func:`require_torchao`, checked before any rank starts) and, on
GPUs, compute capability 8.9 or later (Ada, Hopper); on CPU torchao's float8 runs in
software, for tests.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

__all__ = ["ALIGN", "require_torchao", "check_float8_device", "converts", "convert_to_float8", "float8_tp_plan",
           "precompute_scales"]

logger = logging.getLogger(__name__)

ALIGN = 16
"""Both dimensions of a converted linear's weight must be multiples of this (float8 matmul)."""

_MIN_CAPABILITY = (8, 9)


def require_torchao() -> None:
    """Raise ``ImportError`` naming the fix when torchao's float8 training cannot be imported."""
    try:
        import torchao.float8  # noqa: F401
    except ImportError as e:
        raise ImportError(f"--float8 needs torchao (pip install torchao): {e}") from None


def check_float8_device(device: str) -> None:
    """Raise ``ValueError`` when ``--device`` would put float8 matmuls on a GPU older than compute capability 8.9."""
    if device == "cpu" or not torch.cuda.is_available():
        return
    capability = torch.cuda.get_device_capability()
    if capability < _MIN_CAPABILITY:
        raise ValueError(f"--float8 needs a GPU of compute capability >= 8.9 (Ada, Hopper); this one is "
                         f"{capability[0]}.{capability[1]}; drop --float8 or run with --device cpu")


def converts(module: nn.Module, fqn: str = "") -> bool:
    """Whether ``module`` becomes a ``Float8Linear``: an ``nn.Linear`` whose dimensions are multiples of :data:`ALIGN`."""
    return isinstance(module, nn.Linear) and all(n % ALIGN == 0 for n in module.weight.shape)


def convert_to_float8(blocks: nn.ModuleList) -> int:
    """Swap the convertible linears of every block for torchao's ``Float8Linear`` in place; how many were swapped."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    from torchao.float8.float8_linear import Float8Linear

    config = Float8LinearConfig(enable_fsdp_float8_all_gather=True)
    for block in blocks:
        convert_to_float8_training(block, config=config, module_filter_fn=converts)
    swapped = sum(isinstance(m, Float8Linear) for block in blocks for m in block.modules())
    skipped = sum(type(m) is nn.Linear or type(m).__name__ == "Conv1D" for block in blocks for m in block.modules())
    logger.info("float8: %d linears of %d blocks converted, %d left in high precision (a dimension not a "
                "multiple of %d, or GPT-2's Conv1D)", swapped, len(blocks), skipped, ALIGN)
    return swapped


def float8_tp_plan(plan: dict[str, Any], block: nn.Module) -> dict[str, Any]:
    """``plan`` with torchao's float8 styles for the converted linears (activations cast before TP's collectives).

    A linear left in high precision keeps its plain style; torchao's styles refuse anything
    but a ``Float8Linear``.
    """
    from torchao.float8.float8_linear import Float8Linear
    from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel, Float8RowwiseParallel

    swap = {ColwiseParallel: Float8ColwiseParallel, RowwiseParallel: Float8RowwiseParallel}
    out = {}
    for name, style in plan.items():
        float8 = isinstance(block.get_submodule(name), Float8Linear) and type(style) in swap
        out[name] = swap[type(style)](input_layouts=style.input_layouts[0], output_layouts=style.output_layouts[0],
                                      use_local_output=style.use_local_output) if float8 else style
    return out


@torch.no_grad()
def precompute_scales(model: nn.Module) -> None:
    """Every float8 weight's scale in one all-reduce; call after each optimizer step (torchtitan's hook)."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    precompute_float8_dynamic_scale_for_fsdp(model)
