"""Dtype and device changes after ``fully_shard``: ``module.to(torch.float64)`` and
``to_empty`` after meta-device init, then re-initialisation; per block, and with
torchtitan's grouped units (``fully_shard([norm, output])``, and
``[tok_embeddings, norm, output]`` with tied weights), whose members the root's
``_apply`` converts one at a time.

The invariant (ARCHITECTURE.md): between iterations every managed parameter is the same
sharded ``nn.Parameter`` object the optimizer holds; casting changes its data in place,
never its identity. So the optimizer is built *before* the change and must keep training
the model afterwards. Each case then trains a few SGD steps side by side with

- a plain replica in the same dtype (gradients all-reduced and averaged): float64 values
  agree to float64 rounding (rtol 1e-10), compared through ``full_tensor()``;
- torch's ``fully_shard`` given the same treatment: bit-equal (``torch.equal``).

and checks after every step that the parameters, their ``to_local()`` shards, their DTensor
metadata and their gradients all carry the new dtype.
"""

from __future__ import annotations


import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor

import shardwise
from _models import Transformer, allreduce_mean_grads, apply_fully_shard, chunk_of, lm_loss, rank_generator, token_batch
from _mp_helpers import Agreement, compare_with_torch
from shardwise.testing import run_on_ranks

TIMEOUT = 90
STEPS = 4
LR = 0.1
F64 = torch.float64
DIMS = dict(vocab_size=32, dim=16, n_layers=2, n_heads=2, max_seq_len=8, ffn_hidden=32)


# ---------------------------------------------------------------- helpers (run on the ranks)


def _check_dtype(where: str, model: nn.Module, dtype: torch.dtype, device: str = "cpu") -> None:
    for name, p in model.named_parameters():
        assert isinstance(p, DTensor), f"{where}: {name} is a {type(p).__name__}"
        local = p.to_local()
        got = (p.dtype, local.dtype, p._spec.tensor_meta.dtype, p.device.type, local.device.type)
        assert got == (dtype, dtype, dtype, device, device), f"{where}: {name} (dtype, local, spec, devices) = {got}"
        if p.grad is not None:
            g = p.grad
            assert isinstance(g, DTensor), f"{where}: {name}.grad is a {type(g).__name__}"
            got = (g.dtype, g.to_local().dtype, g._spec.tensor_meta.dtype)
            assert got == (dtype, dtype, dtype), f"{where}: {name}.grad (dtype, local, spec) = {got}"
            assert g.placements == p.placements and g.shape == p.shape, f"{where}: {name}.grad layout"


