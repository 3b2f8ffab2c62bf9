"""The learning-rate schedule of ``shardwise train`` (``--lr-schedule``, ``--warmup-steps``).

``constant`` keeps ``--lr``; ``cosine`` warms up linearly over ``warmup_steps`` and then
decays along a half cosine to ``MIN_RATIO * lr`` at the last step, the usual GPT recipe.
Both are a ``torch.optim.lr_scheduler.LambdaLR`` stepped once per optimizer step, whose
``state_dict()`` is plain data: a checkpoint stores it as JSON and a resumed run continues
the same curve.
"""

from __future__ import annotations

import math

import torch

__all__ = ["MIN_RATIO", "WarmupCosine", "build_scheduler"]

MIN_RATIO = 0.1
"""The cosine schedule ends at this fraction of the peak learning rate."""


class WarmupCosine:
    """``step -> lr multiplier``: linear warm-up to 1, then half-cosine decay to ``min_ratio`` at ``total``.

    A class rather than a closure so that ``LambdaLR.state_dict()`` records its fields.
    """

    warmup: int  # steps of linear warm-up (0: none)
    total: int  # the step where the decay reaches min_ratio
    min_ratio: float  # floor of the multiplier

    def __init__(self, warmup: int, total: int, min_ratio: float = MIN_RATIO) -> None:
        self.warmup, self.total, self.min_ratio = warmup, total, min_ratio

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / self.warmup
        progress = min(1.0, (step - self.warmup) / max(1, self.total - self.warmup))
        return self.min_ratio + (1 - self.min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def build_scheduler(
    optimizer: torch.optim.Optimizer, schedule: str, warmup_steps: int, total_steps: int,
) -> torch.optim.lr_scheduler.LambdaLR:
    """The ``schedule`` (``constant`` or ``cosine``) over ``total_steps`` optimizer steps."""
    if schedule == "constant":
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    if schedule == "cosine":
        return torch.optim.lr_scheduler.LambdaLR(optimizer, WarmupCosine(warmup_steps, total_steps))
    raise ValueError(f"unknown lr schedule {schedule!r}; expected 'constant' or 'cosine'")
