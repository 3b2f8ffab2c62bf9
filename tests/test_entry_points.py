"""The rest of the FSDPModule surface: forward methods, comm context and events, divide
factors, custom collectives, the all-reduce hook, reduce-scatter knobs, argument checks,
and interop with torch's composable ``replicate``.

Numerics are checked every step against an all-reduced replica (sum over ranks divided by
the factor the knob asks for) and, where torch's FSDP2 supports the same knob on gloo,
against torch (``to_local()`` of params and grads) with the same collectives per phase.
"""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed._composable import replicate as torch_replicate
from torch.distributed.fsdp import register_fsdp_forward_method as torch_register_forward_method
from torch.distributed.fsdp import share_comm_ctx as torch_share_comm_ctx
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather as TorchAllGather
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter as TorchReduceScatter
from torch.distributed.tensor import DTensor

import shardwise
from _control_helpers import (
    DIM,
    allreduce_grads,
    IN_DIM,
    Block,
    Stack,
    Trio,
    batch,
    catch_warnings,
    fsdp_modules,
    make_trio,
    mse,
    rank_gen,
    same_phases,
    shard_stack,
)
from _models import compare_step
from shardwise.collectives import AllGather, ReduceScatter
from shardwise.state import get_state
from shardwise.testing import run_on_ranks

TIMEOUT = 90
N = 3
STEPS = 2


def _plain_step(xy, loss_fn=mse):
    def fn(model, rec):
        loss = loss_fn(model, xy)
        rec.mark("forward")
        loss.backward()
        rec.mark("backward")
        return loss

    return fn


def _train(trio: Trio, steps: int = STEPS, *, ref_divide=None, compare_torch_counts=True, loss_fn=mse, gen=None):
    gen = gen or rank_gen()
    results = []
    for step in range(steps):
        res = trio.run(_plain_step(batch(gen), loss_fn), ref_divide=ref_divide)
        if compare_torch_counts:
            same_phases(res, f"step {step}, rank {dist.get_rank()}")
        results.append(res)
    return results


# ---------------------------------------------------------------- register_fsdp_forward_method


def _forward_method() -> None:
    ours, theirs, ref = make_trio(Stack, shard_stack)
    shardwise.register_fsdp_forward_method(ours, "forward_features")
    torch_register_forward_method(theirs, "forward_features")
    with pytest.raises(ValueError):
        shardwise.register_fsdp_forward_method(ours, "no_such_method")
    plain = nn.Linear(2, 2)
    shardwise.register_fsdp_forward_method(plain, "forward")  # not an FSDP module: a no-op
    assert "forward" not in plain.__dict__

    def features_loss(model, xy):
        x, y = xy
        return F.mse_loss(model.forward_features(x), y)

    for res in _train(Trio(ours, theirs, ref), loss_fn=features_loss):
        assert res.ours.phases()["forward"] == {"all_gather": N + 1}


def test_register_fsdp_forward_method():
    run_on_ranks(_forward_method, 2, timeout=TIMEOUT)


# ---------------------------------------------------------------- divide factors


