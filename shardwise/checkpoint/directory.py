"""A checkpoint directory on disk: atomic commit, the ``latest`` pointer, verification, retention.

Layout of ``--checkpoint-dir D``::

    D/latest                    {"step": 8, "dir": "step-00000008"}   <- the commit point
    D/step-00000008/            a committed checkpoint: DCP files, per-rank JSON, manifest.json
    D/step-00000006/            an older one, kept while fewer than --keep-last are newer
    D/.staging-step-00000010/   a save in progress: invisible to readers, removed on the next start

The commit protocol (rank 0, after every rank's files are written and fsynced by DCP):

1. write ``manifest.json`` into the staging directory: the step, the world size, the size of
   every file and the shape of every model tensor; fsync it and every directory in the tree;
2. ``rename`` the staging directory to ``step-N`` and fsync ``D`` (now complete and visible);
3. write the new pointer to ``D/.latest.tmp``, fsync, ``rename`` over ``D/latest``, fsync ``D``;
4. delete checkpoints beyond ``keep_last`` (renamed to ``.trash-*`` first, so a half-deleted
   one never looks complete).

``latest`` is the single source of truth. A ``SIGKILL`` before step 3's rename leaves the
previous pointer, naming the previous checkpoint, which nothing after it touched; a
``step-N`` left without a pointer (killed between 2 and 3) is an uncommitted leftover,
logged and replaced by the next save of step N. Readers (:meth:`CheckpointDir.latest`)
never scan directory names. A pointer naming a missing or damaged checkpoint is an error
(:class:`CheckpointError`), never a silent fresh start nor a silent step back: something
outside this protocol changed the directory, and the message says what to move away to
resume from the previous checkpoint instead.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
from pathlib import Path

from shardwise.checkpoint.faults import maybe_kill

__all__ = ["CheckpointError", "CheckpointDir", "FORMAT", "MANIFEST", "POINTER", "fsync_path", "write_json"]

logger = logging.getLogger(__name__)

FORMAT = "shardwise-checkpoint/1"
POINTER = "latest"
MANIFEST = "manifest.json"
_STEP_RE = re.compile(r"^step-(\d{8,})$")
_STAGING = ".staging-"
_TRASH = ".trash-"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used as asked: missing, incomplete, or of another model."""


