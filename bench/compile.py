"""``python -m bench.compile``: torch.compile over shardwise and over torch FSDP2, side by side.

For each recipe and implementation, in a fresh pair of gloo ranks (nothing compiled or
cached from an earlier measurement)::

    blocks-fullgraph  for block in model.layers: block.compile(backend, fullgraph=True); fully_shard(block)
                      fully_shard(model)                                # torchtitan's order
    wrapper-fullgraph the same with fully_shard(torch.compile(block, backend, fullgraph=True))
    whole             fully_shard per block and root, then torch.compile(model, backend)
    eager             fully_shard per block and root (no compile: the reference step time)

then two training steps (forward, cross-entropy, backward, AdamW step; the GPT preset of
:mod:`shardwise.train.model`): the first one compiles. Printed per row: the graphs Dynamo
compiled (``CompileCounterWithBackend``: frames, recompiles included) and its graph breaks
(``torch._dynamo.utils.counters``), the first and second step times (max over ranks), and
shardwise's first step over torch's. Inductor's caches are disabled so that neither side
reuses the other's kernels; each rank first compiles a one-line function to pay the
backend's one-time start-up outside the measured step::

    python -m bench.compile                               # inductor, GPT tiny, 2 ranks
    python -m bench.compile --backend aot_eager --layers 2 --recipes blocks-fullgraph,whole
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as tmp
from torch.distributed.device_mesh import init_device_mesh

from bench.contenders import make_optimizer
from bench.launch import _loopback_interface, _loopback_store
from bench.workload import make_batches, train_step
from shardwise.train.model import GPT, GPTConfig

__all__ = ["main", "RECIPES", "IMPLS"]

RECIPES = ("blocks-fullgraph", "wrapper-fullgraph", "whole", "eager")
IMPLS = ("torch", "shardwise")
BACKENDS = ("inductor", "aot_eager", "eager")


def _fully_shard_of(impl: str):
    if impl == "shardwise":
        from shardwise import fully_shard
    else:
        from torch.distributed.fsdp import fully_shard
    return fully_shard


def _build(impl: str, recipe: str, backend, model_name: str, layers: int, mesh) -> torch.nn.Module:
    """The GPT preset, compiled and sharded as ``recipe`` says (see the module docstring)."""
    fully_shard = _fully_shard_of(impl)
    torch.manual_seed(0)
    model = GPT(_config(model_name, layers))
    for i, block in enumerate(model.layers):
        if recipe == "blocks-fullgraph":
            block.compile(backend=backend, fullgraph=True)
        elif recipe == "wrapper-fullgraph":
            block = model.layers[i] = torch.compile(block, backend=backend, fullgraph=True)
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return torch.compile(model, backend=backend) if recipe == "whole" else model


def _config(model_name: str, layers: int) -> GPTConfig:
    return GPTConfig.preset(model_name, **({"n_layers": layers} if layers else {}))


def _warm_backend(backend: str) -> None:
    """Compile a one-line function: imports and tool-chain checks are paid here, not in step 1."""
    fn = torch.compile(lambda x: (x.sin() + 1).relu(), backend=backend)
    fn(torch.randn(8, requires_grad=True)).sum().backward()
    torch._dynamo.reset()


def _timed_step(model, optimizer, batch) -> float:
    dist.barrier()
    start = time.perf_counter()
    train_step(model, optimizer, batch)
    return time.perf_counter() - start


def measure(impl: str, recipe: str, backend: str, model_name: str, layers: int) -> dict:
    """One rank's measurement: graphs, breaks, first and second step seconds, final loss."""
    from torch._dynamo.testing import CompileCounterWithBackend
    from torch._dynamo.utils import counters

    if backend == "inductor":
        torch._inductor.config.force_disable_caches = True
    _warm_backend(backend)
    counters.clear()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    counter = CompileCounterWithBackend(backend)
    model = _build(impl, recipe, counter, model_name, layers, mesh)
    optimizer = make_optimizer(model, "foreach")
    batches = make_batches(_config(model_name, layers), batch_size=4, count=2, seed=0, rank=dist.get_rank())
    first, second = (_timed_step(model, optimizer, b) for b in batches)
    breaks = sum(counters["graph_break"].values())
    return dict(graphs=counter.frame_count, breaks=breaks, first_s=first, second_s=second)