def _divide_factor(knob: str) -> None:
    """``grads = sum / factor``. torch's setters act on the module's own group only, so both
    copies get them on every FSDP module (as torchtitan does), except in ``root_only``.
    torch uses PREMUL_SUM for a plain factor, which gloo lacks, so its copy forces SUM
    collectives (same numerics: scaling by the same factor around a SUM)."""
    world = dist.get_world_size()
    ours, theirs, ref = make_trio(Stack, shard_stack)
    factor = 3.0

    def each(model, action):
        for module in fsdp_modules(model):
            action(module)

    if knob == "divide_factor":
        each(ours, lambda m: m.set_gradient_divide_factor(factor))
    elif knob == "deprecated_alias":
        _, warned = catch_warnings(lambda: each(ours, lambda m: m.set_reduce_scatter_divide_factor(factor)))
        assert any(issubclass(w.category, (DeprecationWarning, FutureWarning)) for w in warned), [str(w) for w in warned]
    elif knob == "force_sum":  # torch: only the collectives become SUMs; grads stay the mean
        each(ours, lambda m: m.set_force_sum_reduction_for_comms(True))
        factor = float(world)
    elif knob == "force_sum_and_factor":
        each(ours, lambda m: m.set_force_sum_reduction_for_comms(True))
        each(ours, lambda m: m.set_gradient_divide_factor(factor))
    elif knob == "root_only":  # the root's own group divides by 3, the blocks keep the mean
        ours.set_gradient_divide_factor(factor)
        ref = None
    each(theirs, lambda m: m.set_force_sum_reduction_for_comms(True))
    if knob == "root_only":
        theirs.set_gradient_divide_factor(factor)
    elif knob != "force_sum":
        each(theirs, lambda m: m.set_gradient_divide_factor(factor))
    _train(Trio(ours, theirs, ref), ref_divide=factor)


@pytest.mark.parametrize("knob", ["divide_factor", "deprecated_alias", "force_sum", "force_sum_and_factor", "root_only"])
def test_gradient_divide_factor(knob):
    run_on_ranks(_divide_factor, 2, knob, timeout=TIMEOUT)


def _world_size_one(factor) -> None:
    ours, theirs, ref = make_trio(Stack, shard_stack)
    if factor is not None:
        for module in fsdp_modules(ours) + fsdp_modules(theirs):
            module.set_gradient_divide_factor(factor)
    for res in _train(Trio(ours, theirs, ref), ref_divide=factor or 1.0, compare_torch_counts=False):
        assert res.ours.total() == 0, f"world size 1 communicated: {res.ours.phases()}"


@pytest.mark.parametrize("factor", [None, 1.0, 2.0])
def test_world_size_one_divide_factor(factor):
    run_on_ranks(_world_size_one, 1, factor, timeout=TIMEOUT)


# ---------------------------------------------------------------- custom collectives


class CountingAllGather(AllGather, TorchAllGather):
    """``dist.all_gather_into_tensor``, counting calls (usable by shardwise and torch)."""

    def __init__(self):
        self.calls = 0

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        self.calls += 1
        return dist.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)


class CountingReduceScatter(ReduceScatter, TorchReduceScatter):
    """``dist.reduce_scatter_tensor``, counting calls and the ops it was asked for."""

    def __init__(self):
        self.calls = 0
        self.allocations = 0

    def allocate(self, size, *, dtype, device):
        self.allocations += 1
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        self.calls += 1
        return dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group, async_op=async_op)


def _custom_comms() -> None:
    ours, theirs, ref = make_trio(Stack, shard_stack)
    comms = {}
    for name, model in (("ours", ours), ("torch", theirs)):
        comms[name] = (CountingAllGather(), CountingReduceScatter())
        for module in fsdp_modules(model):
            module.set_custom_all_gather(comms[name][0])
            module.set_custom_reduce_scatter(comms[name][1])
    # combined with process-group allocation, as torch: after a custom comm an AssertionError;
    # before one, allowed (the custom comm overrides it)
    with pytest.raises(AssertionError):
        ours.layers[0].set_allocate_memory_from_process_group_for_comm(True)
    other = shardwise.fully_shard(nn.Linear(4, 4))
    other.set_allocate_memory_from_process_group_for_comm(True)
    other.set_custom_all_gather(CountingAllGather())
    other.set_custom_reduce_scatter(CountingReduceScatter())

    trio = Trio(ours, theirs, ref)
    gen = rank_gen()
    for step in range(STEPS):
        before = {k: (ag.calls, rs.calls) for k, (ag, rs) in comms.items()}
        with shardwise.trace() as t:
            res = trio.run(_plain_step(batch(gen)))
        phases = same_phases(res, f"custom comms, step {step}")
        ag, rs = comms["ours"]
        calls = (ag.calls - before["ours"][0], rs.calls - before["ours"][1])
        unshards, reduces = len(t.of("unshard")), len(t.of("reduce"))
        assert calls == (unshards, reduces) == (2 * N + 1, N + 1), f"custom comm calls {calls}, unshards/reduces {unshards}/{reduces}"
        assert calls == (res.ours.total("all_gather"), res.ours.total("reduce_scatter")), f"{calls} vs {phases}"
        torch_calls = tuple(c.calls - b for c, b in zip(comms["torch"], before["torch"]))
        assert calls == torch_calls, f"custom comm calls: ours {calls}, torch {torch_calls}"
    assert rs.allocations == rs.calls, f"reduce-scatter outputs not from comm.allocate: {rs.allocations}/{rs.calls}"


