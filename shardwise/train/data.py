"""Training text that is on every machine already, tokenized as raw bytes.

Corpus. By default the Python standard library's own ``.py`` sources (the directory
``sysconfig.get_paths()["stdlib"]``, without ``site-packages``), or any file or directory
given as ``--data PATH``. Files are read in sorted path order and joined with a newline
until ``max_bytes`` is reached, so every rank on a machine builds the same byte string and
start-up stays fast however large the directory is.

Tokenizer. One token per byte: the vocabulary is the 256 byte values and decoding is
``bytes(tokens)``; no merges to learn or ship.

Batches. Each step draws one *global* batch of ``batch_size * world_size`` random windows of
``seq_len + 1`` bytes from a generator seeded with ``seed`` (the same on every rank), and
rank ``r`` keeps windows ``[r * batch_size, (r + 1) * batch_size)``. Reruns repeat exactly,
ranks see different data (what makes the gradient all-reduce of data parallelism useful),
and the data position is one generator state that every rank holds: a checkpoint restores
it exactly, and a run resumed on 4 ranks with half the per-rank batch sees the very batches
the 2-rank run would have seen::

    >>> tokens = load_corpus()                       # uint8 tensor, the stdlib sources
    >>> sampler = BatchSampler(tokens, batch_size=8, seq_len=128, seed=0, rank=1, world_size=2)
    >>> x, y = sampler.next_batch()                  # (8, 128) int64 each; y is x shifted by one
    >>> state = sampler.state_dict()                 # JSON-able: the data position
"""

from __future__ import annotations

import base64
import logging
import os
import sysconfig
from pathlib import Path
from typing import Iterator

import torch

__all__ = [
    "VOCAB_SIZE", "DEFAULT_MAX_BYTES", "stdlib_dir", "corpus_files", "load_corpus", "encode", "decode", "BatchSampler",
]

logger = logging.getLogger(__name__)

VOCAB_SIZE = 256
"""Byte-level tokenizer: one token per byte value."""

DEFAULT_MAX_BYTES = 4 * 1024 * 1024
"""Read at most this much text (4 MiB, a few hundred stdlib modules): enough variety, fast start-up."""

_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})


