"""Which model a run trains: a GPT preset (``--model``) or a Transformers causal LM (``--hf-config`` / ``--hf-model``).

The loop and the builder see a model only through :class:`ModelSpec`: how to build it (on
the meta device), its blocks (the FSDP units, in forward order), its logits, how one
module is initialised, its tensor-parallel plan, and the facts an export needs (``card``)::

    spec = model_spec(cfg)                 # GPTSpec or HFSpec
    with torch.device("meta"):
        model = spec.build()
    for block in spec.blocks(model): ...   # TP, activation checkpointing, compile, fully_shard
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Protocol

import torch
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from shardwise.train.config import TrainConfig
from shardwise.train.hf import HFSpec
from shardwise.train.inputs import prepared_vocab_size
from shardwise.train.model import GPT, GPTConfig, count_params

__all__ = ["ModelSpec", "GPTSpec", "model_spec", "param_count"]


class ModelSpec(Protocol):
    """What a training run needs to know of its model."""

    seq_len: int

    @property
    def vocab_size(self) -> int: ...
    def describe(self, n_params: int) -> str: ...
    def build(self) -> nn.Module: ...
    def blocks(self, model: nn.Module) -> nn.ModuleList: ...
    def check_pp(self, n_stages: int) -> None: ...
    def stage_module(self, model: nn.Module, keep: range, first: bool, last: bool) -> nn.Module: ...
    def logits(self, model: nn.Module, tokens: torch.Tensor) -> torch.Tensor: ...
    def init_module(self, model: nn.Module, name: str, module: nn.Module) -> None: ...
    def check_tp(self, tp: int) -> None: ...
    def tp_plan(self) -> dict[str, Any]: ...
    def flops_per_token(self, n_params: int) -> float: ...
    def card(self) -> dict[str, Any]: ...
    def tokens(self, corpus: torch.Tensor) -> torch.Tensor: ...
    def weights(self) -> Any: ...


class GPTSpec:
    """A preset of :class:`~shardwise.train.model.GPT` over the byte vocabulary, or a prepared ``--data``'s."""

    cfg: GPTConfig
    preset: str

    def __init__(self, cfg: GPTConfig, preset: str) -> None:
        self.cfg, self.preset = cfg, preset

    def __repr__(self) -> str:
        return f"GPTSpec({self.preset}, {self.cfg})"

    @property
    def seq_len(self) -> int:
        return self.cfg.seq_len

    @property
    def vocab_size(self) -> int:
        return self.cfg.vocab_size

    def describe(self, n_params: int) -> str:
        return f"{self.preset} GPT ({n_params / 1e6:.2f}M params, {self.cfg.n_layers} layers, dim {self.cfg.dim})"

    def build(self) -> nn.Module:
        return GPT(self.cfg)

    def blocks(self, model: nn.Module) -> nn.ModuleList:
        return model.layers

    def logits(self, model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
        return model(tokens)

    def check_pp(self, n_stages: int) -> None:
        if self.cfg.tie_weights:
            raise ValueError("--pp: the GPT ties its embedding and head, which would sit on the first and the "
                             "last stage; drop tie_weights or --pp")
        if self.cfg.n_layers < n_stages:
            raise ValueError(f"--pp: the {self.preset} GPT has {self.cfg.n_layers} blocks, too few for {n_stages} "
                             "pipeline stages; use a bigger preset, a smaller --pp or a single-stage --pp-schedule")

    def stage_module(self, model: nn.Module, keep: range, first: bool, last: bool) -> nn.Module:
        return model.stage(keep, first, last)

    def init_module(self, model: nn.Module, name: str, module: nn.Module) -> None:
        """GPT-2's initialisation of one module (what :meth:`GPT.reset_parameters` does to each)."""
        if isinstance(module, (nn.Linear, nn.Embedding)):
            residual = name.endswith(".proj")  # the projections writing into the residual stream
            std = 0.02 / math.sqrt(2 * self.cfg.n_layers) if residual else 0.02
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.LayerNorm):
            module.reset_parameters()

    def check_tp(self, tp: int) -> None:
        for field in ("n_heads", "dim"):
            if getattr(self.cfg, field) % tp:
                raise ValueError(f"--tp {tp} must divide the {self.preset} GPT's {field}={getattr(self.cfg, field)}")

    def tp_plan(self) -> dict[str, Any]:
        """Heads (``qkv`` column-wise, rows grouped by head) and MLP hidden units over the TP ranks."""
        return {"attn.qkv": ColwiseParallel(), "attn.proj": RowwiseParallel(),
                "mlp.fc": ColwiseParallel(), "mlp.proj": RowwiseParallel()}

    def flops_per_token(self, n_params: int) -> float:
        embedding = (self.cfg.vocab_size + self.cfg.seq_len) * self.cfg.dim
        return 6 * (n_params - embedding) + 12 * self.cfg.n_layers * self.cfg.dim * self.cfg.seq_len

    def card(self) -> dict[str, Any]:
        return {"kind": "gpt", "preset": self.preset, "config": dataclasses.asdict(self.cfg)}

    def tokens(self, corpus: torch.Tensor) -> torch.Tensor:
        return corpus

    def weights(self) -> None:
        return None


def model_spec(cfg: TrainConfig) -> ModelSpec:
    """The model ``cfg`` asks for."""
    if cfg.is_hf:
        return HFSpec(cfg.hf_config, cfg.hf_model, cfg.seq_len)
    gpt = cfg.model_config()
    vocab = prepared_vocab_size(cfg.data)  # a preset over a prepared --data takes its tokenizer's vocabulary
    return GPTSpec(gpt if vocab is None else dataclasses.replace(gpt, vocab_size=vocab), cfg.model)


def param_count(spec: ModelSpec) -> int:
    """Distinct parameter elements of the model, counted on the meta device (no memory)."""
    if isinstance(spec, GPTSpec):
        return count_params(spec.cfg)
    with torch.device("meta"):
        model = spec.build()
    return sum(p.numel() for p in model.parameters())
