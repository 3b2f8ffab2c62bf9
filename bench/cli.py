"""``python -m bench``: shardwise side by side with torch's FSDP2 and DDP.

Measures every case of the grid (see :mod:`bench.cases`), prints one line per case as it
finishes (stderr), then an aligned table (stdout), and writes everything, raw per-rank
step times included, to ``bench/results/<timestamp>.json``::

    python -m bench --quick                                 # tiny+small, 2 ranks, fp32: < 2 min
    python -m bench                                         # the full grid (long: see bench/README.md)
    python -m bench --models small --world-sizes 4 --dtypes bf16 --reshard true --steps 5
    python -m bench --quick --profile                       # + top costs of one cProfile'd step
    python -m bench --show bench/results/20260101-120000.json  # reprint an earlier run's table
    python -m bench --report-overhead --steps 20            # the step report's cost on GPT-small
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

from bench.cases import DTYPES, OPTIMIZERS, REPLICATE_PEERS, Case, Settings, fsdp_cases, replicate_cases, report_cases
from bench.launch import launch
from bench.report import format_profiles, format_table, summarise_case, write_json
from shardwise.train.model import PRESETS

__all__ = ["main", "build_parser", "plan"]

DEFAULT_OUT = Path(__file__).resolve().parent / "results"

# Defaults of the flags left unset, in the full grid and in --quick.
_FULL = dict(models=["tiny", "small", "medium"], world_sizes=[2, 4], dtypes=["fp32", "bf16"], steps=10, warmup=2)
_QUICK = dict(models=["tiny", "small"], world_sizes=[2], dtypes=["fp32"], replicate_models=["tiny"], steps=3, warmup=1)


def _csv(parse: Callable[[str], Any], choices: tuple | None = None) -> Callable[[str], list]:
    """An argparse type for comma-separated values, each parsed and checked against ``choices``."""

    def convert(text: str) -> list:
        values = [parse(v.strip()) for v in text.split(",") if v.strip()]
        bad = [v for v in values if choices is not None and v not in choices]
        if bad or not values:
            raise argparse.ArgumentTypeError(f"expected a comma-separated subset of {choices}, got {text!r}")
        return values

    return convert


def _bool(text: str) -> bool:
    lowered = text.lower()
    if lowered not in ("true", "false"):
        raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")
    return lowered == "true"


def build_parser() -> argparse.ArgumentParser:
    """The flags of ``python -m bench``; unset ones take the full-grid or ``--quick`` default."""
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    models = tuple(sorted(PRESETS))
    p.add_argument("--quick", action="store_true", help="tiny+small, 2 ranks, fp32, both reshard settings, replicate on tiny, 3 steps")
    p.add_argument("--models", type=_csv(str, models + ("none",)), help="fully_shard models, e.g. tiny,small, or none (full: tiny,small,medium)")
    p.add_argument("--world-sizes", type=_csv(int, (2, 3, 4, 5, 6, 7, 8)), help="rank counts (full: 2,4)")
    p.add_argument("--dtypes", type=_csv(str, DTYPES), help="param dtypes: fp32,bf16 (bf16 reduces in fp32)")
    p.add_argument("--reshard", type=_csv(_bool, (True, False)), default=[True, False], help="reshard_after_forward values (default true,false)")
    p.add_argument("--replicate-models", type=_csv(str, models + ("none",)), help="replicate models, or none (full: the --models)")
    p.add_argument(
        "--replicate-peers",
        type=_csv(str, tuple(REPLICATE_PEERS)),
        default=["ddp", "torch"],
        help="what shardwise.replicate is compared with: ddp (DistributedDataParallel), torch (torch's replicate), "
        "ddp-matched (DDP bucketed to about one all-reduce per replicate call); default ddp,torch",
    )
    p.add_argument("--steps", type=int, help="timed steps per implementation (full 10, quick 3)")
    p.add_argument("--warmup", type=int, help="untimed steps per implementation first (full 2, quick 1)")
    p.add_argument("--batch-size", type=int, default=1, help="sequences per rank per step (default 1)")
    p.add_argument("--seed", type=int, default=0, help="model init and data seed (default 0)")
    p.add_argument("--profile", action="store_true", help="cProfile one extra step per implementation on rank 0")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"directory for the JSON (default {DEFAULT_OUT})")
    p.add_argument(
        "--optimizer",
        choices=OPTIMIZERS,
        default="foreach",
        help="AdamW implementation for every contender (default foreach, as on GPUs; loop: CPU's default)",
    )
    p.add_argument(
        "--report-overhead",
        action="store_true",
        help="instead of the grid: fully_shard with the step report recording vs without (--models, default small; fp32)",
    )
    p.add_argument("--show", type=Path, metavar="JSON", help="print the table (and profiles) of an earlier run and exit")
    return p


def plan(args: argparse.Namespace) -> tuple[list[Case], Settings]:
    """The cases and settings the parsed flags ask for."""
    defaults = _QUICK if args.quick else _FULL

    def pick(name: str):
        value = getattr(args, name)
        return value if value is not None else defaults.get(name)

    models, world_sizes = pick("models"), pick("world_sizes")
    if args.report_overhead:
        models = args.models or ["small"]
        cases = report_cases(models, world_sizes, args.reshard)
        return cases, Settings(warmup=pick("warmup"), steps=pick("steps"), batch_size=args.batch_size, seed=args.seed,
                               profile=args.profile, optimizer=args.optimizer)  # fmt: skip
    replicate_models = pick("replicate_models") or models
    cases = [] if "none" in models else fsdp_cases(models, world_sizes, args.reshard, pick("dtypes"))
    if "none" not in replicate_models:
        cases += replicate_cases(replicate_models, world_sizes, args.replicate_peers)
    cases.sort(key=lambda c: c.world_size)  # stable: one launch per world size, grid order inside
    settings = Settings(warmup=pick("warmup"), steps=pick("steps"), batch_size=args.batch_size, seed=args.seed, profile=args.profile, optimizer=args.optimizer)
    return cases, settings


def _progress(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _run_cases(cases: list[Case], settings: Settings, save: Callable[[list[dict[str, Any]]], None]) -> list[dict[str, Any]]:
    """Launch each world size once; summarise each case as its ranks report it, and ``save`` the results so far."""
    results: list[dict[str, Any]] = []

    def on_result(case: Case, ranks) -> None:
        res = summarise_case(case, ranks, settings)
        results.append(res)
        save(results)
        sw, th = (res["impls"][r]["step_s"]["median"] for r in ("shardwise", "torch"))
        co = res["compute_only"]["step_s"]["median"]
        cpu_sw, cpu_th = (res["impls"][r]["thread_cpu_s"]["median"] for r in ("shardwise", "torch"))
        _progress(
            f"[{len(results)}/{len(cases)}] {case.label}: shardwise {sw * 1e3:.1f} ms, torch {th * 1e3:.1f} ms, "
            f"ratio {res['ratio']:.3f} (compute-only {co * 1e3:.1f} ms); training-thread CPU ratio {cpu_sw / cpu_th:.3f}"
        )

    for ws in dict.fromkeys(c.world_size for c in cases):
        launch(ws, [c for c in cases if c.world_size == ws], settings, on_result)
    return results


def _source_state() -> dict[str, Any]:
    """The commit measured and how many files of ``shardwise/`` differ from it (best effort)."""
    root = Path(__file__).resolve().parent.parent

    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    changed = git("status", "--porcelain", "--", "shardwise")
    digest = hashlib.sha256()
    for path in sorted((root / "shardwise").rglob("*.py")):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes())
    return {
        "commit": git("rev-parse", "HEAD"),
        "shardwise_files_changed": None if changed is None else len(changed.splitlines()),
        "shardwise_sources_sha256": digest.hexdigest(),  # identifies the exact code measured, committed or not
    }


def _loadavg() -> tuple[float, float, float] | None:
    return os.getloadavg() if hasattr(os, "getloadavg") else None


def _run_info(argv: list[str], settings: Settings, n_cases: int) -> dict[str, Any]:
    """What the JSON's ``meta`` says about the run, fixed at its start (the code measured included)."""
    return {
        "argv": argv,
        "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "cases_planned": n_cases,
        "loadavg_start": _loadavg(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "settings": dataclasses.asdict(settings),
        "threads_per_rank": 1,
        "backend": "gloo over 127.0.0.1",
        "source": _source_state(),
    }


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m bench``; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if args.show is not None:
        _print_report(json.loads(args.show.read_text()))
        return 0
    try:
        cases, settings = plan(args)
    except ValueError as e:
        raise SystemExit(f"bench: {e}") from None
    started, info = time.time(), _run_info(argv, settings, len(cases))
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(started))
    _progress(f"bench: {len(cases)} cases, {settings.warmup} warmup + {settings.steps} timed steps each, batch {settings.batch_size}/rank, {settings.optimizer} AdamW")

    def save(results: list[dict[str, Any]]) -> Path:  # after every case, so a long grid cut short keeps its rows
        meta = {**info, "wall_s": time.time() - started, "loadavg_end": _loadavg()}
        return write_json({"meta": meta, "results": results}, args.out, stamp)

    results = _run_cases(cases, settings, save)
    path = save(results)
    _print_report(json.loads(path.read_text()))
    print(f"\nresults: {path}")
    return 0


def _print_report(doc: dict[str, Any]) -> None:
    """The table, then the profiles when the run has them."""
    print(format_table(doc["results"]))
    profiles = format_profiles(doc["results"])
    if profiles:
        print()
        print(profiles)
