"""Comparisons and counters for low-precision (tensor-subclass) parameters, shared by
test_int8_bitnet.py, test_float8_tp.py and test_lowprec_checkpoint.py.

Everything here runs inside the ranks of :func:`shardwise.testing.run_on_ranks`.

- :func:`inner_tensors`: the plain tensors a (possibly nested) tensor subclass holds, by
  ``__tensor_flatten__`` (a DTensor's local tensor, an int8 weight's ``int_data`` and
  ``scale``, an NF4 tensor's quantized data and scalers), so two parameters compare bit for
  bit even where the subclass has no ``aten.equal``;
- :func:`assert_same`: same type at every level, same placements, ``torch.equal`` inner
  tensors;
- :class:`GatherInputs`: what a subclass's ``fsdp_pre_all_gather`` handed to the
  all-gather, in bytes per dtype, with the all-gather payload seen at the dispatcher
  (:class:`shardwise.testing.CommCounter`) — the "bytes each rank all-gathers" of a step.
"""

from __future__ import annotations

import functools
from collections import Counter
from typing import Iterator

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from shardwise.testing import CommCounter


def inner_tensors(t: torch.Tensor, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """``(path, plain tensor)`` for every plain tensor inside ``t`` (``t`` itself if plain)."""
    if isinstance(t, DTensor):
        yield from inner_tensors(t._local_tensor, prefix + "local.")
        return
    if type(t) in (torch.Tensor, torch.nn.Parameter) or not hasattr(t, "__tensor_flatten__"):
        yield prefix.rstrip(".") or "tensor", t
        return
    names, _ = t.__tensor_flatten__()
    for name in names:
        yield from inner_tensors(getattr(t, name), f"{prefix}{name}.")


def type_chain(t: torch.Tensor) -> tuple[str, ...]:
    """The type names from the outside in: ``("DTensor", "NF4Tensor")``."""
    chain = []
    while True:
        chain.append(type(t).__name__ if type(t) is not torch.nn.Parameter else "Tensor")
        if not isinstance(t, DTensor):
            return tuple(chain)
        t = t._local_tensor


def assert_same(ours: torch.Tensor, theirs: torch.Tensor, where: str) -> None:
    """Same subclass chain, dtype and shape, and bit-equal inner tensors."""
    assert type_chain(ours) == type_chain(theirs), f"{where}: type {type_chain(ours)} vs torch's {type_chain(theirs)}"
    if isinstance(ours, DTensor):
        placements = (ours.placements, theirs.placements)
        assert placements[0] == placements[1], f"{where}: placements {placements[0]} vs torch's {placements[1]}"
    assert ours.dtype == theirs.dtype and ours.shape == theirs.shape, (
        f"{where}: {ours.dtype} {tuple(ours.shape)} vs torch's {theirs.dtype} {tuple(theirs.shape)}"
    )
    a, b = dict(inner_tensors(ours)), dict(inner_tensors(theirs))
    assert a.keys() == b.keys(), f"{where}: inner tensors {sorted(a)} vs torch's {sorted(b)}"
    for name in a:
        assert a[name].dtype == b[name].dtype, f"{where}.{name}: {a[name].dtype} vs torch's {b[name].dtype}"
        assert torch.equal(a[name], b[name]), f"{where}.{name} differs from torch's"


def assert_same_params(ours, theirs, where: str, grads: bool = True) -> None:
    """Every parameter (and gradient) of two models, in order, by :func:`assert_same`."""
    for (name, p), (name_t, q) in zip(ours.named_parameters(), theirs.named_parameters(), strict=True):
        assert name == name_t, f"{where}: parameter order {name} vs torch's {name_t}"
        assert_same(p, q, f"{where}: {name}")
        if grads:
            has = (p.grad is not None, q.grad is not None)
            assert has[0] == has[1], f"{where}: {name} has a grad: {has[0]}, torch's: {has[1]}"
            if p.grad is not None:
                assert_same(p.grad, q.grad, f"{where}: {name}.grad")


class GatherInputs:
    """Count, while active, the bytes per dtype that ``cls.fsdp_pre_all_gather`` returned
    (the extension's all-gather inputs on this rank), and every collective's payload.

    ``bytes_by_dtype`` is per rank and per call: multiply by the group size for what the
    all-gather outputs hold. The wrapper keeps the method's signature (FSDP picks the one-
    or five-argument form by it) and is removed on exit.
    """

    def __init__(self, *classes: type):
        self.classes = classes
        self.bytes_by_dtype: Counter = Counter()
        self.calls = 0
        self.comm = CommCounter()
        self._saved: list = []

    def __enter__(self) -> "GatherInputs":
        for cls in self.classes:
            original = cls.__dict__["fsdp_pre_all_gather"]

            @functools.wraps(original)
            def counted(shard, *args, _original=original, **kwargs):
                inputs, metadata = _original(shard, *args, **kwargs)
                self.calls += 1
                for t in inputs:
                    self.bytes_by_dtype[str(t.dtype).removeprefix("torch.")] += t.numel() * t.element_size()
                return inputs, metadata

            self._saved.append((cls, original))
            cls.fsdp_pre_all_gather = counted
        self.comm.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.comm.__exit__(*exc)
        for cls, original in self._saved:
            cls.fsdp_pre_all_gather = original
        self._saved.clear()

    def summary(self) -> dict:
        """Picklable numbers: calls, bytes per dtype of the inputs, all-gather payload bytes."""
        return {
            "pre_all_gather_calls": self.calls,
            "input_bytes_by_dtype": dict(self.bytes_by_dtype),
            "all_gather_count": self.comm.count("all_gather"),
            "all_gather_bytes": self.comm.payload_bytes("all_gather"),
        }


def rank_generator(rank: int | None = None) -> torch.Generator:
    """This rank's data generator (a data-parallel rank's own batches)."""
    return torch.Generator().manual_seed(dist.get_rank() if rank is None else rank)
