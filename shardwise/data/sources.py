"""Where ``shardwise data prepare`` reads text: local files or a saved dataset, through Hugging Face ``datasets``.

``SRC`` is one of:

- a directory written by ``Dataset.save_to_disk`` (``DatasetDict``: its ``train`` split, or its
  only split), memory-mapped by ``datasets.load_from_disk``;
- a ``.jsonl`` / ``.json`` file, a ``.parquet`` file, or a text file (any other suffix: the
  whole file is one document);
- a directory of such files (every file under it, sorted; all of one kind).

JSONL and Parquet rows are documents, their text in ``--text-field`` (default ``text``).
Files go through ``datasets.load_dataset("json" | "parquet" | "text")``, which converts them
to Arrow once under ``cache_dir``. A file that cannot be read or parsed, or a dataset without
the text field, is a :class:`SourceError` naming the file or the field and the columns found.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

__all__ = ["SourceError", "open_source", "KINDS"]

logger = logging.getLogger(__name__)

KINDS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}
"""File suffix -> ``datasets`` builder; any other suffix is read as text."""


class SourceError(ValueError):
    """The source cannot be read as documents; the message names the file or field and the fix."""


def _files(src: Path) -> list[Path]:
    if src.is_file():
        return [src]
    files = sorted(p for p in src.rglob("*") if p.is_file() and not any(part.startswith(".") for part in p.parts[len(src.parts):]))
    if not files:
        raise SourceError(f"{src}: an empty directory; pass files of JSONL, Parquet or text, or a save_to_disk directory")
    return files


def _kind(files: list[Path]) -> str:
    kinds = {KINDS.get(f.suffix.lower(), "text") for f in files}
    if len(kinds) > 1:
        raise SourceError(f"{files[0].parent}: mixes {sorted(kinds)} files; prepare one kind at a time")
    return kinds.pop()


def _is_saved_dataset(src: Path) -> bool:
    return src.is_dir() and ((src / "state.json").is_file() or (src / "dataset_dict.json").is_file())


def _load_saved(src: Path) -> Any:
    import datasets

    try:
        loaded = datasets.load_from_disk(str(src))
    except (OSError, ValueError, FileNotFoundError) as e:
        raise SourceError(f"{src}: datasets.load_from_disk cannot read it ({e})") from None
    if isinstance(loaded, datasets.DatasetDict):
        if "train" in loaded:
            return loaded["train"]
        if len(loaded) != 1:
            raise SourceError(f"{src}: a DatasetDict of splits {sorted(loaded)} and none is 'train'; "
                              "save the split to prepare on its own")
        return next(iter(loaded.values()))
    return loaded


def _check_readable(files: list[Path]) -> None:
    for file in files:
        try:
            with open(file, "rb") as f:
                f.read(1)
        except OSError as e:
            raise SourceError(f"{file}: cannot be read ({e.strerror})") from None


def _load_files(files: list[Path], kind: str, cache_dir: Path) -> Any:
    import datasets

    _check_readable(files)
    options = {"sample_by": "document"} if kind == "text" else {}
    try:
        return datasets.load_dataset(kind, data_files=[str(f) for f in files], split="train",
                                     cache_dir=str(cache_dir), **options)
    except Exception as e:  # datasets wraps the parser's error (DatasetGenerationError, ArrowInvalid...)
        cause = e.__cause__ or e
        raise SourceError(f"{_culprit(files, str(cause))}: not readable as {kind} ({type(cause).__name__}: "
                          f"{str(cause).splitlines()[0] if str(cause) else ''})") from None


def _culprit(files: list[Path], message: str) -> str:
    """The file an error message names, else all of them."""
    named = [str(f) for f in files if str(f) in message or f.name in message]
    return named[0] if named else ", ".join(map(str, files[:3])) + (" ..." if len(files) > 3 else "")


def open_source(src: str | os.PathLike, text_field: str, cache_dir: Path) -> tuple[Any, dict[str, Any]]:
    """``(dataset, description)``: the documents of ``src`` as a ``datasets.Dataset`` and what the manifest records.

    Raises :class:`SourceError` when ``src`` is missing, unreadable, or has no ``text_field`` column.
    """
    path = Path(src)
    if not path.exists():
        raise SourceError(f"{src}: no such file or directory")
    if _is_saved_dataset(path):
        dataset, kind, files = _load_saved(path), "save_to_disk", []
    else:
        files = _files(path)
        kind = _kind(files)
        dataset = _load_files(files, kind, cache_dir)
    field = "text" if kind == "text" else text_field
    if field not in dataset.column_names:
        raise SourceError(f"{src}: no text field {field!r} (columns: {', '.join(dataset.column_names)}); "
                          "pass --text-field NAME")
    stats = [[str(f.relative_to(path) if path.is_dir() else f.name), f.stat().st_size, f.stat().st_mtime_ns]
             for f in files]  # lists, as JSON reads them back: a manifest read equals the one written
    description = {"path": str(path.resolve()), "kind": kind, "text_field": field, "rows": len(dataset),
                   "files": stats, "fingerprint": getattr(dataset, "_fingerprint", None) if not files else None}
    logger.info("source %s: %d documents (%s)", src, len(dataset), kind)
    return dataset, description
