"""Activation memory of one training step, measured on fake tensors (no data, no device).

The model runs one forward, loss and backward under torch's ``FakeTensorMode``: every op
computes shapes only, so a 70B model costs what its few thousand ops cost in Python, and
the attention kernel is the one the real CPU run picks (on the meta device SDPA would fall
back to the math path and save the (T, T) attention matrix). A dispatch mode tracks the
live bytes of every storage the step creates, as ``shardwise.testing.memory`` measures a real
step, except the parameters themselves and their gradients: the memory model accounts for
those as shardwise holds them (sharded, gathered, packed).

The step is cut at the points where shardwise acts, with the mechanisms shardwise uses
(state.py): each unit's pre-forward and post-forward hooks, a multi-grad hook on its
outputs (pre-backward) and an identity autograd function on its inputs (post-backward)::

    pre_forward(root) pre_forward(b0) post_forward(b0) ... post_forward(root) loss
    pre_backward(root) pre_backward(bn) post_backward(bn) ... post_backward(root)

For each mark the trace keeps the live bytes at the mark and the most live between it
and the next mark, which is all :mod:`shardwise.planning.memory` needs to add activations to
its schedule.
"""

from __future__ import annotations

import dataclasses
import functools
import weakref
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_leaves
from torch.utils.checkpoint import checkpoint

from shardwise.backward_hooks import PostBackwardTrigger

__all__ = ["Mark", "ActivationTrace", "trace_activations", "synthetic_marks"]

Mark = tuple[str, str]
"""(event, unit FQN): event is pre_forward, post_forward, loss, pre_backward or post_backward."""


@dataclasses.dataclass(frozen=True)
class ActivationTrace:
    """Live activation bytes of one step, cut at shardwise's lifecycle points."""

    marks: list[Mark]
    at_mark: list[int]  # live bytes when the mark fired
    seg_max: list[int]  # most live bytes from the mark until the next one
    grad_arrivals: list[tuple[int, str]]  # (mark index, param FQN): the segment a param's grad was accumulated in

    @property
    def peak(self) -> int:
        return max(self.seg_max, default=0)


def synthetic_marks(unit_fqns: list[str]) -> list[Mark]:
    """The marks of a root whose forward runs the units in order (no batch to trace)."""
    blocks = [f for f in unit_fqns if f]
    marks = [("pre_forward", "")]
    for f in blocks:
        marks += [("pre_forward", f), ("post_forward", f)]
    marks += [("post_forward", ""), ("loss", ""), ("pre_backward", "")]
    for f in reversed(blocks):
        marks += [("pre_backward", f), ("post_backward", f)]
    return marks + [("post_backward", "")]


class _LiveBytes(TorchDispatchMode):
    """Live storage bytes of the fake step (parameters and buffers excluded), per segment."""

    live: int  # bytes of the tracked storages alive now
    marks: list[Mark]  # lifecycle points so far
    at_mark: list[int]  # live bytes at each mark
    seg_max: list[int]  # most live bytes since each mark
    grad_arrivals: list[tuple[int, str]]  # (mark index, param FQN) of each accumulated grad
    _ignored: set[int]  # StorageImpl addresses of the params and buffers
    _sizes: dict[int, int]  # StorageImpl address -> nbytes, for tracked storages

    def __init__(self, ignored: set[int], seed: list[torch.Tensor]):
        super().__init__()
        self._ignored = ignored
        self._sizes: dict[int, int] = {}
        self._refs: dict[int, weakref.ref] = {}
        self.live = 0
        for t in seed:
            self._track(t)
        self.marks: list[Mark] = []
        self.at_mark: list[int] = []
        self.seg_max: list[int] = []
        self.grad_arrivals: list[tuple[int, str]] = []

    def mark(self, event: str, fqn: str) -> None:
        self.marks.append((event, fqn))
        self.at_mark.append(self.live)
        self.seg_max.append(self.live)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for leaf in tree_leaves(out):
            self._track(leaf)
        if self.seg_max and self.live > self.seg_max[-1]:
            self.seg_max[-1] = self.live
        return out

    def _track(self, leaf: Any) -> None:
        if not isinstance(leaf, torch.Tensor):
            return
        storage = leaf.untyped_storage()
        key = storage._cdata
        if key in self._ignored or key in self._sizes:
            return
        self._sizes[key] = storage.nbytes()
        self.live += self._sizes[key]
        self._refs[key] = weakref.ref(storage, functools.partial(self._free, key))

    def _free(self, key: int, _ref) -> None:
        self.live -= self._sizes.pop(key, 0)
        self._refs.pop(key, None)


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


