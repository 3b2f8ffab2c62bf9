"""torchao's int8 weight-only and BitNet training under fully_shard, against torch's FSDP2.

Both build on FSDP2's tensor-subclass extension (``fsdp_pre_all_gather`` /
``fsdp_post_all_gather``) and both run on CPU over gloo in torch 2.13 with torchao 0.18:

- **int8 weight-only** (``int8_weight_only_quantized_training``): the weight *is* an
  ``Int8QuantizedTrainingLinearWeight`` (row-wise int8 data + a scale per row) and the
  optimizer updates it in place with stochastic rounding (``torch.rand_like`` inside
  ``copy_``, so both sides reseed before each optimizer step). The five-argument signature:
  it gathers ``int_data`` (int8) and the scale cast to ``mp_policy.param_dtype``.
- **BitNet b1.58** (``bitnet_training``): the weight is a ``BitNetTrainingLinearWeight``
  (fp32 data) that gathers ternary weights packed four to a byte plus a tensor-wise scale
  (the one-argument signature); its scale is all-reduced inside ``fsdp_pre_all_gather``, or
  precomputed for every weight in one all-reduce by ``precompute_bitnet_scale_for_fsdp``.

Each case trains shardwise and torch side by side from the same model and data, bit for
bit at every step: losses, every parameter's type chain (``DTensor`` around the subclass)
and inner tensors, every gradient; and what each rank all-gathers (the subclass's inputs
in bytes per dtype, and the all-gather payload at the dispatcher); at the end the
``state_dict()`` values (the subclass kept, as in torch).

Before the extension, shardwise turned each subclass weight into a plain tensor at
``fully_shard`` and trained an fp32 model instead (BitNet's loss was off from step 0,
int8's drifted from step 1), gathering fp32 shards: every case here failed on that.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torchao.prototype.quantized_training import (
    BitNetTrainingLinearWeight,
    Int8QuantizedTrainingLinearWeight,
    bitnet_training,
    int8_weight_only_quantized_training,
    precompute_bitnet_scale_for_fsdp,
)
from torchao.quantization import quantize_

import shardwise
from _extension_helpers import assert_same_params
from _lowprec_helpers import GatherInputs, assert_same, rank_generator
from shardwise.testing import run_on_ranks

TIMEOUT = 120
STEPS = 3
DIM = 16
BF16 = torch.bfloat16
CONFIGS = {"int8": int8_weight_only_quantized_training, "bitnet": bitnet_training}
WEIGHT_TYPES = {"int8": Int8QuantizedTrainingLinearWeight, "bitnet": BitNetTrainingLinearWeight}


class Blocks(nn.Module):
    """Two quantized ``Linear(16, 16)`` blocks (a plain fp32 bias next to each subclass
    weight in one group) and a plain head."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(DIM, DIM) for _ in range(2))
        self.head = nn.Linear(DIM, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = F.relu(layer(x))
        return self.head(x)


def _build(kind: str) -> Blocks:
    torch.manual_seed(0)
    model = Blocks()
    quantize_(model.layers, CONFIGS[kind]())
    return model


def _shard(model: Blocks, fully_shard_fn, **kwargs) -> Blocks:
    for layer in model.layers:
        fully_shard_fn(layer, **kwargs)
    return fully_shard_fn(model, **kwargs)


def _step(model, opt, x, y, kind: str, precompute: bool, step: int) -> tuple[torch.Tensor, dict]:
    if kind == "bitnet" and precompute:
        precompute_bitnet_scale_for_fsdp(model)  # one all-reduce for every weight's scale
    with GatherInputs(WEIGHT_TYPES[kind]) as gathered:
        loss = F.mse_loss(model(x).float(), y)
        loss.backward()
    torch.manual_seed(1000 + step)  # int8's copy_ rounds stochastically: the same draws on both sides
    opt.step()
    opt.zero_grad()
    return loss.detach(), gathered.summary()


def _parity(kind: str, param_dtype, precompute: bool) -> list[dict]:
    base = _build(kind)
    mp = {} if param_dtype is None else {"param_dtype": param_dtype, "reduce_dtype": torch.float32}
    theirs = _shard(copy.deepcopy(base), torch_fully_shard, mp_policy=TorchMixedPrecisionPolicy(**mp))
    ours = _shard(base, shardwise.fully_shard, mp_policy=shardwise.MixedPrecisionPolicy(**mp))
    # Adam (no weight decay): the int8 weight implements addcdiv_ / add_, not mul_
    opts = [torch.optim.Adam(m.parameters(), lr=1e-2) for m in (ours, theirs)]
    gen = rank_generator()
    where = f"{kind}, param_dtype={param_dtype}, precompute={precompute}"
    assert_same_params(ours, theirs, f"{where}, after fully_shard", grads=False)
    tallies = []
    for step in range(STEPS):
        x, y = torch.randn(8, DIM, generator=gen), torch.randn(8, 4, generator=gen)
        (loss, ours_tally), (loss_t, theirs_tally) = (
            _step(m, o, x, y, kind, precompute, step) for m, o in zip((ours, theirs), opts)
        )
        assert torch.equal(loss, loss_t), f"{where}, step {step}: loss {loss.item()} vs torch's {loss_t.item()}"
        assert ours_tally == theirs_tally, f"{where}, step {step}: all-gathered {ours_tally} vs torch's {theirs_tally}"
        assert_same_params(ours, theirs, f"{where}, step {step}", grads=True)
        tallies.append(theirs_tally)
    sd, sd_t = ours.state_dict(), theirs.state_dict()
    assert list(sd) == list(sd_t), f"{where}: state_dict keys {list(sd)} vs torch's {list(sd_t)}"
    for key in sd:  # the subclass is kept in state_dict() values
        assert_same(sd[key], sd_t[key], f"{where}: state_dict()[{key!r}]")
    return tallies


CASES = {
    "int8-fp32": ("int8", None, False),
    "int8-bf16": ("int8", BF16, False),
    "bitnet-fp32": ("bitnet", None, False),  # the scale is all-reduced inside fsdp_pre_all_gather
    "bitnet-fp32-precompute": ("bitnet", None, True),  # precompute_bitnet_scale_for_fsdp before each step
    "bitnet-bf16-precompute": ("bitnet", BF16, True),
}


@pytest.mark.parametrize("kind, param_dtype, precompute", CASES.values(), ids=CASES.keys())
def test_quantized_training_matches_torch(kind, param_dtype, precompute):
    run_on_ranks(_parity, 2, kind, param_dtype, precompute, timeout=TIMEOUT)
