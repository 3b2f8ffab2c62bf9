"""``shardwise data prepare SRC OUT --tokenizer DIR|bytes``: tokenize a corpus once, in parallel, resumably.

The plan is fixed before any work: the last ``held_out`` share of the documents (at least
one) is the held-out split; each split is cut into shards of about ``shard_bytes`` of
source text (whole documents, contiguous rows). Each shard is one job for a worker process
(:func:`~shardwise.data.shards.write_shard`); the main process draws a progress bar
(documents, with tokens/s and the ETA) from the workers' reports.

Resuming is the same command again: a shard whose receipt matches this plan (same source
files, tokenizer, text field and rows) and whose tokens still hash to the recorded sha256
is kept; anything else is rewritten. The manifest is written last, atomically, so an
interrupted run leaves a directory that training refuses until the rerun completes it::

    shardwise data prepare corpus.jsonl tokens/ --tokenizer bytes
    shardwise data prepare data/ tokens/ --tokenizer ./llama-tokenizer --text-field content --workers 8
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import hashlib
import json
import logging
import math
import multiprocessing as mp
import os
import queue
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Callable

from shardwise.data.encoders import Encoder
from shardwise.data.manifest import MANIFEST, Manifest, ShardInfo, read_manifest, token_dtype, write_json_atomic
from shardwise.data.shards import ShardJob, finished_shard, write_shard
from shardwise.data.sources import open_source

__all__ = ["PrepareOptions", "prepare", "plan_rows"]

logger = logging.getLogger(__name__)

CACHE_DIR = ".datasets-cache"
"""``OUT/.datasets-cache``: the Arrow copy ``datasets`` makes of JSONL / Parquet / text, removed when done."""


@dataclasses.dataclass(frozen=True)
class PrepareOptions:
    """The flags of ``shardwise data prepare``."""

    tokenizer: str
    """``bytes``, or a Transformers tokenizer directory."""
    text_field: str = "text"
    """The column holding each document's text (JSONL, Parquet, saved datasets)."""
    held_out: float = 0.01
    """Share of the documents (the last ones) kept out of training, for ``--eval-every``; 0 keeps none."""
    shard_bytes: int = 64 << 20
    """About this many bytes of source text per shard (whole documents)."""
    workers: int = 0
    """Tokenizing processes; 0 means one per CPU core."""

    def __post_init__(self) -> None:
        if not 0 <= self.held_out < 1:
            raise ValueError(f"--held-out must be in [0, 1), got {self.held_out}")
        if self.shard_bytes < 1 or self.workers < 0:
            raise ValueError(f"--shard-bytes must be >= 1 and --workers >= 0, got {self.shard_bytes}, {self.workers}")


def plan_rows(n_rows: int, text_bytes: int, held_out: float, shard_bytes: int) -> list[tuple[str, int, int]]:
    """``[(split, first row, end row), ...]``: every row once, the held-out rows last."""
    held = math.ceil(n_rows * held_out) if held_out > 0 else 0
    if n_rows - held < 1:
        raise ValueError(f"the source has {n_rows} document(s): too few to hold out {held} and train on the rest")
    per_shard = max(1, int(n_rows * shard_bytes / max(text_bytes, 1)))
    plan = []
    for split, first, end in (("train", 0, n_rows - held), ("held_out", n_rows - held, n_rows)):
        plan += [(split, a, min(a + per_shard, end)) for a in range(first, end, per_shard)]
    return plan


def _jobs(out: Path, dataset: Any, source: dict, encoder_id: dict, opts: PrepareOptions) -> list[ShardJob]:
    nbytes = dataset.data.nbytes
    plan = plan_rows(len(dataset), nbytes, opts.held_out, opts.shard_bytes)
    dtype = token_dtype(encoder_id["vocab_size"])
    blob = json.dumps([source, encoder_id, plan], sort_keys=True).encode()
    key = hashlib.sha256(blob).hexdigest()
    return [ShardJob(out, i, split, (a, b), dtype, key) for i, (split, a, b) in enumerate(plan)]


# ---- worker processes: each holds the dataset, encoder and progress queue from its start
_WORKER: dict[str, Any] = {}


def _init_worker(dataset: Any, field: str, encoder: Encoder, reports: Any) -> None:
    _WORKER.update(dataset=dataset, field=field, encoder=encoder, reports=reports)


def _run_job(job: ShardJob) -> ShardInfo:
    w = _WORKER
    return write_shard(job, w["dataset"], w["field"], w["encoder"], lambda d, t: w["reports"].put((d, t)))


