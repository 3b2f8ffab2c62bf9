"""What ``fully_shard`` registers on the module, when — checked against torch's FSDP2.

Between iterations every managed parameter is the same sharded ``nn.Parameter``
(a ``DTensor`` with ``Shard(0)``, chunked like ``torch.chunk``) that the optimizer holds.
During an iteration the unsharded plain tensors are registered instead while a module's
parameters are gathered: after forward that is the root (which keeps them by default)
and every module with ``reshard_after_forward=False``. ``unshard``/``reshard`` do the
same by hand. Each test runs the same sequence on a torch ``fully_shard`` copy and
asserts the same registered types at the same points.

The model is :class:`_models.MLPStack` with odd dims at 4 ranks, so later ranks hold
fewer rows and some hold none.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule as TorchFSDPModule
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor, Shard

import shardwise
from _models import MLP, MLPStack, allreduce_mean_grads, compare_step, mlp_batch, mlp_loss, rank_generator
from shardwise.testing import run_on_ranks

TIMEOUT = 60
WORLD_SIZE = 4
DIMS = dict(in_dim=7, dim=5, hidden=7, out_dim=3, n_layers=2)

# ---------------------------------------------------------------- helpers (run on the ranks)


def _kinds(model: nn.Module) -> dict[str, str]:
    """Name -> "DTensor" (the sharded parameter) or "Tensor" (a plain unsharded one)."""
    return {name: "DTensor" if isinstance(p, DTensor) else "Tensor" for name, p in model.named_parameters()}


def _expected(sharded_prefixes: tuple[str, ...], names) -> dict[str, str]:
    return {n: "DTensor" if n.startswith(sharded_prefixes) else "Tensor" for n in names}


def _torch_chunk(full: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    chunks = torch.chunk(full, world, dim=0)
    return chunks[rank] if rank < len(chunks) else full[:0]


def _build_stack():
    """(ours, theirs, ref): one init; layers.0 reshards after forward, layers.1 keeps, root default."""
    torch.manual_seed(0)
    base = MLPStack(**DIMS)
    ref = copy.deepcopy(base)
    copies = []
    for fully_shard_fn, model in ((torch_fully_shard, copy.deepcopy(base)), (shardwise.fully_shard, base)):
        assert fully_shard_fn(model.layers[0], reshard_after_forward=True) is model.layers[0]
        assert fully_shard_fn(model.layers[1], reshard_after_forward=False) is model.layers[1]
        assert fully_shard_fn(model) is model
        copies.append(model)
    theirs, ours = copies
    return ours, theirs, ref


def _check_sharded(model: nn.Module, ref: nn.Module, where: str) -> None:
    """Every param: an nn.Parameter DTensor, Shard(0), the torch.chunk shard, the full value."""
    rank, world = dist.get_rank(), dist.get_world_size()
    for name, p in model.named_parameters():
        full = ref.get_parameter(name).detach()
        assert isinstance(p, nn.Parameter) and isinstance(p, DTensor), f"{where}: {name} is {type(p).__name__}"
        assert p.placements == (Shard(0),), f"{where}: {name} placements {p.placements}"
        assert p.shape == full.shape, f"{where}: {name} global shape {tuple(p.shape)} vs {tuple(full.shape)}"
        torch.testing.assert_close(p.to_local(), _torch_chunk(full, rank, world), msg=lambda m: f"{where}: {name} {m}")
        torch.testing.assert_close(p.full_tensor(), full, msg=lambda m: f"{where}: {name} {m}")


def _check_unsharded(model: nn.Module, ref: nn.Module, names: list[str], where: str) -> None:
    for name in names:
        p = model.get_parameter(name)
        assert not isinstance(p, DTensor), f"{where}: {name} is a DTensor"
        torch.testing.assert_close(p.detach(), ref.get_parameter(name).detach(), msg=lambda m: f"{where}: {name} {m}")


def _registration_through_steps():
    ours, theirs, ref = _build_stack()
    rank = dist.get_rank()
    names = list(_kinds(ours))
    sharded = _expected(("",), names)  # every name
    assert _kinds(ours) == _kinds(theirs) == sharded
    _check_sharded(ours, ref, "before forward")
    for name, p in ours.named_parameters():
        torch.testing.assert_close(p.to_local(), theirs.get_parameter(name).to_local())
    local_rows = {name: p.to_local().size(0) for name, p in ours.named_parameters()}
    assert local_rows["layers.0.out_proj.weight"] == [2, 2, 1, 0][rank], "the case needs a rank with no rows"
    objects = [id(p) for p in ours.parameters()]
    models = (ours, theirs, ref)
    opts = [torch.optim.Adam(m.parameters(), lr=1e-2, foreach=True) for m in models]
    assert [id(p) for p in opts[0].param_groups[0]["params"]] == objects
    gen = rank_generator()
    after_forward = _expected(("layers.0.",), names)  # root and layers.1 keep theirs unsharded
    for step in range(2):
        batch = mlp_batch(gen, DIMS["in_dim"], DIMS["out_dim"])
        losses = [mlp_loss(m, batch) for m in models]
        assert _kinds(ours) == after_forward, f"step {step} after forward: {_kinds(ours)}"
        assert _kinds(theirs) == after_forward, f"torch at step {step} after forward: {_kinds(theirs)}"
        if step == 0:  # the unsharded tensors hold the full values
            _check_unsharded(ours, ref, [n for n, k in after_forward.items() if k == "Tensor"], "after forward")
        for loss in losses:
            loss.backward()
        allreduce_mean_grads(ref)
        assert _kinds(ours) == _kinds(theirs) == sharded, f"step {step} after backward: {_kinds(ours)}"
        assert [id(p) for p in ours.parameters()] == objects, f"step {step}: other param objects after backward"
        for name, p in ours.named_parameters():
            assert isinstance(p.grad, DTensor) and p.grad.placements == (Shard(0),), f"{name}.grad: {type(p.grad)}"
            local = p.grad.to_local().shape
            assert local == (local_rows[name], *p.shape[1:]), f"{name}.grad local shape {tuple(local)}"
        for opt in opts:
            opt.step()
        compare_step(step, ours, losses[0], ref=ref, ref_loss=losses[2], torch_model=theirs, torch_loss=losses[1])
        assert [id(p) for p in ours.parameters()] == objects, f"step {step}: other param objects after the step"
        for opt in opts:
            opt.zero_grad()
    return local_rows


def _unshard_reshard_before_forward():
    ours, theirs, ref = _build_stack()
    names = list(_kinds(ours))
    objects = [id(p) for p in ours.parameters()]
    sharded = _expected(("",), names)
    root_unsharded = _expected(("layers.",), names)  # unshard() is not recursive
    layer1_unsharded = _expected(("in_proj", "out_proj", "layers.0."), names)
    for impl, model in (("ours", ours), ("torch", theirs)):
        assert model.unshard() is None  # before the first forward
        assert _kinds(model) == root_unsharded, f"{impl} after unshard(): {_kinds(model)}"
        _check_unsharded(model, ref, [n for n, k in root_unsharded.items() if k == "Tensor"], f"{impl} after unshard()")
        model.reshard()
        assert _kinds(model) == sharded, f"{impl} after reshard(): {_kinds(model)}"
        handle = model.layers[1].unshard(async_op=True)
        assert handle is not None, f"{impl}: unshard(async_op=True) returned None"
        handle.wait()
        handle.wait()  # twice is harmless
        assert _kinds(model) == layer1_unsharded, f"{impl} after handle.wait(): {_kinds(model)}"
        layer1 = [n for n in names if n.startswith("layers.1.")]
        _check_unsharded(model, ref, layer1, f"{impl} after unshard(async_op=True)")
        model.layers[1].reshard()
        model.layers[1].reshard()  # idempotent
        assert _kinds(model) == sharded, f"{impl} after layers[1].reshard(): {_kinds(model)}"
    assert [id(p) for p in ours.parameters()] == objects, "reshard() registered other parameter objects"
    _check_sharded(ours, ref, "after reshard()")
    # The manual verbs leave training intact: one step in parity with the replica and torch.
    ours.unshard()
    theirs.unshard()
    batch = mlp_batch(rank_generator(), DIMS["in_dim"], DIMS["out_dim"])
    losses = [mlp_loss(m, batch) for m in (ours, theirs, ref)]
    for loss in losses:
        loss.backward()
    allreduce_mean_grads(ref)
    compare_step(0, ours, losses[0], ref=ref, ref_loss=losses[2], torch_model=theirs, torch_loss=losses[1])
    assert [id(p) for p in ours.parameters()] == objects


class _Wrapper(nn.Module):
    """A module with no parameters of its own around an MLP."""

    def __init__(self):
        super().__init__()
        self.inner = MLP(7, 5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)


def _unshard_without_own_params():
    torch.manual_seed(0)
    base = _Wrapper()
    ref = copy.deepcopy(base)
    theirs = copy.deepcopy(base)
    for fully_shard_fn, model in ((torch_fully_shard, theirs), (shardwise.fully_shard, base)):
        fully_shard_fn(model.inner)
        fully_shard_fn(model)
    ours = base
    for impl, model in (("ours", ours), ("torch", theirs)):
        assert list(model._parameters) == []
        assert model.unshard() is None
        handle = model.unshard(async_op=True)
        assert handle is not None, f"{impl}: unshard(async_op=True) returned None"
        handle.wait()
        handle.wait()
        sharded = all(isinstance(p, DTensor) for p in model.parameters())
        assert sharded, f"{impl}: unshard() of the wrapper gathered its child"
        model.reshard()
        assert all(isinstance(p, DTensor) for p in model.parameters()), f"{impl}: parameters after reshard()"
    x, y = mlp_batch(rank_generator(), 7, 3)
    losses = [mlp_loss(m, (x, y)) for m in (ours, theirs, ref)]
    for loss in losses:
        loss.backward()
    allreduce_mean_grads(ref)
    compare_step(0, ours, losses[0], ref=ref, ref_loss=losses[2], torch_model=theirs, torch_loss=losses[1])


def _module_class_and_deepcopy():
    torch.manual_seed(0)
    model = MLPStack(**DIMS)
    plain_cls = type(model)
    layer_cls = type(model.layers[0])
    assert shardwise.fully_shard(model.layers[0]) is model.layers[0]
    assert shardwise.fully_shard(model) is model
    for module, orig in ((model, plain_cls), (model.layers[0], layer_cls)):
        assert isinstance(module, shardwise.FSDPModule) and isinstance(module, orig), type(module).__mro__
        assert issubclass(type(module), shardwise.FSDPModule) and issubclass(type(module), orig)
        assert type(module) is not orig and not isinstance(module, TorchFSDPModule)
    assert not isinstance(model.layers[1], shardwise.FSDPModule), "fully_shard changed a module it was not given"
    for target in (model, model.layers[0]):
        try:
            copy.deepcopy(target)
        except Exception as exc:  # noqa: BLE001 - any clear error is fine, silence is not
            assert str(exc), "deepcopy raised without a message"
        else:
            raise AssertionError(f"copy.deepcopy of a sharded {type(target).__name__} did not raise")
    return type(model).__name__


# ---------------------------------------------------------------- tests


def test_registered_types_through_steps():
    rows = run_on_ranks(_registration_through_steps, WORLD_SIZE, timeout=TIMEOUT)
    assert [r["layers.0.out_proj.weight"] for r in rows] == [2, 2, 1, 0]


def test_unshard_and_reshard_before_first_forward():
    run_on_ranks(_unshard_reshard_before_forward, WORLD_SIZE, timeout=TIMEOUT)


def test_unshard_module_without_own_params():
    run_on_ranks(_unshard_without_own_params, 2, timeout=TIMEOUT)


def test_module_class_and_deepcopy():
    assert run_on_ranks(_module_class_and_deepcopy, 2, timeout=TIMEOUT) == ["FSDPMLPStack"] * 2