def _rank_main(rank: int, world_size: int, port: int, job: tuple, queue) -> None:
    torch.set_num_threads(1)
    os.environ["GLOO_SOCKET_IFNAME"] = _loopback_interface()
    store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False, timeout=datetime.timedelta(seconds=1800))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    try:
        result = measure(*job)
        gathered = [None] * world_size if rank == 0 else None
        dist.gather_object(result, gathered, dst=0)
        if rank == 0:
            queue.put(gathered)
    finally:
        dist.destroy_process_group()


def run_job(job: tuple, world_size: int) -> dict:
    """``measure(*job)`` on fresh ranks; the worst rank's times, rank 0's counts."""
    store = _loopback_store()
    queue = tmp.get_context("spawn").SimpleQueue()
    tmp.start_processes(_rank_main, args=(world_size, store.port, job, queue), nprocs=world_size, start_method="spawn")
    per_rank = queue.get()
    row = dict(per_rank[0])
    row["first_s"] = max(r["first_s"] for r in per_rank)
    row["second_s"] = max(r["second_s"] for r in per_rank)
    return row


def format_table(rows: list[tuple[str, str, dict]], backend: str) -> str:
    header = f"{'recipe':<18} {'impl':<10} {'graphs':>6} {'breaks':>6} {'1st step s':>10} {'2nd step s':>10} {'1st sw/torch':>12}"
    lines = [f"backend={backend}", header, "-" * len(header)]
    torch_first = {recipe: r["first_s"] for recipe, impl, r in rows if impl == "torch"}
    for recipe, impl, r in rows:
        ratio = f"{r['first_s'] / torch_first[recipe]:.2f}" if impl == "shardwise" and recipe in torch_first else ""
        lines.append(
            f"{recipe:<18} {impl:<10} {r['graphs']:>6} {r['breaks']:>6} {r['first_s']:>10.2f} "
            f"{r['second_s']:>10.3f} {ratio:>12}"
        )
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.compile", description=__doc__.split("\n")[0])
    parser.add_argument("--backend", choices=BACKENDS, default="inductor")
    parser.add_argument("--model", default="tiny", help="GPT preset (default tiny)")
    parser.add_argument("--layers", type=int, default=0, help="override the preset's n_layers (0: keep)")
    parser.add_argument("--recipes", default="blocks-fullgraph,whole,eager", help=f"comma-separated of {RECIPES}")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=1, help="measurements per row (median shown), order alternating")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    recipes = [r.strip() for r in args.recipes.split(",") if r.strip()]
    unknown = [r for r in recipes if r not in RECIPES]
    if unknown:
        raise SystemExit(f"unknown recipes {unknown}; choose from {RECIPES}")
    rows = []
    for recipe in recipes:
        runs: dict[str, list[dict]] = {impl: [] for impl in IMPLS}
        for repeat in range(args.repeats):
            for impl in IMPLS if repeat % 2 == 0 else IMPLS[::-1]:  # A B, B A, ...: load drifts hit both
                print(f"measuring {recipe} {impl} ({args.backend}) #{repeat + 1} ...", file=sys.stderr, flush=True)
                runs[impl].append(run_job((impl, recipe, args.backend, args.model, args.layers), args.world_size))
        rows += [(recipe, impl, _median_row(runs[impl])) for impl in IMPLS]
    print(format_table(rows, args.backend))
    return 0


def _median_row(runs: list[dict]) -> dict:
    """Counts of the first run (every run compiles the same), median step times."""
    row = dict(runs[0])
    for key in ("first_s", "second_s"):
        row[key] = statistics.median(r[key] for r in runs)
    return row


if __name__ == "__main__":
    raise SystemExit(main())
