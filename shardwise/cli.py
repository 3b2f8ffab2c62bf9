"""The ``shardwise`` command line: ``train``, ``export``, ``plan``, ``report``.

``shardwise train`` trains a causal language model with ``fully_shard``: a GPT preset
(``--model``) or any Transformers causal LM, built from a local ``config.json``
(``--hf-config``, random weights) or loaded from a local model directory (``--hf-model``,
its safetensors and tokenizer). Its blocks, one FSDP unit each, are the layers the model's
own ``_no_split_modules`` names. It reads text (``--data``; default: the Python standard
library's sources), shards over the data-parallel ranks, or HSDP with ``--replicate``, adds
tensor parallelism inside each block with ``--tp`` (Llama-family models and the presets),
and saves and resumes DCP checkpoints (``--checkpoint-dir``, ``--resume``). ``shardwise
export`` turns a checkpoint into a directory ``AutoModelForCausalLM.from_pretrained`` reads.
Run from a plain shell, ``train`` starts torch's own launcher for you, which in turn runs
this same command once per rank::

    shardwise train                       # = python -m torch.distributed.run --standalone
                                          #     --nproc-per-node 2 -m shardwise train
    shardwise train --nproc 4 --model small --mixed-precision bf16 --data my_corpus/
    shardwise train --impl torch          # the same run with torch.distributed.fsdp.fully_shard
    shardwise train --nproc 4 --hf-config gpt2.json --replicate 2 --ac full --checkpoint-dir ckpt
    shardwise train --nproc 4 --hf-config gpt2.json --grad-accum 2 --clip-norm 1 --tensorboard runs/a
    shardwise train --nproc 4 --hf-model llama-dir/ --tp 2 --checkpoint-dir ckpt --resume
    shardwise export ckpt out/            # a directory AutoModelForCausalLM.from_pretrained reads
    torchft_lighthouse --min_replicas 1 &  # then each replica group (torchft's fault-tolerant HSDP):
    shardwise train --fault-tolerance torchft --replica-groups 2 --replica-group-id 0 --lighthouse http://localhost:29510

Under torchrun (``RANK``/``LOCAL_RANK`` are set) it trains directly, so this works too::

    torchrun --standalone --nproc-per-node 2 -m shardwise train --steps 50
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

__all__ = ["main", "build_parser"]


def _reshard_arg(text: str):
    from shardwise.train.config import parse_reshard

    try:
        return parse_reshard(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _add_train_args(p: argparse.ArgumentParser) -> None:
    """The flags of ``shardwise train``; each ``dest`` is a :class:`TrainConfig` field of the same name."""
    from shardwise.train.config import LR_SCHEDULES, TrainConfig
    from shardwise.train.model import PRESETS
    from shardwise.train.sharding import IMPLS, MIXED_PRECISION

    d = TrainConfig()
    add = p.add_argument
    add("--nproc", type=int, default=2, help="ranks to launch here when not already under torchrun (default 2)")
    add("--model", choices=sorted(PRESETS), default=d.model,
        help="size: nano ~43K (tests), tiny ~1M, small ~10M, medium ~50M parameters (default %(default)s)")
    add("--steps", type=int, default=d.steps, help="optimizer steps (default %(default)s)")
    add("--batch-size", type=int, default=d.batch_size, help="sequences per data-parallel rank per step (default %(default)s)")
    add("--seq-len", type=int, default=d.seq_len, help="tokens per sequence (default: the preset's)")
    add("--lr", type=float, default=d.lr, help="AdamW learning rate (default %(default)s)")
    add("--seed", type=int, default=d.seed, help="seed for initialisation and sampling (default %(default)s)")
    add("--mixed-precision", choices=MIXED_PRECISION, default=d.mixed_precision,
        help="bf16: bf16 params and compute, fp32 gradient reduction (default %(default)s)")
    add("--impl", choices=IMPLS, default=d.impl, help="which fully_shard to use (default %(default)s)")
    add("--device", choices=("auto", "cpu", "cuda"), default=d.device,
        help="auto: a GPU per rank when there are enough, else CPU (default %(default)s)")
    add("--data", default=d.data, metavar="PATH",
        help="a directory written by `shardwise data prepare` (memory-mapped), or a text file or directory "
             "read into memory (default: the Python stdlib's .py sources)")
    add("--data-bytes", type=int, default=d.data_bytes,
        help="read at most this many bytes of a text --data (default %(default)s)")
    add("--lr-schedule", choices=LR_SCHEDULES, default=d.lr_schedule,
        help="constant, or cosine: linear warm-up then decay to 10%% at --steps (default %(default)s)")
    add("--warmup-steps", type=int, default=d.warmup_steps, help="warm-up steps of the cosine schedule")
    add("--metrics", metavar="PATH", help="append one JSON line per step (step, loss, tokens_per_s, ...) to PATH")
    add("--report", metavar="DIR", help="write a step report (time, exposed communication, memory, plots) into DIR")
    _add_model_args(p)
    _add_parallel_args(p, d)
    _add_watch_args(p, d)
    _add_checkpoint_args(p, d)
    _add_fault_tolerance_args(p, d)
    add("--auto", action="store_true",
        help="shard as shardwise.plan says and report predicted vs measured peak memory")
    add("-v", "--verbose", action="store_true", help="log set-up details from every rank")


def _add_model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("Transformers models (instead of --model; any causal LM whose _no_split_modules names "
                             "its blocks: gpt2, gpt_neox, opt, falcon, bloom, phi, phi3, gemma, gemma2, llama, mistral, "
                             "mixtral, qwen2, qwen3, qwen3_moe, ...; see shardwise.train.hf)")
    g.add_argument("--hf-config", metavar="PATH",
                   help="build a causal LM from this local config.json (or a directory holding one), random weights")
    g.add_argument("--hf-model", metavar="DIR",
                   help="load a causal LM from this local directory (config.json, safetensors, tokenizer if any)")


def _add_parallel_args(p: argparse.ArgumentParser, d) -> None:
    from shardwise.train.config import AC_MODES
    from shardwise.train.pipeline import SCHEDULES

    g = p.add_argument_group("parallelism and memory (see shardwise.train.parallel)")
    g.add_argument("--replicate", type=int, default=d.replicate, metavar="R",
                   help="HSDP: an (R, N/R) mesh: R replicas, each sharded over N/R ranks (default 1)")
    g.add_argument("--tp", type=int, default=d.tp, metavar="T",
                   help="tensor parallel of degree T inside each block, on a (dp, tp) mesh (default 1)")
    g.add_argument("--pp", type=int, default=d.pp, metavar="P",
                   help="pipeline parallel of degree P: the blocks cut into stages on a (pp, dp) mesh (default 1)")
    g.add_argument("--pp-schedule", choices=SCHEDULES, default=d.pp_schedule,
                   help="--pp's schedule from torch.distributed.pipelining (default %(default)s; GPipe and 1F1B "
                        "hold one stage per rank, the others two)")
    g.add_argument("--pp-microbatches", type=int, default=d.pp_microbatches, metavar="M",
                   help="--pp: split each batch into M microbatches (default: the number of stages)")
    g.add_argument("--ac", choices=AC_MODES, default=d.ac, help="activation checkpointing per block (default %(default)s)")
    g.add_argument("--compile", action="store_true", help="torch.compile each block")
    g.add_argument("--compile-backend", default=d.compile_backend, metavar="B", help="torch.compile backend (default %(default)s)")
    g.add_argument("--grad-accum", type=int, default=d.grad_accum, metavar="K",
                   help="split each batch into K micro-batches; gradients sync on the last only (default 1)")
    g.add_argument("--clip-norm", type=float, default=d.clip_norm, metavar="X", help="clip the global grad norm to X")
    g.add_argument("--reshard-after-forward", type=_reshard_arg, default=d.reshard_after_forward, metavar="true|false|INT",
                   help="free each block's gathered parameters after forward, or keep them sharded over INT ranks "
                        "(default true)")
    g.add_argument("--cpu-offload", action="store_true", help="keep sharded params, grads and optimizer state on the host")
    g.add_argument("--float8", action="store_true",
                   help="torchao float8 training of the blocks' linears, all-gathered in float8 (see shardwise.train.float8)")


def _add_watch_args(p: argparse.ArgumentParser, d) -> None:
    g = p.add_argument_group("watching the run")
    g.add_argument("--tensorboard", metavar="DIR",
                   help="write TensorBoard scalars (loss, lr, grad norm, tokens/s, step time, memory, wire bytes)")
    g.add_argument("--eval-every", type=int, default=d.eval_every, metavar="K",
                   help="held-out loss every K steps and at the end: a prepared --data's held-out split, "
                        "else the text's last 10%% (default: off)")


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


def _add_fault_tolerance_args(p: argparse.ArgumentParser, d) -> None:
    from shardwise.train.fault_tolerance import FAULT_TOLERANCE

    g = p.add_argument_group("fault tolerance across replica groups (torchft; see shardwise.train.fault_tolerance)")
    g.add_argument("--fault-tolerance", choices=FAULT_TOLERANCE, default=d.fault_tolerance,
                   help="torchft: this job is one replica group; groups that die are dropped per step and healed "
                        "from a live one when they come back (default %(default)s)")
    g.add_argument("--replica-groups", type=int, metavar="R", help="replica groups the job starts with "
                   "(default $NUM_REPLICA_GROUPS)")
    g.add_argument("--replica-group-id", type=int, metavar="I", help="which group this job is (default $REPLICA_GROUP_ID)")
    g.add_argument("--lighthouse", metavar="URL", help="torchft's lighthouse, http://HOST:PORT (default $TORCHFT_LIGHTHOUSE)")
    g.add_argument("--async-quorum", action="store_true",
                   help="compute each step's quorum and heal during forward (torchtitan's default)")
    g.add_argument("--ft-timeout-s", type=float, default=d.ft_timeout_s, metavar="S",
                   help="torchft's timeout for quorums, collectives across groups and heals; the commit vote "
                        "waits twice this (default %(default)s)")


def build_parser() -> argparse.ArgumentParser:
    """``shardwise <command> [options]``: ``train``, ``plan``, ``report``, ``export``, ``data prepare``."""
    parser = argparse.ArgumentParser(
        prog="shardwise", description="Fully-sharded data parallel training: train GPT presets or Transformers causal "
        "LMs with fully_shard, export their checkpoints to Transformers, plan sharding at scale, read step reports, prepare tokenized datasets.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    train = commands.add_parser(
        "train", help="train a GPT preset or a Transformers causal LM (--hf-config/--hf-model) on text (--data) "
        "with fully_shard: HSDP (--replicate), tensor parallel (--tp), checkpoints and resume", description=__doc__,
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
    rep = commands.add_parser("report", help="print a step report's summary and top causes of exposed communication")
    rep.add_argument("dir", metavar="DIR", help="a directory written by `shardwise train --report DIR` or shardwise.report(DIR)")
    exp = commands.add_parser(
        "export", help="write a training checkpoint as a directory Transformers (or load_gpt) loads: config, "
        "safetensors, tokenizer (one process)",
        description="Export the newest checkpoint of CHECKPOINT_DIR (or a step-N directory) to OUT_DIR: config.json, "
        "safetensors shards and the tokenizer if the run had one; AutoModelForCausalLM.from_pretrained(OUT_DIR) "
        "loads a Transformers model, GPT presets load with shardwise.train.export.load_gpt(OUT_DIR).",
    )
    exp.add_argument("checkpoint", metavar="CHECKPOINT_DIR")
    exp.add_argument("out", metavar="OUT_DIR")
    exp.add_argument("--max-shard-bytes", type=int, default=None, metavar="N",
                     help="start a new safetensors file past N bytes (default 5 GB, as Transformers)")
    _add_data_command(commands)
    return parser


def _add_data_command(commands) -> None:
    from shardwise.data.cli import add_data_args

    data = commands.add_parser("data", help="prepare tokenized corpora for `shardwise train --data DIR`",
                               description="Prepare training data: `shardwise data prepare SRC OUT --tokenizer DIR|bytes`.")
    add_data_args(data)


def _train_config(args: argparse.Namespace):
    """The :class:`TrainConfig` of parsed ``args``: every field whose name is a flag's ``dest``."""
    import dataclasses

    from shardwise.train.config import TrainConfig

    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    return TrainConfig(**{k: v for k, v in vars(args).items() if k in fields})


