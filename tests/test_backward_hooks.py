"""The order backward runs the states' boundary hooks in (:mod:`shardwise.backward_hooks`).

shardwise hooks the autograd node that made a tensor; torch's FSDP2 puts an identity
``autograd.Function`` between an input and its module (the post-backward trigger) and a
tensor hook on each output (the pre-backward). Each case below wires the same forward
both ways, with recording stand-ins for the states, and requires the same order of
pre- and post-backwards in backward. One process, no collectives.
"""

from __future__ import annotations

import weakref

import pytest
import torch

from shardwise.backward_hooks import Boundaries, PostBackwardTrigger, PreBackwardHook, weak_post_backward


class _Recorder:
    """A state stand-in: logs its post-backward and pre-backward."""

    def __init__(self, name: str, log: list):
        self.name, self.log = name, log

    def post_backward(self) -> None:
        self.log.append(("post", self.name))

    def _pre_backward(self, grad) -> None:
        self.log.append(("pre", self.name))


class _FSDP2Wiring:
    """What torch's FSDP2 builds: a trigger node per input, a tensor hook per output."""

    def __init__(self, log):
        self.log, self.states = log, {}

    def state(self, name):
        return self.states.setdefault(name, _Recorder(name, self.log))

    def enter(self, name, x):
        (out,) = PostBackwardTrigger.apply(self.state(name).post_backward, x)
        return out

    def leave(self, name, out):
        out.register_hook(PreBackwardHook(self.state(name)))
        return out


class _ShardwiseWiring(_FSDP2Wiring):
    """What shardwise builds: one hook per output tensor, found again by :class:`Boundaries`."""

    def __init__(self, log):
        super().__init__(log)
        self.boundaries = Boundaries()

    def enter(self, name, x):
        if self.boundaries.hook_input(x, weak_post_backward(weakref.ref(self.state(name)))):  # as a state does
            return x
        return super().enter(name, x)

    def leave(self, name, out):
        self.boundaries.hook_outputs([out], PreBackwardHook(self.state(name)))
        return out


def _chain(w, x, wire):
    """Three blocks and a root around them (the root's output is its last block's)."""
    h = x * w
    for i in range(3):
        h = wire.leave(f"b{i}", wire.enter(f"b{i}", h) * w)
    return wire.leave("root", h)


def _returns_its_input(w, x, wire):
    """A module whose output is its input itself (a skipped block)."""
    h = wire.leave("b0", x * w)
    out = wire.leave("same", wire.enter("same", h))
    return out * w + out


def _two_consumers(w, x, wire):
    """Two blocks read one tensor (parallel branches), then a third after both."""
    h = wire.leave("b0", x * w)
    a = wire.leave("a", wire.enter("a", h) * w)
    b = wire.leave("b", wire.enter("b", h) * w)
    return wire.leave("c", wire.enter("c", a + b) * w)


def _changed_in_place(w, x, wire):
    """A block's output changed in place before the next block reads it."""
    h = wire.leave("b0", x * w)
    h.mul_(2)
    return wire.leave("b1", wire.enter("b1", h) * w)


def _user_hooks_after_forward(w, x, wire):
    """The chain, then the user's own tensor hook on each block's output, registered after
    forward (as a training loop would): FSDP2's hooks on a tensor run before it."""
    h, outputs = x * w, []
    for i in range(3):
        h = wire.leave(f"b{i}", wire.enter(f"b{i}", h) * w)
        outputs.append((f"b{i}", h))
    out = wire.leave("root", h)
    for name, t in outputs:
        t.register_hook(lambda grad, name=name: wire.log.append(("user", name)))
    return out


@pytest.mark.parametrize(
    "forward, events",
    [(_chain, 7), (_returns_its_input, 3), (_two_consumers, 7), (_changed_in_place, 3), (_user_hooks_after_forward, 10)],
)
def test_output_hooks_run_in_fsdp2s_order(forward, events):
    orders = []
    for wiring in (_FSDP2Wiring, _ShardwiseWiring):
        log: list = []
        w = torch.tensor(1.5, requires_grad=True)
        x = torch.ones(3)
        forward(w, x, wiring(log)).sum().backward()
        orders.append(log)
    fsdp2, ours = orders
    assert len(fsdp2) == events  # every hook ran once
    assert ours == fsdp2


def test_only_the_output_hooked_last_joins_its_hooks():
    """A block's input joins an output's hooks only when it is the output hooked last and
    unchanged since: a second reader of a tensor, a leaf, an output changed in place and
    a tensor from before the root's forward take the identity Function."""
    boundaries = Boundaries()
    ref = _Recorder("r", []).post_backward
    w = torch.ones(4, requires_grad=True)
    assert not boundaries.hook_input(w, ref)  # a leaf: no node of ours
    h = w * 2
    assert not boundaries.hook_input(h, ref)  # no block returned it
    boundaries.hook_outputs([h], PreBackwardHook(_Recorder("b0", [])))
    assert boundaries.hook_input(h, ref)
    g = w * 3
    boundaries.hook_outputs([g], PreBackwardHook(_Recorder("b1", [])))
    assert not boundaries.hook_input(h, ref)  # a block after b0 returned g
    g.mul_(2)
    assert not boundaries.hook_input(g, ref)  # a new node since it was hooked
    boundaries.hook_outputs([h, g], PreBackwardHook(_Recorder("b2", [])))
    assert not boundaries.hook_input(h, ref)  # several outputs: none is "the" output
    boundaries.hook_outputs([h], PreBackwardHook(_Recorder("b3", [])))
    boundaries.clear()  # the root's next forward
    assert not boundaries.hook_input(h, ref)


def test_boundaries_hold_no_graph_alive():
    """The output hooked last is held weakly: once the forward's tensors die, the graph
    (the tensors its nodes saved for backward) goes, hooks and all."""
    boundaries = Boundaries()
    w = torch.ones(4, requires_grad=True)
    saved = torch.full((4,), 2.0)
    out = w * saved  # MulBackward saves ``saved``
    boundaries.hook_outputs([out], PreBackwardHook(_Recorder("r", [])))
    assert boundaries.hook_input(out, _Recorder("next", []).post_backward)
    saved_ref = weakref.ref(saved)
    del saved
    assert saved_ref() is not None  # the graph holds it
    del out
    assert saved_ref() is None


def test_the_graph_keeps_no_state_alive():
    """What a state hands the graph (:func:`weak_post_backward`) holds it weakly: a state
    dropped before backward is freed, and its post-backward is then skipped."""
    log: list = []
    state = _Recorder("gone", log)
    on_backward = weak_post_backward(weakref.ref(state))
    w = torch.ones(3, requires_grad=True)
    (out,) = PostBackwardTrigger.apply(on_backward, w * 2)
    state_ref = weakref.ref(state)
    del state
    assert state_ref() is None
    out.sum().backward()
    assert log == [] and torch.equal(w.grad, torch.full((3,), 2.0))
