"""Comparisons and counters for low-precision (tensor-subclass) parameters, shared by
test_int8_bitnet.py, test_float8_tp.py and test_lowprec_checkpoint.py.

Everything here runs inside the ranks of :func:`shardwise.testing.run_on_ranks`.

- :func:`assert_same`: one tensor (a state-dict value) against torch's: the same type at
  every level (``DTensor`` around the subclass), placements, dtype and shape, and bit-equal
  inner tensors (``_extension_helpers.same_values``: by ``__tensor_flatten__``, since a
  subclass may have no ``aten.equal``); parameters and gradients of whole models go through
  ``_extension_helpers.assert_same_params``;
- :class:`GatherInputs`: what a subclass's ``fsdp_pre_all_gather`` handed to the
  all-gather, in bytes per dtype, with the all-gather payload seen at the dispatcher
  (:class:`shardwise.testing.CommCounter`) — the "bytes each rank all-gathers" of a step.
"""

from __future__ import annotations

import functools
from collections import Counter

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from _extension_helpers import same_values
from shardwise.testing import CommCounter


def type_chain(t: torch.Tensor) -> tuple[str, ...]:
    """The type names from the outside in: ``("DTensor", "NF4Tensor")``."""
    chain = []
    while True:
        chain.append(type(t).__name__ if type(t) is not torch.nn.Parameter else "Tensor")
        if not isinstance(t, DTensor):
            return tuple(chain)
        t = t._local_tensor


def assert_same(ours: torch.Tensor, theirs: torch.Tensor, where: str) -> None:
    """Same subclass chain, placements, dtype and shape, and bit-equal inner tensors."""
    assert type_chain(ours) == type_chain(theirs), f"{where}: type {type_chain(ours)} vs torch's {type_chain(theirs)}"
    if isinstance(ours, DTensor):
        placements = (ours.placements, theirs.placements)
        assert placements[0] == placements[1], f"{where}: placements {placements[0]} vs torch's {placements[1]}"
    assert ours.dtype == theirs.dtype and ours.shape == theirs.shape, (
        f"{where}: {ours.dtype} {tuple(ours.shape)} vs torch's {theirs.dtype} {tuple(theirs.shape)}"
    )
    local = (ours._local_tensor, theirs._local_tensor) if isinstance(ours, DTensor) else (ours, theirs)
    assert same_values(*local), f"{where}: values differ from torch's"


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
