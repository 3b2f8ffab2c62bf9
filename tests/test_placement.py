"""``shard_placement_fn``: shard every parameter of a transformer on its largest dim.

Dims are chosen divisible by the 4 shard ranks (``Shard(d != 0)`` must divide evenly) and
so that several parameters are sharded on dim 1 (embeddings wider than the vocabulary,
the feed-forward's down projection, the output head). Each step is compared with a plain
replica (``full_tensor()``) and with torch's fully_shard given the same function
(placements and ``to_local()``). Parameters, gradients and the unsharded parameters the
modules see in forward (checked in a forward pre-hook on every leaf module: plain
unsharded ``nn.Parameter``s, not DTensors) must be contiguous.

``shard_placement_fn`` may also return torch's ``ShardPlacementResult`` (a placement and a
per-parameter mesh; torchtitan's MoE path puts experts on their own mesh that way): the
feed-forward of each block is sharded on an "expert" mesh of its own, trained against
torch given the same function. Params of one call on two meshes (one group per mesh, as
torch) are tested in test_per_param_mesh.py.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo, ShardPlacementResult
from torch.distributed.tensor import DTensor, Shard

import shardwise
from _models import Transformer
from _nd_helpers import TIMEOUT, generator, make_mesh, token_batches, train
from shardwise.testing import run_on_ranks

STEPS = 3
SEQ = 4
# tok (8, 16) -> Shard(1); pos (4, 16) -> Shard(1); qkv (48, 16) -> Shard(0); wo (16, 16) ->
# Shard(0); in_proj (32, 16) -> Shard(0); out_proj (16, 32) -> Shard(1); output (8, 16) -> Shard(1)
DIMS = dict(vocab_size=8, dim=16, n_layers=2, n_heads=2, max_seq_len=SEQ, ffn_hidden=32)


def _largest_dim(param: nn.Parameter) -> Shard:
    return Shard(max(range(param.dim()), key=lambda d: param.size(d)))


def _record_contiguity(model: nn.Module, seen: list) -> None:
    """A forward pre-hook on every leaf module records each parameter it is about to use."""

    def hook(module, args):
        for name, p in module.named_parameters(recurse=False):
            seen.append((name, type(p).__name__, tuple(p.shape), p.is_contiguous()))

    for module in model.modules():
        if not list(module.children()):
            module.register_forward_pre_hook(hook)


def _shard(model, fully_shard_fn, mesh, **kwargs):
    for layer in model.layers:
        fully_shard_fn(layer, mesh=mesh, **kwargs)
    return fully_shard_fn(model, mesh=mesh, **kwargs)


def _placement(mesh_shape: tuple) -> dict:
    hsdp = len(mesh_shape) == 2
    mesh = make_mesh(mesh_shape, ("replicate", "shard") if hsdp else None)
    torch.manual_seed(0)
    base = Transformer(**DIMS)
    ref = copy.deepcopy(base)
    expected = {name: _largest_dim(p) for name, p in base.named_parameters()}
    theirs = _shard(copy.deepcopy(base), torch_fully_shard, mesh, shard_placement_fn=_largest_dim)
    ours = _shard(base, shardwise.fully_shard, mesh, shard_placement_fn=_largest_dim)
    for name, p in ours.named_parameters():
        assert isinstance(p, DTensor) and p.placements[-1] == expected[name], f"{name}: {p.placements}"
    seen: list = []
    _record_contiguity(ours, seen)
    gen = generator(dist.get_rank())
    batches = [token_batches(gen, DIMS["vocab_size"], 1, seq_len=SEQ) for _ in range(STEPS)]
    train(ours, ref, theirs, batches)
    sharded = [(n, p.to_local().is_contiguous(), p.grad.to_local().is_contiguous()) for n, p in ours.named_parameters()]
    return {
        "dims": sorted({e.dim for e in expected.values()}),
        "sharded_not_contiguous": [s for s in sharded if not (s[1] and s[2])],
        "forward_not_contiguous": sorted({s for s in seen if not s[3]}),
        "forward_seen": len(seen),
        "forward_types": sorted({s[1] for s in seen}),
    }


@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2)], ids=["fsdp", "hsdp"])
def test_shard_largest_dim(mesh_shape):
    for rank, result in enumerate(run_on_ranks(_placement, 4, mesh_shape, timeout=TIMEOUT)):
        assert result["dims"] == [0, 1], result["dims"]
        assert result["sharded_not_contiguous"] == [], f"rank {rank}: {result['sharded_not_contiguous']}"
        assert result["forward_not_contiguous"] == [], f"rank {rank}: {result['forward_not_contiguous']}"
        assert result["forward_seen"] > 0 and result["forward_types"] == ["Parameter"], result


def _per_param_mesh() -> None:
    mesh, expert_mesh = make_mesh((2,), ("dp",)), make_mesh((2,), ("edp",))
    expert_info = FSDPMeshInfo(mesh=expert_mesh, shard_mesh_dim=0)

    def on_expert_mesh(param: nn.Parameter) -> ShardPlacementResult:
        return ShardPlacementResult(placement=Shard(0), mesh_info=expert_info)

    def shard(model, fully_shard_fn):
        for layer in model.layers:
            fully_shard_fn(layer.feed_forward, mesh=mesh, shard_placement_fn=on_expert_mesh)
        return _shard(model, fully_shard_fn, mesh)

    torch.manual_seed(0)
    base = Transformer(**DIMS)
    ref = copy.deepcopy(base)
    theirs = shard(copy.deepcopy(base), torch_fully_shard)
    ours = shard(base, shardwise.fully_shard)
    for name, p in ours.named_parameters():
        want = ("edp",) if ".feed_forward." in name else ("dp",)
        assert p.device_mesh.mesh_dim_names == want, f"{name}: on {p.device_mesh}"
    gen = generator(dist.get_rank())
    train(ours, ref, theirs, [token_batches(gen, DIMS["vocab_size"], 1, seq_len=SEQ) for _ in range(STEPS)])


def test_shard_placement_result_per_parameter_mesh():
    run_on_ranks(_per_param_mesh, 2, timeout=TIMEOUT)
