"""``python -m bench.overhead``: what each wrapper adds per unit on a launch-bound stack.

The model is K blocks of two 32-wide Linears (compute negligible), trained with SGD on
one batch that every rank shares (so every contender, the plain model included, trains
the same losses at any world size). Contenders, each built from the same seed::

    plain                   the model itself, no wrapper
    torch.DDP               DistributedDataParallel(model)
    torch.fully_shard       torch FSDP2: fully_shard(block) for each block, then the root
    shardwise.fully_shard   the same calls with shardwise
    torch.replicate         torch.distributed._composable.replicate_with_fsdp, per block + root
    shardwise.replicate     the same calls with shardwise

Steps are interleaved as in :mod:`bench.rank`: at each step index every contender runs one
step (a barrier before each), the order rotating and flipping from step to step so a
shared machine's drifting load hits all alike. A round is ``steps`` such indices; each
contender's round median is the max over ranks of the ranks' medians (:mod:`bench.stats`).
Printed per world size and K: the median step (range over rounds), the **per-unit
overhead** ``(step - plain step) / K`` in µs, the same from the training thread's CPU time
(robust to a loaded machine), and shardwise's per-unit overhead over its torch peer's and
over DDP's, by wall clock | by CPU time.

It runs twice: with shardwise's defaults (fault monitor on: order check of the first 2
steps, watchdog) and with the fault monitor off (``SHARDWISE_ORDER_CHECK=off``,
``SHARDWISE_WATCHDOG_S=0``); no trace is ever active, so tracing costs what it costs when
off. ``--profile`` adds the Python calls of one cProfile'd step per contender on rank 0
(interpreter work, independent of the machine's load)::

    python -m bench.overhead                          # K 12,48,96; ranks 1,2; 60 steps x 3 rounds
    python -m bench.overhead --quick                  # a smoke test (seconds)
    python -m bench.overhead --ks 48 --world-sizes 1 --faults on --profile
    python -m bench.overhead --device cuda --world-sizes 1   # on a GPU (one rank, NCCL)
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from bench.launch import _loopback_interface, _loopback_store, gather_each, spawn_draining
from bench.profiling import PACKAGE_OF, profile_call
from bench.stats import percentile, worst_rank

__all__ = ["CONTENDERS", "OverheadSpec", "build_parser", "main", "run", "format_tables"]

CONTENDERS = (
    "plain", "torch.DDP", "torch.fully_shard", "shardwise.fully_shard", "torch.replicate", "shardwise.replicate",
)  # fmt: skip
WIDTH = 32
BATCH = 8
FAULTS_OFF = {"SHARDWISE_ORDER_CHECK": "off", "SHARDWISE_WATCHDOG_S": "0"}


@dataclasses.dataclass(frozen=True)
class OverheadSpec:
    """One launch: a world size, its Ks, the step counts and the fault setting."""

    world_size: int
    ks: tuple[int, ...]
    warmup: int
    steps: int  # timed step indices per round
    rounds: int
    faults: str  # "on" (defaults) or "off"
    device: str  # "cpu" or "cuda"
    profile: bool
    store_port: int = 0


def build_stack(k: int, seed: int = 0) -> nn.Sequential:
    """K blocks of two ``WIDTH``-wide Linears, initialised from ``seed``."""
    torch.manual_seed(seed)
    return nn.Sequential(*(nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)) for _ in range(k)))


def _per_block(wrap, model: nn.Sequential, **kwargs) -> nn.Module:
    for block in model:
        wrap(block, **kwargs)
    wrap(model, **kwargs)
    return model


def wrap(name: str, model: nn.Sequential, mesh: DeviceMesh) -> nn.Module:
    """``model`` wrapped as contender ``name`` says (see the module docstring)."""
    if name == "plain":
        return model
    if name == "torch.DDP":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model, process_group=mesh.get_group())
    if name == "torch.fully_shard":
        from torch.distributed.fsdp import fully_shard
    elif name == "shardwise.fully_shard":
        from shardwise import fully_shard
    elif name == "torch.replicate":
        from torch.distributed._composable.replicate_with_fsdp import replicate as fully_shard
    elif name == "shardwise.replicate":
        from shardwise import replicate as fully_shard
    else:
        raise ValueError(f"unknown contender {name!r}; choose from {CONTENDERS}")
    return _per_block(fully_shard, model, mesh=mesh)


def _step(model: nn.Module, optimizer: torch.optim.Optimizer, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    loss = (model(x) - y).pow(2).mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()


def _order(i: int) -> list[int]:
    """Step ``i``'s contender order: rotated by ``i``, reversed every other step."""
    n = len(CONTENDERS)
    order = [(i + j) % n for j in range(n)]
    return order[::-1] if i % 2 else order


