"""One ``fully_shard`` call, two meshes: experts on their own mesh next to a block's dense params.

torch 2.13's ``shard_placement_fn`` may return a ``ShardPlacementResult`` (a placement and
a per-parameter ``FSDPMeshInfo``); torchtitan's MoE expert-parallel path shards each block
with one call whose expert params go to an "expert" data-parallel mesh and whose dense
params stay on the call's mesh. torch then makes one param group per distinct mesh inside
the call (in the order of each mesh's first param), each with its own all-gather and
reduce-scatter, driven by the block's hooks. Here the feed-forward of every block is the
"experts" (and the root call's output head goes with them, so that the root, whose
post-backward runs in the end-of-backward callback, has two groups too), on one of:

- ``submesh``: the 1-D ``dp_mod_ep`` slice of a 2-D ``(dp_mod_ep, ep)`` mesh (torchtitan's
  expert data-parallel mesh: fewer ranks than the dense mesh; gradients are averaged over
  the ranks of that slice only, so the expert copies of the two ``ep`` columns diverge,
  as in torch);
- ``hsdp``: a 2-D ``(ep_replicate, edp)`` mesh, sharded over ``edp`` and all-reduced over
  ``ep_replicate`` (at 2 ranks a shard of one rank: experts replicated, dense sharded).

Every step is compared with torch's ``fully_shard`` given the same function, seed and data:
losses, every parameter's and gradient's placements, mesh and local shard, and the
collectives per kind of each step's forward and backward. Also by hand: ``unshard()`` /
``reshard()`` of a two-group block, ``set_requires_gradient_sync(False)`` accumulation,
and ``state_dict()`` round trips (keys, placements, meshes as torch's).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo, HSDPMeshInfo, ShardPlacementResult
from torch.distributed.tensor import DTensor, Shard

import shardwise
from _models import Transformer
from _nd_helpers import TIMEOUT, generator, lm_loss, make_mesh, same_as_torch, tally, token_batches
from shardwise.state import get_state
from shardwise.testing import CommCounter, run_on_ranks

STEPS = 3
SEQ = 4
DIMS = dict(vocab_size=8, dim=16, n_layers=2, n_heads=2, max_seq_len=SEQ, ffn_hidden=32)
VARIANTS = [(4, "submesh"), (4, "hsdp"), (2, "hsdp")]
IDS = [f"{variant}-{world}ranks" for world, variant in VARIANTS]

# ---------------------------------------------------------------- helpers (run on the ranks)


def _meshes(variant: str):
    """(the call's 1-D dense mesh over every rank, the experts' torch FSDPMeshInfo)."""
    world = dist.get_world_size()
    dense = make_mesh((world,), ("dp",))
    if variant == "submesh":
        ep_mesh = make_mesh((world // 2, 2), ("dp_mod_ep", "ep"))
        return dense, FSDPMeshInfo(mesh=ep_mesh["dp_mod_ep"], shard_mesh_dim=0)
    expert_mesh = make_mesh((2, world // 2), ("ep_replicate", "edp"))
    return dense, HSDPMeshInfo(mesh=expert_mesh, shard_mesh_dim=1, replicate_mesh_dim=0)


def _build(variant: str, seed: int = 0, reshard: bool | int = True) -> tuple[nn.Module, nn.Module, FSDPMeshInfo]:
    """(ours, torch's, the experts' FSDPMeshInfo): the same Transformer, each block (and the
    root) one call whose experts go to their own mesh."""
    dense, expert_info = _meshes(variant)
    torch.manual_seed(seed)
    base = Transformer(**DIMS)
    theirs = copy.deepcopy(base)
    experts = {id(model.output.weight) for model in (base, theirs)}
    experts |= {id(p) for model in (base, theirs) for layer in model.layers for p in layer.feed_forward.parameters()}

    def placement(param: nn.Parameter):
        if id(param) in experts:
            return ShardPlacementResult(placement=Shard(0), mesh_info=expert_info)
        return None

    for model, fully_shard_fn in ((base, shardwise.fully_shard), (theirs, torch_fully_shard)):
        for layer in model.layers:
            fully_shard_fn(layer, mesh=dense, shard_placement_fn=placement, reshard_after_forward=reshard)
        fully_shard_fn(model, mesh=dense, shard_placement_fn=placement)
    return base, theirs, expert_info


def _is_expert(name: str) -> bool:
    return ".feed_forward." in name or name == "output.weight"


def _same(what: str, a: torch.Tensor, b: torch.Tensor) -> None:
    """Bit-equal: the same collectives on the same data in the same order give the same bits."""
    assert a.shape == b.shape and a.dtype == b.dtype, f"{what}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
    assert torch.equal(a, b), f"{what}: max diff {(a - b).abs().max().item():.3g} (rank {dist.get_rank()})"


def _check_like_torch(where: str, ours: nn.Module, theirs: nn.Module, expert_mesh) -> None:
    """Placements, meshes and local tensors of every param and grad equal torch's; experts on ``expert_mesh``."""
    same_as_torch(where, ours, theirs, mesh_of=lambda name: expert_mesh if _is_expert(name) else None)


