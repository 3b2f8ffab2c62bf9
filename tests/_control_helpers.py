"""Helpers for the FSDPModule control-surface tests (reshard policies, prefetch, grad
accumulation, multi-use, entry points). Everything here runs inside the ranks of
:func:`shardwise.testing.run_on_ranks`.

- :class:`Stack`: a root with parameters of its own (``inp``, ``out``) around
  ``layers.0..n-1`` residual blocks; optionally an ``emb`` embedding in front.
- :func:`shard_stack`: one ``fully_shard`` group per block (and per ``emb``), then the root.
- :func:`make_trio`: the same initialisation three times: shardwise, torch's FSDP2, and a
  plain replica (the all-reduced reference).
- :class:`Trio`: runs one step function on all three copies, counting each sharded copy's
  collectives per named phase with :class:`~shardwise.testing.CommCounter`, reduces the
  replica's gradients, and checks parity with :func:`_models.compare_step`.
"""

from __future__ import annotations

import copy
import dataclasses
import warnings
from collections import Counter
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor

import shardwise
from _models import compare_step
from shardwise.testing import CommCounter

IN_DIM, DIM, OUT_DIM, VOCAB = 8, 16, 4, 16
LR = 0.05

# ---------------------------------------------------------------- models


class Block(nn.Module):
    """``x + relu(lin(x))``."""

    def __init__(self, dim: int = DIM):
        super().__init__()
        self.lin = nn.Linear(dim, dim)
        self.fail = False  # raise inside forward (after the pre-forward hook gathered the params)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fail:
            raise RuntimeError("injected failure inside Block.forward")
        return x + F.relu(self.lin(x))


class Stack(nn.Module):
    """``[emb | inp] -> layers.0..n-1 -> out``; the root owns ``inp``/``out`` itself.

    With ``embedding=True`` the input is token ids and ``emb`` (an ``nn.Embedding``, whose
    weight backward never needs) replaces ``inp``. ``extra`` adds a block ``extra`` that is
    ``"unused"`` (never called) or a ``"dead_end"`` (called, its output dropped).
    """

    def __init__(self, n_layers: int = 3, embedding: bool = False, repeat: tuple[int, ...] = (), extra: str = ""):
        super().__init__()
        if embedding:
            self.emb = nn.Embedding(VOCAB, DIM)
        else:
            self.inp = nn.Linear(IN_DIM, DIM)
        self.layers = nn.ModuleList(Block() for _ in range(n_layers))
        self.out = nn.Linear(DIM, OUT_DIM)
        self.repeat = repeat  # indices of layers that run twice
        self.skip: set[int] = set()  # indices of layers this forward leaves out (a dynamic order)
        self.extra_kind = extra
        if extra:
            self.extra = Block()

    def features(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x) if hasattr(self, "emb") else self.inp(x)
        for i, layer in enumerate(self.layers):
            if i in self.skip:
                continue
            h = layer(h)
            if i in self.repeat:
                h = layer(h)
            if i == 0 and self.extra_kind == "dead_end":
                self.extra(h)  # runs, but nothing downstream uses it
        return h

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.features(x))

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """A method other than forward that uses the root's and the blocks' params."""
        return self.out(self.features(x)).tanh()


def shard_stack(model: Stack, fully_shard_fn: Callable, root_kwargs: dict | None = None, **layer_kwargs) -> Stack:
    """``fully_shard_fn`` on ``emb`` (if any) and each block with ``layer_kwargs``, then the root."""
    if hasattr(model, "emb"):
        fully_shard_fn(model.emb, **layer_kwargs)
    if hasattr(model, "extra"):
        fully_shard_fn(model.extra, **layer_kwargs)
    for layer in model.layers:
        fully_shard_fn(layer, **layer_kwargs)
    fully_shard_fn(model, **(root_kwargs or {}))
    return model


