"""Prefetching and async unshard, observed through ``shardwise.trace()``.

The model is a root with parameters of its own (``inp``, ``out``: reshard_after_forward
left at its default, so the root keeps them until after backward) around ``layers.0..2``.
Each case trains shardwise, torch's FSDP2 with the same prefetch settings, and an
all-reduced replica side by side (:class:`_control_helpers.Trio`, parity every step)
and requires the same collectives per phase as torch; the trace of shardwise's step must
show the schedule the settings ask for.

Trace events are ``(kind, fqn)`` pairs; the root's FQN is ``""``.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import UnshardHandle as TorchUnshardHandle

import shardwise
import shardwise.tracing
from _control_helpers import Stack, Trio, batch, fsdp_modules, make_trio, mse, rank_gen, same_phases, shard_stack
from shardwise.state import get_state
from shardwise.testing import run_on_ranks

TIMEOUT = 90
N = 3  # blocks
STEPS = 2
L0, L1, L2 = "layers.0", "layers.1", "layers.2"
KINDS = ("unshard", "wait_unshard", "reshard", "post_backward", "reduce", "reduce_done")


def U(fqn):
    return ("unshard", fqn)


def R(fqn):
    return ("reshard", fqn)


IN_TURN = [U(""), U(L0), R(L0), U(L1), R(L1), U(L2), R(L2)]  # each gathered in its own pre-forward
ONE_AHEAD = [U(""), U(L0), U(L1), R(L0), U(L2), R(L1), R(L2)]  # each pre-forward also gathers the next
TWO_AHEAD = [U(""), U(L0), U(L1), U(L2), R(L0), R(L1), R(L2)]  # ... and the one after
FORWARD = {  # expected unshard/reshard order in forward: (first step, later steps)
    # On CPU, later forwards prefetch the two modules that came next in the previous
    # forward (shardwise.prefetch.DEPTH); the first has no order to follow yet.
    "default": (IN_TURN, TWO_AHEAD),
    "no_implicit": (IN_TURN, IN_TURN),
    "forward1": (ONE_AHEAD, [U(""), U(L0), U(L1), R(L0), U(L2), R(L1), R(L2)]),
    "forward2": (TWO_AHEAD, TWO_AHEAD),
    "backward2": (IN_TURN, TWO_AHEAD),
}


def _configure(mode: str, model: nn.Module) -> None:
    layers = model.layers
    if mode == "forward1":
        layers[0].set_modules_to_forward_prefetch([layers[1]])
        layers[1].set_modules_to_forward_prefetch([layers[2]])
    elif mode == "forward2":
        layers[0].set_modules_to_forward_prefetch([layers[1], layers[2]])
    elif mode == "backward2":
        layers[2].set_modules_to_backward_prefetch([layers[1], layers[0]])
    elif mode == "wrong":  # prefetch modules that already ran / run later: a scheduling mistake only
        layers[2].set_modules_to_forward_prefetch([layers[0], layers[1]])
        layers[1].set_modules_to_forward_prefetch([layers[0]])
        layers[0].set_modules_to_backward_prefetch([layers[2], layers[1]])
        layers[1].set_modules_to_backward_prefetch([layers[2]])
        model.set_modules_to_backward_prefetch([layers[0]])
    elif mode == "no_implicit":  # an empty explicit list turns the implicit prefetch off
        for module in (model, *layers):
            module.set_modules_to_forward_prefetch([])
    elif mode == "embedding":
        model.emb.set_unshard_in_backward(False)


def _index(events, event, where):
    assert event in events, f"{where}: {event} missing from {events}"
    return events.index(event)


def _before(events, first, second, where):
    assert _index(events, first, where) < _index(events, second, where), f"{where}: {first} not before {second} in {events}"


def _check_backward(mode: str, backward: list, where: str) -> None:
    unshards = [e for e in backward if e[0] == "unshard"]
    gathered = [L0, L1, L2] + (["emb"] if mode == "embedding" else [])
    skip = {"emb"} if mode == "embedding" else set()
    if mode != "wrong":
        expected = sorted(U(f) for f in gathered if f not in skip)
        assert sorted(unshards) == expected, f"{where}: backward unshards {unshards}, expected {expected}"
    assert U("") not in backward, f"{where}: the root kept its params, yet backward unsharded it"
    post = [f for k, f in backward if k == "post_backward"]
    assert post[:3] == [L2, L1, L0], f"{where}: post_backward order {post}"
    assert sorted(post) == sorted(["", L0, L1, L2] + (["emb"] if mode == "embedding" else [])), where
    if mode in ("default", "no_implicit", "forward1", "forward2", "embedding"):  # implicit: one module ahead
        _before(backward, U(L2), U(L1), where)
        _before(backward, U(L1), ("post_backward", L2), where)
        _before(backward, ("post_backward", L2), U(L0), where)
        _before(backward, U(L0), ("post_backward", L1), where)
    if mode == "backward2":
        _before(backward, U(L2), U(L1), where)
        _before(backward, U(L1), U(L0), where)
        _before(backward, U(L0), ("post_backward", L2), where)
    for fqn in set(post):
        assert backward.count(("reduce", fqn)) == backward.count(("reduce_done", fqn)) == 1, f"{where}: {fqn} reductions"


def _schedule(mode: str, trace_dir: str) -> None:
    rank = dist.get_rank()
    embedding = mode == "embedding"
    ours, theirs, ref = make_trio(lambda: Stack(N, embedding=embedding), shard_stack)
    for model in (ours, theirs):
        _configure(mode, model)
    trio = Trio(ours, theirs, ref)
    gen = rank_gen()
    traces, data = [], {}

    def fn(model, rec):
        xy = data["xy"]
        if rec.name != "ours":
            loss = mse(model, xy)
            rec.mark("forward")
            loss.backward()
            rec.mark("backward")
            return loss
        assert shardwise.tracing._ACTIVE is None, "a trace is active outside any trace() context"
        with shardwise.trace() as t:
            loss = mse(model, xy)
            rec.mark("forward")
            n_forward = len(t.events)
            loss.backward()
            rec.mark("backward")
        assert shardwise.tracing._ACTIVE is None, "trace() did not deactivate on exit"
        traces.append((t, n_forward))
        return loss

    for step in range(STEPS):
        data["xy"] = batch(gen, tokens=embedding)
        res = trio.run(fn)
        where = f"{mode}, step {step}, rank {rank}"
        phases = same_phases(res, where)
        if mode != "wrong":
            # backward gathers the blocks only: the root kept its params, emb needs none
            assert phases["forward"] == {"all_gather": N + 1 + embedding}, f"{where}: {phases}"
            assert phases["backward"] == {"all_gather": N, "reduce_scatter": N + 1 + embedding}, f"{where}: {phases}"
        t, n_forward = traces[-1]
        kinds = {e.kind for e in t.events}
        assert kinds == set(KINDS), f"{where}: trace kinds {kinds}"
        forward = t.of("unshard", "reshard")[: sum(1 for e in t.events[:n_forward] if e.kind in ("unshard", "reshard"))]
        if mode in FORWARD:
            expected = FORWARD[mode][min(step, 1)]
            assert forward == expected, f"{where}: forward schedule {forward}, expected {expected}"
        backward = [(e.kind, e.fqn) for e in t.events[n_forward:]]
        _check_backward(mode, backward, where)

    # Nothing is recorded outside the context, and a finished trace stays as it was.
    t, _ = traces[-1]
    before = len(t.events)
    mse(ours, batch(gen, tokens=embedding)).backward()
    assert len(t.events) == before and shardwise.tracing._ACTIVE is None
    with shardwise.trace() as outer:
        with shardwise.trace() as inner:
            ours(batch(gen, tokens=embedding)[0])
        assert shardwise.tracing._ACTIVE is outer and inner.events and not outer.events
    assert shardwise.tracing._ACTIVE is None
    ours.zero_grad()

    path = os.path.join(trace_dir, f"{mode}-rank{rank}.json")
    t.to_chrome_trace(path)
    with open(path) as f:
        doc = json.load(f)
    records = doc["traceEvents"]
    assert len(records) == len(t.events), f"{len(records)} records for {len(t.events)} events"
    assert [r["name"] for r in records] == [f"{e.kind} ({e.fqn})" for e in t.events]
    assert all(r["pid"] == rank and r["ph"] == "i" for r in records)
    assert [r["ts"] for r in records] == sorted(r["ts"] for r in records)


@pytest.mark.parametrize("mode", ["default", "no_implicit", "forward1", "forward2", "backward2", "wrong", "embedding"])
def test_prefetch_schedule(mode, tmp_path):
    run_on_ranks(_schedule, 2, mode, str(tmp_path), timeout=TIMEOUT)


# ---------------------------------------------------------------- implicit prefetch, changing order


def _order_changes() -> None:
    """The implicit forward prefetch follows the previous forward's order. When a module of
    that order does not run (a no-grad pass that skips ``layers.1``), its prefetched params
    are resharded at the root's post-forward: with no backward to reshard them, an
    optimizer step before the next forward would otherwise leave ``layers.1`` computing
    with stale params. The root (``reshard_after_forward=False``) stays gathered after the
    no-grad pass by design; the step changes its shards, so its next forward gathers again
    (``ParamGroup._gathered_stale``). Parity with the replica after every pass; torch's
    FSDP2 is left out: it computes the next forward with the root's stale params."""
    ours, _, ref = make_trio(Stack, shard_stack, with_torch=False)
    trio = Trio(ours, None, ref)
    gen = rank_gen()
    for step, train_skip in enumerate([set(), set(), {1}, set()]):
        where = f"step {step}, rank {dist.get_rank()}"
        xy = batch(gen)
        for model in trio.models.values():
            model.skip = train_skip
        trio.run(lambda model, rec: _forward_backward(model, rec, xy), optimize=False)
        for model in trio.models.values():
            model.skip = {1}
        with torch.no_grad(), shardwise.trace() as t:  # an eval pass between backward and step
            outputs = [model(xy[0]) for model in trio.models.values()]
        for other in outputs[1:]:
            torch.testing.assert_close(outputs[0], other, rtol=1e-5, atol=1e-6, msg=lambda m: f"{where}: {m}")
        prefetched = U(L1) in t.of("unshard")  # the training pass ran layers.1: it is next after layers.0
        assert prefetched == (not train_skip), f"{where}: {t.of()}"
        gathered = [i for i, layer in enumerate(ours.layers) if get_state(layer).group.gathered_or_gathering]
        assert not gathered, f"{where}: the eval pass left blocks {gathered} gathered (or gathering)"
        for opt in trio.opts.values():
            opt.step()


