"""Where backward crosses a state's boundary: the pre-backward and post-backward hooks.

A state's forward has two boundaries, and backward meets each once per pass:

- its **outputs**: when the first of their gradients is about to flow back, the state's
  *pre-backward* runs (gather the params again). A single output's tensor hook runs once
  per backward, so it is the state's pre-backward itself; several outputs share a
  :class:`PreBackwardHook`, which runs on the first of them.
- its **inputs**: once every gradient of its params exists, which is once the gradient of
  its input is complete, its *post-backward* runs (reduce, reshard).

torch's FSDP2 hooks the outputs with tensor hooks and marks the inputs with an identity
``autograd.Function`` whose backward is the post-backward. The Function is costly per unit
on a launch-bound step (its apply and its backward node cost about 15 µs per unit on CPU).
In a plain stack of blocks, block ``i``'s input *is* block ``i-1``'s output (and the root's
output is its last block's), which already carries block ``i-1``'s pre-backward hook: a
tensor hook runs once every gradient into that tensor is summed, which is once block
``i``'s backward is done. So shardwise puts block ``i``'s post-backward in that same hook.
One :class:`OutputHooks` per hooked output holds every state's hook on it, registered as
the tensor's hook (FSDP2's kind, so a user's own hook registered after forward runs after
them, as after FSDP2's).

Their order on one tensor is what FSDP2's graph gives (:class:`OutputHooks` says how), so
the collectives and peak memory are FSDP2's: block ``i``'s post-backward (its
reduce-scatter, its reshard) runs before block ``i-1``'s pre-backward (the next all-gather).

:class:`Boundaries` says when an input may join an output's hooks: when it is the output
hooked last, the chain of blocks. Other inputs take :class:`PostBackwardTrigger`, the
identity Function, as in FSDP2.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from typing import Any, Callable

import torch

__all__ = [
    "PreBackwardHook", "PostBackwardTrigger", "OutputHooks", "Boundaries", "register_tensor_hook", "weak_post_backward",
]

OnBackward = Callable[..., None]  # what a post-backward hook calls (arguments unused): see weak_post_backward


def weak_post_backward(state_ref: weakref.ref) -> OnBackward:
    """``state.post_backward()`` through a weak reference: what the autograd graph holds of
    a state, so a graph never keeps a state alive (nor a state itself, through its own)."""

    def on_backward(*unused: Any) -> None:  # a trigger calls it bare, an output's hooks with the gradient
        state = state_ref()
        if state is not None:
            state.post_backward()

    return on_backward


class PostBackwardTrigger(torch.autograd.Function):
    """Identity on a module's forward inputs; its backward calls ``on_backward()``, once the
    module's grads are done (the planner's activation model marks its units with it too)."""

    @staticmethod
    def forward(ctx, on_backward: OnBackward, *inputs):
        ctx.on_backward = on_backward
        return inputs

    @staticmethod
    def backward(ctx, *grads):
        ctx.on_backward()
        return (None,) + grads


class PreBackwardHook:
    """The hook a forward's several outputs share: the state's pre-backward, once per
    backward of that forward (``register_multi_grad_hook(mode="any")``'s contract) on
    whichever of its outputs' gradients comes first. One small object per forward call
    instead of ``register_multi_grad_hook``'s closures, lock and handle wrapper (its cost
    was a sixth of a launch-bound step's host time). Called with a tensor hook's gradient:
    unused."""

    __slots__ = ("state", "ran")

    def __init__(self, state: Any):
        self.state = state
        self.ran: dict[int, object] = {}  # graph-task ids this hook already ran in

    def __call__(self, grad: Any) -> None:
        mine = object()  # dict.setdefault is atomic: only one engine thread wins a task
        if self.ran.setdefault(torch._C._current_graph_task_id(), mine) is mine:
            self.state._pre_backward(grad)


class OutputHooks:
    """Every state's hook on one output tensor, run in the order FSDP2's graph runs them.

    In FSDP2 each post-backward trigger is a new node *between* the tensor and the module
    that consumes it: it runs before anything hooked on the tensor so far, and a module
    whose output is that very input (a module that returns its input) hooks the trigger's
    output, which runs before the trigger. So the hooks form layers: a post-backward opens
    a new layer on top, a pre-backward joins the top layer, and backward runs the layers
    top first, each one's pre-backwards in the order they were added, then its
    post-backward. Two post-backwards on one input run last-added first, as the engine
    runs the later trigger node first.

    The layers are kept flat, in the order they run (``calls``): the top layer is always
    first, so a post-backward goes to the front and a pre-backward right after the top
    layer's earlier pre-backwards (``top_pres`` of them), before its post-backward.
    """

    __slots__ = ("calls", "top_pres")

    def __init__(self, pre_backward: Callable):
        self.calls: list[Callable] = [pre_backward]  # each called with the gradient
        self.top_pres = 1  # pre-backwards in the top layer (the bottom layer has no post-backward)

    def add_pre_backward(self, hook: Callable) -> None:
        self.calls.insert(self.top_pres, hook)
        self.top_pres += 1

    def add_post_backward(self, on_backward: OnBackward) -> None:
        self.calls.insert(0, on_backward)
        self.top_pres = 0

    def __call__(self, grad: Any) -> None:
        for call in self.calls:
            call(grad)


class Boundaries:
    """Where the next state's post-backward may join an output's hooks: the output hooked last.

    A block's input is usually the tensor the block before it returned, with nothing else
    reading it: its hooks run right after the block's backward, so the block's post-backward
    can run among them (in a layer above the earlier block's pre-backward, see
    :class:`OutputHooks`). Any other input takes :class:`PostBackwardTrigger`, a node of its
    own as in FSDP2: a tensor read by several blocks (parallel branches) waits at its node
    for all of them, and one block's post-backward must not wait for another's backward.
    What reads the tensor between the two blocks (not a block: an op, an un-sharded
    module) runs its backward before that node too, as if it belonged to the block.

    Only weak references are held: a graph that nobody backpropagates through is never
    kept alive. The output counts only at the version it was hooked at: an in-place change
    gives the tensor a new node.
    """

    __slots__ = ("_last",)

    def __init__(self):
        self._last: tuple | None = None  # (weak ref, version, OutputHooks) of the output hooked last

    def clear(self) -> None:
        self._last = None

    def _hooks_of_last(self, t: torch.Tensor) -> OutputHooks | None:
        last = self._last
        if last is not None and last[0]() is t and last[1] == t._version:
            return last[2]
        return None

    def hook_output(self, t: torch.Tensor, hook: Callable) -> None:
        """Run ``hook`` when ``t``'s gradient is about to flow back; ``t`` becomes the output
        hooked last. A leaf output (no node) takes a tensor hook and is nobody's input."""
        hooks = self._hooks_of_last(t)
        if hooks is not None:
            hooks.add_pre_backward(hook)
        elif t.grad_fn is None:
            t.register_hook(hook)
            self._last = None
            return
        else:
            hooks = OutputHooks(hook)
            register_tensor_hook(t, hooks)
        self._last = (weakref.ref(t), t._version, hooks)

    def hook_outputs(self, tensors: list[torch.Tensor], hook: Callable) -> None:
        """Run ``hook`` when the first of ``tensors``' gradients is about to flow back. Of
        several outputs none is the output hooked last: no one block's input."""
        before = self._last  # each output may be the input that was hooked last: compare with it
        for t in tensors:
            self._last = before
            self.hook_output(t, hook)
        if len(tensors) > 1:
            self._last = None

    def hook_input(self, t: torch.Tensor, on_backward: OnBackward) -> bool:
        """Call ``on_backward`` (a post-backward) in ``t``'s hooks if ``t`` is the output hooked
        last; else False (the caller uses :class:`PostBackwardTrigger`)."""
        hooks = self._hooks_of_last(t)
        if hooks is None:
            return False
        hooks.add_post_backward(on_backward)
        return True


def register_tensor_hook(t: torch.Tensor, hook: Callable) -> None:
    """``t.register_hook(hook)`` without the ``RemovableHandle`` nobody would remove (about
    half the registration's cost): a tensor's first hook gets the ordered dict its node
    reads, as ``Tensor.register_hook`` builds it (the key is no handle's id, so the user's
    later ``register_hook`` calls add theirs after it); later hooks go through the API."""
    if t._backward_hooks is not None:
        t.register_hook(hook)
        return
    hooks = OrderedDict()  # filled after construction: keyword construction costs twice as much
    hooks["shardwise"] = hook
    t._backward_hooks = hooks
    t.grad_fn._register_hook_dict(t)
