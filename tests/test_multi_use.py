"""Modules used more than once, not at all, or outside the root's forward.

Each case trains shardwise, torch's FSDP2 used the same way, and an all-reduced replica
side by side (:class:`_control_helpers.Trio`: losses, params and grads every step, a
grad that is None in torch must be None here too) and requires the same collectives per
phase as torch.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

import shardwise
from _control_helpers import (
    DIM,
    IN_DIM,
    OUT_DIM,
    VOCAB,
    Block,
    ChunkedHead,
    Stack,
    TiedStack,
    Trio,
    batch,
    make_trio,
    mse,
    rank_gen,
    same_phases,
    shard_chunked_head,
    shard_stack,
)
from shardwise.testing import run_on_ranks

TIMEOUT = 90
N = 3
STEPS = 2


def _plain_step(xy):
    def fn(model, rec):
        loss = mse(model, xy)
        rec.mark("forward")
        loss.backward()
        rec.mark("backward")
        return loss

    return fn


# ---------------------------------------------------------------- reuse within a step


def _reuse(case: str) -> None:
    rank = dist.get_rank()
    build = {
        "called_twice": lambda: Stack(N, repeat=(1,)),
        "two_forwards": lambda: Stack(N),
        "unused_module": lambda: Stack(N, extra="unused"),
        "output_not_in_loss": lambda: Stack(N, extra="dead_end"),
        "backward_twice": lambda: Stack(N),
    }[case]
    ours, theirs, ref = make_trio(build, shard_stack)
    trio = Trio(ours, theirs, ref)
    gen = rank_gen()
    for step in range(STEPS):
        xy, xy2 = batch(gen), batch(gen)
        if case == "two_forwards":

            def fn(model, rec):
                loss = mse(model, xy)
                rec.mark("forward 1")
                loss = loss + mse(model, xy2)
                rec.mark("forward 2")
                loss.backward()
                rec.mark("backward")
                return loss

        elif case == "backward_twice":  # each block's pre-backward runs again in the second backward

            def fn(model, rec):
                loss = mse(model, xy)
                rec.mark("forward")
                loss.backward(retain_graph=True)
                rec.mark("backward 1")
                loss.backward()
                rec.mark("backward 2")
                return loss

        else:
            fn = _plain_step(xy)
        res = trio.run(fn)
        where = f"{case}, step {step}, rank {rank}"
        phases = same_phases(res, where)
        groups = N + 1 + (case == "output_not_in_loss") + (case == "unused_module")
        if case == "called_twice":
            assert phases["forward"] == {"all_gather": N + 2}, f"{where}: {phases}"
        if case == "unused_module":
            assert ours.extra.lin.weight.grad is None, f"{where}: the unused module got a grad"
            assert phases["forward"] == {"all_gather": N + 1}, f"{where}: {phases}"
        if case == "output_not_in_loss":
            assert ours.extra.lin.weight.grad is None, f"{where}: a module off the loss path got a grad"
            assert phases["forward"] == {"all_gather": N + 2}, f"{where}: {phases}"
        if case == "backward_twice":
            # the root kept its params through the first backward's forward only: it gathers again too
            assert phases["backward 1"] == {"all_gather": N, "reduce_scatter": N + 1}, f"{where}: {phases}"
            assert phases["backward 2"] == {"all_gather": N + 1, "reduce_scatter": N + 1}, f"{where}: {phases}"
            groups *= 2
        assert res.ours.total("reduce_scatter") <= groups, f"{where}: {phases}"
        assert all(isinstance(p, DTensor) for p in ours.parameters()), f"{where}: not resharded after the step"


@pytest.mark.parametrize(
    "case", ["called_twice", "two_forwards", "unused_module", "output_not_in_loss", "backward_twice"]
)
def test_module_reuse(case):
    run_on_ranks(_reuse, 2, case, timeout=TIMEOUT)


def test_backward_twice_at_4_ranks():
    run_on_ranks(_reuse, 4, "backward_twice", timeout=TIMEOUT)


# ---------------------------------------------------------------- a non-root submodule alone


def _submodule_alone() -> None:
    rank = dist.get_rank()
    ours, theirs, ref = make_trio(lambda: Stack(N), shard_stack)
    trio = Trio(ours, theirs, ref)
    gen = rank_gen()
    trio.run(_plain_step(batch(gen)))  # the root runs first (lazy init)
    for step in range(STEPS):
        h = torch.randn(4, DIM, generator=gen)

        def fn(model, rec):
            loss = model.layers[1](h).pow(2).mean()
            rec.mark("forward")
            loss.backward()
            rec.mark("backward")
            return loss

        res = trio.run(fn)
        where = f"layers.1 alone, step {step}, rank {rank}"
        phases = same_phases(res, where)
        assert phases["forward"] == {"all_gather": 1}, f"{where}: {phases}"
        assert phases["backward"] == {"all_gather": 1, "reduce_scatter": 1}, f"{where}: {phases}"
        with_grad = sorted(n for n, p in ours.named_parameters() if p.grad is not None)
        assert with_grad == ["layers.1.lin.bias", "layers.1.lin.weight"], f"{where}: grads on {with_grad}"
        trio.run(_plain_step(batch(gen)))  # and the whole model trains on afterwards


def test_submodule_forward_backward_alone():
    run_on_ranks(_submodule_alone, 2, timeout=TIMEOUT)


# ---------------------------------------------------------------- recovering from an exception


def _reset_after_exception() -> None:
    rank = dist.get_rank()
    ours, theirs, ref = make_trio(lambda: Stack(N), shard_stack)
    trio = Trio(ours, theirs, ref)
    gen = rank_gen()
    trio.run(_plain_step(batch(gen)))
    for where_fails in (1, 2):
        xy = batch(gen)
        for model in (ours, theirs):
            model.zero_grad()
            model.layers[where_fails].fail = True
            with pytest.raises(RuntimeError, match="injected failure"):
                mse(model, xy).backward()
            model.layers[where_fails].fail = False
            for non_root in (model.layers[0], model.layers[2]):
                with pytest.raises(RuntimeError):
                    non_root.reset_iter_state()
            model.reset_iter_state()
            model.reset_iter_state()  # idempotent
            assert all(isinstance(p, DTensor) for p in model.parameters()), "reset_iter_state left params unsharded"
        res = trio.run(_plain_step(batch(gen)))
        phases = same_phases(res, f"after a failure in layers.{where_fails}, rank {rank}")
        assert phases["forward"] == {"all_gather": N + 1}, phases
        assert phases["backward"] == {"all_gather": N, "reduce_scatter": N + 1}, phases


def test_reset_iter_state_after_exception_in_forward():
    run_on_ranks(_reset_after_exception, 2, timeout=TIMEOUT)


# ---------------------------------------------------------------- grouped module with a chunked loss


def _chunked_loss(variant: str) -> None:
    rank = dist.get_rank()
    ours, theirs, ref = make_trio(ChunkedHead, shard_chunked_head)
    trio = Trio(ours, theirs, ref)
    gen = rank_gen()
    chunks = 2
    for step in range(STEPS):
        x, y = batch(gen, n=6)

        def fn(model, rec):
            h = model(x)
            rec.mark("forward")
            total = torch.zeros(())
            if variant == "backward_per_chunk":  # each chunk reduces the head's grads and accumulates
                hd = h.detach().requires_grad_()
                for hc, yc in zip(hd.chunk(chunks), y.chunk(chunks)):
                    loss = F.mse_loss(model.output(hc), yc) / chunks
                    loss.backward()
                    total = total + loss.detach()
                rec.mark("chunks")
                h.backward(hd.grad)
            else:  # one backward through every chunk's loss
                for hc, yc in zip(h.chunk(chunks), y.chunk(chunks)):
                    total = total + F.mse_loss(model.output(hc), yc) / chunks
                rec.mark("chunks")
                total.backward()
            rec.mark("backward")
            return total

        res = trio.run(fn)
        where = f"{variant}, step {step}, rank {rank}"
        phases = same_phases(res, where)
        assert all(isinstance(p, DTensor) for p in ours.parameters()), f"{where}: not resharded after the step"
        assert ours.output.weight.grad is not None and ours.norm.weight.grad is not None, where
        assert phases["forward"] == {"all_gather": 4}, f"{where}: {phases}"  # root, 2 blocks, the group


@pytest.mark.parametrize("variant", ["backward_per_chunk", "one_backward"])
def test_grouped_head_called_standalone_per_chunk(variant):
    run_on_ranks(_chunked_loss, 2, variant, timeout=TIMEOUT)


# ---------------------------------------------------------------- tied weights, grouped root


def _tied_and_grouped_root() -> None:
    rank = dist.get_rank()

    def shard(model, fs):
        for layer in model.layers:
            fs(layer)
        fs(model)
        return model

    ours, theirs, ref = make_trio(TiedStack, shard)
    assert ours.out.weight is ours.emb.weight, "tied weights were untied by fully_shard"
    trio = Trio(ours, theirs, ref)
    gen = rank_gen()
    for step in range(STEPS):
        tokens = torch.randint(0, VOCAB, (4,), generator=gen)
        target = torch.randn(4, VOCAB, generator=gen)

        def fn(model, rec):
            loss = F.mse_loss(model(tokens), target)
            rec.mark("forward")
            loss.backward()
            rec.mark("backward")
            return loss

        res = trio.run(fn)
        phases = same_phases(res, f"tied, step {step}, rank {rank}")
        assert phases["backward"]["reduce_scatter"] == 3, phases
        assert ours.out.weight is ours.emb.weight and len(list(ours.parameters())) == 5

    a, b = nn.Linear(4, 4), nn.Linear(4, 4)
    shardwise.fully_shard([a, b])
    with pytest.raises(RuntimeError, match="root"):
        a(torch.randn(2, 4))


def test_tied_weights_and_grouped_root():
    run_on_ranks(_tied_and_grouped_root, 2, timeout=TIMEOUT)


# ---------------------------------------------------------------- where backward meets the blocks


class _Passthrough(nn.Module):
    """A sharded block that hands its input back as it is (a skipped layer): its params
    get no gradient, and its pre- and post-backward meet on its input's autograd node."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


