"""Composed parallelism on meshes built the way torchtitan builds them.

torchtitan's ``ParallelDims`` makes one 1-D ``world`` mesh and ``_unflatten``s it three times
(data loading ``(pp, batch, cp, tp)``, dense ``(pp, dp_replicate, fsdp, tp)``, experts
``(pp, dp_replicate, efsdp, ep)``; a dim of size 1 gets the ``fake`` backend). Its ``tp`` mesh
is a slice of the first, its data-parallel mesh a slice of the second: the root of both is
``world``, which has neither name, so a parameter's SPMD mesh can only be formed by composing
the two meshes (``shardwise/spmd_mesh.py``), never by slicing the root by names.

- FSDP x TP (4 ranks), HSDP x TP (8 ranks), FSDP x CP x TP (4 ranks: ``cp`` folded into
  ``fsdp``), each bit-equal to torch's ``fully_shard`` every step (losses, placements, meshes,
  local shards of params and grads, collectives per kind) and close to a TP-only replica
  whose grads are averaged over the data-parallel ranks;
- FSDP x EP (4 ranks): MoE experts on an expert-parallel mesh, sharded over ``efsdp`` through
  ``ShardPlacementResult`` exactly as torchtitan's ``apply_fsdp_to_decoder`` does, with
  ``Shard(1)`` when ``efsdp * ep`` exceeds the number of experts, bit-equal to torch;
- the other ways to make a mesh: a 2-D ``DeviceMesh.from_group`` mesh, ``_flatten``ed dims;
  and meshes that cannot be composed, refused naming the parameter and both meshes.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_common import ShardPlacementResult
from torch.distributed.fsdp._fully_shard._fsdp_init import _get_mesh_info
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

import shardwise
from _nd_helpers import (
    TIMEOUT,
    TPTransformer,
    clear_dtensor_caches,
    generator,
    lm_loss,
    parallelize,
    same_as_torch,
    tally,
    titan_meshes,
    token_batches,
    train,
)
from shardwise.testing import CommCounter, run_on_ranks

STEPS = 3
DIMS = dict(vocab_size=16, dim=8, n_layers=2, n_heads=2, hidden=10, max_seq_len=8)

# ---------------------------------------------------------------- checks (run on the ranks)


def same_collectives(counts: dict) -> None:
    """Each step's forward+backward issued torch's collectives, per kind."""
    ours = [tally(events) for events in counts["ours"]]
    theirs = [tally(events) for events in counts["torch"]]
    assert ours == theirs, f"collectives per step {ours} vs torch {theirs}"


def data_rank(dp_mesh: DeviceMesh) -> int:
    """Our index among the data-parallel ranks (row-major over the dp mesh)."""
    return dp_mesh.mesh.flatten().tolist().index(dist.get_rank())


def dp_group(dp_mesh: DeviceMesh) -> dist.ProcessGroup:
    return dp_mesh.get_group() if dp_mesh.ndim == 1 else dp_mesh._flatten("dp_flat").get_group()


# ---------------------------------------------------------------- FSDP / HSDP x TP (x CP)


def _shard_blocks(model: nn.Module, fully_shard_fn, mesh: DeviceMesh) -> nn.Module:
    for layer in model.layers:
        fully_shard_fn(layer, mesh=mesh)
    return fully_shard_fn(model, mesh=mesh)


def _tp_on_titan_meshes(degrees: dict) -> list[float]:
    meshes = titan_meshes(**degrees)
    dp_mesh, tp_mesh = meshes["dp"], meshes["tp"]
    torch.manual_seed(0)
    base = TPTransformer(**DIMS)
    ref = parallelize(copy.deepcopy(base), tp_mesh)  # TP-only replica, grads averaged over dp
    ours, theirs = (
        _shard_blocks(parallelize(copy.deepcopy(base), tp_mesh), fn, dp_mesh) for fn in (shardwise.fully_shard, torch_fully_shard)
    )
    want_names = dp_mesh.mesh_dim_names + ("tp",)
    for name, p in ours.named_parameters():
        if isinstance(ref.get_parameter(name), DTensor):
            assert p.device_mesh.mesh_dim_names == want_names, f"{name}: {p.device_mesh}"
    same_as_torch("after fully_shard", ours, theirs)
    gen = generator(data_rank(dp_mesh))
    batches = [token_batches(gen, DIMS["vocab_size"], 1) for _ in range(STEPS)]
    counts: dict = {}
    check = lambda a, _ref, b: same_as_torch("after backward", a, b)  # noqa: E731
    losses = train(ours, ref, theirs, batches, ref_group=dp_group(dp_mesh), counts=counts, after_backward=check)
    same_as_torch("after the last step", ours, theirs)
    same_collectives(counts)
    return losses


TP_CASES = [
    (4, dict(dp_shard=2, tp=2)),
    (8, dict(dp_replicate=2, dp_shard=2, tp=2)),
    (4, dict(cp=2, tp=2)),
]


@pytest.mark.parametrize("world,degrees", TP_CASES, ids=["fsdp2xtp2", "hsdp2x2xtp2", "cp2xtp2"])
def test_tensor_parallel_on_unflattened_world_mesh_matches_torch(world, degrees):
    histories = run_on_ranks(_tp_on_titan_meshes, world, degrees, timeout=TIMEOUT)
    assert all(len(h) == STEPS for h in histories)


# ---------------------------------------------------------------- FSDP x EP (MoE)


class Experts(nn.Module):
    """``n`` expert MLPs as two stacked weights, split over the expert-parallel ranks like
    torchtitan's grouped experts: each rank runs its local experts (``to_local()``) on its own
    tokens, weighted by its slice of the router's gates (a dispatch that keeps tokens local)."""

    def __init__(self, n: int, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(n, dim, hidden) * 0.2)
        self.w2 = nn.Parameter(torch.randn(n, hidden, dim) * 0.2)

    def forward(self, x: torch.Tensor, gates: torch.Tensor) -> torch.Tensor:
        w1, w2 = (w.to_local() if isinstance(w, DTensor) else w for w in (self.w1, self.w2))
        first = w1.shape[0] * (self.w1.device_mesh.get_local_rank() if isinstance(self.w1, DTensor) else 0)
        local_gates = gates[..., first : first + w1.shape[0]]  # (b, s, local experts)
        h = torch.einsum("bsd,edh->bseh", x, w1).relu()
        return torch.einsum("bseh,ehd,bse->bsd", h, w2, local_gates)