def _child_env(nproc: int, verbose: bool = False) -> dict[str, str]:
    """Environment for the ranks: this shardwise importable, the CPU cores split between them, and
    torchft's servers (Rust) logging warnings only unless ``-v`` (else a line per quorum and commit)."""
    from shardwise.train.distributed import cpu_threads_per_rank

    env = dict(os.environ)
    package_root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    env.setdefault("OMP_NUM_THREADS", str(cpu_threads_per_rank(nproc)))
    env.setdefault("RUST_LOG", "info" if verbose else "warn")
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
    """Re-run ``python -m shardwise <argv>`` on ``nproc`` local ranks with torchrun; its exit code.

    SIGTERM sent to this process goes on to torchrun, which hands it to every rank (each
    stops after its step, see :mod:`shardwise.train.signals`); SIGINT (Ctrl-C) reaches
    torchrun from the terminal already. Either way this process waits for the job and
    exits with 128 + the signal."""
    if nproc < 1:
        raise SystemExit(f"shardwise: --nproc must be >= 1, got {nproc}")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    cmd += ["-m", "shardwise", *_without_nproc(argv)]
    verbose = any(arg in ("-v", "--verbose") for arg in argv)
    proc = subprocess.Popen(cmd, env=_child_env(nproc, verbose))
    received: list[int] = []

    def forward(signum: int, frame) -> None:
        received.append(signum)
        if signum == signal.SIGTERM and proc.poll() is None:
            proc.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        returncode = proc.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 128 + received[0] if received else returncode