def fsync_path(path: Path) -> None:
    """Flush a file's or a directory's entry to stable storage (a rename is durable once its dir is)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json(path: Path, obj: object) -> None:
    """Write ``obj`` as JSON to ``path`` and fsync it (no rename: callers decide visibility)."""
    with open(path, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())


def _fsync_tree(root: Path) -> None:
    for dirpath, _, filenames in os.walk(root, topdown=False):
        for name in filenames:
            fsync_path(Path(dirpath) / name)
        fsync_path(Path(dirpath))


def _file_sizes(root: Path) -> dict[str, int]:
    """``{relative path: size}`` of every file under ``root``, the manifest excepted."""
    sizes = {}
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            path = Path(dirpath) / name
            rel = path.relative_to(root).as_posix()
            if rel != MANIFEST:
                sizes[rel] = path.stat().st_size
    return dict(sorted(sizes.items()))


class CheckpointDir:
    """One ``--checkpoint-dir``: where to stage a save, how to commit it, which one is the newest.

    Only rank 0 calls the mutating methods (:meth:`clean_leftovers`, :meth:`commit`,
    :meth:`prune`); every rank may call :meth:`staging` and the readers.
    """

    root: Path  # the directory given by the user; created on first use

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = Path(root)

    def __repr__(self) -> str:
        return f"CheckpointDir({str(self.root)!r})"

    @staticmethod
    def step_name(step: int) -> str:
        return f"step-{step:08d}"

    def staging(self, step: int) -> Path:
        """Where step ``step`` is written before it is committed (hidden from readers)."""
        return self.root / f"{_STAGING}{self.step_name(step)}"

    def committed_steps(self) -> list[int]:
        """Steps of the ``step-N`` directories present, oldest first (committed or leftover)."""
        if not self.root.is_dir():
            return []
        matches = (_STEP_RE.match(p.name) for p in self.root.iterdir() if p.is_dir())
        return sorted(int(m.group(1)) for m in matches if m)

    def clean_leftovers(self) -> None:
        """Delete what killed saves left behind: staging and trash directories."""
        if not self.root.is_dir():
            return
        for path in self.root.iterdir():
            if path.name.startswith((_STAGING, _TRASH)) or path.name == POINTER + ".tmp":
                logger.warning("removing %s, left by an interrupted save", path)
                shutil.rmtree(path) if path.is_dir() else path.unlink()

    def latest(self) -> Path | None:
        """The checkpoint ``latest`` names, or ``None`` when no checkpoint was ever committed here.

        Raises:
            CheckpointError: the pointer is unreadable or names a directory that is missing.
        """
        pointer = self.root / POINTER
        if not pointer.exists():
            leftovers = self.committed_steps()
            if leftovers:
                logger.warning("%s has no %r pointer: %s never committed; starting fresh",
                               self.root, POINTER, [self.step_name(s) for s in leftovers])
            return None
        try:
            name = json.loads(pointer.read_text())["dir"]
        except (ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"{pointer} is not a valid checkpoint pointer ({e}); restore or delete it") from None
        path = self.root / name
        if not path.is_dir():
            raise CheckpointError(
                f"{pointer} names {name}, which does not exist; restore it, or point {POINTER} at an older "
                f"checkpoint ({[self.step_name(s) for s in self.committed_steps()]}) to resume from there"
            )
        return path

    @staticmethod
    def verify(path: Path) -> dict:
        """The manifest of the committed checkpoint ``path``, after checking every file it lists.

        Raises:
            CheckpointError: no readable manifest, or a listed file missing or of another size.
        """
        hint = f"move {path} away (and point {POINTER} at an older checkpoint) to resume from an older one"
        try:
            manifest = json.loads((path / MANIFEST).read_text())
        except (OSError, ValueError) as e:
            raise CheckpointError(f"checkpoint {path} is incomplete: unreadable {MANIFEST} ({e}); {hint}") from None
        if manifest.get("format") != FORMAT:
            raise CheckpointError(f"checkpoint {path}: format {manifest.get('format')!r}, expected {FORMAT!r}")
        for rel, size in manifest["files"].items():
            file = path / rel
            actual = file.stat().st_size if file.is_file() else None
            if actual != size:
                state = "missing" if actual is None else f"{actual} bytes, the manifest says {size}"
                raise CheckpointError(f"checkpoint {path} is damaged: {rel} is {state}; {hint}")
        return manifest

    def commit(self, step: int, manifest: dict) -> Path:
        """Make the staged save of ``step`` the newest checkpoint (rank 0; steps 1-3 of the protocol)."""
        staging, final = self.staging(step), self.root / self.step_name(step)
        maybe_kill("ckpt_after_shards", step, 0)
        full = {"format": FORMAT, "step": step, "saved_at": time.time(), **manifest, "files": _file_sizes(staging)}
        write_json(staging / MANIFEST, full)
        _fsync_tree(staging)
        maybe_kill("ckpt_before_rename", step, 0)
        if final.exists():  # an uncommitted leftover of an interrupted run (never what `latest` names)
            shutil.rmtree(final)
        os.rename(staging, final)
        fsync_path(self.root)
        maybe_kill("ckpt_after_rename", step, 0)
        tmp = self.root / (POINTER + ".tmp")
        write_json(tmp, {"step": step, "dir": final.name})
        maybe_kill("ckpt_before_pointer_replace", step, 0)
        os.replace(tmp, self.root / POINTER)
        fsync_path(self.root)
        logger.info("committed checkpoint %s", final)
        return final

    def prune(self, keep_last: int, step: int) -> None:
        """Delete committed checkpoints older than the ``keep_last`` newest (rank 0, after :meth:`commit`)."""
        current = self.latest()
        kept = [s for s in self.committed_steps() if s <= step]  # later ones are leftovers, replaced when reached
        for s in kept[: max(0, len(kept) - keep_last)]:
            path = self.root / self.step_name(s)
            if path == current:
                continue
            trash = self.root / f"{_TRASH}{path.name}"
            os.rename(path, trash)
            maybe_kill("ckpt_mid_prune", step, 0)
            shutil.rmtree(trash)
            logger.info("deleted checkpoint %s (keep_last=%d)", path, keep_last)
