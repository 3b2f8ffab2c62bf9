"""``python -m bench.cuda``: one GPU, world size 1 on NCCL: shardwise vs torch FSDP2 vs DDP.

For each GPT preset and precision, each contender runs in a fresh process of its own (one
NCCL group of one rank; nothing an earlier contender allocated or cached can count
against it): it builds the same seeded model on the GPU, trains ``--warmup`` steps, then
times ``--steps`` steps (forward, cross-entropy, backward, AdamW; ``torch.cuda.synchronize``
around each) and reads ``torch.cuda.max_memory_allocated`` over the timed steps::

    fsdp    fully_shard per block, then the root (reshard after forward: torch's default)
    ddp     DistributedDataParallel (fp32 only: it has no mixed-precision policy)

Printed: median step time and peak memory per contender, and shardwise's over torch's.
Needs a CUDA GPU; the contenders run in turns.

    python -m bench.cuda                                   # small and medium, fp32 and bf16
    python -m bench.cuda --presets small --steps 50
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import subprocess
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMP
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.nn.parallel import DistributedDataParallel

import shardwise
from shardwise.train.model import GPT, GPTConfig

BATCH = 8


def _model(preset: str, impl: str, precision: str) -> nn.Module:
    torch.manual_seed(0)
    model = GPT(GPTConfig.preset(preset)).cuda()
    if impl == "ddp":
        return DistributedDataParallel(model)
    fully_shard = shardwise.fully_shard if impl == "shardwise" else torch_fully_shard
    kwargs = {}
    if precision == "bf16":
        policy = shardwise.MixedPrecisionPolicy if impl == "shardwise" else TorchMP
        kwargs["mp_policy"] = policy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.layers:
        fully_shard(block, **kwargs)
    return fully_shard(model, **kwargs)


def _measure(preset: str, impl: str, precision: str, warmup: int, steps: int) -> tuple[float, float]:
    """(median step ms, peak MiB over the timed steps)."""
    gc.collect()
    torch.cuda.empty_cache()
    model = _model(preset, impl, precision)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    seq = GPTConfig.preset(preset).seq_len
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 256, (BATCH, seq + 1), generator=gen).cuda()
    times = []
    for i in range(warmup + steps):
        if i == warmup:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        logits = model(tokens[:, :-1])
        F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten()).backward()
        opt.step()
        opt.zero_grad()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated() / 2**20
    del model, opt
    return 1e3 * statistics.median(times[warmup:]), peak


def _one(spec: str, warmup: int, steps: int) -> None:
    """Measure one ``preset:precision:impl`` in this process; print it as a JSON line."""
    preset, precision, impl = spec.split(":")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=torch.device("cuda", 0))
    ms, mib = _measure(preset, impl, precision, warmup, steps)
    print(json.dumps({"ms": ms, "mib": mib}))
    dist.destroy_process_group()


def _in_fresh_process(spec: str, warmup: int, steps: int) -> tuple[float, float]:
    cmd = [sys.executable, "-m", "bench.cuda", "--one", spec, "--warmup", str(warmup), "--steps", str(steps)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    result = json.loads(out.strip().splitlines()[-1])
    return result["ms"], result["mib"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.cuda", description=__doc__.splitlines()[0])
    parser.add_argument("--presets", default="small,medium")
    parser.add_argument("--precisions", default="fp32,bf16")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--one", help=argparse.SUPPRESS)  # preset:precision:impl, in this process
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench.cuda needs a CUDA GPU", file=sys.stderr)
        return 2
    if args.one:
        _one(args.one, args.warmup, args.steps)
        return 0
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, world size 1 (NCCL), batch {BATCH}")
    print(f"{'preset':8} {'prec':5} {'impl':10} {'step ms':>9} {'peak MiB':>9} {'time/torch':>10} {'mem/torch':>9}")
    for preset in args.presets.split(","):
        for precision in args.precisions.split(","):
            impls = ["shardwise", "torch", "ddp"] if precision == "fp32" else ["shardwise", "torch"]
            results = {i: _in_fresh_process(f"{preset}:{precision}:{i}", args.warmup, args.steps) for i in impls}
            ms_torch, mib_torch = results["torch"]
            for impl, (ms, mib) in results.items():
                print(f"{preset:8} {precision:5} {impl:10} {ms:9.2f} {mib:9.1f} {ms / ms_torch:10.3f} {mib / mib_torch:9.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