def _print_report(directory: str) -> int:
    from shardwise.step_report.cli import print_report

    try:
        print_report(directory)
    except FileNotFoundError as e:
        raise SystemExit(f"shardwise report: {e}") from None
    return 0


def _export(args: argparse.Namespace) -> int:
    from shardwise.train.export import DEFAULT_MAX_SHARD_BYTES, export_checkpoint

    try:
        out = export_checkpoint(args.checkpoint, args.out, args.max_shard_bytes or DEFAULT_MAX_SHARD_BYTES)
    except (ValueError, FileNotFoundError) as e:
        raise SystemExit(f"shardwise export: {e}") from None
    print(f"exported {out.source} (step {out.step}) to {args.out}: {out.n_tensors} tensors, "
          f"{out.n_bytes / 1e6:.1f} MB in {out.n_files} safetensors file(s)")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``shardwise`` and ``python -m shardwise``; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if args.command == "plan":
        from shardwise.planning.cli import run_plan

        return run_plan(args)
    if args.command == "report":
        return _print_report(args.dir)
    if args.command == "export":
        return _export(args)
    if args.command == "data":
        from shardwise.data.cli import run_data

        return run_data(args)
    from shardwise.train.distributed import is_under_launcher

    under_launcher = is_under_launcher()
    try:
        cfg = _train_config(args)
        if not under_launcher:
            from shardwise.train.preflight import preflight

            preflight(cfg, args.nproc)
    except (ValueError, FileNotFoundError, ImportError) as e:
        raise SystemExit(f"shardwise train: {e}") from None
    if not under_launcher:
        return launch_torchrun(args.nproc, argv)
    rank = os.environ.get("RANK", "0")
    level = logging.INFO if args.verbose else logging.WARNING
    logging.basicConfig(level=level, format=f"[rank {rank}] %(levelname)s %(name)s: %(message)s")
    from shardwise.train.loop import run

    result = run(cfg)
    return result.exit_code