def _forward_backward(model, rec, xy):
    loss = mse(model, xy)
    rec.mark("forward")
    loss.backward()
    rec.mark("backward")
    return loss


def test_implicit_prefetch_when_the_order_changes():
    run_on_ranks(_order_changes, 2, timeout=TIMEOUT)


# ---------------------------------------------------------------- validation


def _prefetch_lists_validated() -> None:
    ours, theirs, _ = make_trio(Stack, shard_stack)
    plain = nn.Linear(2, 2)
    for model in (ours, theirs):  # torch raises the same type
        for setter in (model.layers[0].set_modules_to_forward_prefetch, model.layers[0].set_modules_to_backward_prefetch):
            for bad in ([plain], [model.layers[1], plain], [model.layers[1].lin]):
                with pytest.raises(ValueError):
                    setter(bad)
    # and the setters accept FSDP modules (an empty list clears them)
    ours.layers[0].set_modules_to_forward_prefetch([ours.layers[1]])
    ours.layers[0].set_modules_to_forward_prefetch([])
    ours.layers[0].set_modules_to_backward_prefetch([])


def test_prefetch_lists_must_be_fsdp_modules():
    run_on_ranks(_prefetch_lists_validated, 2, timeout=TIMEOUT)


# ---------------------------------------------------------------- async unshard


