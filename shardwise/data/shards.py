"""One shard of a prepared directory: tokenize a range of source rows and write it so that it appears whole.

:func:`write_shard` runs in a worker process. It reads its rows in batches of
:data:`BATCH_ROWS`, tokenizes them (an EOS after each document), appends the ids to
``.shard-NNNNN.bin.tmp`` while hashing them, saves the document starts, fsyncs, renames the
index and then the tokens into place, and writes the receipt (``shard-NNNNN.json``, atomically)
last. :func:`finished_shard` is the resume check: a receipt for the same job whose ``.bin``
still has the recorded sha256.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path
from typing import Any, Callable

import numpy as np

from shardwise.checkpoint.faults import maybe_kill
from shardwise.data.encoders import Encoder
from shardwise.data.manifest import ShardInfo, sha256_file, shard_paths, write_json_atomic

__all__ = ["ShardJob", "write_shard", "finished_shard", "BATCH_ROWS"]

BATCH_ROWS = 512
"""Documents tokenized per call (one progress report each)."""


@dataclasses.dataclass(frozen=True)
class ShardJob:
    """What one shard holds: its place, split and source rows, and the key a resume must match."""

    out: Path
    index: int
    split: str  # "train" or "held_out"
    rows: tuple[int, int]  # [first, end) rows of the source
    dtype: str  # "uint16" or "uint32"
    key: str  # sha256 of (source, tokenizer, text field, plan): a receipt of another key is stale


def _texts(dataset: Any, field: str, first: int, end: int) -> list[str]:
    texts = dataset[first:end][field]
    for i, text in enumerate(texts):
        if not isinstance(text, str):
            raise ValueError(f"row {first + i} of the source: field {field!r} is {type(text).__name__}, not text")
    return texts


def _encode(encoder: Encoder, texts: list[str], dtype: str, vocab: int) -> tuple[np.ndarray, np.ndarray]:
    """``(ids as dtype, per-document lengths)``; ids past the vocabulary are an error."""
    flat, lengths = encoder.encode(texts)
    if flat.size and (flat.max() >= vocab or flat.min() < 0):
        raise ValueError(f"tokenizer {encoder.name} produced id {int(flat.max())} outside its vocabulary of {vocab}")
    return flat.astype(dtype), lengths


def _fsync(f) -> None:
    f.flush()
    os.fsync(f.fileno())


def write_shard(job: ShardJob, dataset: Any, field: str, encoder: Encoder,
                progress: Callable[[int, int], None]) -> ShardInfo:
    """Tokenize ``job.rows`` of ``dataset[field]`` into shard ``job.index``; ``progress(documents, tokens)`` per batch."""
    bin_path, idx_path, receipt = shard_paths(job.out, job.index)
    tmp_bin, tmp_idx = (p.with_name(f".{p.name}.tmp") for p in (bin_path, idx_path))
    digest, starts, n = hashlib.sha256(), [], 0
    vocab = encoder.vocab_size
    with open(tmp_bin, "wb") as f:
        for first in range(job.rows[0], job.rows[1], BATCH_ROWS):
            end = min(first + BATCH_ROWS, job.rows[1])
            ids, lengths = _encode(encoder, _texts(dataset, field, first, end), job.dtype, vocab)
            buf = ids.tobytes()
            f.write(buf)
            digest.update(buf)
            starts.append(n + np.cumsum(lengths) - lengths)
            n += ids.size
            progress(end - first, int(ids.size))
            if first == job.rows[0]:
                maybe_kill("prepare_mid_shard", job.index, 0)
        _fsync(f)
    with open(tmp_idx, "wb") as f:
        np.save(f, np.concatenate(starts or [np.zeros(0, np.int64)]).astype(np.uint64))
        _fsync(f)
    os.replace(tmp_idx, idx_path)
    os.replace(tmp_bin, bin_path)
    info = ShardInfo(job.index, job.split, job.rows, n, job.rows[1] - job.rows[0], digest.hexdigest())
    write_json_atomic(receipt, {"key": job.key, "shard": dataclasses.asdict(info)})
    maybe_kill("prepare_after_shard", job.index, 0)
    return info


def finished_shard(job: ShardJob) -> ShardInfo | None:
    """The shard's info when a receipt of this very job exists and its ``.bin`` matches the recorded sha256."""
    bin_path, idx_path, receipt = shard_paths(job.out, job.index)
    try:
        record = json.loads(receipt.read_text())
        info = ShardInfo(**{**record["shard"], "rows": tuple(record["shard"]["rows"])})
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if record.get("key") != job.key or info.rows != job.rows or not (bin_path.is_file() and idx_path.is_file()):
        return None
    return info if sha256_file(bin_path) == info.sha256 else None
