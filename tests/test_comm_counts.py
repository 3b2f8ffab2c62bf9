"""Collectives per training step, counted at the c10d dispatcher, against torch's FSDP2.

For a transformer of N blocks, each block and the root one ``fully_shard`` group:

- forward: N+1 all-gathers (one per group);
- backward: N+1 reduce-scatters, and the all-gathers of the groups resharded after
  forward: N for ``reshard_after_forward=None`` (the root keeps its parameters), N+1 for
  True, 0 for False;
- nothing else, in the first step (lazy init must not add a collective) and later ones.

torch's ``fully_shard`` trains a copy of the same model in the same test and must issue
the same counts. The payload of each of our all-gathers (and reductions) is the group's
padded unsharded size: ``N_ranks * sum(ceil(dim0 / N_ranks) * numel_per_row)`` elements.

By default the collectives are exactly torch's. With
``SHARDWISE_GLOO_REDUCE_SCATTER=all_to_all`` shardwise reduces on gloo with an all-to-all
plus a local sum (``shardwise.collectives.use_all_to_all_reduce``, faster on gloo); there
each of our all-to-alls stands for one of torch's reduce-scatters.
"""

from __future__ import annotations

import copy
import math
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import fully_shard as torch_fully_shard

import shardwise
from shardwise import collectives
from _models import Transformer, apply_fully_shard, lm_loss, rank_generator, token_batch
from shardwise.testing import CommCounter, run_on_ranks

TIMEOUT = 60
STEPS = 3
REDUCE_ENV = "SHARDWISE_GLOO_REDUCE_SCATTER"
REDUCTIONS = ("reduce_scatter", "all_to_all")

# ---------------------------------------------------------------- helpers (run on the ranks)


def _padded_bytes(params: list[nn.Parameter], world: int) -> int:
    """Bytes of one group's all-gather output (or reduce-scatter input): padded on dim 0."""
    numel = sum(math.ceil(p.size(0) / world) * world * (p.numel() // p.size(0)) for p in params)
    return numel * params[0].element_size()


def _group_bytes(model: Transformer, world: int) -> tuple[int, list[int]]:
    """(root group bytes, [block group bytes]) for the unsharded model ``model``."""
    block_params = {id(p) for layer in model.layers for p in layer.parameters()}
    root = [p for p in model.parameters() if id(p) not in block_params]
    return _padded_bytes(root, world), [_padded_bytes(list(layer.parameters()), world) for layer in model.layers]


def _count_steps(model: nn.Module, opt: torch.optim.Optimizer, vocab_size: int) -> list[dict]:
    """Per step: the forward and backward tallies and the all-gather payloads in issue order."""
    gen = rank_generator()
    steps = []
    for _ in range(STEPS):
        tokens = token_batch(gen, vocab_size)
        opt.zero_grad()
        with CommCounter() as comm:
            loss = lm_loss(model, tokens)
            forward = comm.snapshot()
            forward_events = list(comm.events)
            loss.backward()
            backward = comm.snapshot() - forward
            backward_events = comm.events[len(forward_events) :]
        opt.step()  # outside the counter: DTensor's sharding propagation fails under a dispatch mode
        steps.append(
            {
                "forward": dict(forward.counts),
                "backward": dict(backward.counts),
                "forward_all_gather_bytes": [e.payload_bytes for e in forward_events if e.kind == "all_gather"],
                "backward_all_gather_bytes": sorted(e.payload_bytes for e in backward_events if e.kind == "all_gather"),
                "reduction_bytes": sorted(e.payload_bytes for e in backward_events if e.kind in REDUCTIONS),
                "loss": loss.item(),
            }
        )
    return steps


def _comm_counts(n_layers: int, reshard_after_forward: bool | None, all_to_all_reduce: bool):
    torch.manual_seed(0)
    dims = dict(vocab_size=32, dim=16, n_layers=n_layers, n_heads=2, max_seq_len=8, ffn_hidden=32)
    base = Transformer(**dims)
    root_bytes, block_bytes = _group_bytes(base, dist.get_world_size())
    theirs = apply_fully_shard(copy.deepcopy(base), torch_fully_shard, reshard_after_forward=reshard_after_forward)
    ours = apply_fully_shard(base, shardwise.fully_shard, reshard_after_forward=reshard_after_forward)
    saved = os.environ.get(REDUCE_ENV)
    if all_to_all_reduce:
        os.environ[REDUCE_ENV] = "all_to_all"
    try:
        group = next(ours.parameters()).device_mesh.get_group(0)
        reduction = "all_to_all" if collectives.use_all_to_all_reduce(group) else "reduce_scatter"
        result = {}
        for name, model in (("ours", ours), ("torch", theirs)):
            opt = torch.optim.Adam(model.parameters(), lr=1e-2, foreach=True)
            result[name] = _count_steps(model, opt, dims["vocab_size"])
    finally:
        if saved is None:
            os.environ.pop(REDUCE_ENV, None)
        else:
            os.environ[REDUCE_ENV] = saved
    return result, root_bytes, block_bytes, reduction


# ---------------------------------------------------------------- tests


@pytest.mark.parametrize(
    "world_size,n_layers,reshard_after_forward,all_to_all_reduce",
    [(2, 2, None, False), (2, 2, True, False), (2, 2, False, False), (4, 3, None, False), (2, 2, None, True)],
    ids=["2-2-None", "2-2-True", "2-2-False", "4-3-None", "2-2-None-all_to_all_reduce"],
)
def test_collectives_per_step_match_torch(world_size, n_layers, reshard_after_forward, all_to_all_reduce):
    groups = n_layers + 1
    backward_all_gathers = {None: n_layers, True: groups, False: 0}[reshard_after_forward]
    expected_forward = {"all_gather": groups}
    per_rank = run_on_ranks(_comm_counts, world_size, n_layers, reshard_after_forward, all_to_all_reduce, timeout=TIMEOUT)
    for rank, (result, root_bytes, block_bytes, reduction) in enumerate(per_rank):
        wanted = "all_to_all" if all_to_all_reduce else "reduce_scatter"
        assert reduction == wanted, f"{REDUCE_ENV}={os.environ.get(REDUCE_ENV)!r}: reduces with {reduction}"
        expected_backward = {reduction: groups}
        if backward_all_gathers:
            expected_backward["all_gather"] = backward_all_gathers
        ours, theirs = result["ours"], result["torch"]
        for step, (mine, ref) in enumerate(zip(ours, theirs), start=1):
            where = f"rank {rank}, step {step}"
            assert mine["forward"] == expected_forward, f"{where}: our forward issued {mine['forward']}"
            assert mine["backward"] == expected_backward, f"{where}: our backward issued {mine['backward']}"
            as_torch = {("reduce_scatter" if k == reduction else k): v for k, v in mine["backward"].items()}
            assert (mine["forward"], as_torch) == (ref["forward"], ref["backward"]), (
                f"{where}: ours {mine['forward']} / {mine['backward']}, torch {ref['forward']} / {ref['backward']}"
            )
            # Forward gathers the root first, then each block in order.
            assert mine["forward_all_gather_bytes"] == [root_bytes, *block_bytes], where
            gathered_again = sorted(([root_bytes] if reshard_after_forward else []) + block_bytes)
            assert mine["backward_all_gather_bytes"] == (gathered_again if backward_all_gathers else []), where
            assert mine["reduction_bytes"] == sorted([root_bytes, *block_bytes]), where
            assert mine["loss"] == pytest.approx(ref["loss"], rel=1e-5, abs=1e-6), where
