"""Training parity, every step: shardwise against a plain replica and against torch's FSDP2.

Each case trains ``STEPS`` Adam steps on real gloo ranks, every rank on its own data
(seeded by rank). Three copies of one initialisation train side by side:

- ``ours``: ``shardwise.fully_shard``;
- ``ref``: a plain replica whose gradients are all-reduced and averaged;
- ``theirs``: ``torch.distributed.fsdp.fully_shard`` (where the case allows it).

After every optimizer step :func:`_models.compare_step` asserts the losses, every
parameter and every gradient agree to fp32 tolerance: against torch through
``to_local()`` and the placements (the same sharding layout), against the replica
through ``full_tensor()`` on the first and last steps and, in between, each rank's shard
against its chunk of the replica's tensor (the same check without a collective per
tensor, which would dominate the run time).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor, Shard

import shardwise
from _models import (
    MLP,
    Transformer,
    allreduce_mean_grads,
    apply_fully_shard,
    chunk_of,
    compare_step,
    lm_loss,
    mlp_batch,
    mlp_loss,
    rank_generator,
    token_batch,
)
from shardwise.testing import CommCounter, run_on_ranks

STEPS = 10
LR = 1e-2
TIMEOUT = 60

TRANSFORMER = dict(vocab_size=32, dim=16, n_layers=2, n_heads=2, max_seq_len=8, ffn_hidden=32)


# ---------------------------------------------------------------- helpers (run on the ranks)


def _build(kind: str, dims: dict) -> nn.Module:
    torch.manual_seed(0)  # the same initialisation on every rank and for every copy
    return Transformer(**dims) if kind == "transformer" else MLP(**dims)


def _shard(model: nn.Module, fully_shard_fn, layout: str, **kwargs) -> nn.Module:
    if layout == "per_block":
        return apply_fully_shard(model, fully_shard_fn, **kwargs)
    return fully_shard_fn(model, **kwargs)


def _batches(kind: str, dims: dict, gen: torch.Generator, n: int) -> list:
    if kind == "transformer":
        return [token_batch(gen, dims["vocab_size"], seq_len=dims["max_seq_len"]) for _ in range(n)]
    return [mlp_batch(gen, dims["in_dim"], dims["out_dim"]) for _ in range(n)]


def _forward_backward(kind: str, model: nn.Module, batches: list) -> torch.Tensor:
    """Every micro-batch's loss (backward on each: grads accumulate); returns them stacked."""
    loss_fn = lm_loss if kind == "transformer" else mlp_loss
    losses = []
    for batch in batches:
        loss = loss_fn(model, batch)
        loss.backward()
        losses.append(loss.detach())
    return torch.stack(losses)


def _largest_dim(param: nn.Parameter) -> Shard:
    return Shard(max(range(param.dim()), key=lambda d: param.size(d)))


def _train(ours, ref, theirs, kind, dims, *, set_to_none=True, accum=1, counter=None) -> list[float]:
    """STEPS Adam steps of the three copies, compared after every step; our losses per step."""
    models = [m for m in (ours, ref, theirs) if m is not None]
    opts = [torch.optim.Adam(m.parameters(), lr=LR, foreach=True) for m in models]
    compare_step(-1, ours, None, ref=ref, torch_model=theirs)  # the initialisation
    gen = rank_generator()
    history = []
    for step in range(STEPS):
        batches = _batches(kind, dims, gen, accum)
        for opt in opts:
            opt.zero_grad(set_to_none=set_to_none)
        if counter is not None:
            # The optimizer step stays outside: DTensor's fake-tensor sharding propagation
            # fails under the counter's dispatch mode (and the step is torch's, not ours).
            with counter:
                loss = _forward_backward(kind, ours, batches)
        else:
            loss = _forward_backward(kind, ours, batches)
        opts[0].step()
        ref_loss = _forward_backward(kind, ref, batches)
        allreduce_mean_grads(ref)
        opts[1].step()
        torch_loss = None
        if theirs is not None:
            torch_loss = _forward_backward(kind, theirs, batches)
            opts[2].step()
        full = step in (0, STEPS - 1)  # full_tensor() there, each rank's shard vs its chunk between
        compare_step(step, ours, loss, ref=ref, ref_loss=ref_loss, torch_model=theirs, torch_loss=torch_loss, full=full)
        history.append(loss.sum().item())
    return history


def _parity(kind, dims, layout, shard_kwargs, *, with_torch=True, set_to_none=True, accum=1):
    base = _build(kind, dims)
    ref = copy.deepcopy(base)
    theirs = _shard(copy.deepcopy(base), torch_fully_shard, layout, **shard_kwargs) if with_torch else None
    ours = _shard(base, shardwise.fully_shard, layout, **shard_kwargs)
    return _train(ours, ref, theirs, kind, dims, set_to_none=set_to_none, accum=accum)


