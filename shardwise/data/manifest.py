"""The on-disk layout of a prepared token directory, and its manifest.

``shardwise data prepare SRC OUT`` writes::

    OUT/shard-00000.bin      flat token ids (uint16 when the vocabulary fits, else uint32), an EOS after
                             every document; one shard holds whole documents of one split
    OUT/shard-00000.idx.npy  the shard's document starts (uint64 offsets into the .bin, one per document)
    OUT/shard-00000.json     the shard's receipt: rows of the source, tokens, documents, sha256 of the .bin
    OUT/manifest.json        written last: the tokenizer, vocabulary, dtype, counts, splits, every shard

Visibility is the invariant: a ``.bin`` and its ``.idx.npy`` are written under temporary names
and renamed, and the receipt is written (atomically) after both, so a shard without a receipt
is unfinished whatever its size. The manifest is written (atomically) only once every shard
has a receipt, so ``OUT/manifest.json`` existing means the directory is complete: training
reads only directories that have one.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path
from typing import Any

__all__ = [
    "MANIFEST", "FORMAT", "SPLITS", "ShardInfo", "Manifest", "token_dtype", "sha256_file", "write_json_atomic",
    "read_manifest", "is_prepared", "shard_paths",
]

MANIFEST = "manifest.json"
FORMAT = "shardwise-tokens/1"
SPLITS = ("train", "held_out")


def token_dtype(vocab_size: int) -> str:
    """``uint16`` when every id of a ``vocab_size`` vocabulary fits in it, else ``uint32``."""
    return "uint16" if vocab_size <= 2**16 else "uint32"


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    """The sha256 of ``path``'s bytes, read in 4 MiB pieces."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while piece := f.read(chunk):
            h.update(piece)
    return h.hexdigest()


def write_json_atomic(path: Path, obj: Any) -> None:
    """Write ``obj`` as JSON to a temporary name beside ``path``, fsync, rename: readers see all or nothing."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def shard_paths(out: Path, index: int) -> tuple[Path, Path, Path]:
    """``(tokens .bin, document index .idx.npy, receipt .json)`` of shard ``index`` in ``out``."""
    stem = out / f"shard-{index:05d}"
    return stem.with_suffix(".bin"), stem.with_suffix(".idx.npy"), stem.with_suffix(".json")


@dataclasses.dataclass(frozen=True)
class ShardInfo:
    """One finished shard, as its receipt and the manifest record it."""

    index: int
    split: str  # "train" or "held_out"
    rows: tuple[int, int]  # [first, end) rows of the source dataset it tokenized
    tokens: int  # ids in the .bin (EOS included)
    documents: int
    sha256: str  # of the .bin


@dataclasses.dataclass(frozen=True)
class Manifest:
    """What ``OUT/manifest.json`` says: enough to train on the directory without reading the source."""

    tokenizer: dict[str, Any]  # Encoder.identity(): name, vocab_size, eos_id, vocab_sha256
    dtype: str  # token_dtype(vocab_size)
    source: dict[str, Any]  # where the text came from (path, kind, text field, files)
    held_out_fraction: float
    shards: tuple[ShardInfo, ...]
    format: str = FORMAT

    @property
    def vocab_size(self) -> int:
        return int(self.tokenizer["vocab_size"])

    def split(self, name: str) -> tuple[ShardInfo, ...]:
        """The shards of split ``name``, in order (their concatenation is the split's token stream)."""
        if name not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {name!r}")
        return tuple(s for s in self.shards if s.split == name)

    def counts(self) -> dict[str, dict[str, int]]:
        """Tokens and documents per split."""
        return {name: {"tokens": sum(s.tokens for s in self.split(name)),
                       "documents": sum(s.documents for s in self.split(name))} for name in SPLITS}

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["counts"] = self.counts()
        return out

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> Manifest:
        shards = tuple(ShardInfo(**{**s, "rows": tuple(s["rows"])}) for s in obj["shards"])
        return cls(obj["tokenizer"], obj["dtype"], obj["source"], obj["held_out_fraction"], shards, obj["format"])


def is_prepared(path: str | os.PathLike | None) -> bool:
    """Whether ``path`` is a directory ``shardwise data prepare`` writes into (finished or not)."""
    if path is None or not Path(path).is_dir():
        return False
    root = Path(path)
    return (root / MANIFEST).is_file() or any(root.glob("shard-*.json")) or any(root.glob("shard-*.bin"))


def read_manifest(path: str | os.PathLike) -> Manifest:
    """The manifest of the prepared directory ``path``, its shard files checked for presence and size.

    Raises ``FileNotFoundError`` (with the fix) when the preparation never finished, and
    ``ValueError`` when a shard is missing or its size disagrees with the manifest.
    """
    root = Path(path)
    file = root / MANIFEST
    if not file.is_file():
        raise FileNotFoundError(f"{root} has no {MANIFEST}: its `shardwise data prepare` did not finish; "
                                "run the same command again to complete it")
    try:
        manifest = Manifest.from_json(json.loads(file.read_text()))
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{file} is not a shardwise token manifest ({e}); prepare {root} again") from None
    if manifest.format != FORMAT:
        raise ValueError(f"{file}: format {manifest.format!r}, this shardwise reads {FORMAT!r}; prepare it again")
    itemsize = 2 if manifest.dtype == "uint16" else 4
    for shard in manifest.shards:
        bin_path = shard_paths(root, shard.index)[0]
        size = bin_path.stat().st_size if bin_path.is_file() else None
        if size != shard.tokens * itemsize:
            raise ValueError(f"{bin_path}: {'missing' if size is None else f'{size} bytes'}, the manifest says "
                             f"{shard.tokens * itemsize}; prepare {root} again")
    return manifest
