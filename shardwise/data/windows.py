"""Training batches from a prepared directory: memory-mapped shards, packed windows, a global order.

Tokens. A split's shards are ``np.memmap``-ed read-only (``MADV_RANDOM``: no read-ahead), and
their concatenation is one token stream (:class:`TokenStream`). Nothing is read until a
window is, so a rank's resident memory grows with the windows it has touched, never with
the corpus.

Windows. The stream is cut into packed windows of ``seq_len + 1`` tokens: window ``w`` is
tokens ``[w * seq_len, w * seq_len + seq_len + 1)`` (neighbours share one token: the last
target of one is the first input of the next), documents joined by their EOS.

Order. All windows form one global sequence: epoch ``e`` visits every window once, in the
order of a seeded bijection of ``[0, n)`` keyed by ``(seed, e)``
(:func:`~shardwise.data.permutation.permute`, evaluated pointwise: no ``n``-sized table).
Step ``k`` is positions ``[k * G, (k + 1) * G)`` of that sequence (``G`` = the global batch),
and data-parallel rank ``r`` takes its ``[r * B, (r + 1) * B)``. The data position is the
count of windows consumed: one integer, the same on every rank, so a resume at any world
size with the same global batch sees exactly the batches the uninterrupted run would::

    stream = TokenStream.open("tokens/", "train")
    sampler = WindowSampler(stream, batch_size=8, seq_len=256, seed=0, rank=1, world_size=2)
    x, y = sampler.next_batch()          # (8, 256) int64 each; y is x shifted by one
    sampler.state_dict()                 # {"position": 16, ...}
"""

from __future__ import annotations

import bisect
import logging
import mmap
import os
from pathlib import Path

import numpy as np
import torch

from shardwise.data.manifest import Manifest, read_manifest, shard_paths
from shardwise.data.permutation import permute

__all__ = ["TokenStream", "WindowSampler"]

logger = logging.getLogger(__name__)


class TokenStream:
    """One split of a prepared directory as a single read-only token sequence over memory-mapped shards."""

    shards: list[np.memmap]  # (tokens_i,) uint16 or uint32 each, read-only, never loaded whole
    starts: list[int]  # global offset of each shard's first token
    manifest: Manifest
    split: str

    def __init__(self, manifest: Manifest, root: str | os.PathLike, split: str) -> None:
        root = Path(root)
        self.manifest, self.split = manifest, split
        self.shards, self.starts, offset = [], [], 0
        for info in manifest.split(split):
            if info.tokens == 0:
                continue
            tokens = np.memmap(shard_paths(root, info.index)[0], dtype=manifest.dtype, mode="r", shape=(info.tokens,))
            _advise_random(tokens)
            self.shards.append(tokens)
            self.starts.append(offset)
            offset += info.tokens
        self.n_tokens = offset

    @classmethod
    def open(cls, root: str | os.PathLike, split: str = "train") -> TokenStream:
        """The ``split`` of the prepared directory ``root`` (its manifest and shard sizes checked)."""
        return cls(read_manifest(root), Path(root), split)

    def __len__(self) -> int:
        return self.n_tokens

    def __repr__(self) -> str:
        return f"TokenStream({self.split}: {self.n_tokens} tokens in {len(self.shards)} memory-mapped shards)"

    def read(self, start: int, length: int) -> np.ndarray:
        """Tokens ``[start, start + length)`` as int64, across shard boundaries."""
        if start < 0 or start + length > self.n_tokens:
            raise IndexError(f"tokens [{start}, {start + length}) outside the {self.split} split's {self.n_tokens}")
        out = np.empty(length, dtype=np.int64)
        i, filled = bisect.bisect_right(self.starts, start) - 1, 0
        while filled < length:
            shard, local = self.shards[i], start + filled - self.starts[i]
            take = min(length - filled, len(shard) - local)
            out[filled : filled + take] = shard[local : local + take]
            filled, i = filled + take, i + 1
        return out


