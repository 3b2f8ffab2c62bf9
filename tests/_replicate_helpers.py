"""Per-rank helpers for tests/test_replicate.py: models, the two replicate libraries, the trainer.

Everything here runs inside the ranks of :func:`shardwise.testing.run_on_ranks`.

- :class:`Lib`: what differs between shardwise and torch's FSDP-based ``replicate``
  (the function, the policy classes, ``register_fsdp_forward_method``); :data:`OURS`, :data:`TORCH`.
- models beyond ``_models``: :class:`TwiceCalled` (one replicated block called twice per
  forward), :class:`CheckpointedBlock` (non-reentrant ``torch.utils.checkpoint`` inside the
  block's forward), :class:`StackWithPredict` (a second entry point besides ``forward``).
- :func:`apply_layout`: the groupings the tests use, applied the same way for both libraries.
- :func:`train`: ``STEPS`` Adam steps of (ours, torch's replicate, reference) with parity
  after every step and the per-step collective counts of ours and torch's.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed._composable.replicate_with_fsdp import replicate as torch_replicate
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.fsdp import CPUOffloadPolicy as TorchCPUOffloadPolicy
from torch.distributed.fsdp import FSDPModule as TorchFSDPModule
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMixedPrecisionPolicy
from torch.distributed.fsdp import register_fsdp_forward_method as torch_register_fsdp_forward_method
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint

import shardwise
from _models import (
    MLP,
    Block,
    MLPStack,
    Transformer,
    allreduce_mean_grads,
    compare_step,
    lm_loss,
    mlp_batch,
    mlp_loss,
    rank_generator,
    token_batch,
)
from shardwise.testing import CommCounter

STEPS = 10
LR = 1e-2
TRANSFORMER = dict(vocab_size=32, dim=16, n_layers=2, n_heads=2, max_seq_len=8, ffn_hidden=32)
STACK = dict(in_dim=7, dim=5, hidden=7, out_dim=3, n_layers=2)

# ---------------------------------------------------------------- the two libraries


@dataclasses.dataclass(frozen=True)
class Lib:
    """One implementation of ``replicate`` and the classes that go with it."""

    name: str
    replicate: Callable
    mp_policy: type
    cpu_offload_policy: type
    register_fsdp_forward_method: Callable
    module_cls: type  # FSDPModule


OURS = Lib(
    "shardwise",
    shardwise.replicate,
    shardwise.MixedPrecisionPolicy,
    shardwise.CPUOffloadPolicy,
    shardwise.register_fsdp_forward_method,
    shardwise.FSDPModule,
)
TORCH = Lib(
    "torch",
    torch_replicate,
    TorchMixedPrecisionPolicy,
    TorchCPUOffloadPolicy,
    torch_register_fsdp_forward_method,
    TorchFSDPModule,
)

# ---------------------------------------------------------------- models


class TwiceCalled(nn.Module):
    """``in_proj -> block -> block -> out_proj``: the replicated ``block`` runs twice per forward,
    the second call on the first call's output."""

    def __init__(self, in_dim: int = 7, dim: int = 5, hidden: int = 7, out_dim: int = 3):
        super().__init__()
        self.in_proj = nn.Linear(in_dim, dim)
        self.block = MLP(dim, hidden, dim)
        self.out_proj = nn.Linear(dim, out_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.in_proj(x)
        h = h + self.block(h)
        h = h + self.block(h)
        return self.out_proj(h)


class CheckpointedBlock(Block):
    """A transformer block whose forward body runs under non-reentrant activation checkpointing."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(super().forward, x, use_reentrant=False)


class StackWithPredict(MLPStack):
    """An MLPStack with a second entry point, ``predict``, that calls the submodules directly."""

    def predict(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.in_proj(x))
        for layer in self.layers:
            h = h + layer(h)
        return self.out_proj(h)


def build(kind: str, dims: dict | None = None) -> nn.Module:
    """One initialisation (seed 0, the same on every rank)."""
    torch.manual_seed(0)
    if kind == "mlp":
        return MLP(**dims)
    if kind == "stack":
        return MLPStack(**STACK)
    if kind == "predict":
        return StackWithPredict(**STACK)
    if kind == "twice":
        return TwiceCalled()
    model = Transformer(**TRANSFORMER)
    if kind == "tied":
        model.output.weight = model.tok_embeddings.weight  # (vocab, dim): one parameter, two sites
    elif kind == "checkpointed":
        for layer in model.layers:
            layer.__class__ = CheckpointedBlock
    elif kind != "transformer":
        raise ValueError(f"unknown model kind {kind!r}")
    return model


def batch(kind: str, gen: torch.Generator, dims: dict | None = None):
    if kind == "mlp":
        return mlp_batch(gen, dims["in_dim"], dims["out_dim"])
    if kind in ("stack", "predict", "twice"):
        return mlp_batch(gen, STACK["in_dim"], STACK["out_dim"])
    return token_batch(gen, TRANSFORMER["vocab_size"], seq_len=TRANSFORMER["max_seq_len"])


def loss_of(kind: str, model: nn.Module, data) -> torch.Tensor:
    if kind == "predict":
        x, y = data
        return F.mse_loss(model.predict(x), y)
    if kind in ("mlp", "stack", "twice"):
        return mlp_loss(model, data)
    return lm_loss(model, data)


# ---------------------------------------------------------------- groupings


def apply_layout(model: nn.Module, lib: Lib | None, layout: str, **kwargs) -> nn.Module:
    """Apply ``lib.replicate`` to ``model`` in one of the groupings the tests use; ``lib=None``
    only makes the same structural changes (checkpoint wrappers), for the reference."""
    rep = lib.replicate if lib is not None else (lambda module, **_: module)
    if layout == "root":
        rep(model, **kwargs)
    elif layout == "per_block":
        for layer in model.layers:
            rep(layer, **kwargs)
        rep(model, **kwargs)
    elif layout == "embedding_group":  # the token embedding in a group of its own
        rep(model.tok_embeddings, **kwargs)
        apply_layout(model, lib, "per_block", **kwargs)
    elif layout == "grouped_layers":  # both blocks in one group
        rep(list(model.layers), **kwargs)
        rep(model, **kwargs)
    elif layout == "grouped_projections":  # the first and last modules of forward in one group
        rep([model.in_proj, model.out_proj], **kwargs)
        apply_layout(model, lib, "per_block", **kwargs)
    elif layout == "twice":
        rep(model.block, **kwargs)
        rep(model, **kwargs)
    elif layout == "wrapper_outside":  # replicate(checkpoint_wrapper(block))
        for i, layer in enumerate(model.layers):
            model.layers[i] = checkpoint_wrapper(layer)
            rep(model.layers[i], **kwargs)
        rep(model, **kwargs)
    elif layout == "wrapper_inside":  # checkpoint_wrapper(replicate(block)): recompute runs its hooks
        for i, layer in enumerate(model.layers):
            rep(layer, **kwargs)
            model.layers[i] = checkpoint_wrapper(layer)
        rep(model, **kwargs)
    else:
        raise ValueError(f"unknown layout {layout!r}")
    return model


def policies(lib: Lib, policy: str | None) -> dict:
    if policy is None:
        return {}
    if policy == "cpu_offload":
        # torch cannot pin host memory without an accelerator; shardwise accepts the default
        # pin_memory=True on CPU and ignores it.
        policy = lib.cpu_offload_policy(pin_memory=False) if lib is TORCH else lib.cpu_offload_policy()
        return dict(offload_policy=policy)
    if policy == "bf16":
        return dict(mp_policy=lib.mp_policy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    raise ValueError(f"unknown policy {policy!r}")


def kinds(model: nn.Module) -> dict[str, str]:
    """Parameter name -> "DTensor" (the replicated parameter) or "Tensor" (the plain unsharded one)."""
    return {name: "DTensor" if isinstance(p, DTensor) else "Tensor" for name, p in model.named_parameters()}


def replicate_modules(model: nn.Module, lib: Lib) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, lib.module_cls)]


# ---------------------------------------------------------------- training


@dataclasses.dataclass
class Copies:
    """The same initialisation three times: ours, torch's replicate, and the reference."""

    ours: nn.Module
    theirs: nn.Module
    ref: nn.Module | None  # DDP, a plain replica (grads all-reduced by hand), or None

    @property
    def ref_module(self) -> nn.Module | None:
        return self.ref.module if isinstance(self.ref, DDP) else self.ref


def make_copies(kind: str, layout: str, *, dims=None, policy=None, reference="ddp", prepare=None) -> Copies:
    """``prepare(model, lib)`` runs on ours and torch's after replicate (``lib=None``: the reference)."""
    base = build(kind, dims)
    theirs = apply_layout(copy.deepcopy(base), TORCH, layout, **policies(TORCH, policy))
    ref = None if reference == "none" else apply_layout(copy.deepcopy(base), None, layout)
    ours = apply_layout(base, OURS, layout, **policies(OURS, policy))
    if prepare is not None:
        for model, lib in ((ours, OURS), (theirs, TORCH), (ref, None)):
            if model is not None:
                prepare(model, lib)
    if reference == "ddp":
        ref = DDP(ref)
    return Copies(ours, theirs, ref)


def default_step(kind: str, model: nn.Module, data) -> torch.Tensor:
    loss = loss_of(kind, model, data)
    loss.backward()
    return loss.detach()


def train(copies: Copies, kind: str, groups: int, *, dims=None, step_fn=default_step, after_step=None) -> list[float]:
    """``STEPS`` Adam steps of the three copies, each rank on its own data; after every step
    losses, params and grads agree, and ours issued exactly ``groups`` all-reduces and no other
    collective, as torch's replicate did. Returns our loss per step."""
    ours, theirs, ref = copies.ours, copies.theirs, copies.ref
    models = [m for m in (ours, theirs, ref) if m is not None]
    opts = [torch.optim.Adam(m.parameters(), lr=LR, foreach=True) for m in models]
    compare_step(-1, ours, None, ref=copies.ref_module, torch_model=theirs, full=False)
    gen = rank_generator()
    history = []
    for step in range(STEPS):
        data = batch(kind, gen, dims)
        for opt in opts:
            opt.zero_grad()
        with CommCounter() as ours_comm:
            loss = step_fn(kind, ours, data)
        with CommCounter() as torch_comm:
            torch_loss = step_fn(kind, theirs, data)
        ref_loss = None
        if ref is not None:
            ref_loss = step_fn(kind, ref, data)
            if not isinstance(ref, DDP):
                allreduce_mean_grads(ref)
        for opt in opts:
            opt.step()
        compare_step(
            step,
            ours,
            loss,
            ref=copies.ref_module,
            ref_loss=ref_loss,
            torch_model=theirs,
            torch_loss=torch_loss,
            full=False,  # Replicate(): to_local() is the whole tensor, no collective needed
        )
        check_counts(f"step {step}", ours_comm.counts, torch_comm.counts, {"all_reduce": groups})
        if after_step is not None:
            after_step(step, copies)
        history.append(loss.sum().item())
    return history


def compare(step: int, copies: Copies, losses: list[torch.Tensor]) -> None:
    """Parity of one step; ``losses`` are (ours, torch's, the reference's)."""
    compare_step(
        step,
        copies.ours,
        losses[0],
        ref=copies.ref_module,
        ref_loss=losses[2],
        torch_model=copies.theirs,
        torch_loss=losses[1],
        full=False,
    )


def check_counts(where: str, ours: dict, theirs: dict, expected: dict) -> None:
    rank = dist.get_rank()
    assert ours == expected, f"{where}, rank {rank}: shardwise issued {ours}, expected {expected} (torch: {theirs})"
    assert theirs == expected, f"{where}, rank {rank}: torch's replicate issued {theirs}, expected {expected}"
