"""``python -m bench.instructions``: the instructions each wrapper adds per unit, counted.

On a shared VM the wall clock drifts by up to 2x between minutes (the plain K=48 step took
4.3 ms and then 7.5-8.2 ms in the same half hour), so a change of a few per cent in a
wrapper's per-unit overhead cannot be told from noise by :mod:`bench.overhead`'s medians.
An instruction count can: valgrind's cachegrind counts every instruction the process
executes, and with the hash seed fixed and one BLAS thread two runs agree to about 0.5%
of a wrapper's overhead. Instructions are not time (a cache miss costs more than an add),
but a change that removes work shows here whatever the machine's load.

Each contender of :mod:`bench.overhead` (world size 1, one rank, an in-memory store, so no
collective and no port) runs twice under cachegrind: ``warmup`` steps then none, and
``warmup`` steps then ``steps`` more. The difference, over ``steps`` and K, is its
instructions per unit per step; less the plain model's, its overhead per unit.
``--no-optimizer`` leaves ``optimizer.step()`` out (``zero_grad`` still runs): SGD over
DTensor parameters costs every FSDP2-style wrapper the same (about 180 K instructions per
unit, four DTensor ``add_`` dispatches) and would hide a change to the wrapper's own
hooks::

    python -m bench.instructions                                  # K=48, 60 steps, 4 contenders
    python -m bench.instructions --no-optimizer --contenders plain,shardwise.fully_shard
    PYTHONPATH=/path/to/other/checkout python -m bench.instructions ...   # another tree

Each run takes one to three minutes (valgrind runs ~50x slower; importing torch is most of
it); ``--jobs`` runs that many at once.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

__all__ = ["instructions_in", "per_unit", "format_table", "main"]

DEFAULT_CONTENDERS = ("plain", "torch.DDP", "torch.fully_shard", "shardwise.fully_shard")
_DETERMINISTIC = {"PYTHONHASHSEED": "0", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
_TOTAL = re.compile(r"I\s+refs:\s+([\d,]+)")


def instructions_in(valgrind_output: str) -> int:
    """The total instruction count cachegrind printed (its ``I refs:`` line)."""
    found = _TOTAL.findall(valgrind_output)
    if not found:
        raise RuntimeError(f"no 'I refs:' line in valgrind's output:\n{valgrind_output[-2000:]}")
    return int(found[-1].replace(",", ""))


def per_unit(without_steps: int, with_steps: int, steps: int, k: int) -> float:
    """Instructions per unit per step: the ``steps`` timed steps' share of the difference."""
    return (with_steps - without_steps) / steps / k


def _child_command(name: str, args: argparse.Namespace, steps: int) -> list[str]:
    command = [sys.executable, "-m", "bench.instructions", "--child", name, "--k", str(args.k)]
    command += ["--warmup", str(args.warmup), "--steps", str(steps)]
    return command + (["--no-optimizer"] if args.no_optimizer else [])


def _count(name: str, args: argparse.Namespace, steps: int) -> int:
    valgrind = ["valgrind", "--tool=cachegrind", "--cache-sim=no", "--cachegrind-out-file=/dev/null"]
    env = dict(os.environ, **_DETERMINISTIC)
    done = subprocess.run(valgrind + _child_command(name, args, steps), env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{name} under valgrind exited with {done.returncode}:\n{done.stderr[-3000:]}")
    return instructions_in(done.stderr)


def measure(args: argparse.Namespace) -> dict[str, float]:
    """Instructions per unit per step of each contender (two valgrind runs each)."""
    runs = [(name, steps) for name in args.contenders for steps in (0, args.steps)]
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        counts = dict(zip(runs, pool.map(lambda run: _count(run[0], args, run[1]), runs)))
    return {name: per_unit(counts[name, 0], counts[name, args.steps], args.steps, args.k) for name in args.contenders}


def format_table(per_unit_counts: dict[str, float]) -> str:
    """Per contender: instructions per unit per step, and over the plain model's if measured."""
    plain = per_unit_counts.get("plain")
    lines = [f"{'contender':24s} {'K instr/unit':>13s} {'over plain':>11s}"]
    for name, count in per_unit_counts.items():
        over = "" if plain is None or name == "plain" else f"{(count - plain) / 1e3:11.1f}"
        lines.append(f"{name:24s} {count / 1e3:13.1f} {over}")
    return "\n".join(lines)


def _run_child(args: argparse.Namespace) -> int:
    """One contender, in-process: ``warmup`` then ``steps`` steps (what valgrind counts)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from bench.overhead import BATCH, WIDTH, _step, build_stack, wrap

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = wrap(args.child, build_stack(args.k), init_device_mesh("cpu", (1,)))
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
        if args.no_optimizer:
            optimizer.step = lambda *unused, **kwargs: None  # zero_grad still runs
        torch.manual_seed(1)
        batch = torch.randn(BATCH, WIDTH), torch.randn(BATCH, WIDTH)
        for _ in range(args.warmup + args.steps):
            _step(model, optimizer, batch)
    finally:
        dist.destroy_process_group()
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.instructions", description=__doc__.split("\n\n")[0])
    parser.add_argument("--k", type=int, default=48, help="blocks in the stack (default 48)")
    parser.add_argument("--steps", type=int, default=60, help="counted steps (default 60)")
    parser.add_argument("--warmup", type=int, default=20, help="steps before counting (default 20)")
    parser.add_argument(
        "--contenders", default=",".join(DEFAULT_CONTENDERS), help="comma-separated, from bench.overhead's"
    )
    parser.add_argument("--no-optimizer", action="store_true", help="leave optimizer.step() out")
    parser.add_argument("--jobs", type=int, default=2, help="valgrind runs at once (default 2)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.child:
        return _run_child(args)
    from bench.overhead import CONTENDERS

    args.contenders = [name for name in args.contenders.split(",") if name]
    unknown = [name for name in args.contenders if name not in CONTENDERS]
    if unknown:
        raise SystemExit(f"unknown contender(s) {unknown}; choose from {', '.join(CONTENDERS)}")
    if shutil.which("valgrind") is None:
        raise SystemExit("python -m bench.instructions needs valgrind on PATH (apt install valgrind)")
    print(format_table(measure(args)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