def _init_weights(model: nn.Module, seed: int) -> None:
    """A torchtitan-style ``init_weights`` through DTensor ops on the sharded params."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif "norm" in name:
                nn.init.ones_(p)
            else:
                nn.init.normal_(p, std=0.3)


def _build(layout: str) -> Transformer:
    model = Transformer(**DIMS)
    if layout == "tied":
        model.output.weight = model.tok_embeddings.weight
    return model


def _shard(model: Transformer, fully_shard_fn, layout: str) -> Transformer:
    """One group per block, then the root; torchtitan's layouts group the root's leaves:
    ``[norm, output]``, or ``[tok_embeddings, norm, output]`` when the weights are tied."""
    if layout == "per_block":
        return apply_fully_shard(model, fully_shard_fn)
    for layer in model.layers:
        fully_shard_fn(layer)
    head = [model.norm, model.output]
    fully_shard_fn(head if layout == "grouped" else [model.tok_embeddings, *head])
    return fully_shard_fn(model)


def _prepare(scenario: str, fully_shard_fn, layout: str = "per_block"):
    """The sharded model after the scenario's change, and the optimizer built before it.

    ``nn.Module._apply`` on the root visits a group's members one at a time: a grouped
    layout has members converted while the others are still on meta / in the old dtype."""
    torch.manual_seed(0)
    if scenario == "cast":
        model = _shard(_build(layout), fully_shard_fn, layout)
    else:
        with torch.device("meta"):
            model = _shard(_build(layout), fully_shard_fn, layout)
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=LR, foreach=True)
    if scenario != "cast":
        model.to_empty(device="cpu")
        _init_weights(model, seed=1)
    if scenario != "meta_to_empty":
        model.to(F64)
    assert [id(p) for p in model.parameters()] == [id(p) for p in params], f"{scenario}: parameter objects replaced"
    assert opt.param_groups[0]["params"] == params
    return model, opt


def _compare_with_replica(where: str, ours: nn.Module, ref: nn.Module, loss, ref_loss) -> None:
    torch.testing.assert_close(
        loss.detach(), ref_loss.detach(), rtol=1e-10, atol=1e-12, msg=lambda m: f"{where}: loss: {m}"
    )
    for name, p in ours.named_parameters():
        r = ref.get_parameter(name)
        pairs = [("param", p.detach(), r.detach()), ("grad", p.grad, r.grad)]
        for what, a, b in pairs:
            full = a.full_tensor()
            assert full.dtype == b.dtype, f"{where}: {what} {name}: {full.dtype} vs replica {b.dtype}"
            torch.testing.assert_close(full, b, rtol=1e-10, atol=1e-12, msg=lambda m: f"{where}: {what} {name}: {m}")


def _dtype_change(scenario: str, layout: str) -> dict:
    dtype = torch.float32 if scenario == "meta_to_empty" else F64
    ours, opt = _prepare(scenario, shardwise.fully_shard, layout)
    theirs, torch_opt = _prepare(scenario, torch_fully_shard, layout)
    _check_dtype("after the change", ours, dtype)
    # The replica: the values each rank's shards hold now (full tensors), in the same dtype.
    ref = _build(layout).to(dtype)
    ref.load_state_dict({name: p.full_tensor() for name, p in ours.named_parameters()}, strict=layout != "tied")
    if layout == "tied":
        assert ours.output.weight is ours.tok_embeddings.weight, "tied weights untied"
    ref_opt = torch.optim.SGD(ref.parameters(), lr=LR, foreach=True)
    rank, world = dist.get_rank(), dist.get_world_size()
    for name, p in ours.named_parameters():  # each rank holds its torch.chunk of the values
        assert torch.equal(p.to_local(), chunk_of(ref.get_parameter(name).detach(), rank, world)), name
    gen = rank_generator()
    agreement = Agreement()
    for step in range(STEPS):
        tokens = token_batch(gen, DIMS["vocab_size"], seq_len=DIMS["max_seq_len"])
        losses = []
        for model, optimizer in ((ours, opt), (theirs, torch_opt), (ref, ref_opt)):
            optimizer.zero_grad()
            loss = lm_loss(model, tokens)
            loss.backward()
            if model is ref:
                allreduce_mean_grads(ref)
            optimizer.step()
            losses.append(loss.detach())
        where = f"{scenario} ({layout}), step {step}, rank {rank}"
        assert losses[0].dtype == dtype, f"{where}: loss in {losses[0].dtype}"
        _check_dtype(where, ours, dtype)
        compare_with_torch(where, ours, theirs, losses[0], losses[1], agreement, exact=True, rtol=0, atol=0)
        _compare_with_replica(where, ours, ref, losses[0], losses[2])
    return agreement.as_dict()


def _cast_keeps_unsharded_param_dtype_in_forward() -> list:
    """What a module sees in forward after ``.to(float64)``: float64 unsharded params."""
    torch.manual_seed(0)
    model = apply_fully_shard(Transformer(**DIMS), shardwise.fully_shard)
    model.to(F64)
    seen = []
    for layer in model.layers:
        layer.register_forward_pre_hook(lambda m, args: seen.append((args[0].dtype, m.attention.qkv.weight.dtype)))
    tokens = token_batch(rank_generator(), DIMS["vocab_size"], seq_len=DIMS["max_seq_len"])
    lm_loss(model, tokens).backward()
    return seen


# ---------------------------------------------------------------- tests


@pytest.mark.parametrize(
    "scenario, layout",
    [
        ("cast", "per_block"),
        ("meta_to_empty", "per_block"),
        ("meta_to_empty_then_cast", "per_block"),
        ("meta_to_empty", "grouped"),
        ("cast", "grouped"),
        ("meta_to_empty_then_cast", "tied"),
    ],
)
def test_dtype_change_after_fully_shard_keeps_identity_and_parity(scenario, layout):
    agreements = run_on_ranks(_dtype_change, 2, scenario, layout, timeout=TIMEOUT)
    assert all(all(v for k, v in a.items() if not k.startswith("max")) for a in agreements), agreements


def test_unsharded_params_in_forward_follow_the_cast():
    for seen in run_on_ranks(_cast_keeps_unsharded_param_dtype_in_forward, 2, timeout=TIMEOUT):
        assert seen and set(seen) == {(F64, F64)}, seen
