"""A frozen low-precision base next to trainable fp32 adapters in one group (LoRA).

torch's FSDP2 checks dtype uniformity over the *trainable* parameters only and gathers a
group of mixed dtypes as bytes; shardwise does the same (:mod:`shardwise.layout`). Odd
shapes make the padded shards of the bf16 params odd numbers of bf16 elements, so the
layout's alignment (widest itemsize first) is exercised. Each case trains shardwise and
torch's FSDP2 side by side and compares every step, bit for bit: losses, parameters,
gradients (the frozen ones have none) and dtypes; the frozen base never moves. Two
trainable dtypes in one group stay an error, as in torch.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard

import shardwise
from shardwise.testing import run_on_ranks

TIMEOUT = 60
STEPS = 3
BF16 = torch.bfloat16


class LoRALinear(nn.Module):
    """``base(x)`` (frozen, bf16) plus ``up(down(x))`` (trainable, fp32)."""

    def __init__(self, dim: int = 7, rank: int = 3):
        super().__init__()
        self.base = nn.Linear(dim, dim).to(BF16).requires_grad_(False)
        self.down = nn.Linear(dim, rank, bias=False)
        self.up = nn.Linear(rank, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.base(x.to(self.base.weight.dtype)).to(x.dtype) + self.up(self.down(x))


class LoRAStack(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(LoRALinear() for _ in range(2))
        self.head = nn.Linear(7, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def _shard(model: LoRAStack, fully_shard_fn, **kwargs) -> LoRAStack:
    for layer in model.layers:
        fully_shard_fn(layer, **kwargs)
    return fully_shard_fn(model, **kwargs)


def _lora_parity(param_dtype) -> None:
    torch.manual_seed(0)
    base = LoRAStack()
    frozen = {n: p.detach().clone() for n, p in base.named_parameters() if not p.requires_grad}
    mp = {} if param_dtype is None else {"param_dtype": param_dtype}
    theirs = _shard(copy.deepcopy(base), torch_fully_shard, mp_policy=TorchMixedPrecisionPolicy(**mp))
    ours = _shard(base, shardwise.fully_shard, mp_policy=shardwise.MixedPrecisionPolicy(**mp))
    opts = [torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.1) for m in (ours, theirs)]
    gen = torch.Generator().manual_seed(dist.get_rank())
    for step in range(STEPS):
        x, y = torch.randn(4, 7, generator=gen), torch.randn(4, 3, generator=gen)
        losses = []
        for model, opt in zip((ours, theirs), opts):
            opt.zero_grad()
            loss = F.mse_loss(model(x).float(), y)
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        where = f"param_dtype={param_dtype}, step {step}, rank {dist.get_rank()}"
        assert torch.equal(*losses), f"{where}: losses {losses}"
        for (name, p), q in zip(ours.named_parameters(), theirs.parameters()):
            assert p.dtype == q.dtype and p.placements == q.placements, f"{where}: {name} {p.dtype} {p.placements}"
            assert torch.equal(p.to_local(), q.to_local()), f"{where}: {name}"
            if not p.requires_grad:
                assert p.grad is None, f"{where}: frozen {name} has a grad"
                assert torch.equal(p.full_tensor(), frozen[name]), f"{where}: frozen {name} moved"
            else:
                assert torch.equal(p.grad.to_local(), q.grad.to_local()), f"{where}: {name}.grad"


@pytest.mark.parametrize("param_dtype", [None, BF16], ids=["no_mp", "param_bf16"])
def test_frozen_bf16_base_with_trainable_fp32_adapters(param_dtype):
    run_on_ranks(_lora_parity, 2, param_dtype, timeout=TIMEOUT)


def _two_trainable_dtypes() -> None:
    model = LoRALinear()
    model.base.requires_grad_(True)
    with pytest.raises(NotImplementedError, match="uniform original parameter dtype"):
        shardwise.fully_shard(model)


def test_two_trainable_dtypes_in_one_group_is_an_error():
    run_on_ranks(_two_trainable_dtypes, 2, timeout=TIMEOUT)
