"""CPU offload: parity with torch's FSDP2 under ``CPUOffloadPolicy``, every step.

Torch's upstream multi-group offload test (``test_train_parity_multi_group_cpu_offload_eager``)
runs on CUDA with optional delays before/after each collective and the optimizer; on CPU
there are no streams to race, so every delay-free variant runs here: ``pin_memory`` True and
False, ``reshard_after_forward`` True / False / None, ``unshard_async_op`` False / True,
plus gradient accumulation (accumulating into existing sharded grads, and with gradient
sync off) and offload combined with bf16 mixed precision. Each case trains shardwise and
torch side by side (a group per layer and per projection, then the root) and compares the
loss, every sharded parameter and every sharded gradient bit for bit after every step; after
every step the parameters and gradients must be DTensors on the host.

On a CPU-only machine ``pin_memory=True`` has nothing to pin: shardwise must accept it and
behave like ``pin_memory=False``. (torch's own ``CPUOffloadPolicy(pin_memory=True)`` is run
too where it works on this machine, see ``_torch_offload``.)

torch rejects CPU offload when a sharded parameter is not on the CPU at lazy init ("FSDP
parameters should be materialized on CPU when enabling CPU offloading"), e.g. after
``to_empty(device="cuda")``. With a CPU mesh the only device a parameter can be on besides
the CPU is ``meta``, so that case is tested as: offload + meta init and no ``to_empty``
must raise a clear RuntimeError at the first forward in both implementations.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import CPUOffloadPolicy as TorchCPUOffload
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMP
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor

import shardwise
from _models import MLPStack, mlp_batch, mlp_loss, rank_generator
from _mp_helpers import Agreement, compare_with_torch
from shardwise import CPUOffloadPolicy, MixedPrecisionPolicy
from shardwise.testing import run_on_ranks

TIMEOUT = 90
STEPS = 4
LR = 0.1
DIMS = dict(in_dim=7, dim=5, hidden=7, out_dim=3, n_layers=3)  # odd dims: uneven shards


# ---------------------------------------------------------------- helpers (run on the ranks)


def _torch_offload(pin_memory: bool) -> TorchCPUOffload:
    """torch's policy; pinning needs an accelerator, so without one torch gets pin_memory=False."""
    pin_memory = pin_memory and torch.accelerator.is_available()
    return TorchCPUOffload(pin_memory=pin_memory)


def _shard_groups(model: MLPStack, fully_shard_fn, **kwargs) -> MLPStack:
    """A group per residual MLP layer, one for the input projection, then the root."""
    for layer in model.layers:
        fully_shard_fn(layer, **kwargs)
    fully_shard_fn(model.in_proj, **kwargs)
    fully_shard_fn(model, **kwargs)
    return model


def _check_on_host(where: str, model: nn.Module) -> None:
    for name, p in model.named_parameters():
        assert isinstance(p, DTensor) and p.device.type == "cpu", f"{where}: {name} {type(p).__name__} {p.device}"
        assert p.to_local().device.type == "cpu"
        if p.grad is not None:
            assert isinstance(p.grad, DTensor), f"{where}: {name}.grad is a {type(p.grad).__name__}"
            assert p.grad.device.type == "cpu" and p.grad.to_local().device.type == "cpu", f"{where}: {name}.grad"


