"""The ``shardwise`` command line.

``shardwise train`` trains a small GPT on the Python standard library's sources with
``fully_shard``. Run from a plain shell it starts torch's own launcher for you, which in
turn runs this same command once per rank::

    shardwise train                       # = python -m torch.distributed.run --standalone
                                          #     --nproc-per-node 2 -m shardwise train
    shardwise train --nproc 4 --model small --mixed-precision bf16
    shardwise train          # the same run with torch.distributed.fsdp.fully_shard

Under torchrun (``RANK``/``LOCAL_RANK`` are set) it trains directly, so this works too::

    torchrun --standalone --nproc-per-node 2 -m shardwise train --steps 50
"""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
from pathlib import Path

__all__ = ["main", "build_parser"]


def _add_train_args(p: argparse.ArgumentParser) -> None:
    from shardwise.train.config import LR_SCHEDULES, TrainConfig
    from shardwise.train.model import PRESETS
    from shardwise.train.sharding import IMPLS, MIXED_PRECISION

    d = TrainConfig()
    add = p.add_argument
    add("--nproc", type=int, default=2, help="ranks to launch here when not already under torchrun (default 2)")
    add("--model", choices=sorted(PRESETS), default=d.model,
        help="size: nano ~43K (tests), tiny ~1M, small ~10M, medium ~50M parameters (default %(default)s)")
    add("--steps", type=int, default=d.steps, help="optimizer steps (default %(default)s)")
    add("--batch-size", type=int, default=d.batch_size, help="sequences per rank per step (default %(default)s)")
    add("--seq-len", type=int, default=d.seq_len, help="tokens per sequence (default: the preset's)")
    add("--lr", type=float, default=d.lr, help="AdamW learning rate (default %(default)s)")
    add("--seed", type=int, default=d.seed, help="seed for initialisation and sampling (default %(default)s)")
    add("--mixed-precision", choices=MIXED_PRECISION, default=d.mixed_precision,
        help="bf16: bf16 params and compute, fp32 gradient reduction (default %(default)s)")
    add("--impl", choices=IMPLS, default=d.impl, help="which fully_shard to use (default %(default)s)")
    add("--device", choices=("auto", "cpu", "cuda"), default=d.device,
        help="auto: a GPU per rank when there are enough, else CPU (default %(default)s)")
    add("--data", default=d.data, metavar="PATH",
        help="text file or directory to train on (default: the Python stdlib's .py sources)")
    add("--data-bytes", type=int, default=d.data_bytes, help="read at most this many bytes (default %(default)s)")
    add("--lr-schedule", choices=LR_SCHEDULES, default=d.lr_schedule,
        help="constant, or cosine: linear warm-up then decay to 10%% at --steps (default %(default)s)")
    add("--warmup-steps", type=int, default=d.warmup_steps, help="warm-up steps of the cosine schedule")
    add("--metrics", metavar="PATH", help="append one JSON line per step (step, loss, tokens_per_s, ...) to PATH")
    _add_checkpoint_args(p, d)
    add("--auto", action="store_true",
        help="shard as shardwise.plan says and report predicted vs measured peak memory")
    add("-v", "--verbose", action="store_true", help="log set-up details from every rank")


def _add_checkpoint_args(p: argparse.ArgumentParser, d) -> None:
    g = p.add_argument_group("checkpoints (DCP format; see shardwise.checkpoint)")
    g.add_argument("--checkpoint-dir", metavar="DIR", help="save checkpoints under DIR")
    g.add_argument("--checkpoint-every", type=int, default=d.checkpoint_every, metavar="K",
                   help="save after every K steps and after the last (default: only after the last)")
    g.add_argument("--keep-last", type=int, default=d.keep_last, metavar="N",
                   help="keep the N newest checkpoints (default %(default)s)")
    g.add_argument("--resume", action="store_true",
                   help="continue from the newest checkpoint in DIR; start fresh when there is none")
    g.add_argument("--async-checkpoint", action="store_true",
                   help="write checkpoints in the background (dcp.async_save); steps wait only for the copy")
    g.add_argument("--stop-after", type=int, metavar="STEP",
                   help="end after STEP (checkpointed) though the LR schedule spans --steps; resume later")


def build_parser() -> argparse.ArgumentParser:
    """``shardwise <command> [options]``; the only command so far is ``train``."""
    parser = argparse.ArgumentParser(prog="shardwise", description="Fully-sharded data parallel training.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    train = commands.add_parser(
        "train", help="train a small GPT with fully_shard", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False,
    )
    _add_train_args(train)
    from shardwise.planning.cli import add_plan_args

    plan = commands.add_parser(
        "plan", help="plan units, memory and communication for a model (no ranks needed)",
        description="Plan how to fully_shard a model at scale: units, reshard policies, per-rank peak memory, "
        "bytes on the wire. Exit code 1 when the plan does not fit --memory.",
    )
    add_plan_args(plan)
    return parser


def _train_config(args: argparse.Namespace):
    from shardwise.train.config import TrainConfig

    return TrainConfig(
        model=args.model, steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len, lr=args.lr,
        seed=args.seed, mixed_precision=args.mixed_precision, impl=args.impl, device=args.device,
        data=args.data, data_bytes=args.data_bytes, lr_schedule=args.lr_schedule, warmup_steps=args.warmup_steps,
        metrics=args.metrics, checkpoint_dir=args.checkpoint_dir, checkpoint_every=args.checkpoint_every,
        keep_last=args.keep_last, resume=args.resume, async_checkpoint=args.async_checkpoint,
        stop_after=args.stop_after, auto=args.auto,
    )


def _child_env(nproc: int) -> dict[str, str]:
    """Environment for the ranks: this shardwise importable, and the CPU cores split between them."""
    from shardwise.train.distributed import cpu_threads_per_rank

    env = dict(os.environ)
    package_root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    env.setdefault("OMP_NUM_THREADS", str(cpu_threads_per_rank(nproc)))
    return env


def _without_nproc(argv: list[str]) -> list[str]:
    """``argv`` less ``--nproc N`` / ``--nproc=N``.

    The ranks do not need it, and torchrun's own parser rejects it even after the script
    name: argparse reports ``--nproc`` as an ambiguous prefix of ``--nproc-per-node``.
    """
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--nproc":
            skip = True
        elif not arg.startswith("--nproc="):
            out.append(arg)
    return out


def launch_torchrun(nproc: int, argv: list[str]) -> int:
    """Re-run ``python -m shardwise <argv>`` on ``nproc`` local ranks with torchrun; its exit code."""
    if nproc < 1:
        raise SystemExit(f"shardwise: --nproc must be >= 1, got {nproc}")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    cmd += ["-m", "shardwise", *_without_nproc(argv)]
    try:
        return subprocess.run(cmd, env=_child_env(nproc)).returncode
    except KeyboardInterrupt:
        return 130


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``shardwise`` and ``python -m shardwise``; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if args.command == "plan":
        from shardwise.planning.cli import run_plan

        return run_plan(args)
    try:
        cfg = _train_config(args)
    except ValueError as e:
        raise SystemExit(f"shardwise train: {e}") from None
    from shardwise.train.distributed import is_under_launcher

    if not is_under_launcher():
        return launch_torchrun(args.nproc, argv)
    rank = os.environ.get("RANK", "0")
    level = logging.INFO if args.verbose else logging.WARNING
    logging.basicConfig(level=level, format=f"[rank {rank}] %(levelname)s %(name)s: %(message)s")
    from shardwise.train.loop import run

    run(cfg)
    return 0