def test_custom_all_gather_and_reduce_scatter():
    run_on_ranks(_custom_comms, 2, timeout=TIMEOUT)


# ---------------------------------------------------------------- all-reduce hook


def _all_reduce_hook() -> None:
    world = dist.get_world_size()
    ours, theirs, ref = make_trio(Stack, shard_stack)
    seen = {"ours": [], "torch": []}
    for name, model in (("ours", ours), ("torch", theirs)):

        def hook(reduced, name=name):
            seen[name].append(reduced.numel())
            reduced.mul_(2)  # in place: the stored gradient doubles

        for module in fsdp_modules(model):
            module.set_all_reduce_hook(hook)
    _train(Trio(ours, theirs, ref), ref_divide=world / 2)
    assert len(seen["ours"]) == STEPS * (N + 1), f"hook calls {len(seen['ours'])}, expected {STEPS * (N + 1)}"
    assert sorted(seen["ours"]) == sorted(seen["torch"]), f"hook saw {seen['ours']} elements, torch {seen['torch']}"


def test_all_reduce_hook():
    run_on_ranks(_all_reduce_hook, 2, timeout=TIMEOUT)


# ---------------------------------------------------------------- reduce-scatter knobs


class Gate(nn.Module):
    """``lin_a(x)`` plus ``lin_b(x)`` on every rank but rank 0: lin_b gets no grad on rank 0."""

    def __init__(self):
        super().__init__()
        self.lin_a = nn.Linear(DIM, DIM)
        self.lin_b = nn.Linear(DIM, DIM)

    def forward(self, x):
        h = self.lin_a(x)
        if dist.get_rank() != 0:
            h = h + self.lin_b(x)
        return h


