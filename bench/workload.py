"""The work one benchmark step does: a batch of random tokens and one training step.

A step is exactly what the report times::

    logits = model(x)                                          # (B, T, vocab)
    loss = cross_entropy(logits.float(), y)                    # fp32 loss even under bf16 compute
    loss.backward(); optimizer.step(); optimizer.zero_grad()

Data are random byte tokens rather than the training corpus: the step time does not
depend on what the tokens say, and a seeded generator per ``(seed, rank)`` gives every
implementation the same batches without touching the disk.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from shardwise.train.model import GPTConfig

__all__ = ["Batch", "make_batches", "train_step"]


class Batch(NamedTuple):
    """Inputs and next-token targets, both ``(B, T)`` int64."""

    x: torch.Tensor
    y: torch.Tensor


def make_batches(cfg: GPTConfig, batch_size: int, count: int, seed: int, rank: int) -> list[Batch]:
    """``count`` batches for ``rank``: random windows of ``T + 1`` tokens, split into ``x`` and ``y``.

    Generated up front so no step pays for them; the same arguments give the same batches.
    """
    gen = torch.Generator().manual_seed(seed * 1_000_003 + rank)
    batches = []
    for _ in range(count):
        tokens = torch.randint(0, cfg.vocab_size, (batch_size, cfg.seq_len + 1), generator=gen)  # (B, T+1)
        batches.append(Batch(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()))  # (B, T) each
    return batches


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, batch: Batch) -> torch.Tensor:
    """Forward, backward, optimizer step and ``zero_grad``; returns the detached loss."""
    logits = model(batch.x)  # (B, T, vocab), bf16 under mixed precision
    loss = F.cross_entropy(logits.flatten(0, 1).float(), batch.y.flatten())  # (B*T, vocab) vs (B*T,)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()
