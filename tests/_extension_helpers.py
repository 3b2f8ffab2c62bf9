"""Shared by the tensor-extension tests: train shardwise and torch's FSDP2 side by side.

:func:`side_by_side` builds one model twice from the same seed, shards one with each
``fully_shard``, trains both on the same batches and compares every step bit for bit:
losses, every sharded parameter (type and values) and every gradient. It counts, per
step, the ``fsdp_pre_all_gather`` calls (through a counter the caller's subclass bumps,
or the float8 weight's, patched) and the bytes each rank all-gathers by dtype (torch's
through ``dist.all_gather_single``, which its FSDP2 calls at call time; shardwise's from
``shardwise.comm_stats``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections import Counter
from typing import Callable
from unittest import mock

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import CPUOffloadPolicy as TorchCPUOffloadPolicy
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard

import shardwise
from shardwise import comm_stats


@dataclasses.dataclass
class Case:
    build: Callable[[], nn.Module]  # the model, from the current seed
    shard_units: Callable[[nn.Module], list[nn.Module]]  # modules to fully_shard before the root
    batch: Callable[[torch.Generator], torch.Tensor]
    loss: Callable[[torch.Tensor], torch.Tensor] = lambda out: out.float().pow(2).mean()
    steps: int = 3
    lr: float = 0.05
    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    reshard_after_forward: bool | int | None = None
    after_step: Callable[[nn.Module], None] | None = None  # e.g. precompute_float8_dynamic_scale_for_fsdp
    configure: Callable[[nn.Module], None] | None = None  # after sharding, on both (set_* knobs)
    micro_batches: int = 1  # >1: gradients accumulate without sync until the last micro-batch
    offload: bool = False  # CPUOffloadPolicy(pin_memory=False)
    shard_kwargs: dict = dataclasses.field(default_factory=dict)  # the same for both (mesh=...)


@dataclasses.dataclass
class Tally:
    pre_all_gather_calls: int = 0
    gathered: Counter = dataclasses.field(default_factory=Counter)  # dtype -> all-gather output bytes


def _shard(case: Case, model: nn.Module, fully_shard, policies) -> nn.Module:
    mp_cls, offload_cls = policies
    kwargs = dict(case.shard_kwargs, mp_policy=mp_cls(param_dtype=case.param_dtype, reduce_dtype=case.reduce_dtype))
    if case.offload:
        kwargs["offload_policy"] = offload_cls(pin_memory=False)
    if case.reshard_after_forward is not None:
        kwargs["reshard_after_forward"] = case.reshard_after_forward
    for unit in case.shard_units(model):
        fully_shard(unit, **kwargs)
    model = fully_shard(model, **kwargs)
    if case.configure is not None:
        case.configure(model)
    return model


@contextlib.contextmanager
def _count_torch_gathers(tally: Tally):
    real = dist.all_gather_single

    def counting(output, input, *args, **kwargs):
        tally.gathered[output.dtype] += output.numel() * output.element_size()
        return real(output, input, *args, **kwargs)

    with mock.patch.object(dist, "all_gather_single", counting):
        yield


def side_by_side(case: Case, counter: Callable[[], int]) -> tuple[nn.Module, nn.Module, list[tuple[Tally, Tally]]]:
    """Train ``case`` with shardwise and torch; return both models and per-step tallies
    (ours, torch's). ``counter()`` reads the running count of ``fsdp_pre_all_gather`` calls."""
    torch.manual_seed(0)
    ours = _shard(case, case.build(), shardwise.fully_shard, (shardwise.MixedPrecisionPolicy, shardwise.CPUOffloadPolicy))
    torch.manual_seed(0)
    theirs = _shard(case, case.build(), torch_fully_shard, (TorchMixedPrecisionPolicy, TorchCPUOffloadPolicy))
    assert_same_params(ours, theirs, "after fully_shard")
    opts = [torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=case.lr) for m in (ours, theirs)]
    gen = torch.Generator().manual_seed(dist.get_rank())
    tallies = []
    for step in range(case.steps):
        x = case.batch(gen)
        losses, step_tallies = [], []
        for model, opt, ctx in ((ours, opts[0], contextlib.nullcontext), (theirs, opts[1], None)):
            tally = Tally()
            before, comm_stats_before = counter(), comm_stats.snapshot()
            with ctx() if ctx else _count_torch_gathers(tally):
                opt.zero_grad()
                for micro in range(case.micro_batches):
                    model.set_requires_gradient_sync(micro == case.micro_batches - 1)
                    loss = case.loss(model(x + micro))
                    loss.backward()
                torch.manual_seed(step)  # the same draws for a stochastically rounding update (int8 training)
                opt.step()
                if case.after_step is not None:
                    case.after_step(model)
            tally.pre_all_gather_calls = counter() - before
            if ctx:  # ours: from comm_stats
                now = comm_stats.snapshot().bytes_by_dtype("all_gather")
                old = comm_stats_before.bytes_by_dtype("all_gather")
                tally.gathered = Counter({d: n - old.get(d, 0) for d, n in now.items() if n - old.get(d, 0)})
            losses.append(loss.detach())
            step_tallies.append(tally)
        where = f"step {step}, rank {dist.get_rank()}"
        assert torch.equal(*losses), f"{where}: losses {losses}"
        assert_same_params(ours, theirs, where, grads=True)
        assert step_tallies[0] == step_tallies[1], f"{where}: ours {step_tallies[0]} vs torch {step_tallies[1]}"
        tallies.append(tuple(step_tallies))
    return ours, theirs, tallies