def _async_unshard() -> None:
    rank = dist.get_rank()
    ours, theirs, ref = make_trio(Stack, shard_stack)
    trio = Trio(ours, theirs, ref)
    gen = rank_gen()
    handle_types = {"ours": shardwise.UnshardHandle, "torch": TorchUnshardHandle}

    def step(pattern):
        xy = batch(gen)
        traces = []

        def fn(model, rec):
            sharded = rec.sharded
            with shardwise.trace() as t:
                if pattern == "one layer, unwaited" and sharded:
                    handle = model.layers[1].unshard(async_op=True)
                    assert isinstance(handle, handle_types[rec.name]), f"{rec.name}: unshard returned {handle!r}"
                elif pattern == "waited twice" and sharded:
                    handle = model.layers[0].unshard(async_op=True)
                    handle.wait()
                    handle.wait()
                    assert model.layers[0].unshard() is None  # already unsharded: sync, returns None
                elif pattern == "all up front" and sharded:
                    handles = [m.unshard(async_op=True) for m in fsdp_modules(model)]
                rec.mark("unshard")
                loss = mse(model, xy)
                rec.mark("forward")
                if pattern == "all up front" and sharded:
                    for h in handles:  # already waited by forward: harmless
                        h.wait()
                loss.backward()
                rec.mark("backward")
            if rec.name == "ours":
                traces.append(t.of("unshard", "wait_unshard"))
            return loss

        res = trio.run(fn)
        where = f"{pattern}, rank {rank}"
        phases = same_phases(res, where)
        total_forward = phases["unshard"].get("all_gather", 0) + phases["forward"].get("all_gather", 0)
        assert total_forward == N + 1, f"{where}: {phases}"
        assert phases["backward"] == {"all_gather": N, "reduce_scatter": N + 1}, f"{where}: {phases}"
        return traces[0], phases

    step("plain")  # first: lazy init names the groups (a trace before it shows no FQNs)
    events, phases = step("one layer, unwaited")
    assert phases["unshard"] == {"all_gather": 1}, phases
    assert events[0] == U(L1) and events.count(U(L1)) == 2, f"layers.1 gathered once per forward+backward: {events}"
    assert events.index(("wait_unshard", L1)) > events.index(("wait_unshard", L0)), f"forward waited late: {events}"
    events, phases = step("waited twice")
    assert events[:2] == [U(L0), ("wait_unshard", L0)] and events.count(U(L0)) == 2, events
    events, phases = step("all up front")
    assert phases["unshard"] == {"all_gather": N + 1} and phases["forward"] == {}, phases
    assert events[: N + 1] == [U(""), U(L0), U(L1), U(L2)], events
    assert [e for e in events[N + 1 :] if e[0] == "unshard"] == [U(L2), U(L1), U(L0)], f"forward gathered again: {events}"


