"""Peak live tensor bytes of a region, measured at the dispatcher (CPU has no allocator stats).

Used by the benchmark (``bench/``), the planner's accuracy check and ``shardwise train --auto``.

Algorithm of :class:`PeakMemory`:

1. Every storage the region touches is *tracked*: the storages of the tensors it is
   seeded with (parameters, gradients, optimizer state, the batch), and of every input
   and output of every aten/c10d op dispatched while the mode is active. A storage is
   keyed by its ``StorageImpl`` (views of one storage count once) and held weakly:
   ``weakref`` on an ``UntypedStorage`` fires only when the storage itself is freed,
   and then its bytes leave the live total.
2. The live total is kept incrementally: a storage adds its ``nbytes()`` when first
   seen, and is re-measured whenever an op touches it again.
3. Both FSDP implementations free unsharded parameters with
   ``untyped_storage().resize_(0)`` and re-allocate them with ``resize_(n)``, which never
   passes the dispatcher; while the mode is active ``UntypedStorage.resize_`` is wrapped
   so each resize re-measures its storage at once.
4. The peak is the largest live total after any op or resize.

What it cannot see: memory a kernel allocates internally (inside gloo, oneDNN) and
storages created and freed between two dispatched ops without being an op's input or
output. Both implementations are measured by the same rule, so the comparison is fair.
Tensor subclasses (DTensor) are let through to desugar first, so the plain local tensors
they operate on are what gets tracked. Measure one untimed step with it: every op pays
a Python round trip.
"""

from __future__ import annotations

import weakref
from typing import Any, Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["PeakMemory", "tensors_of"]

_ORIGINAL_RESIZE = torch.UntypedStorage.resize_


class PeakMemory(TorchDispatchMode):
    """Track the peak of live tensor storage bytes while active (one instance active at a time).

    Attributes:
        peak_bytes: the largest live total seen so far.
        start_bytes: the live total of the seed tensors when the mode was created.
        live_bytes: the current live total.
    """

    peak_bytes: int
    start_bytes: int
    live_bytes: int
    _refs: dict[int, weakref.ref]  # StorageImpl address -> weak ref to its UntypedStorage
    _sizes: dict[int, int]  # StorageImpl address -> nbytes when last measured

    def __init__(self, seed: Iterable[torch.Tensor] = ()) -> None:
        super().__init__()
        self._refs, self._sizes = {}, {}
        self.live_bytes = 0
        for t in seed:
            self._track(t)
        self.start_bytes = self.peak_bytes = self.live_bytes

    def __repr__(self) -> str:
        return f"PeakMemory(peak_bytes={self.peak_bytes}, live_bytes={self.live_bytes}, tracked={len(self._refs)})"

    def __enter__(self):
        if torch.UntypedStorage.resize_ is not _ORIGINAL_RESIZE:
            raise RuntimeError("another PeakMemory is active; they do not nest")
        tracker = self

        def resize_(storage: torch.UntypedStorage, size: int):
            result = _ORIGINAL_RESIZE(storage, size)
            tracker._track(storage)
            tracker._update_peak()
            return result

        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *exc):
        torch.UntypedStorage.resize_ = _ORIGINAL_RESIZE
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(_is_subclass_with_dispatch(t) for t in types):
            return NotImplemented  # let DTensor & co. desugar; we see the plain ops they issue
        for leaf in tree_leaves((args, kwargs)):
            self._track(leaf)
        self._update_peak()
        out = func(*args, **kwargs)
        for leaf in tree_leaves(out):
            self._track(leaf)
        self._update_peak()
        return out

    def _update_peak(self) -> None:
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)

    def _track(self, leaf: Any) -> None:
        """Start tracking ``leaf``'s storage, or re-measure it if tracked already."""
        if isinstance(leaf, torch.Tensor):
            if _is_subclass_with_dispatch(type(leaf)) or leaf.device.type == "meta":
                return
            leaf = leaf.untyped_storage()
        if not isinstance(leaf, torch.UntypedStorage):
            return
        key, size = leaf._cdata, leaf.nbytes()
        ref = self._refs.get(key)
        if ref is None or ref() is None:
            self.live_bytes -= self._sizes.get(key, 0)  # a freed storage whose callback has not run yet
            self._refs[key] = weakref.ref(leaf, self._on_free(key))
            self._sizes[key] = 0
        self.live_bytes += size - self._sizes[key]
        self._sizes[key] = size

    def _on_free(self, key: int):
        """A weakref callback: drop ``key``'s bytes, unless the key now names a newer storage."""
        refs, sizes = self._refs, self._sizes

        def callback(ref: weakref.ref) -> None:
            if refs.get(key) is ref:
                del refs[key]
                self.live_bytes -= sizes.pop(key)

        return callback


def tensors_of(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The long-lived tensors of a training setup: parameters, their grads, optimizer state.

    DTensor parameters contribute their local shard (what this rank actually stores).
    """
    found = []
    for p in model.parameters():
        found.append(_local(p))
        if p.grad is not None:
            found.append(_local(p.grad))
    for state in optimizer.state.values():
        found.extend(_local(v) for v in state.values() if isinstance(v, torch.Tensor))
    return found


@torch.no_grad()
def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _is_subclass_with_dispatch(cls: type) -> bool:
    handler = getattr(cls, "__torch_dispatch__", None)
    return handler is not None and handler is not torch._C._disabled_torch_dispatch_impl
