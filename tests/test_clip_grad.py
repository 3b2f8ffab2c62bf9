"""Gradient clipping on sharded models: the global norm, and grads clipped like the reference.

Per step the clipping norm alternates 2, inf, 2 and ``max_norm`` is below every step's
norm, so clipping really scales. The reference is a plain replica (grads averaged over
the data-parallel ranks, then ``torch.nn.utils.clip_grad_norm_``); the clipped grads are
compared every step by :func:`_nd_helpers.check_step` (``full_tensor()`` vs the reference,
``to_local()`` vs torch's fully_shard clipped the same way).

- 1-D FSDP, HSDP and a TP model whose every parameter ends on the (dp, tp) mesh: all grads
  share one mesh, and torch's own ``clip_grad_norm_`` works on shardwise's DTensor grads;
  ``shardwise.clip_grad_norm_`` must report the same norm.
- Mixed meshes (TP blocks on (dp, tp), embeddings/norm/head on dp): torch's helper fails
  (the error is recorded and must occur); ``shardwise.clip_grad_norm_`` returns the right
  norm and clips identically.
"""

from __future__ import annotations

import copy
import logging
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import shardwise
from _models import Transformer
from _nd_helpers import (
    TIMEOUT,
    FeedForward,
    TPTransformer,
    generator,
    lm_loss,
    make_mesh,
    parallelize,
    token_batches,
    train,
)
from shardwise.testing import run_on_ranks

STEPS = 3
NORM_TYPES = [2.0, math.inf, 2.0]  # per step
MAX_NORM = 0.01
DIMS = dict(vocab_size=17, dim=8, n_layers=2, n_heads=2, max_seq_len=8, ffn_hidden=12)
TP_DIMS = dict(vocab_size=16, dim=8, n_layers=2, n_heads=2, hidden=10, max_seq_len=8)


class FFNStack(nn.Module):
    """Residual feed-forward blocks only: with TP every parameter is a (dp, tp) DTensor."""

    def __init__(self, dim: int = 8, hidden: int = 10, n_layers: int = 2):
        super().__init__()
        self.layers = nn.ModuleList(FeedForward(dim, hidden) for _ in range(n_layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + layer(x)
        return x


def _mse(model: nn.Module, batch: tuple) -> torch.Tensor:
    x, y = batch
    return F.mse_loss(model(x), y)


def _build(kind: str):
    """(base model, mesh, dp mesh, how to TP it, batches maker, loss)."""
    torch.manual_seed(0)
    if kind in ("fsdp", "hsdp"):
        mesh = make_mesh((4,), None) if kind == "fsdp" else make_mesh((2, 2), ("replicate", "shard"))
        gen = generator(dist.get_rank())
        batches = [token_batches(gen, DIMS["vocab_size"], 1) for _ in range(STEPS)]
        return Transformer(**DIMS), mesh, None, batches, lm_loss
    mesh = make_mesh((2, 2), ("dp", "tp"))
    gen = generator(mesh.get_local_rank("dp"))
    if kind == "tp":
        batches = [[(torch.randn(4, 8, generator=gen), torch.randn(4, 8, generator=gen))] for _ in range(STEPS)]
        return FFNStack(), mesh["dp"], mesh["tp"], batches, _mse
    batches = [token_batches(gen, TP_DIMS["vocab_size"], 1) for _ in range(STEPS)]
    return TPTransformer(**TP_DIMS), mesh["dp"], mesh["tp"], batches, lm_loss


def _tensor_parallel(model: nn.Module, tp_mesh) -> nn.Module:
    if isinstance(model, FFNStack):
        for layer in model.layers:
            parallelize_module(layer, tp_mesh, {"w1": ColwiseParallel(), "w2": RowwiseParallel()})
        return model
    return parallelize(model, tp_mesh)


def _shard(model: nn.Module, fully_shard_fn, mesh) -> nn.Module:
    for layer in model.layers:
        fully_shard_fn(layer, mesh=mesh)
    return fully_shard_fn(model, mesh=mesh)


def _scalar(norm: torch.Tensor) -> torch.Tensor:
    return (norm.full_tensor() if isinstance(norm, DTensor) else norm).detach().float().cpu()


def _clip(kind: str) -> dict:
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    base, mesh, tp_mesh, batches, loss_fn = _build(kind)
    ref = copy.deepcopy(base)
    copies = []
    for fully_shard_fn in (shardwise.fully_shard, torch_fully_shard):
        model = copy.deepcopy(base)
        if tp_mesh is not None:
            _tensor_parallel(model, tp_mesh)
        copies.append(_shard(model, fully_shard_fn, mesh))
    ours, theirs = copies
    meshes = {tuple(p.device_mesh.mesh_dim_names or ()) for p in ours.parameters()}
    record = {"meshes": sorted(meshes), "torch_helper_errors": [], "norms": []}
    step = [0]

    def clip(ours, ref, theirs):
        norm_type = NORM_TYPES[step[0]]
        step[0] += 1
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM, norm_type)
        # shardwise's helper with max_norm=inf only measures (the scale is min(1, inf) = 1)
        ours_measured = shardwise.clip_grad_norm_(ours.parameters(), math.inf, norm_type)
        if kind == "mixed":
            try:
                torch.nn.utils.clip_grad_norm_(ours.parameters(), MAX_NORM, norm_type)
                record["torch_helper_errors"].append(None)
            except Exception as err:  # must fail: grads on two meshes; recorded
                record["torch_helper_errors"].append(f"{type(err).__name__}: {err}"[:300])
            helper = shardwise.clip_grad_norm_
        else:
            helper = torch.nn.utils.clip_grad_norm_
        ours_norm = helper(ours.parameters(), MAX_NORM, norm_type)
        theirs_norm = helper(theirs.parameters(), MAX_NORM, norm_type)
        norms = [_scalar(n) for n in (ref_norm, ours_measured, ours_norm, theirs_norm)]
        record["norms"].append([n.item() for n in norms])
        for what, n in zip(("shardwise.clip_grad_norm_", "clip helper on ours", "clip helper on torch's"), norms[1:]):
            torch.testing.assert_close(n, norms[0], msg=lambda m, what=what: f"{kind} norm {norm_type} {what}: {m}")

    train(ours, ref, theirs, batches, loss_fn=loss_fn, after_backward=clip)
    return record


@pytest.mark.parametrize("kind", ["fsdp", "hsdp", "tp"])
def test_clip_grad_norm_one_mesh(kind):
    for rank, record in enumerate(run_on_ranks(_clip, 4, kind, timeout=TIMEOUT)):
        assert len(record["meshes"]) == 1, f"rank {rank}: grads on several meshes {record['meshes']}"
        assert all(norms[0] > MAX_NORM for norms in record["norms"]), f"nothing was clipped: {record['norms']}"
        assert len(record["norms"]) == STEPS


def test_clip_grad_norm_mixed_meshes():
    for rank, record in enumerate(run_on_ranks(_clip, 4, "mixed", timeout=TIMEOUT)):
        assert record["meshes"] == [("dp",), ("dp", "tp")], record["meshes"]
        assert all(norms[0] > MAX_NORM for norms in record["norms"]), f"nothing was clipped: {record['norms']}"
        errors = record["torch_helper_errors"]
        assert len(errors) == STEPS and all(errors), f"rank {rank}: torch's clip_grad_norm_ did not fail: {errors}"