def measure_k(k: int, spec: OverheadSpec, mesh: DeviceMesh) -> dict:
    """This rank's step times (per round) and losses of every contender on the K-block stack."""
    device = torch.device(spec.device)
    arms = []
    for name in CONTENDERS:
        model = wrap(name, build_stack(k).to(device), mesh)
        arms.append((name, model, torch.optim.SGD(model.parameters(), lr=0.01)))
    gen = torch.Generator().manual_seed(k)
    total = spec.warmup + spec.steps * spec.rounds
    batches = [(torch.randn(BATCH, WIDTH, generator=gen).to(device), torch.randn(BATCH, WIDTH, generator=gen).to(device)) for _ in range(total)]  # fmt: skip
    times = {name: [[] for _ in range(spec.rounds)] for name in CONTENDERS}
    cpu = {name: [[] for _ in range(spec.rounds)] for name in CONTENDERS}
    losses = {name: [] for name in CONTENDERS}
    for i, batch in enumerate(batches):
        for j in _order(i):
            name, model, optimizer = arms[j]
            dist.barrier()
            cpu0, start = time.thread_time(), time.perf_counter()
            loss = _step(model, optimizer, batch)
            if device.type == "cuda":
                torch.cuda.synchronize()
            elapsed, cpu_s = time.perf_counter() - start, time.thread_time() - cpu0
            losses[name].append(loss.item())
            if i >= spec.warmup:
                times[name][(i - spec.warmup) // spec.steps].append(elapsed)
                cpu[name][(i - spec.warmup) // spec.steps].append(cpu_s)
    calls = _profiled_calls(arms, batches[-1]) if spec.profile else None
    return {"times": times, "cpu": cpu, "losses": losses, "calls": calls}


def _profiled_calls(arms: list, batch) -> dict | None:
    """Python calls (all, and the wrapper's own) of one more step per contender, rank 0 only."""
    calls = {}
    for name, model, optimizer in arms:
        dist.barrier()
        step = lambda: _step(model, optimizer, batch)  # noqa: E731 - bound per contender
        if dist.get_rank() == 0:
            prof = profile_call(step, PACKAGE_OF.get(name, f"bench{os.sep}overhead"))
            calls[name] = {"calls": prof.calls, "own_calls": prof.own_calls}
        else:
            step()
    return calls if dist.get_rank() == 0 else None


def rank_main(rank: int, spec: OverheadSpec, queue) -> None:
    """One rank of a launch: every K in turn, gathered to rank 0, which queues the result."""
    torch.set_num_threads(1)
    os.environ["GLOO_SOCKET_IFNAME"] = _loopback_interface()
    if spec.faults == "off":
        from shardwise.faults import configure

        configure(order_check="off", watchdog_s=0)
    timeout = datetime.timedelta(seconds=900)
    store = dist.TCPStore("127.0.0.1", spec.store_port, spec.world_size, is_master=False, timeout=timeout)
    backend = "cpu:gloo,cuda:nccl" if spec.device == "cuda" else "gloo"
    if spec.device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, store=store, rank=rank, world_size=spec.world_size, timeout=timeout)
    try:
        mesh = init_device_mesh(spec.device, (spec.world_size,))
        gather_each(spec.ks, lambda k: measure_k(k, spec, mesh), queue)
    finally:
        dist.destroy_process_group()


def summarise(k: int, world_size: int, faults: str, per_rank: list[dict]) -> dict:
    """One table's numbers: per contender the round medians (worst rank) and per-unit overheads."""
    rounds = range(len(per_rank[0]["times"]["plain"]))
    rows = {
        name: {key: [worst_rank([r[src][name][i] for r in per_rank]).median for i in rounds] for key, src in _MEASURES}
        for name in CONTENDERS
    }  # fmt: skip
    for name in CONTENDERS:
        for key, unit in (("step_s", "unit_us"), ("cpu_s", "cpu_unit_us")):
            rows[name][unit] = [(s - p) / k * 1e6 for s, p in zip(rows[name][key], rows["plain"][key])]
    plain = per_rank[0]["losses"]["plain"]
    loss_diff = {n: max(abs(a - b) for a, b in zip(per_rank[0]["losses"][n], plain)) for n in CONTENDERS}
    return {
        "k": k, "world_size": world_size, "faults": faults, "rows": rows, "max_loss_diff_vs_plain": loss_diff,
        "calls": per_rank[0]["calls"],
    }  # fmt: skip


_MEASURES = (("step_s", "times"), ("cpu_s", "cpu"))
"""Per round and contender: the wall-clock step, and the training thread's CPU time in it
(load-robust: time spent waiting for a core on a shared machine is not counted; at world
size 1 nothing else runs, so on a quiet machine it equals the wall-clock step)."""


def launch(spec: OverheadSpec, on_result) -> None:
    """Run ``spec`` on fresh ranks; ``on_result(summary)`` per K as each finishes."""
    store = _loopback_store()
    spec = dataclasses.replace(spec, store_port=store.port)

    def on_item(index: int, per_rank: list) -> None:
        on_result(summarise(spec.ks[index], spec.world_size, spec.faults, per_rank))

    spawn_draining(rank_main, spec, spec.world_size, on_item)


def _mid(values: list[float]) -> float:
    return percentile(values, 50)


def _range(values: list[float], fmt: str) -> str:
    lo, hi = min(values), max(values)
    return format(lo, fmt) if len(values) == 1 else f"{format(lo, fmt)}-{format(hi, fmt)}"


_PEERS = {"shardwise.fully_shard": "torch.fully_shard", "shardwise.replicate": "torch.replicate"}


def _ratios(rows: dict, name: str, peer: str) -> str:
    """``name``'s per-unit overhead over ``peer``'s, wall-clock | thread CPU (medians over rounds)."""
    cells = []
    for key in ("unit_us", "cpu_unit_us"):
        theirs = _mid(rows[peer][key])
        cells.append(f"{_mid(rows[name][key]) / theirs:.2f}" if theirs > 0 else "-")
    return "|".join(cells)


def format_tables(summaries: list[dict]) -> str:
    """A table per (faults, world size, K): step ms and µs per unit (ranges over rounds),
    shardwise's per-unit overhead over its torch peer's and over DDP's (medians over rounds)."""
    out = []
    for s in summaries:
        rows = s["rows"]
        out.append(f"\nfaults={s['faults']} world_size={s['world_size']} K={s['k']}")
        out.append(
            f"{'contender':<22} {'step ms':>13} {'µs/unit':>11} {'cpu µs/unit':>11} {'/peer w|c':>11} {'/DDP w|c':>11} "
            f"{'calls':>7} {'own':>6} {'loss diff':>9}"
        )  # fmt: skip
        for name in CONTENDERS:
            r = rows[name]
            peer = _PEERS.get(name)
            calls = (s["calls"] or {}).get(name, {})
            out.append(
                f"{name:<22} {_range([t * 1e3 for t in r['step_s']], '.2f'):>13} "
                f"{'' if name == 'plain' else _range(r['unit_us'], '.0f'):>11} "
                f"{'' if name == 'plain' else _range(r['cpu_unit_us'], '.0f'):>11} "
                f"{_ratios(rows, name, peer) if peer else '':>11} "
                f"{_ratios(rows, name, 'torch.DDP') if name.startswith('shardwise') else '':>11} "
                f"{calls.get('calls', ''):>7} {calls.get('own_calls', ''):>6} {s['max_loss_diff_vs_plain'][name]:>9.1e}"
            )
    return "\n".join(out)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.overhead", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke test: K=2, ranks 1 and 2, 3 steps, 1 round")
    parser.add_argument("--ks", default=None, help="comma-separated block counts (default 12,48,96)")
    parser.add_argument("--world-sizes", default=None, help="comma-separated (default 1,2)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per round (default 60)")
    parser.add_argument("--rounds", type=int, default=None, help="rounds (default 3)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed first steps (default 5)")
    parser.add_argument("--faults", choices=("on", "off", "both"), default="both")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--profile", action="store_true", help="+ Python calls of one cProfile'd step (rank 0)")
    parser.add_argument("--json", default=None, help="write the summaries to this file")
    return parser


