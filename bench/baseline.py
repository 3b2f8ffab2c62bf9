"""The compute-only baseline: what one rank's step costs with no wrapper and no peers.

The plain GPT (same seed, so the same weights) with its own AdamW, trained on rank 0's
batches with one intra-op thread: the work one rank does, minus data parallelism. A
contender's ``step / compute-only`` ratio is then the price of data parallelism on that
machine: communication, waiting for the slowest rank, the wrapper's own overhead, and
(with more ranks than cores) sharing the CPU.

It is measured *inside* the case's schedule, on rank 0 only, right after each step of
the pair: while it runs, the other ranks sleep in the next barrier (gloo waits without
spinning), so it has the process to itself yet sees the same moment of the shared
machine's load as the contenders it is compared with.

For ``bf16`` the model is cast to bf16, the precision mixed-precision FSDP computes in
(its optimizer then steps bf16 weights rather than fp32 shards: a small part of a step).
"""

from __future__ import annotations

import torch

from bench.cases import Case
from bench.contenders import Contender, build_plain, make_optimizer

__all__ = ["COMPUTE_ONLY", "build_compute_only"]

COMPUTE_ONLY = "compute-only"
"""The contender name of the baseline."""

_TORCH_DTYPE = {"fp32": torch.float32, "bf16": torch.bfloat16}


def build_compute_only(case: Case, seed: int, optimizer: str) -> Contender:
    """The unwrapped model of ``case`` in its compute dtype, with AdamW."""
    model = build_plain(case.model, seed).to(_TORCH_DTYPE[case.dtype])
    return Contender(COMPUTE_ONLY, model, make_optimizer(model, optimizer))