class _Progress:
    """A tqdm bar over documents with tokens/s, on stderr; quiet when ``enabled`` is false."""

    def __init__(self, total_docs: int, enabled: bool) -> None:
        from tqdm.auto import tqdm

        self.bar = tqdm(total=total_docs, unit="doc", desc="tokenizing", disable=not enabled, file=sys.stderr)
        self.tokens, self.start = 0, time.perf_counter()

    def __call__(self, docs: int, tokens: int) -> None:
        self.tokens += tokens
        rate = self.tokens / max(time.perf_counter() - self.start, 1e-9)
        self.bar.set_postfix_str(f"{self.tokens / 1e6:.1f}M tokens, {rate / 1e6:.2f}M tokens/s", refresh=False)
        self.bar.update(docs)

    def close(self) -> None:
        self.bar.close()


def _run_pool(jobs: list[ShardJob], dataset: Any, field: str, encoder: Encoder, workers: int,
              progress: Callable[[int, int], None]) -> list[ShardInfo]:
    ctx = mp.get_context("fork" if sys.platform == "linux" else "spawn")
    reports = ctx.Queue()
    done: list[ShardInfo] = []
    with cf.ProcessPoolExecutor(workers, ctx, initializer=_init_worker,
                                initargs=(dataset, field, encoder, reports)) as pool:
        pending = {pool.submit(_run_job, job) for job in jobs}
        while pending:
            finished, pending = cf.wait(pending, timeout=0.2, return_when=cf.FIRST_COMPLETED)
            _drain(reports, progress)
            try:
                done += [f.result() for f in finished]
            except cf.process.BrokenProcessPool:
                raise RuntimeError("a tokenizing worker died (killed, or out of memory); finished shards are "
                                   "kept: run the same command again to resume") from None
        _drain(reports, progress)
    return done


def _drain(reports: Any, progress: Callable[[int, int], None]) -> None:
    while True:
        try:
            progress(*reports.get_nowait())
        except queue.Empty:
            return


def _tokenize(jobs: list[ShardJob], dataset: Any, field: str, encoder: Encoder, workers: int,
              show_progress: bool) -> list[ShardInfo]:
    bar = _Progress(sum(j.rows[1] - j.rows[0] for j in jobs), show_progress)
    try:
        if workers == 1 or len(jobs) == 1:
            return [write_shard(job, dataset, field, encoder, bar) for job in jobs]
        return _run_pool(jobs, dataset, field, encoder, workers, bar)
    finally:
        bar.close()


def _remove_stale(out: Path, n_shards: int) -> None:
    """Shard files of another plan (an index past this plan's last), and temporaries of a killed run."""
    for path in out.glob("shard-*"):
        if int(path.name[6:11]) >= n_shards:
            path.unlink()
    for path in out.glob(".shard-*.tmp"):
        path.unlink()


def prepare(src: str | os.PathLike, out: str | os.PathLike, opts: PrepareOptions,
            show_progress: bool = True) -> Manifest:
    """Tokenize ``src`` into the prepared directory ``out`` (see the module docstring); its manifest.

    Raises ``SourceError`` / ``ValueError`` / ``FileNotFoundError`` naming the file, field or
    tokenizer at fault, and ``FileExistsError`` when ``out`` is a finished directory of another
    source or tokenizer.
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    encoder = Encoder(opts.tokenizer)
    identity = encoder.identity()
    dataset, source = open_source(src, opts.text_field, out / CACHE_DIR)
    jobs = _jobs(out, dataset, source, identity, opts)
    if (out / MANIFEST).is_file():
        return _already_prepared(out, jobs)
    _remove_stale(out, len(jobs))
    kept = [info for info in map(finished_shard, jobs) if info is not None]
    todo = [job for job in jobs if job.index not in {k.index for k in kept}]
    logger.info("%s: %d shards, %d kept from an earlier run", out, len(jobs), len(kept))
    field = source["text_field"]
    dataset = dataset.select_columns([field])
    workers = min(opts.workers or os.cpu_count() or 1, max(len(todo), 1))
    made = _tokenize(todo, dataset, field, encoder, workers, show_progress) if todo else []
    shards = tuple(sorted(kept + made, key=lambda s: s.index))
    manifest = Manifest(identity, jobs[0].dtype, source, opts.held_out, shards)
    write_json_atomic(out / MANIFEST, manifest.to_json())
    shutil.rmtree(out / CACHE_DIR, ignore_errors=True)
    return manifest


def _already_prepared(out: Path, jobs: list[ShardJob]) -> Manifest:
    manifest = read_manifest(out)
    if any(finished_shard(job) is None for job in jobs) or len(manifest.shards) != len(jobs):
        raise FileExistsError(f"{out} already holds a prepared corpus of another source, tokenizer or plan; "
                              "choose another OUT, or delete it to prepare again")
    shutil.rmtree(out / CACHE_DIR, ignore_errors=True)
    return manifest