def _advise_random(tokens: np.memmap) -> None:
    """No read-ahead: windows are read at random places, and read-ahead would map pages nobody reads."""
    raw = getattr(tokens, "_mmap", None)
    if raw is not None and hasattr(raw, "madvise") and hasattr(mmap, "MADV_RANDOM"):
        raw.madvise(mmap.MADV_RANDOM)


class WindowSampler:
    """This rank's slice of each global batch of packed windows (see the module docstring)."""

    stream: TokenStream
    batch_size: int  # windows per batch on this rank (B)
    seq_len: int  # tokens per window less one (T)
    seed: int
    rank: int
    world_size: int
    n_windows: int  # windows in the stream: (len(stream) - 1) // seq_len
    position: int  # windows of the global sequence consumed so far, on every rank alike

    def __init__(self, stream: TokenStream, batch_size: int, seq_len: int, seed: int, rank: int = 0,
                 world_size: int = 1) -> None:
        if batch_size < 1 or seq_len < 1:
            raise ValueError(f"batch_size and seq_len must be >= 1, got {batch_size} and {seq_len}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
        self.n_windows = (len(stream) - 1) // seq_len
        if self.n_windows < 1:
            raise ValueError(f"the {stream.split} split holds {len(stream)} tokens, fewer than one window of "
                             f"seq_len+1={seq_len + 1}; prepare more text or lower --seq-len")
        self.stream, self.batch_size, self.seq_len, self.seed = stream, batch_size, seq_len, seed
        self.rank, self.world_size, self.position = rank, world_size, 0

    def __repr__(self) -> str:
        return (f"WindowSampler({self.stream!r}, {self.n_windows} windows of {self.seq_len + 1}, "
                f"batch_size={self.batch_size}, rank={self.rank}/{self.world_size}, position={self.position})")

    @property
    def global_batch_size(self) -> int:
        return self.batch_size * self.world_size

    def window_ids(self, positions: np.ndarray) -> np.ndarray:
        """The window at each position of the global sequence (epoch by epoch, each a seeded bijection)."""
        epoch, offset = np.divmod(positions, self.n_windows)
        out = np.empty_like(positions)
        for e in np.unique(epoch):
            mask = epoch == e
            out[mask] = permute(offset[mask], self.n_windows, self.seed, int(e))
        return out

    def next_batch(self, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
        """The next ``(inputs, targets)``, each ``(batch_size, seq_len)`` int64 on ``device``."""
        T, B = self.seq_len, self.batch_size
        first = self.position + self.rank * B
        windows = self.window_ids(np.arange(first, first + B, dtype=np.int64))  # (B,)
        tokens = np.stack([self.stream.read(int(w) * T, T + 1) for w in windows])  # (B, T+1)
        self.position += self.global_batch_size
        batch = torch.from_numpy(tokens)
        x, y = batch[:, :-1], batch[:, 1:]  # (B, T) each, y[b, t] = x[b, t+1]
        return x.to(device, non_blocking=True), y.to(device, non_blocking=True)

    def state_dict(self) -> dict:
        """The data position, JSON-able: windows consumed, and what they are windows of."""
        return {"position": self.position, "global_batch_size": self.global_batch_size, "seed": self.seed,
                "seq_len": self.seq_len, "windows": self.n_windows}

    def load_state_dict(self, state: dict) -> None:
        """Continue after ``state["position"]`` windows; a position of other windows is refused."""
        if "position" not in state:
            raise ValueError("the checkpoint's data position is of the text corpus (--data FILE), not of a "
                             "prepared directory; resume with the --data it was saved with")
        saved = (state["windows"], state["seq_len"], state["seed"])
        if saved != (self.n_windows, self.seq_len, self.seed):
            raise ValueError(f"the checkpoint's data position counts {saved[0]} windows of seq_len {saved[1]} "
                             f"(seed {saved[2]}); this run has {self.n_windows} of seq_len {self.seq_len} (seed "
                             f"{self.seed}): resume with the same --data, --seq-len and --seed")
        self.position = int(state["position"])
        if state["global_batch_size"] != self.global_batch_size:
            logger.warning("data position saved with a global batch of %d windows, resumed with %d: the same "
                           "windows in the same order, grouped into steps differently",
                           state["global_batch_size"], self.global_batch_size)