class MoEBlock(nn.Module):
    def __init__(self, dim: int, hidden: int, n_experts: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.router = nn.Linear(dim, n_experts, bias=False)
        self.experts = Experts(n_experts, dim, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        return x + self.experts(h, self.router(h).softmax(-1))


class MoEModel(nn.Module):
    def __init__(self, vocab: int, dim: int, hidden: int, n_experts: int, n_layers: int = 2):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(MoEBlock(dim, hidden, n_experts) for _ in range(n_layers))
        self.norm = nn.LayerNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


def _expert_parallel(model: MoEModel, ep_mesh: DeviceMesh) -> MoEModel:
    for layer in model.layers:
        for name in ("w1", "w2"):
            full = getattr(layer.experts, name)
            setattr(layer.experts, name, nn.Parameter(distribute_tensor(full.detach(), ep_mesh, [Shard(0)])))
    return model


def _shard_like_torchtitan(model: MoEModel, fully_shard_fn, meshes: dict, ep: int, n_experts: int) -> MoEModel:
    """torchtitan's ``apply_fsdp_to_decoder`` for MoE blocks with EP > 1: one call per block,
    experts to the ``efsdp`` mesh (torch's mesh infos, built by torch's ``_get_mesh_info``),
    ``Shard(1)`` for them when ``efsdp * ep`` exceeds the number of experts."""
    dp_info, edp_info = _get_mesh_info(meshes["dp"]), _get_mesh_info(meshes["efsdp"])
    expert_placement = Shard(1) if meshes["efsdp"].size() * ep > n_experts else Shard(0)
    for layer in model.layers:
        experts = set(layer.experts.parameters())

        def placement(param, experts=experts):
            if param in experts:
                return ShardPlacementResult(placement=expert_placement, mesh_info=edp_info)
            return ShardPlacementResult(placement=Shard(0), mesh_info=dp_info)

        fully_shard_fn(layer, mesh=meshes["dp"], shard_placement_fn=placement)
    return fully_shard_fn(model, mesh=meshes["dp"])


def _step(model: nn.Module, opt: torch.optim.Optimizer, batch: torch.Tensor) -> tuple[torch.Tensor, dict]:
    opt.zero_grad(set_to_none=True)
    with CommCounter() as counter:
        loss = lm_loss(model, batch)
        loss.backward()
    return loss.detach(), tally(counter.events)


def _moe_on_titan_meshes(n_experts: int) -> list[float]:
    ep = 2
    meshes = titan_meshes(dp_shard=dist.get_world_size(), ep=ep)
    torch.manual_seed(0)
    base = MoEModel(DIMS["vocab_size"], DIMS["dim"], 12, n_experts)
    ours, theirs = (
        _shard_like_torchtitan(_expert_parallel(copy.deepcopy(base), meshes["ep"]), fn, meshes, ep, n_experts)
        for fn in (shardwise.fully_shard, torch_fully_shard)
    )
    w1 = ours.layers[0].experts.w1
    assert w1.device_mesh.mesh_dim_names == ("efsdp", "ep"), w1.device_mesh
    same_as_torch("after fully_shard", ours, theirs)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ours, theirs)]
    gen, losses = generator(dist.get_rank()), []
    for step in range(STEPS):
        batch = token_batches(gen, DIMS["vocab_size"], 1)[0]
        (loss, counts), (torch_loss, torch_counts) = (_step(m, o, batch) for m, o in zip((ours, theirs), opts))
        assert torch.equal(loss, torch_loss), f"step {step}: loss {loss.item()} vs torch {torch_loss.item()}"
        assert counts == torch_counts, f"step {step}: collectives {counts} vs torch {torch_counts}"
        same_as_torch(f"step {step} after backward", ours, theirs)
        for opt in opts:
            opt.step()
        same_as_torch(f"step {step} after AdamW", ours, theirs)
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("n_experts", [4, 2], ids=["shard0", "shard1"])
def test_expert_parallel_on_unflattened_world_mesh_matches_torch(n_experts):
    histories = run_on_ranks(_moe_on_titan_meshes, 4, n_experts, timeout=TIMEOUT)
    assert all(len(h) == STEPS for h in histories)