class _Graphs(nn.Module):
    """Graphs where a block's input is not simply the previous block's output alone."""

    def __init__(self, case: str):
        super().__init__()
        self.case = case
        self.inp, self.out = nn.Linear(IN_DIM, DIM), nn.Linear(DIM, OUT_DIM)
        self.layers = nn.ModuleList([Block(), _Passthrough() if case == "passthrough" else Block(), Block()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.layers[0](self.inp(x))
        if self.case == "two_readers":  # layers 1 and 2 both read layer 0's output
            return self.out(self.layers[1](h) * self.layers[2](h))
        if self.case == "read_between":  # an op reads layer 0's output before layer 1 does
            scale = h.tanh().mean()
            return self.out(self.layers[2](self.layers[1](h) * scale))
        return self.out(self.layers[2](self.layers[1](h)))  # passthrough


def _backward_meets_blocks(case: str) -> None:
    rank = dist.get_rank()
    ours, theirs, ref = make_trio(lambda: _Graphs(case), shard_stack)
    trio = Trio(ours, theirs, ref)
    gen = rank_gen()
    for step in range(STEPS):
        plain, traces = _plain_step(batch(gen)), []

        def fn(model, rec):
            if rec.name != "ours":
                return plain(model, rec)
            with shardwise.trace() as t:
                loss = plain(model, rec)
            traces.append([(e.kind, e.fqn) for e in t.events])
            return loss

        res = trio.run(fn)
        where = f"{case}, step {step}, rank {rank}"
        phases = same_phases(res, where)
        assert phases["backward"]["reduce_scatter"] == 4 - (case == "passthrough"), f"{where}: {phases}"
        if case == "two_readers":  # layers.2 ran last: its post-backward does not wait for layers.1's backward
            events = traces[-1]
            first, then = ("post_backward", "layers.2"), ("wait_unshard", "layers.1")
            assert events.index(first) < len(events) - events[::-1].index(then) - 1, f"{where}: {events}"
        if case == "passthrough":
            assert ours.layers[1].lin.weight.grad is None, f"{where}: the passthrough's unused params got a grad"
        assert all(isinstance(p, DTensor) for p in ours.parameters()), f"{where}: not resharded after the step"


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("case", ["two_readers", "read_between", "passthrough"])
def test_backward_meets_blocks_as_in_torch(case, world_size):
    """Losses, params and grads equal torch's every step, and the collectives per phase
    too, where a block's post-backward cannot simply follow the previous block's output
    (:mod:`shardwise.backward_hooks`). At 4 ranks a pre-backward also finishes reductions
    that hold gloo's receive buffer, so the hooks' order meets that path too."""
    run_on_ranks(_backward_meets_blocks, world_size, case, timeout=TIMEOUT)
