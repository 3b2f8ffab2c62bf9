"""``shardwise plan``: plan a model from a config file, no weights, no GPUs, no ranks.

::

    shardwise plan --model llama-70b --world-size 1024 --memory 80GiB --batch-size 1 --seq-len 4096
    shardwise plan --hf-config path/to/config.json --world-size 64 --memory 40GiB --json plan.json
    shardwise plan --model small --world-size 2 --device cpu --mixed-precision none

``--model`` names a shipped Transformers config (``llama-8b``, ``llama-70b``, in
``configs/``) or a ``shardwise train`` GPT preset. The model is built on the meta device,
so a 70B model costs no memory; Transformers is imported only for ``--hf-config`` and the
Llama names.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from torch import nn

__all__ = ["add_plan_args", "run_plan", "build_meta_model", "SHIPPED_CONFIGS"]

CONFIG_DIR = Path(__file__).resolve().parent / "configs"
SHIPPED_CONFIGS = {p.stem: p for p in sorted(CONFIG_DIR.glob("*.json"))}


def add_plan_args(p: argparse.ArgumentParser) -> None:
    from shardwise.train.model import PRESETS

    names = sorted(SHIPPED_CONFIGS) + sorted(PRESETS)
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--hf-config", metavar="PATH", help="a Transformers config.json (or a directory holding one)")
    source.add_argument("--model", choices=names, help="a shipped config or a GPT preset")
    p.add_argument("--world-size", type=int, default=8, help="data-parallel ranks (default %(default)s)")
    p.add_argument("--mesh-shape", metavar="R,S", help="HSDP: replicate x shard ranks, e.g. 128,8")
    p.add_argument("--memory", metavar="SIZE", help="memory budget per rank, e.g. 80GiB")
    p.add_argument("--mixed-precision", choices=("bf16", "none"), default="bf16",
                   help="bf16: bf16 params, fp32 reduction (default %(default)s)")
    p.add_argument("--batch-size", type=int, help="sequences per rank (with --seq-len: count activations)")
    p.add_argument("--seq-len", type=int, help="tokens per sequence")
    p.add_argument("--activation-checkpointing", choices=("auto", "on", "off"), default="auto",
                   help="auto: only when that makes the plan fit (default %(default)s)")
    p.add_argument("--optimizer", choices=("adamw", "adam", "sgd", "none"), default="adamw")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="what the ranks run on (default %(default)s)")
    p.add_argument("--json", metavar="PATH", help="also write the plan as JSON (auto_shard can apply it)")


def build_meta_model(hf_config: str | None, model: str | None) -> nn.Module:
    """The model on the meta device: from a Transformers config file or a shipped name."""
    path = Path(hf_config) if hf_config else SHIPPED_CONFIGS.get(model)
    if path is None:
        from shardwise.train.model import GPT, GPTConfig

        with torch.device("meta"):
            return GPT(GPTConfig.preset(model))
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise SystemExit(f"shardwise plan: no config file at {path}")
    data = json.loads(path.read_text())
    if "model_type" not in data:
        raise SystemExit(f"shardwise plan: {path} has no 'model_type'; is it a Transformers config.json?")
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(**data)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(cfg)


def _mesh_shape(text: str | None):
    if text is None:
        return None
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise SystemExit(f"shardwise plan: --mesh-shape must be R,S integers, got {text!r}") from None


def run_plan(args: argparse.Namespace) -> int:
    from shardwise import MixedPrecisionPolicy
    from shardwise.planning import plan

    start = time.perf_counter()
    model = build_meta_model(args.hf_config, args.model)
    if (args.batch_size is None) != (args.seq_len is None):
        raise SystemExit("shardwise plan: give --batch-size and --seq-len together (or neither)")
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if args.mixed_precision == "bf16" else None
    ac = {"auto": None, "on": True, "off": False}[args.activation_checkpointing]
    mesh = _mesh_shape(args.mesh_shape)
    try:
        result = plan(
            model, world_size=None if mesh else args.world_size, mesh_shape=mesh, memory_budget=args.memory,
            mp_policy=mp, optimizer=args.optimizer, device=args.device, activation_checkpointing=ac,
            batch=(args.batch_size, args.seq_len) if args.batch_size else None,
        )
    except ValueError as e:
        raise SystemExit(f"shardwise plan: {e}") from None
    print(result)
    print(f"\n(planned in {time.perf_counter() - start:.1f} s)")
    if args.json:
        result.save(args.json)
    return 0 if result.fits is not False else 1