def _hook_unit(module: nn.Module, fqn: str, tracker: _LiveBytes, handles: list) -> None:
    def pre(mod, args, kwargs):
        if _in_backward():
            return None
        tracker.mark("pre_forward", fqn)
        flat, spec = tree_flatten((args, kwargs))
        pos = [i for i, x in enumerate(flat) if isinstance(x, torch.Tensor) and x.requires_grad]
        if not pos:
            return None
        outs = PostBackwardTrigger.apply(lambda: tracker.mark("post_backward", fqn), *(flat[i] for i in pos))
        for i, o in zip(pos, outs):
            flat[i] = o
        return spec.unflatten(flat)

    def post(mod, args, kwargs, output):
        if _in_backward():
            return None
        tracker.mark("post_forward", fqn)
        tensors = [t for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad]
        if tensors:
            torch.autograd.graph.register_multi_grad_hook(
                tensors, lambda *_: tracker.mark("pre_backward", fqn), mode="any"
            )
        return None

    handles.append(module.register_forward_pre_hook(pre, with_kwargs=True, prepend=True))
    handles.append(module.register_forward_hook(post, with_kwargs=True))


def _logits(output: Any) -> torch.Tensor:
    if isinstance(output, torch.Tensor):
        return output
    if hasattr(output, "logits"):
        return output.logits
    return tree_leaves(output)[0]


def _fake_inputs(batch: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    b, t = batch
    return torch.zeros(b, t, dtype=torch.long), torch.zeros(b, t, dtype=torch.long)  # tokens, targets


def trace_activations(
    model: nn.Module, unit_fqns: list[str], batch: tuple[int, int], param_dtype: torch.dtype | None,
    checkpointed: bool = False,
) -> ActivationTrace:
    """One fake forward + cross-entropy loss + backward of ``model`` on ``batch`` = (B, T) tokens.

    Args:
        model: any device (meta included); it is not modified (params are swapped in with
            ``torch.func.functional_call``; hooks are removed afterwards).
        unit_fqns: the units' FQNs ("" is the root).
        param_dtype: the dtype the unsharded params compute in (mixed precision), or None.
        checkpointed: wrap every non-root unit in activation checkpointing.
    """
    modules = dict(model.named_modules())
    handles: list = []
    patched = []
    with FakeTensorMode(allow_non_fake_inputs=False):
        params = {n: _fake_like(p, param_dtype, p.requires_grad) for n, p in model.named_parameters()}
        buffers = {n: _fake_like(b, None, False) for n, b in model.named_buffers()}
        ignored = {t.untyped_storage()._cdata for t in (*params.values(), *buffers.values())}
        x, y = _fake_inputs(batch)
        tracker = _LiveBytes(ignored, [x, y])
        for name, p in params.items():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(functools.partial(_drop_grad, tracker, name))
        try:
            for fqn in unit_fqns:
                _hook_unit(modules[fqn], fqn, tracker, handles)
                if checkpointed and fqn:
                    patched.append(_checkpoint_forward(modules[fqn]))
            with tracker:
                step = _Step(model, tracker)  # backward inside functional_call: recomputation sees the fakes
                torch.func.functional_call(step, {f"model.{k}": v for k, v in {**params, **buffers}.items()}, (x, y))
        finally:
            for h in handles:
                h.remove()
            for module in patched:
                del module.forward
        if not tracker.marks or tracker.marks[-1] != ("post_backward", ""):
            tracker.mark("post_backward", "")  # the root's inputs need no grad: its final callback
    return ActivationTrace(tracker.marks, tracker.at_mark, tracker.seg_max, tracker.grad_arrivals)


class _Step(nn.Module):
    """Forward, cross-entropy loss (in fp32, as the train loop and bench compute it), backward."""

    def __init__(self, model: nn.Module, tracker: _LiveBytes):
        super().__init__()
        self.model = model
        self._tracker = [tracker]  # in a list: not a submodule

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> None:
        logits = _logits(self.model(x))  # (B, T, V)
        self._tracker[0].mark("loss", "")
        loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())  # (B*T, V) vs (B*T,)
        del logits
        loss.backward()


def _drop_grad(tracker: _LiveBytes, name: str, p: torch.Tensor) -> None:
    """Note which segment ``name``'s grad arrived in, and drop it: the memory model holds
    unsharded grads itself, as shardwise does (until the unit's post-backward packs them)."""
    tracker.grad_arrivals.append((len(tracker.marks) - 1, name))
    p.grad = None


def _fake_like(t: torch.Tensor, dtype: torch.dtype | None, requires_grad: bool) -> torch.Tensor:
    dtype = dtype if dtype is not None and t.is_floating_point() else t.dtype
    return torch.empty(t.shape, dtype=dtype, device="cpu", requires_grad=requires_grad)


def _checkpoint_forward(module: nn.Module) -> nn.Module:
    original = module.forward

    def forward(*args, **kwargs):
        return checkpoint(original, *args, use_reentrant=False, **kwargs)

    module.forward = forward
    return module
