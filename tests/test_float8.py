"""torchao float8 training with the float8 all-gather, against torch's FSDP2, bit for bit.

``Float8LinearConfig(enable_fsdp_float8_all_gather=True)`` makes each ``Float8Linear``
weight a ``WeightWithDynamicFloat8CastTensor``: its ``fsdp_pre_all_gather`` casts the fp32
shard straight to float8 (with an amax all-reduce over the shard mesh, or the scale
``precompute_float8_dynamic_scale_for_fsdp`` computed after the optimizer step) and the
all-gather moves float8 bytes. Each case trains shardwise and torch side by side and
compares every step: losses, every parameter (still the float8 weight subclass) and
gradient, the number of ``fsdp_pre_all_gather`` calls and the bytes each rank
all-gathers by dtype. torchao's float8 runs on CPU (its C extensions need not load).

Every group here holds a float8 weight next to an fp32 (or bf16) bias, so the group's
all-gather moves bytes (uint8), as torch's does: gloo has no float8 dtype, and a group of
float8 inputs alone fails in torch's FSDP2 on gloo with "Invalid scalar type" (NCCL
gathers it as float8); shardwise issues the same collective and fails the same way.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
from torch.distributed.fsdp import fully_shard as torch_fully_shard

import shardwise
from shardwise.testing import run_on_ranks
from tests._extension_helpers import Case, side_by_side_counting

TIMEOUT = 180
BF16 = torch.bfloat16
DIM = 32


class Block(nn.Module):
    """Two linears (float8 weights after conversion, one fp32 bias) with a residual."""

    def __init__(self):
        super().__init__()
        self.up = nn.Linear(DIM, 2 * DIM)
        self.down = nn.Linear(2 * DIM, DIM, bias=False)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(DIM, DIM)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _build() -> nn.Module:
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = Float8LinearConfig(enable_fsdp_float8_all_gather=True)
    return convert_to_float8_training(Model(), config=config)


def _float8(param_dtype, precompute: bool, reshard_after_forward) -> list:
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    warnings.filterwarnings("ignore")
    case = Case(
        build=_build,
        shard_units=lambda m: list(m.blocks),
        batch=lambda gen: torch.randn(8, DIM, generator=gen),
        param_dtype=param_dtype,
        reduce_dtype=torch.float32 if param_dtype else None,
        reshard_after_forward=reshard_after_forward,
        after_step=precompute_float8_dynamic_scale_for_fsdp if precompute else None,
        steps=3,
    )
    ours, per_step = side_by_side_counting(case, WeightWithDynamicFloat8CastTensor)
    for name, p in ours.named_parameters():
        if name.endswith("weight"):
            assert type(p.to_local()) is WeightWithDynamicFloat8CastTensor, f"{name}: {type(p.to_local())}"
    sd = ours.state_dict()
    assert all(type(sd[k].to_local()) is WeightWithDynamicFloat8CastTensor for k in sd if k.endswith("weight"))
    return per_step


def _gathered_bytes(param_dtype, reshard_after_forward: bool) -> int:
    """What one step all-gathers (payload: every rank's share): every float8 weight as one
    byte per element plus every bias in ``param_dtype``, in forward and, when resharded
    after forward (the root too: it is passed explicitly), again in backward."""
    bias = 2 if param_dtype == BF16 else 4
    block = 2 * (2 * DIM * DIM) + 2 * DIM * bias  # up and down weights, up's bias
    head = DIM * DIM + DIM * bias
    return (2 * block + head) * (2 if reshard_after_forward else 1)


@pytest.mark.parametrize(
    "param_dtype,precompute,reshard_after_forward",
    [(None, False, True), (None, True, False), (BF16, False, False), (BF16, True, True)],
    ids=["fp32-dynamic-reshard", "fp32-precomputed-keep", "bf16-dynamic-keep", "bf16-precomputed-reshard"],
)  # every pair of the three knobs' values once (the full 2x2x2 grid cost 15 s more)
def test_float8_all_gather_matches_torch(param_dtype, precompute, reshard_after_forward):
    per_step = run_on_ranks(_float8, 2, param_dtype, precompute, reshard_after_forward, timeout=TIMEOUT)[0]
    calls, gathered = per_step[-1]
    assert calls == 5 * (2 if reshard_after_forward else 1), per_step  # 5 float8 weights
    assert gathered == {torch.uint8: _gathered_bytes(param_dtype, reshard_after_forward)}, gathered


def test_float8_at_world_size_one_matches_torch():
    """World size 1 hands each unsharded gradient over as the sharded one, no pack (reduce.py):
    the float8 weights' gradients too. Every step equals torch's; the extension still runs
    (twice per weight and step), and nothing is gathered."""
    per_step = run_on_ranks(_float8, 1, None, False, True, timeout=TIMEOUT)[0]
    assert per_step == [(10, {})] * len(per_step), per_step


def _float8_accumulating() -> list:
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    warnings.filterwarnings("ignore")
    case = Case(
        build=_build, shard_units=lambda m: list(m.blocks), batch=lambda gen: torch.randn(8, DIM, generator=gen),
        param_dtype=BF16, reduce_dtype=torch.float32, micro_batches=3, steps=2,
    )
    return side_by_side_counting(case, WeightWithDynamicFloat8CastTensor)[1]


def test_float8_gradient_accumulation_without_sync_matches_torch():
    """Three micro-batches per step, gradient sync off but for the last: bf16 gradients of
    the float8 weights accumulate in fp32 (reduce_dtype) and reduce once, as in torch."""
    per_step = run_on_ranks(_float8_accumulating, 2, timeout=TIMEOUT)[0]
    assert per_step[-1][0] == 3 * (5 + 4), per_step  # 5 float8 weights; the blocks again in backward (root kept)


def _float8_int_reshard() -> None:
    warnings.filterwarnings("ignore")
    for fully_shard in (torch_fully_shard, shardwise.fully_shard):
        torch.manual_seed(0)
        model = _build()
        for block in model.blocks:
            fully_shard(block, reshard_after_forward=2)
        fully_shard(model, reshard_after_forward=2)
        with pytest.raises(NotImplementedError):
            model(torch.randn(8, DIM)).sum().backward()


def test_float8_int_reshard_after_forward_is_refused_like_torch():
    """torch's FSDP2 raises NotImplementedError for reshard_after_forward=2 with the float8
    all-gather (an extension param has no post-forward shard); shardwise raises it too."""
    run_on_ranks(_float8_int_reshard, 4, timeout=TIMEOUT)
