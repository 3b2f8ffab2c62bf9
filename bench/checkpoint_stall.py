"""How long a checkpoint save holds up training: blocking ``dcp.save`` vs ``dcp.async_save``.

Runs ``shardwise train`` three times on the same local ranks and settings, each with
``--metrics`` (one JSON line per step, with ``step_s`` and ``checkpoint_s``):

- ``none``: no checkpoints, the baseline step time;
- ``blocking``: ``--checkpoint-every K``;
- ``async``: ``--checkpoint-every K --async-checkpoint``.

and prints, per mode, medians (a shared machine is noisy): the step time of steps without a
save, the stall of a save step (its step time above that median; rank 0's view, the one
committing), the time the save call held the step (``checkpoint_s``), and the extra time of
the step after a save, which the background write overlaps in async mode::

    .venv/bin/python -m bench.checkpoint_stall                       # small GPT, 2 ranks
    .venv/bin/python -m bench.checkpoint_stall --model tiny --steps 40 --every 10

The first step of a run (lazy init) is left out of the medians.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from shardwise.train.metrics import read_metrics

MODES = {"none": [], "blocking": [], "async": ["--async-checkpoint"]}


def _run_mode(mode: str, args: argparse.Namespace, workdir: Path) -> dict[int, dict]:
    metrics = workdir / f"{mode}.jsonl"
    cmd = [sys.executable, "-m", "shardwise", "train", "--nproc", str(args.nproc), "--model", args.model,
           "--steps", str(args.steps), "--batch-size", str(args.batch_size), "--metrics", str(metrics)]
    if mode != "none":
        cmd += ["--checkpoint-dir", str(workdir / mode), "--checkpoint-every", str(args.every), *MODES[mode]]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)
    return read_metrics(metrics)


def _summary(records: dict[int, dict], every: int, last: int) -> dict[str, float]:
    """Median plain step, median stall of save steps, median extra time of the steps after each save."""
    saves = {s for s in records if records[s]["checkpoint_s"] > 0}
    after = {s + 1 for s in saves if s + 1 <= last}  # the background write overlaps these (async)
    plain = [r["step_s"] for s, r in records.items() if s > 1 and s not in saves and s not in after]
    median = statistics.median(plain)
    stall = [records[s]["step_s"] - median for s in sorted(saves) if s != last]  # the last one waits for no step
    extra = [records[s]["step_s"] - median for s in sorted(after)]
    return {
        "median_step_ms": 1e3 * median,
        "save_step_stall_ms": 1e3 * statistics.median(stall) if stall else float("nan"),
        "held_by_save_ms": 1e3 * statistics.median(records[s]["checkpoint_s"] for s in saves if s != last)
        if len(saves) > 1 else float("nan"),
        "next_step_extra_ms": 1e3 * statistics.median(extra) if extra else float("nan"),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.checkpoint_stall", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="small")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--steps", type=int, default=31)
    p.add_argument("--every", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--json", metavar="PATH", help="also write the numbers here")
    args = p.parse_args(argv)
    results = {}
    with tempfile.TemporaryDirectory(prefix="ckpt-stall-") as tmp:
        for mode in MODES:
            print(f"running {mode} ...", file=sys.stderr, flush=True)
            results[mode] = _summary(_run_mode(mode, args, Path(tmp)), args.every, args.steps)
    print(f"{args.model} GPT, {args.nproc} ranks, save every {args.every} of {args.steps} steps")
    print(f"{'mode':<9} {'step ms':>9} {'save-step stall ms':>19} {'held by save ms':>16} {'next step +ms':>14}")
    for mode, r in results.items():
        print(f"{mode:<9} {r['median_step_ms']:9.1f} {r['save_step_stall_ms']:19.1f} {r['held_by_save_ms']:16.1f} "
              f"{r['next_step_extra_ms']:14.1f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