def _offload_parity(pin_memory: bool, reshard, accumulate: str | None, async_unshard: bool, bf16: bool) -> dict:
    torch.manual_seed(0)
    base = MLPStack(**DIMS)
    mp = dict(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else {}
    theirs = _shard_groups(
        copy.deepcopy(base),
        torch_fully_shard,
        reshard_after_forward=reshard,
        offload_policy=_torch_offload(pin_memory),
        mp_policy=TorchMP(**mp),
    )
    ours = _shard_groups(
        base,
        shardwise.fully_shard,
        reshard_after_forward=reshard,
        offload_policy=CPUOffloadPolicy(pin_memory=pin_memory),
        mp_policy=MixedPrecisionPolicy(**mp),
    )
    _check_on_host("after fully_shard", ours)
    if async_unshard:
        for model in (ours, theirs):
            model._set_unshard_async_op(True)
    opts = [torch.optim.SGD(m.parameters(), lr=LR, foreach=True) for m in (ours, theirs)]
    gen = rank_generator()
    agreement = Agreement()
    microbatches = 1 if accumulate is None else 2
    for step in range(STEPS):
        batches = [mlp_batch(gen, DIMS["in_dim"], DIMS["out_dim"], batch=2) for _ in range(microbatches)]
        losses = []
        for model, opt in zip((ours, theirs), opts):
            opt.zero_grad()
            total = 0.0
            for i, batch in enumerate(batches):
                if accumulate == "sync_off":
                    model.set_requires_gradient_sync(i == len(batches) - 1)
                loss = mlp_loss(model, batch)
                loss.backward()
                total = total + loss.detach()
            opt.step()
            losses.append(total)
        where = f"step {step}, rank {dist.get_rank()}"
        compare_with_torch(where, ours, theirs, *losses, agreement, exact=True, rtol=0, atol=0)
        _check_on_host(where, ours)
    return agreement.as_dict()


def _offload_meta_without_to_empty(impl: str) -> str:
    fully_shard_fn, policy = {
        "ours": (shardwise.fully_shard, CPUOffloadPolicy()),
        "torch": (torch_fully_shard, TorchCPUOffload(pin_memory=False)),
    }[impl]
    with torch.device("meta"):
        model = MLPStack(**DIMS)
    _shard_groups(model, fully_shard_fn, offload_policy=policy)
    x, _ = mlp_batch(rank_generator(), DIMS["in_dim"], DIMS["out_dim"])
    with pytest.raises(RuntimeError) as info:
        model(x)
    return str(info.value)


# ---------------------------------------------------------------- tests


@pytest.mark.parametrize("reshard", [True, False, None], ids=["reshard", "no_reshard", "reshard_default"])
@pytest.mark.parametrize("pin_memory", [True, False], ids=["pinned", "unpinned"])
def test_offload_parity_with_torch(pin_memory, reshard):
    run_on_ranks(_offload_parity, 2, pin_memory, reshard, None, False, False, timeout=TIMEOUT)


@pytest.mark.parametrize("pin_memory", [True, False], ids=["pinned", "unpinned"])
def test_offload_parity_with_async_unshard(pin_memory):
    run_on_ranks(_offload_parity, 2, pin_memory, True, None, True, False, timeout=TIMEOUT)


@pytest.mark.parametrize("accumulate", ["sum", "sync_off"])
@pytest.mark.parametrize("reshard", [True, None], ids=["reshard", "reshard_default"])
def test_offload_gradient_accumulation_parity_with_torch(accumulate, reshard):
    run_on_ranks(_offload_parity, 2, True, reshard, accumulate, False, False, timeout=TIMEOUT)


def test_offload_with_bf16_mixed_precision_parity_with_torch():
    run_on_ranks(_offload_parity, 2, False, None, "sync_off", False, True, timeout=TIMEOUT)


def test_offload_of_meta_params_without_to_empty_is_a_clear_error():
    # torch: "FSDP parameters should be materialized from meta device before training, but the
    # following were still on meta device: ['out_proj.weight', 'out_proj.bias'] ...". Ours must
    # be as clear: say meta, say to_empty, and name a parameter still on meta (the root's
    # out_proj is the first group gathered).
    for impl in ("torch", "ours"):
        messages = run_on_ranks(_offload_meta_without_to_empty, 2, impl, timeout=TIMEOUT)
        assert all("meta" in m and "to_empty" in m for m in messages), messages
        assert all("out_proj.weight" in m for m in messages), f"{impl}: no parameter named: {messages}"