def side_by_side_counting(case: Case, cls: type) -> tuple[nn.Module, list[tuple[int, dict]]]:
    """:func:`side_by_side`, counting ``cls.fsdp_pre_all_gather`` calls (patched for the run;
    the signature torch and shardwise inspect stays the original's). Returns our model and
    our per-step ``(pre-all-gather calls, all-gather bytes by dtype)``, equal to torch's."""
    calls = [0]
    real = cls.fsdp_pre_all_gather

    @functools.wraps(real)
    def counting(tensor, *args):
        calls[0] += 1
        return real(tensor, *args)

    with mock.patch.object(cls, "fsdp_pre_all_gather", counting):
        ours, _, tallies = side_by_side(case, lambda: calls[0])
    return ours, [(t.pre_all_gather_calls, dict(t.gathered)) for t, _ in tallies]


def assert_same_params(ours: nn.Module, theirs: nn.Module, where: str, grads: bool = False) -> None:
    for (name, p), (_, q) in zip(ours.named_parameters(), theirs.named_parameters()):
        assert type(p.to_local()) is type(q.to_local()), f"{where}: {name} local {type(p.to_local())}"
        assert p.placements == q.placements and p.dtype == q.dtype, f"{where}: {name} {p.placements} {p.dtype}"
        assert same_values(p.to_local(), q.to_local()), f"{where}: {name}"
        if grads and q.grad is not None:
            assert p.grad is not None, f"{where}: {name} has no grad"
            assert torch.equal(p.grad.to_local(), q.grad.to_local()), f"{where}: {name}.grad"
        elif grads:
            assert p.grad is None, f"{where}: {name} has a grad torch has not"


def same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-equal values: plain tensors by ``torch.equal``; a subclass by each of its inner
    tensors (``__tensor_flatten__``: float8's fp32 data, NF4's quantized data and scalers,
    int8's data and scale), as the subclass's own ``equal`` may not exist."""
    if type(a) is not type(b):
        return False
    if type(a) is torch.Tensor or not hasattr(a, "__tensor_flatten__"):
        return torch.equal(a, b)
    names, meta = a.__tensor_flatten__()
    return names == b.__tensor_flatten__()[0] and all(same_values(getattr(a, n), getattr(b, n)) for n in names)
