"""Tensor parallel + FSDP (2-D and 3-D meshes) and ``dp_mesh_dims`` on a full SPMD mesh.

- 2-D: ``parallelize_module`` on ``mesh["tp"]`` (heads and hidden units split Megatron
  style, optionally sequence-parallel norms, optionally activation checkpointing), then
  ``fully_shard(..., mesh=mesh["dp"])`` per block and on the root. The TP'd params become
  DTensors on the (dp, tp) mesh with two placements — ``_StridedShard(0, sf=tp)`` on dp when
  TP already shards dim 0, else ``Shard(0)`` — the same as torch's.
- 3-D (8 ranks): TP on ``mesh["tp"]``, HSDP on ``mesh["dp_replicate", "dp_shard"]``.
- ``dp_mesh_dims``: the params are already DTensors on the full mesh, replicated over dp;
  fully_shard shards them over the named dim — for a (dp, tp) and a (tp, dp) mesh, where
  the dp placement of a TP-row-sharded param is ``_StridedShard(0, sf=2)`` and ``Shard(0)``
  respectively (torch's rule: only TP dims after dp interleave with it).
- ``dp_mesh_dims`` with the batch a DTensor ``Shard(0)`` on dp (``distribute_module``): the
  unsharded gradients come out ``Partial()`` over dp. They must be reduced once, by
  FSDP's own reduce-scatter (not first all-reduced by a redistribution to the param's
  ``Replicate()``, which made them N x torch's).

The reference is a TP-only replica (or a plain one) whose gradients are averaged over the
data-parallel ranks; every step :func:`_nd_helpers.check_step` compares ``full_tensor()`` of
params and grads with it, and placements plus ``to_local()`` with torch's fully_shard.
Ranks of one TP group share their data; data differs across data-parallel ranks.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed._composable import checkpoint
from torch.distributed.fsdp import DataParallelMeshDims as TorchDataParallelMeshDims
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

import shardwise
from _nd_helpers import TIMEOUT, TPTransformer, full, generator, make_mesh, parallelize, token_batches, train
from shardwise.testing import run_on_ranks

STEPS = 3
# hidden 10 over tp 2 -> 5 rows per TP rank -> 3 + 2 over dp 2: uneven after TP. (torch's TP
# itself needs dims divisible by tp: ColwiseParallel's output shape inference fails otherwise.)
DIMS = dict(vocab_size=16, dim=8, n_layers=2, n_heads=2, hidden=10, max_seq_len=8)
COLWISE = ("wq", "wk", "wv", "w1")  # TP shards dim 0 of their weight (and w1's bias)
ROWWISE = ("wo", "w2")  # TP shards dim 1 of their weight; w2's bias is Replicate on tp


def _quiet_redistribute_warnings() -> None:
    # full_tensor() of a (_StridedShard, Shard) DTensor warns that it needs two all-gathers
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)


def _shard(model, fully_shard_fn, mesh, **kwargs):
    for layer in model.layers:
        fully_shard_fn(layer, mesh=mesh, **kwargs)
    return fully_shard_fn(model, mesh=mesh, **kwargs)


def _expected_placements(name: str, tp_placements: tuple, dp: tuple) -> tuple:
    """``dp``: the placements of the data-parallel dims for a param TP does not shard on dim 0."""
    leaf = name.split(".")[-2]
    if leaf in COLWISE:
        return dp[:-1] + (_StridedShard(0, split_factor=2),) + tp_placements
    return dp + tp_placements


def _layout(model: nn.Module) -> dict:
    return {name: (p.device_mesh.mesh_dim_names, tuple(p.placements)) for name, p in model.named_parameters()}


def _check_layout(model: nn.Module, ref: nn.Module, dp_names: tuple, dp: tuple) -> None:
    """Placements and meshes after fully_shard, and an exact full_tensor() round trip."""
    for name, p in model.named_parameters():
        r = ref.get_parameter(name)
        assert isinstance(p, DTensor), name
        if isinstance(r, DTensor):  # TP'd: (dp..., tp) mesh
            assert p.device_mesh.mesh_dim_names == dp_names + ("tp",), f"{name}: {p.device_mesh}"
            assert p.placements == _expected_placements(name, tuple(r.placements), dp), f"{name}: {p.placements}"
        else:
            assert p.device_mesh.mesh_dim_names == dp_names, f"{name}: {p.device_mesh}"
            assert p.placements == dp, f"{name}: {p.placements}"
        assert torch.equal(p.full_tensor(), full(r.detach())), f"{name}: full_tensor() does not round-trip"


def _no_sync_until_last(model, i, n):
    model.set_requires_gradient_sync(i == n - 1)


def _tp_fsdp(sequence_parallel: bool, activation_checkpointing: bool, microbatches: int = 1) -> list[float]:
    _quiet_redistribute_warnings()
    mesh = make_mesh((2, 2), ("dp", "tp"))
    torch.manual_seed(0)
    base = TPTransformer(**DIMS)
    ref = parallelize(copy.deepcopy(base), mesh["tp"], sequence_parallel)  # TP-only replica
    copies = []
    for fully_shard_fn in (shardwise.fully_shard, torch_fully_shard):
        model = parallelize(copy.deepcopy(base), mesh["tp"], sequence_parallel)
        if activation_checkpointing:
            for layer in model.layers:
                checkpoint(layer)
        copies.append(_shard(model, fully_shard_fn, mesh["dp"]))
    ours, theirs = copies
    _check_layout(ours, ref, ("dp",), (Shard(0),))
    layout = _layout(ours)
    gen = generator(mesh.get_local_rank("dp"))
    batches = [token_batches(gen, DIMS["vocab_size"], microbatches) for _ in range(STEPS)]
    before = _no_sync_until_last if microbatches > 1 else None  # TP grads accumulate unreduced
    losses = train(ours, ref, theirs, batches, ref_group=mesh.get_group("dp"), before=before)
    assert _layout(ours) == layout, "the layout changed during training"
    return losses


def _tp_3d() -> list[float]:
    _quiet_redistribute_warnings()
    mesh = make_mesh((2, 2, 2), ("dp_replicate", "dp_shard", "tp"))
    dp_mesh = mesh["dp_replicate", "dp_shard"]
    dp_group = dp_mesh._flatten("dp").get_group()  # the 4 data-parallel ranks of our TP rank
    torch.manual_seed(0)
    base = TPTransformer(**DIMS)
    ref = parallelize(copy.deepcopy(base), mesh["tp"])
    theirs = _shard(parallelize(copy.deepcopy(base), mesh["tp"]), torch_fully_shard, dp_mesh)
    ours = _shard(parallelize(copy.deepcopy(base), mesh["tp"]), shardwise.fully_shard, dp_mesh)
    dp_names = ("dp_replicate", "dp_shard")
    _check_layout(ours, ref, dp_names, (Replicate(), Shard(0)))
    data_rank = mesh.get_local_rank("dp_replicate") * 2 + mesh.get_local_rank("dp_shard")
    gen = generator(data_rank)
    batches = [token_batches(gen, DIMS["vocab_size"], 1) for _ in range(STEPS)]
    return train(ours, ref, theirs, batches, ref_group=dp_group)


@pytest.mark.parametrize(
    "sequence_parallel,activation_checkpointing,microbatches",
    [(False, False, 1), (True, False, 1), (False, True, 1), (True, False, 3)],
    ids=["tp", "sequence_parallel", "tp_activation_checkpointing", "sequence_parallel_no_sync_microbatches"],
)
def test_tp_fsdp_2d(sequence_parallel, activation_checkpointing, microbatches):
    args = (sequence_parallel, activation_checkpointing, microbatches)
    histories = run_on_ranks(_tp_fsdp, 4, *args, timeout=TIMEOUT)
    assert histories[0] == histories[1] and histories[2] == histories[3], "a TP pair saw different losses"
    assert histories[0] != histories[2], "the data-parallel ranks saw the same data"


def test_tp_hsdp_3d():
    histories = run_on_ranks(_tp_3d, 8, timeout=TIMEOUT)
    assert len({tuple(h) for h in histories}) == 4, "expected 4 data-parallel streams of 2 TP ranks"


# ---------------------------------------------------------------- dp_mesh_dims


class SpmdMLP(nn.Module):
    """``norm -> w1 (colwise) -> relu -> w2 (rowwise)`` on DTensor params of the full mesh.

    The input is this rank's batch declared ``Replicate()`` on dp (each data-parallel rank
    holds different data, as in DDP: FSDP averages the gradients over dp) and on tp."""

    def __init__(self, dim: int = 8, hidden: int = 10):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.w1 = nn.Linear(dim, hidden)
        self.w2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(self.w1.weight, DTensor) and not isinstance(x, DTensor):
            x = DTensor.from_local(x, self.w1.weight.device_mesh, [Replicate(), Replicate()], run_check=False)
        y = x + self.w2(F.relu(self.w1(self.norm(x))))
        return y.full_tensor() if isinstance(y, DTensor) else y


class SpmdStack(nn.Module):
    def __init__(self, n_layers: int = 2, dim: int = 8):
        super().__init__()
        self.layers = nn.ModuleList(SpmdMLP(dim) for _ in range(n_layers))
        self.head = nn.Linear(dim, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        if isinstance(self.head.weight, DTensor):
            x = DTensor.from_local(x, self.head.weight.device_mesh, [Replicate(), Replicate()], run_check=False)
            return self.head(x).full_tensor()
        return self.head(x)


SPMD_TP = {  # the TP placement of each parameter; every one starts Replicate() over dp
    "norm.weight": Replicate(),
    "norm.bias": Replicate(),
    "w1.weight": Shard(0),
    "w1.bias": Shard(0),
    "w2.weight": Shard(1),
    "w2.bias": Replicate(),
    "head.weight": Replicate(),
    "head.bias": Replicate(),
}


def _leaf_name(name: str) -> str:
    return ".".join(name.split(".")[-2:])


def _on_mesh(names: tuple[str, str], dp: object, tp: object) -> tuple:
    return tuple(dp if n == "dp" else tp for n in names)


def _sharded_dp_placement(names: tuple[str, str], leaf: str):
    """torch's rule: when TP shards dim 0 on a mesh dim *after* dp, the dp shard of the
    TP-local rows is strided in the global tensor; a TP dim *before* dp splits first, so
    sharding its local rows over dp is a plain Shard(0) after it."""
    tp_after_dp = names.index("tp") > names.index("dp")
    return _StridedShard(0, split_factor=2) if tp_after_dp and SPMD_TP[leaf] == Shard(0) else Shard(0)


def _distribute(model: nn.Module, mesh) -> nn.Module:
    """Every param becomes a DTensor on the full mesh: Replicate() over dp, SPMD_TP over tp."""
    for name, p in list(model.named_parameters()):
        owner = model.get_submodule(name.rsplit(".", 1)[0])
        placements = _on_mesh(mesh.mesh_dim_names, Replicate(), SPMD_TP[_leaf_name(name)])
        setattr(owner, name.rsplit(".", 1)[1], nn.Parameter(distribute_tensor(p.detach(), mesh, placements)))
    return model


def _mse(model: nn.Module, batch: tuple) -> torch.Tensor:
    x, y = batch
    return F.mse_loss(model(x), y)


def _spmd_copies(mesh, *appliers) -> tuple[nn.Module, ...]:
    """One seeded SpmdStack as a plain replica (grads averaged over every rank) and, per
    ``(apply_fn, dp_mesh_dims)``, a copy distributed on ``mesh`` with ``apply_fn`` on each
    layer and then the root."""
    torch.manual_seed(0)
    base = SpmdStack()
    copies = [copy.deepcopy(base)]
    for apply_fn, dims in appliers:
        model = _distribute(copy.deepcopy(base), mesh)
        for layer in model.layers:
            apply_fn(layer, mesh=mesh, dp_mesh_dims=dims)
        copies.append(apply_fn(model, mesh=mesh, dp_mesh_dims=dims))
    return tuple(copies)


def _dp_mesh_dims(names: tuple[str, str]) -> list[float]:
    _quiet_redistribute_warnings()
    mesh = make_mesh((2, 2), names)
    ref, ours, theirs = _spmd_copies(
        mesh,
        (shardwise.fully_shard, shardwise.DataParallelMeshDims(shard="dp")),
        (torch_fully_shard, TorchDataParallelMeshDims(shard="dp")),
    )
    for name, p in ours.named_parameters():
        leaf = _leaf_name(name)
        expected = _on_mesh(names, _sharded_dp_placement(names, leaf), SPMD_TP[leaf])
        assert p.device_mesh.mesh_dim_names == names, f"{name}: {p.device_mesh}"
        assert p.placements == expected, f"{name}: {p.placements}, expected {expected} (torch's)"
        assert torch.equal(p.full_tensor(), ref.get_parameter(name).detach()), f"{name}: full_tensor() does not round-trip"
    gen = generator(mesh.get_local_rank("dp"))
    batches = [[(torch.randn(4, 8, generator=gen), torch.randn(4, 4, generator=gen))] for _ in range(STEPS)]
    return train(ours, ref, theirs, batches, loss_fn=_mse)


def _dp_mesh_dims_int_reshard() -> dict:
    mesh = make_mesh((2, 2), ("dp", "tp"))
    errors = {}
    for name, fully_shard_fn, dims in (
        ("ours", shardwise.fully_shard, shardwise.DataParallelMeshDims(shard="dp")),
        ("torch", torch_fully_shard, TorchDataParallelMeshDims(shard="dp")),
    ):
        torch.manual_seed(0)
        model = _distribute(SpmdStack(), mesh)
        try:
            fully_shard_fn(model, mesh=mesh, dp_mesh_dims=dims, reshard_after_forward=2)
            errors[name] = None
        except Exception as err:  # recorded for both, compared in the test
            errors[name] = (type(err).__name__, str(err))
    return errors


def test_dp_mesh_dims_int_reshard_after_forward_not_implemented():
    for errors in run_on_ranks(_dp_mesh_dims_int_reshard, 4, timeout=TIMEOUT):
        assert errors["torch"] is not None and errors["torch"][0] == "NotImplementedError", errors["torch"]
        assert errors["ours"] is not None and errors["ours"][0] == "NotImplementedError", errors["ours"]


@pytest.mark.parametrize("names", [("dp", "tp"), ("tp", "dp")], ids=["dp_then_tp", "tp_then_dp"])
def test_dp_mesh_dims_parity(names):
    histories = run_on_ranks(_dp_mesh_dims, 4, names, timeout=TIMEOUT)
    tp_pairs = [(0, 1), (2, 3)] if names == ("dp", "tp") else [(0, 2), (1, 3)]
    for a, b in tp_pairs:
        assert histories[a] == histories[b], "a TP pair saw different losses"
    assert len({tuple(h) for h in histories}) == 2, "expected 2 data-parallel streams"


def _replicate_dp_mesh_dims() -> list[float]:
    """replicate() on the full (dp, tp) mesh, reducing over dp only: parity with torch's
    replicate and with a replica averaged over every rank, every step."""
    from torch.distributed._composable.replicate_with_fsdp import replicate as torch_replicate

    _quiet_redistribute_warnings()
    mesh = make_mesh((2, 2), ("dp", "tp"))
    ref, ours, theirs = _spmd_copies(
        mesh,
        (shardwise.replicate, shardwise.DataParallelMeshDims(replicate="dp")),
        (torch_replicate, TorchDataParallelMeshDims(replicate="dp")),
    )
    for (name, p), q in zip(ours.named_parameters(), theirs.parameters()):
        assert p.placements == q.placements, f"{name}: {p.placements}, torch's {q.placements}"
    gen = generator(mesh.get_local_rank("dp"))
    batches = [[(torch.randn(4, 8, generator=gen), torch.randn(4, 4, generator=gen))] for _ in range(STEPS)]
    return train(ours, ref, theirs, batches, loss_fn=_mse)


def _replicate_dp_mesh_dims_with_shard() -> str:
    mesh = make_mesh((2, 2), ("dp", "tp"))
    model = _distribute(SpmdStack(), mesh)
    with pytest.raises(ValueError, match="requires replicate-only dims") as err:
        shardwise.replicate(model, mesh=mesh, dp_mesh_dims=shardwise.DataParallelMeshDims(shard="dp"))
    return str(err.value)


def test_replicate_dp_mesh_dims_parity():
    histories = run_on_ranks(_replicate_dp_mesh_dims, 4, timeout=TIMEOUT)
    assert len({tuple(h) for h in histories}) == 2, "expected 2 data-parallel streams"


def test_replicate_dp_mesh_dims_refuses_shard_dims():
    for message in run_on_ranks(_replicate_dp_mesh_dims_with_shard, 4, timeout=TIMEOUT):
        assert "Use fully_shard() for sharding" in message


# ---------------------------------------------------------------- dp_mesh_dims, batch sharded over dp


def _partial_over_dp(shape: tuple[int, ...], names: tuple[str, ...]) -> None:
    mesh = make_mesh(shape, names)
    batch_placements = [Shard(0) if n == "dp" else Replicate() for n in names]

    def feed(module, inputs, device_mesh):  # this rank's rows of the global batch
        return tuple(DTensor.from_local(x, device_mesh, batch_placements, run_check=False) for x in inputs)

    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(8, 12), nn.Tanh(), nn.Linear(12, 4))
    copies = []
    for fully_shard_fn, dims in (
        (shardwise.fully_shard, shardwise.DataParallelMeshDims(shard="dp")),
        (torch_fully_shard, TorchDataParallelMeshDims(shard="dp")),
    ):
        model = distribute_module(copy.deepcopy(base), mesh, input_fn=feed)  # params Replicate() everywhere
        copies.append(fully_shard_fn(model, mesh=mesh, dp_mesh_dims=dims))
    gen = generator(mesh.get_local_rank("dp"))
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in copies]
    for step in range(STEPS):
        x, y = torch.randn(4, 8, generator=gen), torch.randn(4, 4, generator=gen)
        for model, opt in zip(copies, opts):
            opt.zero_grad()
            F.mse_loss(model(x).to_local(), y).backward()
        for (name, p), q in zip(copies[0].named_parameters(), copies[1].parameters()):
            where = f"{names} step {step}: {name}.grad"
            assert p.grad.placements == q.grad.placements, f"{where}: {p.grad.placements} vs {q.grad.placements}"
            ratio = (p.grad.to_local().norm() / q.grad.to_local().norm()).item()
            torch.testing.assert_close(p.grad.to_local(), q.grad.to_local(), msg=lambda m: f"{where} ({ratio:.3f}x torch's): {m}")
        for opt in opts:
            opt.step()


@pytest.mark.parametrize(
    "world_size, shape, names", [(2, (2,), ("dp",)), (4, (2, 2), ("dp", "tp"))], ids=["1d_dp", "2d_dp_tp"]
)
def test_dp_mesh_dims_batch_sharded_over_dp_reduces_once(world_size, shape, names):
    run_on_ranks(_partial_over_dp, world_size, shape, names, timeout=TIMEOUT)
