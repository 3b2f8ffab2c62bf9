"""What prepared data costs: ``shardwise data prepare`` throughput, training RSS per rank, the loader's share of a step.

Writes a synthetic JSONL corpus (documents of random words, ~2 KB each) of ``--small-mb`` and
of ``--big-mb`` megabytes into ``--workdir``, prepares each with the byte tokenizer
(one token per byte: 1 GB of text is 1 G tokens), then:

- **prepare**: wall time, and tokens per CPU-second of the command and its workers
  (``getrusage``: the per-core figure, which a shared machine's load does not inflate);
- **train RSS**: ``shardwise train --data OUT`` on ``--nproc`` ranks; each rank's peak RSS
  (``peak_memory_gb`` of ``--metrics`` is rank 0's ``ru_maxrss``) at both sizes: memory-mapped
  shards make them equal within noise;
- **loader share**: the median time of ``WindowSampler.next_batch`` (one rank's batch) over the
  median training step time, on the big corpus::

    .venv/bin/python -m bench.data_pipeline                       # 100 MB and 1 GB, in /tmp
    .venv/bin/python -m bench.data_pipeline --small-mb 1 --big-mb 4 --steps 4

The corpora are left in ``--workdir`` (``--keep``) or removed at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from shardwise.data.manifest import read_manifest
from shardwise.data.windows import TokenStream, WindowSampler
from shardwise.train.metrics import read_metrics

WORDS = 2000


def write_corpus(path: Path, megabytes: float, seed: int = 0) -> int:
    """A JSONL file of about ``megabytes`` MB: documents of random words, cycled from a fixed pool; its size."""
    rng = random.Random(seed)
    vocab = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9))) for _ in range(WORDS)]
    pool = [json.dumps({"text": " ".join(rng.choices(vocab, k=rng.randint(100, 600)))}) + "\n" for _ in range(997)]
    block = "".join(pool).encode()
    target = int(megabytes * 1e6)
    with open(path, "wb") as f:
        while f.tell() < target:
            f.write(block[: target - f.tell()] if target - f.tell() < len(block) else block)
    _trim_to_line(path)
    return path.stat().st_size


def _trim_to_line(path: Path) -> None:
    with open(path, "rb+") as f:
        f.seek(max(f.seek(0, 2) - 8192, 0))
        tail = f.read()
        f.truncate(f.tell() - len(tail) + tail.rfind(b"\n") + 1)


def _cpu_s() -> float:
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def run_prepare(src: Path, out: Path, workers: int) -> dict:
    """``shardwise data prepare`` in a child process: wall seconds, CPU seconds, tokens."""
    cmd = [sys.executable, "-m", "shardwise", "data", "prepare", str(src), str(out), "--tokenizer", "bytes",
           "--workers", str(workers), "-q"]
    cpu, start = _cpu_s(), time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    wall, cpu = time.perf_counter() - start, _cpu_s() - cpu
    tokens = sum(c["tokens"] for c in read_manifest(out).counts().values())
    return {"tokens": tokens, "wall_s": wall, "cpu_s": cpu, "tokens_per_cpu_s": tokens / cpu,
            "tokens_per_s": tokens / wall}


def run_train(data: Path, args: argparse.Namespace, workdir: Path) -> dict:
    """``shardwise train --data`` on ``args.nproc`` ranks: peak RSS (rank 0) and the median step."""
    metrics = workdir / f"metrics-{data.name}.jsonl"
    metrics.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "shardwise", "train", "--data", str(data), "--nproc", str(args.nproc),
           "--model", args.model, "--steps", str(args.steps), "--batch-size", str(args.batch_size),
           "--seq-len", str(args.seq_len), "--device", "cpu", "--metrics", str(metrics)]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)
    records = read_metrics(metrics)
    steps = [r["step_s"] for s, r in records.items() if s > 1]
    return {"peak_rss_mb": 1e3 * max(r["peak_memory_gb"] for r in records.values()),
            "median_step_ms": 1e3 * statistics.median(steps)}


def loader_ms(data: Path, args: argparse.Namespace, calls: int = 200) -> float:
    """Median milliseconds of one rank's ``next_batch`` on ``data`` (the median: a shared machine's
    preemptions land on a few calls, not on the loader's cost)."""
    sampler = WindowSampler(TokenStream.open(data), args.batch_size, args.seq_len, seed=0, rank=0,
                            world_size=args.nproc)
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        sampler.next_batch()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def measure(args: argparse.Namespace) -> dict:
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    results: dict = {"args": vars(args), "sizes": {}}
    for label, mb in (("small", args.small_mb), ("big", args.big_mb)):
        print(f"{label}: writing {mb} MB of JSONL ...", file=sys.stderr, flush=True)
        src, out = work / f"{label}.jsonl", work / f"{label}-tokens"
        shutil.rmtree(out, ignore_errors=True)
        row = {"corpus_bytes": write_corpus(src, mb)}
        print(f"{label}: preparing ...", file=sys.stderr, flush=True)
        row["prepare"] = run_prepare(src, out, args.workers)
        src.unlink()
        if not args.no_train:
            print(f"{label}: training ...", file=sys.stderr, flush=True)
            row["train"] = run_train(out, args, work)
        row["loader_ms"] = loader_ms(out, args)
        results["sizes"][label] = row
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    return results


def print_table(results: dict) -> None:
    a = results["args"]
    print(f"byte tokenizer, {a['workers'] or os.cpu_count()} prepare workers; {a['model']} GPT, {a['nproc']} ranks, "
          f"batch {a['batch_size']} x {a['seq_len']}")
    print(f"{'corpus':>8} {'tokens':>12} {'prepare s':>10} {'tok/CPU-s':>11} {'rank RSS MB':>12} "
          f"{'step ms':>9} {'loader ms':>10} {'loader %':>9}")
    for row in results["sizes"].values():
        p, t = row["prepare"], row.get("train", {})
        step = t.get("median_step_ms", float("nan"))
        print(f"{row['corpus_bytes'] / 1e6:6.0f}MB {p['tokens']:12d} {p['wall_s']:10.1f} {p['tokens_per_cpu_s'] / 1e6:9.1f}M "
              f"{t.get('peak_rss_mb', float('nan')):12.0f} {step:9.1f} {row['loader_ms']:10.3f} "
              f"{100 * row['loader_ms'] / step:8.2f}%")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.data_pipeline", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--small-mb", type=float, default=100)
    p.add_argument("--big-mb", type=float, default=1000)
    p.add_argument("--workers", type=int, default=0, help="prepare's --workers (default: one per core)")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--model", default="tiny")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--workdir", default="/tmp/shardwise-bench-data")
    p.add_argument("--keep", action="store_true", help="keep the prepared corpora")
    p.add_argument("--no-train", action="store_true", help="prepare and the loader only")
    p.add_argument("--json", metavar="PATH", help="also write the numbers here")
    args = p.parse_args(argv)
    results = measure(args)
    print_table(results)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
