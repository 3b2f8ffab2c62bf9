"""Reshard policies: ``reshard_after_forward`` as an int, and the runtime setters.

Every case trains shardwise, torch's FSDP2 (same knobs) and an all-reduced replica side by
side on real gloo ranks (:class:`_control_helpers.Trio`): losses, ``full_tensor()`` of
params and grads vs the replica and ``to_local()`` vs torch every step; collectives per
phase counted with ``CommCounter`` for both and required equal.

``reshard_after_forward=k`` keeps, after forward, a shard over blocks of ``k`` ranks, so
backward all-gathers over ``k`` ranks: the all-gather output (CommCounter's payload) is
the same unsharded size, but each rank sends ``(k-1)/k`` of it instead of ``(N-1)/N``.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor

import shardwise
from _control_helpers import Stack, Trio, batch, catch_warnings, is_sharded, make_trio, mse, rank_gen, same_phases, shard_stack
from shardwise.testing import run_on_ranks

TIMEOUT = 90
N_LAYERS = 3
STEPS = 3


def _wire(payload: int, group: int) -> float:
    return payload * (group - 1) / group


def _forward_backward(xy, after_forward=None):
    def fn(model, rec):
        loss = mse(model, xy)
        rec.mark("forward")
        if after_forward is not None and rec.sharded:
            after_forward(model)
        loss.backward()
        rec.mark("backward")
        return loss

    return fn


# ---------------------------------------------------------------- int reshard_after_forward


def _int_reshard(k: int) -> None:
    world, n = dist.get_world_size(), N_LAYERS
    ours, theirs, ref = make_trio(Stack, lambda m, fs: shard_stack(m, fs, reshard_after_forward=k))
    trio = Trio(ours, theirs, ref)
    gen = rank_gen()

    def after_forward(model):
        for i, layer in enumerate(model.layers):
            assert is_sharded(layer), f"layers.{i} after forward with reshard_after_forward={k}: not DTensors"
            for name, p in layer.named_parameters():
                assert p.device_mesh.size() == world, f"layers.{i}.{name} registered on {p.device_mesh}"

    for step in range(STEPS):
        res = trio.run(_forward_backward(batch(gen), after_forward))
        where = f"k={k}, step {step}, rank {dist.get_rank()}"
        phases = same_phases(res, where)
        assert phases["forward"] == {"all_gather": n + 1}, where
        assert phases["backward"] == {"all_gather": n, "reduce_scatter": n + 1}, where
        forward_ag = [e for e in res.ours.phase_events("forward") if e[0] == "all_gather"]
        backward_ag = [e for e in res.ours.phase_events("backward") if e[0] == "all_gather"]
        assert all(g == world for _, _, g in forward_ag), f"{where}: forward gathers {forward_ag}"
        assert all(g == k for _, _, g in backward_ag), f"{where}: backward gathers over {backward_ag}, want k={k}"
        block_payload = forward_ag[1][1]  # blocks are identical
        for _, payload, group in backward_ag:
            assert payload == block_payload, f"{where}: backward payload {payload} vs forward {block_payload}"
            assert _wire(payload, group) < _wire(block_payload, world), f"{where}: backward sends no less"
        if res.torch is not None:
            for phase in ("forward", "backward"):
                mine, theirs_ = sorted(res.ours.phase_events(phase)), sorted(res.torch.phase_events(phase))
                assert mine == theirs_, f"{where}: {phase} (kind, bytes, group): ours {mine}, torch {theirs_}"


@pytest.mark.parametrize("world_size,k", [(4, 2), (8, 2), (8, 4)])
def test_int_reshard_after_forward_parity_and_gather_group(world_size, k):
    run_on_ranks(_int_reshard, world_size, k, timeout=TIMEOUT)


def _int_reshard_edge_cases() -> None:
    """At 4 ranks: k=1 warns and is False, k=4 is True, k not dividing 4 is a ValueError."""
    n, rank = N_LAYERS, dist.get_rank()
    for bad in (3, 0, 8, -2):
        for fs in (shardwise.fully_shard, torch_fully_shard):
            with pytest.raises(ValueError):
                fs(torch.nn.Linear(4, 4), reshard_after_forward=bad)

    trios, caught = {}, None
    for k in (1, 4):
        (ours, theirs, ref), warned = catch_warnings(
            lambda: make_trio(Stack, lambda m, fs: shard_stack(m, fs, reshard_after_forward=k))
        )
        if k == 1:
            caught = [str(w.message) for w in warned if "reshard_after_forward" in str(w.message)]
        trios[k] = Trio(ours, theirs, ref)
    assert caught, f"rank {rank}: reshard_after_forward=1 did not warn"

    gen = rank_gen()
    for step in range(2):
        xy = batch(gen)
        for k, keeps in ((1, True), (4, False)):

            def after_forward(model, keeps=keeps):
                for i, layer in enumerate(model.layers):
                    assert is_sharded(layer) != keeps, f"k={k}: layers.{i} sharded={is_sharded(layer)} after forward"

            res = trios[k].run(_forward_backward(xy, after_forward))
            phases = same_phases(res, f"k={k}, step {step}, rank {rank}")
            backward = {"reduce_scatter": n + 1} if keeps else {"all_gather": n, "reduce_scatter": n + 1}
            assert phases["backward"] == backward, f"k={k}: backward {phases['backward']}"
            if not keeps:
                groups = {g for kind, _, g in res.ours.phase_events("backward") if kind == "all_gather"}
                assert groups == {4}, f"k=4 should gather over all 4 ranks in backward, got {groups}"


def test_int_reshard_edge_cases():
    run_on_ranks(_int_reshard_edge_cases, 4, timeout=TIMEOUT)


# ---------------------------------------------------------------- runtime setters


def _runtime_setters() -> None:
    n, rank = N_LAYERS, dist.get_rank()
    ours, theirs, ref = make_trio(Stack, shard_stack)
    trio = Trio(ours, theirs, ref)
    gen = rank_gen()

    def both(action):
        action(ours)
        action(theirs)

    def run(label, expect_backward_ag, kept):
        """One step; ``kept``: which modules keep unsharded params after forward."""

        def after_forward(model):
            for name, module in (("root", model.out), *((f"layers.{i}", l) for i, l in enumerate(model.layers))):
                assert is_sharded(module) != (name in kept), f"{label}: {name} sharded={is_sharded(module)} after forward"

        res = trio.run(_forward_backward(batch(gen), after_forward))
        phases = same_phases(res, f"{label}, rank {rank}")
        backward = {"reduce_scatter": n + 1, **({"all_gather": expect_backward_ag} if expect_backward_ag else {})}
        assert phases == {"forward": {"all_gather": n + 1}, "backward": backward, "end": {}}, f"{label}: {phases}"

    every = {"root", *(f"layers.{i}" for i in range(n))}
    run("default (root keeps)", n, {"root"})
    both(lambda m: m.set_reshard_after_forward(True))
    run("set_reshard_after_forward(True)", n + 1, set())
    both(lambda m: m.set_reshard_after_forward(False))
    run("set_reshard_after_forward(False)", 0, every)
    both(lambda m: m.set_reshard_after_forward(True, recurse=False))
    run("root only True (recurse=False)", 1, every - {"root"})
    both(lambda m: m.layers[1].set_reshard_after_forward(True, recurse=False))
    run("+ layers.1 True (recurse=False)", 2, every - {"root", "layers.1"})

    # reshard_after_backward=False keeps everything gathered: the next forward gathers nothing.
    both(lambda m: m.set_reshard_after_forward(False))
    both(lambda m: m.set_reshard_after_backward(False))
    def two_microbatches(root_only: bool):
        mb = [batch(gen), batch(gen)]

        def fn(model, rec):
            loss = mse(model, mb[0])
            rec.mark("forward 1")
            loss.backward()
            rec.mark("backward 1")
            for name, p in model.named_parameters() if rec.sharded else ():
                kept = not name.startswith("layers.") or not root_only
                assert isinstance(p, DTensor) != kept, f"{name} after backward 1 (root_only={root_only}): {type(p)}"
            if rec.sharded:
                model.set_reshard_after_backward(True)
            loss2 = mse(model, mb[1])
            rec.mark("forward 2")
            loss2.backward()
            rec.mark("backward 2")
            if rec.sharded:
                model.set_reshard_after_backward(False, recurse=not root_only)
            return loss + loss2

        return fn

    res = trio.run(two_microbatches(root_only=False))
    phases = same_phases(res, f"reshard_after_backward, rank {rank}")
    assert phases["forward 1"] == {"all_gather": n + 1}, phases
    assert phases["forward 2"] == {}, f"forward after a backward that kept params gathered: {phases['forward 2']}"
    assert phases["backward 1"] == phases["backward 2"] == {"reduce_scatter": n + 1}, phases

    # recurse=False: only the root keeps its params after backward.
    both(lambda m: m.set_reshard_after_backward(True))
    both(lambda m: m.set_reshard_after_backward(False, recurse=False))
    res = trio.run(two_microbatches(root_only=True))
    phases = same_phases(res, f"root-only reshard_after_backward, rank {rank}")
    assert phases["forward 1"] == {"all_gather": n + 1}, phases
    assert phases["forward 2"] == {"all_gather": n}, f"only the root should stay gathered: {phases['forward 2']}"


def test_runtime_reshard_setters():
    run_on_ranks(_runtime_setters, 2, timeout=TIMEOUT)


def _post_forward_group_on_a_fresh_mesh() -> list[int]:
    from torch.distributed.device_mesh import init_device_mesh

    from shardwise.mesh import MeshInfo, post_forward_group

    info = MeshInfo(init_device_mesh("cpu", (4,)), shard_mesh_dim=0, replicate_mesh_dim=None)
    group = post_forward_group(info, 2).group
    dist.all_reduce(torch.ones(1), group=group)  # a live group: it works
    return dist.get_process_group_ranks(group)  # (torch forgets a destroyed one: KeyError)


def test_int_reshard_group_is_made_again_once_destroyed():
    """The post-forward groups of an int reshard are made once per (mesh, k); one that was
    destroyed (a job re-initialising; here the test pool, which destroys the groups each
    task made) must be made again for the next model on an equal mesh, not returned dead."""
    expected = [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert run_on_ranks(_post_forward_group_on_a_fresh_mesh, 4) == expected
    assert run_on_ranks(_post_forward_group_on_a_fresh_mesh, 4) == expected  # after the pool destroyed it