def _ints(text: str | None, default: tuple[int, ...]) -> tuple[int, ...]:
    return default if text is None else tuple(int(v) for v in text.split(",") if v.strip())


def plan(args: argparse.Namespace) -> list[OverheadSpec]:
    """The launches ``args`` ask for, one per (faults setting, world size)."""
    quick = args.quick
    ks = _ints(args.ks, (2,) if quick else (12, 48, 96))
    steps = args.steps or (3 if quick else 60)
    rounds = args.rounds or (1 if quick else 3)
    warmup = args.warmup if args.warmup is not None else (1 if quick else 5)
    faults = ("on", "off") if args.faults == "both" else (args.faults,)
    return [
        OverheadSpec(ws, ks, warmup, steps, rounds, f, args.device, args.profile)
        for f in faults for ws in _ints(args.world_sizes, (1, 2))
    ]  # fmt: skip


def run(argv: list[str] | None = None) -> list[dict]:
    """Measure what ``argv`` asks; return the summaries (and print the tables)."""
    args = build_parser().parse_args(argv)
    summaries: list[dict] = []

    def on_result(summary: dict) -> None:
        summaries.append(summary)
        print(format_tables([summary]), flush=True)

    for spec in plan(args):
        print(f"measuring faults={spec.faults} world_size={spec.world_size} K={spec.ks} ...", file=sys.stderr, flush=True)
        launch(spec, on_result)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summaries, f, indent=1)
    return summaries


def main(argv: list[str] | None = None) -> int:
    run(argv)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