def _step(model: nn.Module, opt: torch.optim.Optimizer, batches: list, before=None) -> tuple[torch.Tensor, list, list]:
    """zero_grad, forward+backward per micro-batch (``before(model, i, n)`` first), counting
    each forward's and backward's collectives. Returns (summed loss, [tally per phase],
    [(kind, group size, payload bytes) of each collective in issue order])."""
    opt.zero_grad(set_to_none=True)
    total, phases, order = torch.zeros(()), [], []
    for i, batch in enumerate(batches):
        if before is not None:
            before(model, i, len(batches))
        with CommCounter() as forward:
            loss = lm_loss(model, batch)
        with CommCounter() as backward:
            loss.backward()
        phases += [tally(forward.events), tally(backward.events)]
        order += [(e.kind, e.group_size, e.payload_bytes) for e in forward.events + backward.events]
        total = total + loss.detach()
    return total, phases, order


def _by_kind(order: list, kind: str) -> list:
    """The collectives of one kind, in issue order. Across kinds the order may differ from
    torch's: shardwise issues an HSDP all-reduce when it finishes the reduce-scatter before
    it (reduce.py: at the next state's post-backward), so after the reduce-scatter of the
    block's other group; torch issues it right behind its own reduce-scatter."""
    return [e for e in order if e[0] == kind]


def _train_like_torch(variant: str, micro_batches: int = 1, before=None, reshard: bool | int = True) -> list[list]:
    """A few AdamW steps of ours and torch's, compared after each backward and each step;
    returns our collective tallies per step."""
    ours, theirs, expert_info = _build(variant, reshard=reshard)
    assert len(get_state(ours.layers[0]).groups) == 2, get_state(ours.layers[0]).groups
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ours, theirs)]
    gen = generator(dist.get_rank())
    tallies = []
    for step in range(STEPS):
        batches = token_batches(gen, DIMS["vocab_size"], micro_batches, seq_len=SEQ)
        loss, counts, order = _step(ours, opts[0], batches, before)
        torch_loss, torch_counts, torch_order = _step(theirs, opts[1], batches, before)
        _same(f"loss at step {step}", loss, torch_loss)
        assert counts == torch_counts, f"step {step}: collectives per phase {counts} vs torch {torch_counts}"
        for kind in ("all_gather", "reduce_scatter", "all_reduce"):  # across kinds, see _by_kind
            mine, torch_kind = _by_kind(order, kind), _by_kind(torch_order, kind)
            assert mine == torch_kind, f"step {step}: {kind}s in order {mine} vs torch {torch_kind}"
        _check_like_torch(f"step {step} after backward", ours, theirs, expert_info.mesh)
        for opt in opts:
            opt.step()
        _check_like_torch(f"step {step} after AdamW", ours, theirs, expert_info.mesh)
        tallies.append(counts)
    return tallies


