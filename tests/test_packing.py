"""Packing gradients for a reduction (``shardwise.collectives``), single process.

With shard size 1 (``replicate``) the gradients are concatenated and divided by the
world size in one pass, as DDP divides while copying into its buckets; the result must
be exactly the concatenation of ``g / divisor`` (cast to the reduce dtype), whatever the
gradients' shapes, strides and dtype.
"""

from __future__ import annotations

import pytest
import torch

from shardwise import collectives

# Both packing strategies: one concatenation then one division (small gradients), and one
# division into place per gradient (large ones), forced through the size threshold.
_STRATEGIES = pytest.mark.parametrize("small_grad_numel", [1 << 40, 0], ids=["concat-then-divide", "divide-into-place"])


@_STRATEGIES
@pytest.mark.parametrize("with_cast", [False, True])
def test_pack_dividing_is_the_divided_concatenation(monkeypatch, small_grad_numel, with_cast):
    monkeypatch.setattr(collectives, "SMALL_GRAD_NUMEL", small_grad_numel)
    gen = torch.Generator().manual_seed(0)
    grads = [
        torch.randn(5, 3, generator=gen),
        torch.randn(4, 6, generator=gen).t(),  # non-contiguous
        torch.randn(7, generator=gen, dtype=torch.bfloat16 if with_cast else torch.float32),  # cast on the way
        torch.randn(0, 2, generator=gen),  # empty
    ]
    for divisor in (2.0, 3.0):
        out = torch.full((sum(g.numel() for g in grads),), float("nan"))
        for into in (None, out):
            packed = collectives.pack_dividing(list(grads), torch.float32, divisor, out=into)
            expected = torch.cat([(g.float() / divisor).reshape(-1) for g in grads])
            assert packed.shape == (1, expected.numel()) and packed.dtype == torch.float32
            assert torch.equal(packed.view(-1), expected)
            assert into is None or packed.data_ptr() == out.data_ptr()


@_STRATEGIES
def test_pack_dividing_by_a_power_of_two_commutes_with_the_sum(monkeypatch, small_grad_numel):
    """For N = 2, 4 the fused pre-division gives bit for bit the post-divided mean."""
    monkeypatch.setattr(collectives, "SMALL_GRAD_NUMEL", small_grad_numel)
    gen = torch.Generator().manual_seed(1)
    for n in (2, 4):
        per_rank = [[torch.randn(33, generator=gen), torch.randn(4, 5, generator=gen)] for _ in range(n)]
        summed = sum(collectives.pack_dividing(g, torch.float32, float(n)) for g in per_rank)
        post = sum(torch.cat([t.reshape(-1) for t in g]) for g in per_rank) / n
        assert torch.equal(summed.view(-1), post)