def test_async_unshard():
    run_on_ranks(_async_unshard, 2, timeout=TIMEOUT)


# ---------------------------------------------------------------- the torch profiler's ranges


def _profiled_names(run) -> list[str]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        run()
    return [e.name for e in prof.events() if e.name.startswith("shardwise::")]


def test_lifecycle_events_are_profiler_ranges_without_a_trace(single_rank):
    """With no ``shardwise.trace()`` open, each lifecycle event is still a ``shardwise::<kind>
    (<fqn>)`` range while the torch profiler runs, also when it starts between forward and
    backward; at world size 1 every block is gathered by registering its shards (``unshard``
    and ``wait_unshard`` at once) and its gradients are handed over (``reduce``,
    ``reduce_done``)."""
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(2)))
    for block in model:
        shardwise.fully_shard(block)
    shardwise.fully_shard(model)
    x = torch.randn(4, 8)
    model(x).sum().backward()  # lazy init names the groups
    loss = None

    def forward():
        nonlocal loss
        loss = model(x).sum()

    forward_names = _profiled_names(forward)
    backward_names = _profiled_names(lambda: loss.backward())
    assert forward_names == [  # the root has no parameters of its own: no group, no events
        "shardwise::unshard (0)", "shardwise::wait_unshard (0)", "shardwise::reshard (0)",
        "shardwise::unshard (1)", "shardwise::wait_unshard (1)", "shardwise::reshard (1)",
    ], forward_names  # fmt: skip
    for fqn in ("0", "1"):
        for kind in ("unshard", "wait_unshard", "post_backward", "reshard", "reduce", "reduce_done"):
            assert f"shardwise::{kind} ({fqn})" in backward_names, (kind, fqn, backward_names)
    assert not shardwise.tracing.wanted()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        assert shardwise.tracing.wanted()
    with shardwise.trace():
        assert shardwise.tracing.wanted()