class Gated(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(IN_DIM, DIM)
        self.gate = Gate()
        self.layers = nn.ModuleList([Block()])
        self.out = nn.Linear(DIM, 4)

    def forward(self, x):
        return self.out(self.layers[0](self.gate(self.inp(x))))


def _reduce_scatter_knobs(knob: str) -> None:
    rank = dist.get_rank()
    if knob == "unused_params":

        def shard(model, fs):
            fs(model.gate)
            fs(model.layers[0])
            fs(model)
            model.set_reduce_scatter_unused_params(True)
            return model

        ours, theirs, ref = make_trio(Gated, shard)
        _train(Trio(ours, theirs, ref))
        assert ours.gate.lin_b.weight.grad is not None, f"rank {rank}: the unused param's grad is missing"
        return
    if knob == "separate_group":
        ours, theirs, ref = make_trio(Stack, shard_stack)
        for model in (ours, theirs):
            model.set_separate_reduce_scatter_group(True)
        groups_before = len(dist.distributed_c10d._world.pg_map)
        ours.set_separate_reduce_scatter_group(True)  # idempotent, as torch's: no new group
        assert len(dist.distributed_c10d._world.pg_map) == groups_before
        for res in _train(Trio(ours, theirs, ref)):
            groups = {g for kind, _, g in res.ours.phase_events("backward") if kind == "reduce_scatter"}
            assert groups == {dist.get_world_size()}, groups
            assert sorted(res.ours.phase_events("backward")) == sorted(res.torch.phase_events("backward"))
        ours.set_separate_reduce_scatter_group(False)  # back to the shard group
        _train(Trio(ours, theirs, None), steps=1)
        return
    # max input buffers: type checks, then 1 and 3 train bit-identically
    ours, theirs, ref = make_trio(Stack, shard_stack)
    for bad, exc in (("2", TypeError), (2.0, TypeError), (True, TypeError), (0, ValueError), (-1, ValueError)):
        for model in (ours, theirs):
            with pytest.raises(exc):
                model.set_reduce_scatter_max_input_buffers(bad)
    other, _, _ = make_trio(Stack, shard_stack, with_torch=False)
    ours.set_reduce_scatter_max_input_buffers(1)
    other.set_reduce_scatter_max_input_buffers(3, recurse=True)
    theirs.set_reduce_scatter_max_input_buffers(3)
    trio_one, trio_three = Trio(ours, theirs, ref), Trio(other, None, None)
    gen = rank_gen()
    for step in range(STEPS):
        xy = batch(gen)
        one = trio_one.run(_plain_step(xy))
        trio_three.run(_plain_step(xy), check=False)
        same_phases(one, f"max buffers, step {step}")
        for (name, a), b in zip(ours.named_parameters(), other.parameters()):
            assert torch.equal(a.to_local(), b.to_local()) and torch.equal(a.grad.to_local(), b.grad.to_local()), (
                f"{name}: max_input_buffers 1 and 3 differ at step {step}"
            )


@pytest.mark.parametrize("knob", ["unused_params", "separate_group", "max_input_buffers"])
def test_reduce_scatter_knobs(knob):
    run_on_ranks(_reduce_scatter_knobs, 2, knob, timeout=TIMEOUT)


# ---------------------------------------------------------------- comm context, events, async op


def _accepted_knobs() -> None:
    ours, theirs, ref = make_trio(Stack, shard_stack)
    shardwise.share_comm_ctx([ours.layers[0], ours.layers[1]])
    torch_share_comm_ctx([theirs.layers[0], theirs.layers[1]])
    for share in (shardwise.share_comm_ctx, torch_share_comm_ctx):
        with pytest.raises(ValueError):
            share([nn.Linear(2, 2)])
    with pytest.raises(ValueError):
        shardwise.share_comm_ctx([ours.layers[0], nn.Linear(2, 2)])
    ours._set_unshard_async_op(True)
    theirs._set_unshard_async_op(True)
    flags = [get_state(m).unshard_async_op for m in fsdp_modules(ours)]
    assert flags == [True] * (N + 1), f"_set_unshard_async_op(True) on the root is not recursive: {flags}"
    for model in (ours, theirs):
        model.set_allocate_memory_from_process_group_for_comm(True)
    with pytest.raises(RuntimeError):
        ours.set_symm_mem_for_comm()
    trio = Trio(ours, theirs, ref)
    gen = rank_gen()
    for step in range(STEPS):
        for model in (ours, theirs):  # a fresh event per step, as after each optimizer step
            model.set_post_optim_event(torch.Event("cpu"))
        res = trio.run(_plain_step(batch(gen)))
        same_phases(res, f"accepted knobs, step {step}")

    class Marker:
        waits = 0

        def wait(self, *args):
            Marker.waits += 1

    ours.set_post_optim_event(Marker())
    trio_ours = Trio(ours, None, ref)
    trio_ours.run(_plain_step(batch(gen)))
    assert Marker.waits >= 1, "the post-optim event was never waited on"
    waits = Marker.waits
    trio_ours.run(_plain_step(batch(gen)))
    assert Marker.waits == waits, "the post-optim event was waited on again in a later step"


def test_comm_ctx_post_optim_event_and_accepted_knobs():
    run_on_ranks(_accepted_knobs, 2, timeout=TIMEOUT)


# ---------------------------------------------------------------- argument checks

BAD_ARGS = [  # (setter, bad args, kwargs)
    ("set_reshard_after_forward", ("yes",), {}),
    ("set_reshard_after_forward", (2,), {}),
    ("set_reshard_after_backward", (1,), {}),
    ("set_requires_gradient_sync", ("no",), {}),
    ("set_requires_all_reduce", (None,), {}),
    ("set_is_last_backward", (1,), {}),
    ("set_unshard_in_backward", ("False",), {}),
    ("set_modules_to_forward_prefetch", ("layers",), {}),
    ("set_modules_to_backward_prefetch", (nn.Linear(2, 2),), {}),
    ("set_gradient_divide_factor", ("3",), {}),
    ("set_gradient_divide_factor", (0.0,), {}),
    ("set_gradient_divide_factor", (-2.0,), {}),
    ("set_force_sum_reduction_for_comms", (1,), {}),
    ("set_reduce_scatter_unused_params", ("yes",), {}),
    ("set_reduce_scatter_max_input_buffers", ("2",), {}),
    ("set_separate_reduce_scatter_group", (1,), {}),
    ("set_custom_all_gather", (object(),), {}),
    ("set_custom_reduce_scatter", (42,), {}),
    ("set_all_reduce_hook", (42,), {}),
    ("set_post_optim_event", (42,), {}),
    ("set_allocate_memory_from_process_group_for_comm", ("yes",), {}),
    ("set_symm_mem_for_comm", ("GLOO",), {}),
    ("_set_unshard_async_op", ("yes",), {}),
]


def _bad_arguments() -> list[str]:
    ours, _, _ = make_trio(Stack, shard_stack, with_torch=False)
    problems = []
    for setter, args, kwargs in BAD_ARGS:
        method = getattr(ours, setter)
        arg_name = list(inspect.signature(method).parameters)[0]
        try:
            method(*args, **kwargs)
        except (TypeError, ValueError) as e:
            message = str(e)
            if arg_name not in message and setter not in message:
                problems.append(f"{setter}{args!r}: message names neither {arg_name!r} nor the setter: {message!r}")
        except Exception as e:  # noqa: BLE001 - report what it was
            problems.append(f"{setter}{args!r}: raised {type(e).__name__}: {e}")
        else:
            problems.append(f"{setter}{args!r}: accepted")
    # the model still trains after all of that
    xy = batch(rank_gen())
    mse(ours, xy).backward()
    return problems


def test_setters_reject_wrong_types():
    problems = run_on_ranks(_bad_arguments, 2, timeout=TIMEOUT)[0]
    assert not problems, "\n".join(problems)


# ---------------------------------------------------------------- interop with torch's replicate


def _replicate_interop() -> None:
    def shard(model, fs):
        for layer in model.layers:
            fs(layer)
        torch_replicate(model)
        return model

    ours, theirs, ref = make_trio(Stack, shard)
    with pytest.raises(RuntimeError):
        torch_replicate(ours.layers[0])
    gen = rank_gen()
    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (ours, theirs, ref)]
    for step in range(STEPS):
        xy = batch(gen)
        losses = []
        for model, opt in zip((ours, theirs, ref), opts):
            opt.zero_grad()
            loss = mse(model, xy)
            loss.backward()
            losses.append(loss)
        allreduce_grads(ref, dist.get_world_size())
        compare_step(step, ours, losses[0], ref=ref, ref_loss=losses[2], torch_model=theirs, torch_loss=losses[1], sharded=False)
        for opt in opts:
            opt.step()
    state = torch_replicate.state(ours)
    managed = sorted(state._param_names)
    assert managed == ["inp.bias", "inp.weight", "out.bias", "out.weight"], f"replicate manages {managed}"
    assert sorted(torch_replicate.state(theirs)._param_names) == managed
    block_params = {id(p) for layer in ours.layers for p in layer.parameters()}
    assert not block_params & {id(p) for p in state._param_list}, "replicate manages shardwise's params"
    assert all(isinstance(p, DTensor) for layer in ours.layers for p in layer.parameters())


def test_torch_replicate_skips_shardwise_blocks():
    run_on_ranks(_replicate_interop, 2, timeout=TIMEOUT)
