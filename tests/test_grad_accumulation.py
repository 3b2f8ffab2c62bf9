"""Gradient accumulation over microbatches: skipping gradient sync, keeping params gathered
between microbatches, the 1F1B pattern, and manual ``reshard()``.

Each step runs M microbatches (a backward each) on shardwise, on torch's FSDP2 driven
the same way, and on a replica whose gradients are summed over the microbatches and then
averaged over ranks; after the step the three must agree (losses, params, grads) and
shardwise must issue the same collectives as torch in every microbatch.

With N blocks plus the root (N+1 groups) and M microbatches, the reduce-scatters per step:
``N+1`` when every group skips sync until the last microbatch, ``N+1 + N(M-1)`` when only
the root skips (``recurse=False``), ``N+1 + (N-K+1)(M-1)`` when K blocks skip. All-gathers:
``2(N+1)M`` when every group reshards after forward, ``(N+1)M`` when none does, ``N+1``
when none does and none reshards after backward until the last microbatch.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from _control_helpers import Stack, Trio, batch, fsdp_modules, make_trio, mse, rank_gen, same_phases, shard_stack
from shardwise.testing import run_on_ranks

TIMEOUT = 90
N = 3  # blocks
M = 3  # microbatches per step
K = 2  # blocks that skip sync in the "blocks" case
STEPS = 2


def _sharded_only(model, rec, action):
    if rec.sharded:
        action(model)


def _skip_sync(skip: str, model, enabled: bool) -> None:
    if skip == "all":
        model.set_requires_gradient_sync(enabled)
    elif skip == "root":
        model.set_requires_gradient_sync(enabled, recurse=False)
    else:
        for layer in model.layers[:K]:
            layer.set_requires_gradient_sync(enabled)


def _accumulate(skip: str, reshard: str) -> None:
    rank = dist.get_rank()
    ours, theirs, ref = make_trio(Stack, shard_stack)
    for model in (ours, theirs):
        model.set_reshard_after_forward(reshard == "true")  # recursive: the root too
    trio = Trio(ours, theirs, ref)
    gen = rank_gen()
    for step in range(STEPS):
        microbatches = [batch(gen) for _ in range(M)]

        def fn(model, rec):
            losses = []
            for i, xy in enumerate(microbatches):
                last = i == M - 1
                if rec.sharded:
                    _skip_sync(skip, model, last)
                    if reshard == "false_keep":
                        model.set_reshard_after_backward(last)
                loss = mse(model, xy)
                rec.mark(f"forward {i}")
                loss.backward()
                rec.mark(f"backward {i}")
                losses.append(loss.detach())
            return torch.stack(losses)

        res = trio.run(fn)
        where = f"skip={skip}, reshard={reshard}, step {step}, rank {rank}"
        same_phases(res, where)
        reduce_scatters = {"all": N + 1, "root": N + 1 + N * (M - 1), "blocks": N + 1 + (N - K + 1) * (M - 1)}[skip]
        all_gathers = {"true": 2 * (N + 1) * M, "false": (N + 1) * M, "false_keep": N + 1}[reshard]
        got = (res.ours.total("all_gather"), res.ours.total("reduce_scatter"), res.ours.total())
        assert got == (all_gathers, reduce_scatters, all_gathers + reduce_scatters), (
            f"{where}: (all-gathers, reduce-scatters, all collectives) {got}, expected "
            f"({all_gathers}, {reduce_scatters}, {all_gathers + reduce_scatters}); phases {res.ours.phases()}"
        )


@pytest.mark.parametrize("reshard", ["true", "false", "false_keep"])
@pytest.mark.parametrize("skip", ["all", "root", "blocks"])
def test_skip_gradient_sync_until_last_microbatch(skip, reshard):
    run_on_ranks(_accumulate, 2, skip, reshard, timeout=TIMEOUT)


# ---------------------------------------------------------------- 1F1B-style microbatching


def _one_f_one_b() -> None:
    rank = dist.get_rank()
    ours, theirs, ref = make_trio(Stack, shard_stack)
    trio = Trio(ours, theirs, ref)
    gen = rank_gen()
    for step in range(STEPS):
        microbatches = [batch(gen) for _ in range(M)]

        def fn(model, rec):
            if rec.sharded:
                handles = [m.unshard(async_op=True) for m in fsdp_modules(model)]
                assert all(h is not None for h in handles)
            rec.mark("unshard")
            losses = []
            for i, xy in enumerate(microbatches):
                last = i == M - 1
                if rec.sharded:
                    model.set_requires_gradient_sync(last)
                    model.set_reshard_after_backward(last)
                    model.set_is_last_backward(last)
                loss = mse(model, xy)
                rec.mark(f"forward {i}")
                loss.backward()
                rec.mark(f"backward {i}")
                losses.append(loss.detach())
                if rec.sharded and not last:  # gathered params stay registered between microbatches
                    assert not any(isinstance(p, DTensor) for p in model.out.parameters()), "root resharded"
            return torch.stack(losses)

        res = trio.run(fn)
        where = f"1F1B step {step}, rank {rank}"
        phases = same_phases(res, where)
        assert phases["unshard"] == {"all_gather": N + 1}, f"{where}: {phases}"
        assert res.ours.total("reduce_scatter") == N + 1, f"{where}: {phases}"
        # the blocks reshard after forward (default) so backward gathers them; nothing else gathers
        assert res.ours.total("all_gather") == N + 1 + N * M, f"{where}: {phases}"
        for i in range(M):
            assert phases[f"forward {i}"] == {}, f"{where}: forward {i} gathered {phases[f'forward {i}']}"


def test_one_f_one_b_pattern():
    run_on_ranks(_one_f_one_b, 2, timeout=TIMEOUT)


# ---------------------------------------------------------------- manual reshard


def _manual_reshard() -> None:
    rank = dist.get_rank()
    ours, theirs, ref = make_trio(
        Stack, lambda m, fs: shard_stack(m, fs, root_kwargs=dict(reshard_after_forward=False), reshard_after_forward=False)
    )
    trio = Trio(ours, theirs, ref)
    gen = rank_gen()
    for step in range(STEPS):
        xy = batch(gen)

        def fn(model, rec):
            loss = mse(model, xy)
            rec.mark("forward")
            if rec.sharded:
                assert not any(isinstance(p, DTensor) for p in model.parameters()), "reshard_after_forward=False resharded"
                for module in fsdp_modules(model):
                    module.reshard()
                    module.reshard()  # idempotent
                assert all(isinstance(p, DTensor) for p in model.parameters()), "reshard() left unsharded params"
            rec.mark("reshard")
            loss.backward()
            rec.mark("backward")
            return loss

        res = trio.run(fn)
        phases = same_phases(res, f"manual reshard, step {step}, rank {rank}")
        assert phases["reshard"] == {}, phases
        assert phases["backward"] == {"all_gather": N + 1, "reduce_scatter": N + 1}, phases


def test_manual_reshard_between_forward_and_backward():
    run_on_ranks(_manual_reshard, 2, timeout=TIMEOUT)
