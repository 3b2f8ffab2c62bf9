"""torchao NF4 QLoRA against torch's FSDP2, bit for bit, in bf16.

The model is what torchtune's ``lora_llama3(quantize_base=True)`` builds per projection: a
frozen NF4 base weight (``to_nf4`` of a bf16 weight, applied through ``linear_nf4``) plus
trainable bf16 LoRA adapters (``lora_b`` zero-initialised), sharded per layer and at the
root. ``NF4Tensor`` implements the extension: its shard is what ``torch.chunk`` gives
(each inner tensor split), its all-gather inputs are the quantized scalers (int8), the
quantization factors (bf16) and the 4-bit data (uint8), gathered as bytes with the bf16
adapters in one all-gather; the unsharded NF4 weight is rebuilt around the outputs and
reused through ``out=``. Every step compares losses, parameters (the NF4 weights still
NF4 and unchanged), adapter gradients, ``fsdp_pre_all_gather`` calls and bytes gathered.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn

from shardwise.testing import run_on_ranks
from tests._extension_helpers import Case, side_by_side_counting

TIMEOUT = 180
BF16 = torch.bfloat16
DIM, RANK = 256, 8  # 256*256 NF4 elements: 1024 blocks of 64, 4 scaler blocks of 256: shards over 2 or 4


class LoRALinear(nn.Module):
    """torchtune's LoRALinear with ``quantize_base=True`` (no dropout, no bias)."""

    def __init__(self, dim: int = DIM, rank: int = RANK, alpha: float = 16.0):
        from torchao.quantization import to_nf4

        super().__init__()
        base = nn.Linear(dim, dim, bias=False, dtype=BF16)
        self.weight = nn.Parameter(to_nf4(base.weight.detach()), requires_grad=False)
        self.lora_a = nn.Linear(dim, rank, bias=False, dtype=BF16)
        self.lora_b = nn.Linear(rank, dim, bias=False, dtype=BF16)
        nn.init.zeros_(self.lora_b.weight)
        self.scaling = alpha / rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import linear_nf4

        return linear_nf4(input=x, weight=self.weight) + self.lora_b(self.lora_a(x)) * self.scaling


class QLoRA(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(LoRALinear() for _ in range(2))
        self.output = LoRALinear()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + torch.nn.functional.silu(layer(x))
        return self.output(x)


def _qlora(reshard_after_forward) -> list:
    from torchao.quantization import NF4Tensor

    warnings.filterwarnings("ignore")
    case = Case(
        build=QLoRA,
        shard_units=lambda m: list(m.layers),
        batch=lambda gen: torch.randn(4, DIM, generator=gen).to(BF16),
        reshard_after_forward=reshard_after_forward,
        lr=0.5,
        steps=3,
    )
    ours, per_step = side_by_side_counting(case, NF4Tensor)
    for name, p in ours.named_parameters():
        if not p.requires_grad:
            assert type(p.to_local()) is NF4Tensor and p.grad is None, f"{name}: {type(p.to_local())}"
        else:
            assert p.dtype == BF16 and p.grad is not None, name
    sd = ours.state_dict()
    assert all(type(sd[k].to_local()) is NF4Tensor for k in sd if k.endswith(".weight") and "lora" not in k)
    return per_step


@pytest.mark.parametrize("reshard_after_forward", [True, False], ids=["reshard", "keep"])
def test_nf4_qlora_matches_torch(reshard_after_forward):
    per_step = run_on_ranks(_qlora, 2, reshard_after_forward, timeout=TIMEOUT)[0]
    calls, gathered = per_step[-1]
    assert calls == 3 * (2 if reshard_after_forward else 1), per_step
    # per NF4 weight: 1024 int8 scalers + 4 bf16 factors + 32768 bytes of 4-bit data; adapters 2*256*8 bf16
    per_layer = 1024 + 4 * 2 + DIM * DIM // 2 + 2 * DIM * RANK * 2
    assert gathered == {torch.uint8: 3 * per_layer * (2 if reshard_after_forward else 1)}, gathered