# ---------------------------------------------------------------- training parity


@pytest.mark.parametrize("world,variant", VARIANTS, ids=IDS)
def test_experts_on_their_mesh_train_like_torch(world, variant):
    tallies = run_on_ranks(_train_like_torch, world, variant, timeout=TIMEOUT)[0]
    # 2 blocks and the root, each 2 groups (dense, experts). Experts on a shard of one rank
    # (hsdp at 2 ranks) gather nothing and only all-reduce over the replicate dim.
    experts_sharded = variant == "submesh" or world == 4
    gathers = 6 if experts_sharded else 3
    forward, backward = tallies[-1]
    assert forward == {"all_gather": gathers}, forward
    root_gathers = 2 if experts_sharded else 1  # the root keeps its params for backward
    want = {"all_gather": gathers - root_gathers, "reduce_scatter": 6 if experts_sharded else 3}
    if variant == "hsdp":
        want["all_reduce"] = 3
    assert backward == want, backward


def test_int_reshard_after_forward_on_each_mesh_like_torch():
    """reshard_after_forward=2 at 4 ranks: the dense group keeps a 2-rank shard after
    forward; the experts' sub-mesh has 2 ranks, so theirs is a full reshard. Each group
    reads the int against its own mesh, as torch's do."""
    tallies = run_on_ranks(_train_like_torch, 4, "submesh", 1, None, 2, timeout=TIMEOUT)[0]
    assert tallies[-1][1]["all_gather"] == 4, tallies[-1]  # backward re-gathers both blocks' two groups


def _no_sync_then_sync(model: nn.Module, i: int, n: int) -> None:
    model.set_requires_gradient_sync(i == n - 1)


def _accumulate_like_torch(variant: str) -> list[list]:
    return _train_like_torch(variant, micro_batches=3, before=_no_sync_then_sync)


@pytest.mark.parametrize("world,variant", VARIANTS, ids=IDS)
def test_gradient_accumulation_without_sync_like_torch(world, variant):
    tallies = run_on_ranks(_accumulate_like_torch, world, variant, timeout=TIMEOUT)[0]
    phases = tallies[-1]  # (forward, backward) per micro-batch
    for backward in phases[1:-2:2]:  # sync off: no reduction
        assert "reduce_scatter" not in backward and "all_reduce" not in backward, phases
    assert phases[-1].get("reduce_scatter", 0) > 0, phases


# ---------------------------------------------------------------- unshard / reshard by hand


def _unshard_by_hand(variant: str) -> dict:
    ours, theirs, _ = _build(variant)
    batch = token_batches(generator(dist.get_rank()), DIMS["vocab_size"], 1, seq_len=SEQ)[0]
    for model in (ours, theirs):
        lm_loss(model, batch)  # lazy init; blocks resharded after forward
    counts = {}
    for name, model in (("ours", ours), ("torch", theirs)):
        block = model.layers[0]
        with CommCounter() as sync:
            block.unshard()
        unsharded = [(n, type(p).__name__, tuple(p.shape)) for n, p in block.named_parameters()]
        block.reshard()
        with CommCounter() as asynchronous:
            handle = block.unshard(async_op=True)
            handle.wait()
        gathered_again = all(not isinstance(p, DTensor) for p in block.parameters())
        block.reshard()
        resharded = all(isinstance(p, DTensor) for p in block.parameters())
        counts[name] = (tally(sync.events), tally(asynchronous.events), unsharded, gathered_again, resharded)
    assert counts["ours"] == counts["torch"], counts
    for model in (ours, theirs):  # a per-call comm would be ambiguous across meshes (torch's words)
        with pytest.raises(ValueError, match="multiple param groups"):
            model.layers[0].set_all_reduce_hook(lambda reduced: None)
    loss = lm_loss(ours, batch)
    torch_loss = lm_loss(theirs, batch)
    _same("loss after unshard/reshard by hand", loss, torch_loss)
    return counts["ours"]


