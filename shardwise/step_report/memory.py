"""How many bytes this rank holds right now: the sampler behind the report's memory curve.

- **CUDA**: ``torch.cuda.memory_allocated`` (bytes of live tensors on the device).
- **CPU with glibc**: ``mallinfo2()``, the bytes the C allocator has handed out and not
  taken back (``uordblks + hblkhd``): live tensors plus the interpreter's own small
  objects. It falls the moment a tensor is freed, unlike the resident set size; a call
  walks every malloc arena (microseconds alone, tens of µs beside gloo's threads).
- **elsewhere**: the resident set size from ``/proc/self/statm`` (or 0 where there is none);
  the label says so.

Samples are taken at lifecycle events only (thinned to every k-th event when sampling
would cost more than 0.3% of a step: ``recorder.MEMORY_BUDGET``), so the peak is the largest
*sampled* value: a transient inside one module's compute can go higher between two samples.
"""

from __future__ import annotations

import ctypes
import os
from typing import Callable

import torch

__all__ = ["MemorySampler", "sampler_for"]


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost",
    )]  # fmt: skip


class MemorySampler:
    """``sample()`` returns the current bytes; ``label`` names what is measured."""

    label: str  # e.g. "CUDA allocated", "malloc in use", "RSS"
    sample: Callable[[], int]

    def __init__(self, label: str, sample: Callable[[], int]) -> None:
        self.label, self.sample = label, sample

    def __repr__(self) -> str:
        return f"MemorySampler({self.label!r})"


def _mallinfo2() -> Callable[[], int] | None:
    try:
        fn = ctypes.CDLL(None).mallinfo2
    except (OSError, AttributeError):
        return None
    fn.restype = _MallInfo2

    def sample() -> int:
        info = fn()
        return info.uordblks + info.hblkhd

    return sample


def _rss() -> Callable[[], int]:
    page = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096

    def sample() -> int:
        try:
            with open("/proc/self/statm", "rb") as f:
                return int(f.read().split()[1]) * page
        except OSError:
            return 0

    return sample


def sampler_for(device: torch.device) -> MemorySampler:
    """The cheapest honest sampler for tensors on ``device``."""
    if device.type == "cuda":
        return MemorySampler("CUDA allocated", lambda: torch.cuda.memory_allocated(device))
    mallinfo = _mallinfo2()
    if mallinfo is not None:
        return MemorySampler("malloc in use", mallinfo)
    return MemorySampler("RSS", _rss())