class ChunkedHead(nn.Module):
    """``inp -> layers -> norm``; the ``output`` projection is applied outside forward, per chunk
    (chunked loss), so a ``fully_shard([norm, output])`` group runs ``output`` standalone."""

    def __init__(self, n_layers: int = 2):
        super().__init__()
        self.inp = nn.Linear(IN_DIM, DIM)
        self.layers = nn.ModuleList(Block() for _ in range(n_layers))
        self.norm = nn.LayerNorm(DIM)
        self.output = nn.Linear(DIM, OUT_DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for layer in self.layers:
            h = layer(h)
        return self.norm(h)


def shard_chunked_head(model: ChunkedHead, fully_shard_fn: Callable) -> ChunkedHead:
    for layer in model.layers:
        fully_shard_fn(layer)
    fully_shard_fn([model.norm, model.output])
    fully_shard_fn(model)
    return model


class TiedStack(nn.Module):
    """``emb -> layers -> out`` with ``out.weight`` tied to ``emb.weight`` (both in the root's group)."""

    def __init__(self, n_layers: int = 2):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block() for _ in range(n_layers))
        self.out = nn.Linear(DIM, VOCAB, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.emb(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.out(h)


def make_trio(build: Callable[[], nn.Module], shard: Callable[[nn.Module, Callable], nn.Module], with_torch: bool = True):
    """(ours, torch's, replica) from one initialisation (seed 0 on every rank)."""
    torch.manual_seed(0)
    base = build()
    ref = copy.deepcopy(base)
    theirs = shard(copy.deepcopy(base), torch_fully_shard) if with_torch else None
    ours = shard(base, shardwise.fully_shard)
    return ours, theirs, ref


def fsdp_modules(model: nn.Module) -> list[nn.Module]:
    """Every module ``fully_shard`` was applied to (shardwise or torch), in pre-order."""
    kinds = (shardwise.FSDPModule, torch.distributed.fsdp.FSDPModule)
    return [m for m in model.modules() if isinstance(m, kinds)]


# ---------------------------------------------------------------- data


def rank_gen(seed: int = 0) -> torch.Generator:
    """Different data on every rank, the same on every run."""
    return torch.Generator().manual_seed(7919 * (seed + 1) + dist.get_rank())


def batch(gen: torch.Generator, n: int = 4, tokens: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randint(0, VOCAB, (n,), generator=gen) if tokens else torch.randn(n, IN_DIM, generator=gen)
    return x, torch.randn(n, OUT_DIM, generator=gen)


def mse(model: nn.Module, xy: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = xy
    return F.mse_loss(model(x), y)


# ---------------------------------------------------------------- counting


def _kind(event) -> str:
    """The logical collective: with ``SHARDWISE_GLOO_REDUCE_SCATTER=all_to_all`` shardwise
    reduce-scatters on gloo as an all-to-all plus a local sum; neither FSDP issues
    all-to-alls otherwise, so an all-to-all counts as the reduce-scatter it stands for."""
    return "reduce_scatter" if event.kind == "all_to_all" else event.kind


class Recorder:
    """Collectives of one model's step, split into named phases by :meth:`mark`.

    Inactive recorders (the replica's) accept marks and record nothing. Kinds are logical (see :func:`_kind`).
    """

    def __init__(self, name: str, active: bool):
        self.name = name  # "ours", "torch" or "ref": which copy this step runs on
        self.sharded = name != "ref"
        self.counter = CommCounter() if active else None
        self._marks: list[tuple[str, int]] = []

    def __enter__(self) -> "Recorder":
        if self.counter is not None:
            self.counter.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.counter is not None:
            self.counter.__exit__(*exc)

    def mark(self, phase: str) -> None:
        """Everything since the previous mark belongs to ``phase``."""
        if self.counter is not None:
            self._marks.append((phase, len(self.counter.events)))

    @property
    def events(self):
        return [] if self.counter is None else list(self.counter.events)

    def phases(self) -> dict[str, dict[str, int]]:
        """phase -> {kind: count}; a phase with no collectives maps to {}."""
        out: dict[str, Counter] = {}
        start = 0
        for phase, end in self._marks:
            counts = out.setdefault(phase, Counter())
            counts.update(_kind(e) for e in self.counter.events[start:end])
            start = end
        return {k: dict(v) for k, v in out.items()}

    def phase_events(self, phase: str) -> list:
        """(kind, payload bytes, group size) of the collectives in ``phase``."""
        start, out = 0, []
        for name, end in self._marks:
            if name == phase:
                out += [(_kind(e), e.payload_bytes, e.group_size) for e in self.counter.events[start:end]]
            start = end
        return out

    def total(self, kind: str | None = None) -> int:
        return sum(1 for e in self.events if kind is None or _kind(e) == kind)


# ---------------------------------------------------------------- training side by side


def allreduce_grads(model: nn.Module, divide: float) -> None:
    """Sum the replica's grads over all ranks (None counts as zeros) and divide."""
    params = [p for p in model.parameters() if p.requires_grad]
    has = torch.tensor([float(p.grad is not None) for p in params])
    dist.all_reduce(has)
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    flat.div_(divide)
    for p, g, reduced, any_rank in zip(params, grads, flat.split([g.numel() for g in grads]), has):
        p.grad = reduced.view_as(g).clone() if any_rank else None


@dataclasses.dataclass
class StepResult:
    ours: Recorder
    torch: Recorder | None  # None when the trio has no torch copy
    losses: dict[str, torch.Tensor]


class Trio:
    """Trains shardwise, torch's FSDP2 and a replica side by side (SGD), checking parity."""

    def __init__(self, ours: nn.Module, theirs: nn.Module | None, ref: nn.Module | None):
        self.models = {"ours": ours, "torch": theirs, "ref": ref}
        self.models = {k: m for k, m in self.models.items() if m is not None}
        self.opts = {k: torch.optim.SGD(m.parameters(), lr=LR) for k, m in self.models.items()}
        self.steps = 0
        compare_step(-1, ours, None, ref=ref, torch_model=theirs)

    @property
    def ours(self) -> nn.Module:
        return self.models["ours"]

    @property
    def theirs(self) -> nn.Module | None:
        return self.models.get("torch")

    @property
    def ref(self) -> nn.Module | None:
        return self.models.get("ref")

    def run(
        self,
        fn: Callable[[nn.Module, Recorder], torch.Tensor],
        *,
        ref_divide: float | None = None,
        check: bool = True,
        sharded: bool = True,
        optimize: bool = True,
        zero_grad: bool = True,
    ) -> StepResult:
        """One step: ``fn(model, recorder) -> loss`` (forward and backward) on each copy.

        Then the replica's grads are summed over ranks and divided by ``ref_divide``
        (default: world size), the three are compared (losses, params, grads), and each
        optimizer steps (outside the counters).
        """
        recorders, losses = {}, {}
        for name, model in self.models.items():
            if zero_grad:
                self.opts[name].zero_grad(set_to_none=True)
            with Recorder(name, active=name != "ref") as rec:
                losses[name] = fn(model, rec)
                rec.mark("end")
            recorders[name] = rec
        if self.ref is not None:
            allreduce_grads(self.ref, dist.get_world_size() if ref_divide is None else ref_divide)
        if check:
            self.check(losses, sharded=sharded)
        if optimize:
            for opt in self.opts.values():
                opt.step()
        self.steps += 1
        return StepResult(recorders["ours"], recorders.get("torch"), losses)

    def check(self, losses: dict[str, torch.Tensor] | None = None, *, sharded: bool = True) -> None:
        losses = losses or {}
        compare_step(
            self.steps,
            self.ours,
            losses.get("ours"),
            ref=self.ref,
            ref_loss=losses.get("ref"),
            torch_model=self.theirs,
            torch_loss=losses.get("torch"),
            sharded=sharded,
        )


def same_phases(result: StepResult, where: str) -> dict[str, dict[str, int]]:
    """Assert our per-phase collective counts equal torch's (when torch was counted)."""
    ours = result.ours.phases()
    if result.torch is not None:
        theirs = result.torch.phases()
        assert ours == theirs, f"{where}: collectives per phase: shardwise {ours}, torch {theirs}"
    return ours


def catch_warnings(fn: Callable[[], Any]) -> tuple[Any, list[warnings.WarningMessage]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        value = fn()
    return value, list(caught)


def is_sharded(module: nn.Module) -> bool:
    """Every parameter registered directly on ``module``'s subtree is a DTensor."""
    return all(isinstance(p, DTensor) for p in module.parameters())