@pytest.mark.parametrize("world,variant", VARIANTS[:2], ids=IDS[:2])
def test_unshard_and_reshard_by_hand(world, variant):
    sync, asynchronous, unsharded, gathered_again, resharded = run_on_ranks(
        _unshard_by_hand, world, variant, timeout=TIMEOUT
    )[0]
    assert sync == asynchronous == {"all_gather": 2}, (sync, asynchronous)  # one per mesh
    assert {kind for _, kind, _ in unsharded} == {"Parameter"}, unsharded
    assert gathered_again and resharded


# ---------------------------------------------------------------- state dict


def _state_dict_round_trip(variant: str) -> list:
    ours, theirs, expert_info = _build(variant)
    batch = token_batches(generator(dist.get_rank()), DIMS["vocab_size"], 1, seq_len=SEQ)[0]
    for model in (ours, theirs):
        lm_loss(model, batch).backward()  # the root keeps its params gathered after forward
    sd, torch_sd = ours.state_dict(), theirs.state_dict()
    assert list(sd) == list(torch_sd), (list(sd), list(torch_sd))
    layout = []
    for key, value in sd.items():
        want = torch_sd[key]
        assert isinstance(value, DTensor) and value.placements == want.placements, (key, value, want)
        assert value.device_mesh == want.device_mesh, (key, value.device_mesh, want.device_mesh)
        _same(f"state_dict {key}", value.to_local(), want.to_local())
        layout.append((key, str(value.placements), value.device_mesh.mesh_dim_names))
    fresh, _, _ = _build(variant, seed=1)
    fresh.load_state_dict(sd)
    for (key, value), (name, p) in zip(sd.items(), fresh.named_parameters()):
        assert key == name and p.device_mesh == value.device_mesh, (key, name)
        _same(f"loaded {key}", p.to_local(), value.to_local())
    _same("loss after loading", lm_loss(fresh, batch), lm_loss(ours, batch))
    return layout


@pytest.mark.parametrize("world,variant", VARIANTS, ids=IDS)
def test_state_dict_round_trips(world, variant):
    layout = run_on_ranks(_state_dict_round_trip, world, variant, timeout=TIMEOUT)[0]
    experts = {meshes for key, _, meshes in layout if _is_expert(key)}
    dense = {meshes for key, _, meshes in layout if not _is_expert(key)}
    assert dense == {("dp",)}, dense
    assert experts == ({("dp_mod_ep",)} if variant == "submesh" else {("ep_replicate", "edp")}), experts


def _one_info_object_per_process_group() -> dict[str, str]:
    """A shard_placement_fn that makes a new FSDPMeshInfo on every call: two expert params
    on one process group through two objects. Both libraries refuse it the same way."""
    dense, expert_info = _meshes("submesh")

    def placement(param: nn.Parameter):
        if param.dim() == 2 and param.shape[0] == DIMS["ffn_hidden"]:  # the feed-forward input projection
            info = FSDPMeshInfo(mesh=expert_info.mesh, shard_mesh_dim=expert_info.shard_mesh_dim)
            return ShardPlacementResult(placement=Shard(0), mesh_info=info)
        return None

    errors = {}
    for name, fully_shard in (("shardwise", shardwise.fully_shard), ("torch", torch_fully_shard)):
        torch.manual_seed(0)
        block = Transformer(**DIMS).layers[0]
        block.feed_forward.gate = nn.Linear(DIMS["dim"], DIMS["ffn_hidden"])  # a second param of that shape
        with pytest.raises(ValueError, match="same FSDPMeshInfo object") as err:
            fully_shard(block, mesh=dense, shard_placement_fn=placement)
        errors[name] = str(err.value)
    return errors


def test_params_on_one_process_group_need_one_mesh_info_object_like_torch():
    errors = run_on_ranks(_one_info_object_per_process_group, 4, timeout=TIMEOUT)[0]
    assert "feed_forward" in errors["shardwise"], errors