def _parity_largest_dim(kind, dims, with_torch):
    base = _build(kind, dims)
    ref = copy.deepcopy(base)
    expected = {name: _largest_dim(p) for name, p in base.named_parameters()}
    layout = "per_block" if kind == "transformer" else "root"
    kwargs = dict(shard_placement_fn=_largest_dim)
    theirs = _shard(copy.deepcopy(base), torch_fully_shard, layout, **kwargs) if with_torch else None
    ours = _shard(base, shardwise.fully_shard, layout, **kwargs)
    for name, p in ours.named_parameters():
        assert isinstance(p, DTensor) and p.placements == (expected[name],), f"{name}: {p.placements}"
        want = chunk_of(ref.get_parameter(name).detach(), dist.get_rank(), dist.get_world_size(), expected[name].dim)
        torch.testing.assert_close(p.to_local(), want)
    return _train(ours, ref, theirs, kind, dims)


def _parity_world_size_one():
    dims = TRANSFORMER
    base = _build("transformer", dims)
    ref = copy.deepcopy(base)
    theirs = apply_fully_shard(copy.deepcopy(base), torch_fully_shard)
    counter = CommCounter()
    with counter:  # fully_shard itself must not communicate either
        ours = apply_fully_shard(base, shardwise.fully_shard)
    history = _train(ours, ref, theirs, "transformer", dims, counter=counter)
    return history, counter.counts


def _parity_meta_init(with_torch):
    dims = TRANSFORMER
    ref = _build("transformer", dims)
    rank, world = dist.get_rank(), dist.get_world_size()
    copies = []
    for fully_shard_fn in (shardwise.fully_shard, torch_fully_shard)[: 1 + with_torch]:
        with torch.device("meta"):
            model = Transformer(**dims)
        apply_fully_shard(model, fully_shard_fn)
        for name, p in model.named_parameters():
            assert isinstance(p, DTensor) and p.is_meta, f"{name} before to_empty: {type(p).__name__} {p.device}"
        model.to_empty(device="cpu")
        with torch.no_grad():  # each rank fills its own chunk of the replica's values
            for name, p in model.named_parameters():
                assert isinstance(p, DTensor) and p.device.type == "cpu", f"{name} after to_empty: {p.device}"
                p.to_local().copy_(chunk_of(ref.get_parameter(name), rank, world))
        copies.append(model)
    ours, theirs = copies[0], (copies[1] if with_torch else None)
    params_before = [id(p) for p in ours.parameters()]
    history = _train(ours, ref, theirs, "transformer", dims)
    assert [id(p) for p in ours.parameters()] == params_before, "parameter objects changed during training"
    return history


# ---------------------------------------------------------------- tests


def _check_trained(histories: list[list[float]]) -> None:
    """Every rank ran STEPS steps on its own data."""
    assert all(len(h) == STEPS for h in histories)
    assert len({tuple(h) for h in histories}) == len(histories), "ranks saw the same data"


@pytest.mark.parametrize("world_size", [4, 8])
@pytest.mark.parametrize("in_dim,hidden,out_dim", [(16, 15, 8), (7, 15, 3), (16, 17, 8)])
def test_one_group_mlp(world_size, in_dim, hidden, out_dim):
    dims = dict(in_dim=in_dim, hidden=hidden, out_dim=out_dim)
    _check_trained(run_on_ranks(_parity, world_size, "mlp", dims, "root", {}, timeout=TIMEOUT))


@pytest.mark.parametrize("reshard_after_forward", [True, False, None])
@pytest.mark.parametrize("world_size", [2, 4])
def test_group_per_block_transformer(world_size, reshard_after_forward):
    kwargs = dict(reshard_after_forward=reshard_after_forward)
    _check_trained(run_on_ranks(_parity, world_size, "transformer", TRANSFORMER, "per_block", kwargs, timeout=TIMEOUT))


@pytest.mark.parametrize(
    "set_to_none,accum",
    [(False, 1), (True, 2), (False, 2)],
    ids=["zero_grad_to_zeros", "accumulate_from_none", "accumulate_into_zeros"],
)
def test_zero_grad_and_accumulation(set_to_none, accum):
    kwargs = dict(set_to_none=set_to_none, accum=accum)
    _check_trained(run_on_ranks(_parity, 2, "transformer", TRANSFORMER, "per_block", {}, timeout=TIMEOUT, **kwargs))


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize(
    "kind,dims",
    [("mlp", dict(in_dim=32, hidden=64, out_dim=16)), ("transformer", TRANSFORMER)],
    ids=["mlp", "transformer"],
)
def test_shard_placement_fn_largest_dim(kind, dims, world_size):
    _check_trained(run_on_ranks(_parity_largest_dim, world_size, kind, dims, True, timeout=TIMEOUT))


def test_world_size_one_no_collectives():
    ((history, counts),) = run_on_ranks(_parity_world_size_one, 1, timeout=TIMEOUT)
    assert counts == {}, f"world size 1 issued collectives: {counts}"
    assert len(history) == STEPS


@pytest.mark.parametrize("world_size", [2, 4])
def test_meta_device_init(world_size):
    _check_trained(run_on_ranks(_parity_meta_init, world_size, True, timeout=TIMEOUT))