def stdlib_dir() -> Path:
    """The directory of the running interpreter's standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


def corpus_files(root: Path, suffix: str | None = None) -> Iterator[Path]:
    """Files under ``root`` (or ``root`` itself) in sorted order, skipping installed packages.

    Args:
        root: a file or a directory to walk.
        suffix: keep only names ending in it (``".py"``); ``None`` keeps every file.
    """
    if root.is_file():
        yield root
        return
    if not root.is_dir():
        raise FileNotFoundError(f"training data path {str(root)!r} is neither a file nor a directory")
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS and not d.startswith("."))
        for name in sorted(filenames):
            if suffix is None or name.endswith(suffix):
                yield Path(dirpath) / name


def _looks_binary(chunk: bytes) -> bool:
    return b"\0" in chunk[:4096]


def load_corpus(path: str | os.PathLike | None = None, max_bytes: int = DEFAULT_MAX_BYTES) -> torch.Tensor:
    """Read the corpus into a 1-D ``uint8`` tensor of at most ``max_bytes`` tokens.

    Args:
        path: a text file or a directory of text files; ``None`` means the stdlib ``.py`` sources.
        max_bytes: stop reading once this many bytes are collected (the last file is cut).

    Files containing NUL bytes are skipped as binary. Raises ``ValueError`` when fewer than
    two bytes of text are found.
    """
    if max_bytes < 2:
        raise ValueError(f"max_bytes must be >= 2, got {max_bytes}")
    root, suffix = (stdlib_dir(), ".py") if path is None else (Path(path), None)
    parts: list[bytes] = []
    total = 0
    for file in corpus_files(root, suffix):
        text = file.read_bytes()
        if _looks_binary(text):
            continue
        parts.append(text[: max_bytes - total] + b"\n")
        total += len(parts[-1])
        if total >= max_bytes:
            break
    data = b"".join(parts)[:max_bytes]
    if len(data) < 2:
        raise ValueError(f"no text found under {str(root)!r}; pass --data PATH to a text file or directory")
    logger.info("corpus: %d bytes from %d files under %s", len(data), len(parts), root)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def encode(text: str) -> torch.Tensor:
    """UTF-8 bytes of ``text`` as a 1-D ``int64`` token tensor."""
    return torch.tensor(list(text.encode("utf-8")), dtype=torch.long)


def decode(tokens: torch.Tensor) -> str:
    """Inverse of :func:`encode` (invalid UTF-8 sequences become U+FFFD)."""
    return bytes(tokens.to(torch.uint8).tolist()).decode("utf-8", errors="replace")


class BatchSampler:
    """Random ``(inputs, targets)`` windows of a token tensor: this rank's slice of a global batch.

    Each batch is this rank's ``batch_size`` of the ``batch_size * world_size`` window starts
    drawn uniformly from one generator seeded with ``seed``; ``targets`` are the ``inputs``
    shifted one token to the left. Every rank advances the generator identically.
    """

    tokens: torch.Tensor  # (N,) uint8, the whole corpus, identical on every rank
    batch_size: int  # windows per batch on this rank
    seq_len: int  # tokens per window (targets need one more)
    rank: int  # which slice of the global batch this rank keeps
    world_size: int  # slices in a global batch
    generator: torch.Generator  # CPU generator seeded with seed; same state on every rank

    def __init__(
        self, tokens: torch.Tensor, batch_size: int, seq_len: int, seed: int, rank: int = 0, world_size: int = 1,
    ) -> None:
        if tokens.dim() != 1 or tokens.numel() < seq_len + 1:
            raise ValueError(
                f"need a 1-D corpus of at least seq_len+1={seq_len + 1} tokens, got shape {tuple(tokens.shape)}"
            )
        if batch_size < 1 or seq_len < 1:
            raise ValueError(f"batch_size and seq_len must be >= 1, got {batch_size} and {seq_len}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
        self.tokens = tokens
        self.batch_size = batch_size
        self.seq_len = seq_len
        self.rank = rank
        self.world_size = world_size
        self.generator = torch.Generator().manual_seed(seed)

    def __repr__(self) -> str:
        n = self.tokens.numel()
        return (
            f"BatchSampler(corpus={n} tokens, batch_size={self.batch_size}, seq_len={self.seq_len}, "
            f"rank={self.rank}/{self.world_size})"
        )

    @property
    def global_batch_size(self) -> int:
        """Windows per step over all ranks."""
        return self.batch_size * self.world_size

    def next_batch(self, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
        """The next ``(inputs, targets)`` pair, each ``(batch_size, seq_len)`` int64 on ``device``."""
        T, B = self.seq_len, self.batch_size
        starts = torch.randint(0, self.tokens.numel() - T, (self.global_batch_size,), generator=self.generator)
        starts = starts[self.rank * B : (self.rank + 1) * B]  # (B,): this rank's slice of the global batch
        offsets = starts[:, None] + torch.arange(T + 1)  # (B, T+1): index of every token of every window
        windows = self.tokens[offsets].long()  # (B, T+1)
        x, y = windows[:, :-1], windows[:, 1:]  # (B, T) each, y[b, t] = x[b, t+1]
        return x.to(device, non_blocking=True), y.to(device, non_blocking=True)

    def state_dict(self) -> dict:
        """The data position, JSON-able: the generator state and the global batch it was drawn for."""
        state = base64.b64encode(self.generator.get_state().numpy().tobytes()).decode("ascii")
        return {"generator": state, "global_batch_size": self.global_batch_size}

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state``; a different global batch size draws a different stream (logged)."""
        if "generator" not in state:
            raise ValueError("the checkpoint's data position is of a prepared directory (shardwise data prepare), "
                             "not of a text corpus; resume with the --data it was saved with")
        raw = bytearray(base64.b64decode(state["generator"]))
        self.generator.set_state(torch.frombuffer(raw, dtype=torch.uint8).clone())
        if state["global_batch_size"] != self.global_batch_size:
            logger.warning(
                "data position saved for a global batch of %d windows, resumed with %d: batches from here on "
                "differ from the original run's", state["global_batch_size"], self.global_batch_size,
            )
