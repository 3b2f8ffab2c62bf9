"""torchao float8 training with tensor parallelism and FSDP on a (dp, tp) mesh, against torch.

torchtitan's float8 recipe: every ``nn.Linear`` becomes a ``Float8Linear``
(``Float8LinearConfig(enable_fsdp_float8_all_gather=True)``), ``parallelize_module`` splits
them on ``mesh["tp"]`` with torchao's ``Float8ColwiseParallel`` / ``Float8RowwiseParallel``
(activations cast to float8 before TP's collectives), then ``fully_shard(..., mesh=mesh["dp"])``
per block and on the root. Each weight is then a ``DTensor`` on the 2-D mesh whose local
tensor is torchao's ``WeightWithDynamicFloat8CastTensor``; FSDP calls its
``fsdp_pre_all_gather`` on the dp mesh and gets float8 data (and the scale as metadata),
and the rebuilt weight is a TP ``DTensor`` around a ``Float8TrainingTensor``.
``precompute_float8_dynamic_scale_for_fsdp`` after each optimizer step computes every
weight's scale in one all-reduce (else each pre-all-gather all-reduces its amax).

Each block's linears carry a plain fp32 bias: gloo cannot all-gather float8 tensors
("Invalid scalar type", torch's FSDP2 fails so on an all-float8 group), while a group of
mixed dtypes is gathered as bytes by both torch and shardwise.

4 ranks (dp 2 x tp 2), shardwise and torch side by side from the same model and data, bit
for bit at every step: losses, every parameter's type chain, placements and inner tensors,
every gradient, and what each rank all-gathers (float8 bytes of the inputs, all-gather
payload). Before the extension, shardwise gathered the fp32 shards of a plain local tensor
and never called the extension (the weights' type was ``('DTensor', 'Tensor')``).
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor.parallel import parallelize_module
from torchao.float8 import Float8LinearConfig, convert_to_float8_training, precompute_float8_dynamic_scale_for_fsdp
from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel, Float8RowwiseParallel
from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

import shardwise
from _extension_helpers import assert_same_params
from _lowprec_helpers import GatherInputs, rank_generator
from _nd_helpers import make_mesh
from shardwise.testing import run_on_ranks

TIMEOUT = 240
STEPS = 2  # step 0 casts with a fresh amax (or none precomputed yet); step 1 reuses the rebuilt weight (out=)
DIM, HIDDEN = 32, 64  # float8 matmuls want multiples of 16; TP splits HIDDEN
BF16 = torch.bfloat16


class FeedForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1 = nn.Linear(DIM, HIDDEN)
        self.w2 = nn.Linear(HIDDEN, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.w2(F.relu(self.w1(x)))


def _build(mesh) -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(FeedForward(), FeedForward())
    convert_to_float8_training(model, config=Float8LinearConfig(enable_fsdp_float8_all_gather=True))
    for block in model:
        parallelize_module(block, mesh["tp"], {"w1": Float8ColwiseParallel(), "w2": Float8RowwiseParallel()})
    return model


def _shard(model, fully_shard_fn, mesh, **kwargs):
    for block in model:
        fully_shard_fn(block, mesh=mesh["dp"], **kwargs)
    return fully_shard_fn(model, mesh=mesh["dp"], **kwargs)


def _step(model, opt, x, precompute: bool) -> tuple[torch.Tensor, dict]:
    with GatherInputs(WeightWithDynamicFloat8CastTensor) as gathered:
        loss = model(x).float().pow(2).mean()
        loss.backward()
    opt.step()
    opt.zero_grad()
    if precompute:
        precompute_float8_dynamic_scale_for_fsdp(model)
    return loss.detach(), gathered.summary()


def _parity(param_dtype, precompute: bool) -> list[dict]:
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    mesh = make_mesh((2, 2), ("dp", "tp"))
    base = _build(mesh)
    mp = {} if param_dtype is None else {"param_dtype": param_dtype, "reduce_dtype": torch.float32}
    theirs = _shard(copy.deepcopy(base), torch_fully_shard, mesh, mp_policy=TorchMixedPrecisionPolicy(**mp))
    ours = _shard(base, shardwise.fully_shard, mesh, mp_policy=shardwise.MixedPrecisionPolicy(**mp))
    opts = [torch.optim.Adam(m.parameters(), lr=1e-2) for m in (ours, theirs)]
    gen = rank_generator(mesh["dp"].get_local_rank())  # a TP group shares its batch
    where = f"float8 TP+FSDP, param_dtype={param_dtype}, precompute={precompute}"
    assert_same_params(ours, theirs, f"{where}, after fully_shard", grads=False)
    tallies = []
    for step in range(STEPS):
        x = torch.randn(8, DIM, generator=gen)
        (loss, ours_tally), (loss_t, theirs_tally) = (_step(m, o, x, precompute) for m, o in zip((ours, theirs), opts))
        assert torch.equal(loss, loss_t), f"{where}, step {step}: loss {loss.item()} vs torch's {loss_t.item()}"
        assert ours_tally == theirs_tally, f"{where}, step {step}: all-gathered {ours_tally} vs torch's {theirs_tally}"
        assert_same_params(ours, theirs, f"{where}, step {step}", grads=True)
        tallies.append(theirs_tally)
    return tallies


@pytest.mark.parametrize(
    "param_dtype, precompute", [(None, False), (BF16, True)], ids=["fp32", "bf16-precompute"]
)
def test_float8_tp_fsdp_matches_torch(param_dtype, precompute):
    run_on_ranks(_parity, 4, param_dtype, precompute, timeout=TIMEOUT)
