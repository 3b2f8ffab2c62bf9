"""A seeded permutation of ``[0, n)`` evaluated one index at a time: no ``n``-sized table.

A shuffled order of every training window would cost 8 bytes per window on every rank
(64 MB for a billion tokens at ``seq_len`` 128), growing with the corpus. Instead
:func:`permute` computes where position ``i`` goes: a 4-round Feistel network on the
smallest even number of bits covering ``n`` is a bijection of ``[0, 4^k)``; values that land
past ``n`` are sent through it again (*cycle walking*) until they fall inside, which keeps it
a bijection of ``[0, n)``. The round keys come from ``(seed, epoch)``, so each epoch is a
different order, the same on every rank and every run.
"""

from __future__ import annotations

import functools

import numpy as np

__all__ = ["permute"]

ROUNDS = 4
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: a well-spread 64-bit hash of each element."""
    x = (x ^ (x >> np.uint64(30))) * _M1
    x = (x ^ (x >> np.uint64(27))) * _M2
    return x ^ (x >> np.uint64(31))


@functools.lru_cache(maxsize=8)
def _round_keys(seed: int, epoch: int) -> tuple[np.uint64, ...]:
    words = np.random.SeedSequence([seed & 0xFFFFFFFF, epoch & 0xFFFFFFFF, 0x5AD]).generate_state(ROUNDS, np.uint64)
    return tuple(np.uint64(w) for w in words)


def _feistel(x: np.ndarray, half_bits: int, keys: tuple[np.uint64, ...]) -> np.ndarray:
    mask = np.uint64((1 << half_bits) - 1)
    left, right = x >> np.uint64(half_bits), x & mask
    for key in keys:
        left, right = right, left ^ (_mix(right ^ key) & mask)
    return (left << np.uint64(half_bits)) | right


def permute(index: np.ndarray, n: int, seed: int, epoch: int = 0) -> np.ndarray:
    """Where each of ``index`` (values in ``[0, n)``) goes in the ``(seed, epoch)`` permutation of ``[0, n)``."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    index = np.asarray(index, dtype=np.int64)
    if index.size and (index.min() < 0 or index.max() >= n):
        raise ValueError(f"indices must lie in [0, {n})")
    half_bits = max(1, (int(n - 1).bit_length() + 1) // 2)
    keys = _round_keys(seed, epoch)
    with np.errstate(over="ignore"):
        x = _feistel(index.astype(np.uint64), half_bits, keys)
        outside = x >= np.uint64(n)
        while outside.any():
            x[outside] = _feistel(x[outside], half_bits, keys)
            outside = x >= np.uint64(n)
    return x.astype(np.int64)