# ---------------------------------------------------------------- other mesh constructions


def _from_group_mesh() -> list[float]:
    """A 2-D mesh made from existing groups (``DeviceMesh.from_group``), sliced into dp and tp."""
    clear_dtensor_caches()
    grid = torch.arange(dist.get_world_size()).view(2, 2)  # (dp, tp)
    rank = dist.get_rank()
    groups = {}
    for dim, name in ((0, "dp"), (1, "tp")):
        for ranks in grid.unbind(1 - dim):
            group = dist.new_group(ranks.tolist())
            if rank in ranks.tolist():
                groups[name] = group
    mesh = DeviceMesh.from_group([groups["dp"], groups["tp"]], "cpu", mesh=grid, mesh_dim_names=("dp", "tp"))
    return _one_backward_like_torch(mesh["dp"], mesh["tp"])


def test_dp_and_tp_slices_of_a_from_group_mesh_match_torch():
    run_on_ranks(_from_group_mesh, 4, timeout=TIMEOUT)


def _flattened_dp_mesh() -> list[float]:
    """HSDP's two dims ``_flatten``ed into one FSDP dim, next to TP (8 ranks)."""
    meshes = titan_meshes(dp_replicate=2, dp_shard=2, tp=2)
    return _one_backward_like_torch(meshes["dp"]._flatten("dp_shard_flat"), meshes["tp"])


def _one_backward_like_torch(dp_mesh: DeviceMesh, tp_mesh: DeviceMesh) -> list[float]:
    """TP on ``tp_mesh``, then fully_shard on ``dp_mesh``: the layout after fully_shard and the
    grads of one backward are torch's."""
    torch.manual_seed(0)
    base = TPTransformer(**DIMS)
    ours, theirs = (
        _shard_blocks(parallelize(copy.deepcopy(base), tp_mesh), fn, dp_mesh) for fn in (shardwise.fully_shard, torch_fully_shard)
    )
    same_as_torch("after fully_shard", ours, theirs)
    batch = token_batches(generator(data_rank(dp_mesh)), DIMS["vocab_size"], 1)[0]
    for model in (ours, theirs):
        lm_loss(model, batch).backward()
    same_as_torch("after backward", ours, theirs)
    return [1.0]


def test_flattened_dp_dim_next_to_tp_matches_torch():
    run_on_ranks(_flattened_dp_mesh, 8, timeout=TIMEOUT)


def _meshes_that_overlap(how: str) -> str:
    """A tp mesh over the same ranks as the dp mesh (``overlap``), or two 1-D meshes each made
    from a group of its own (``from_group``: no common root), do not compose."""
    clear_dtensor_caches()
    dp_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "x"))["dp"]
    if how == "overlap":
        tp_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("tp", "y"))["tp"]
    else:
        dp_mesh = DeviceMesh.from_group(dp_mesh.get_group(), "cpu", mesh_dim_names=("dp",))
        tp_mesh = DeviceMesh.from_group(init_device_mesh("cpu", (2, 2), mesh_dim_names=("y", "tp"))["tp"].get_group(), "cpu", mesh_dim_names=("tp",))
    model = parallelize(TPTransformer(**DIMS), tp_mesh)
    with pytest.raises(RuntimeError) as caught:
        shardwise.fully_shard(model.layers[0], mesh=dp_mesh)
    return str(caught.value)


@pytest.mark.parametrize("how", ["overlap", "from_group"])
def test_meshes_that_do_not_compose_are_refused_naming_param_and_meshes(how):
    for message in run_on_ranks(_meshes_that_overlap, 4, how, timeout=TIMEOUT):
        assert "attention.wq.weight" in message, message
        assert "dp=2" in message and "tp=2" in message, message
        assert "one root mesh" in message, message
