"""CommCounter: count the collectives a piece of code issues, at the dispatcher.

Every eager collective in PyTorch, whoever calls it, ends in a dispatcher op:
``dist.all_gather_into_tensor`` becomes ``c10d::_allgather_base_``,
``dist.reduce_scatter_tensor`` becomes ``c10d::_reduce_scatter_base_``, DTensor and
functional collectives become ``_c10d_functional::all_gather_into_tensor`` and friends.
A ``TorchDispatchMode`` sees each of those ops once, with its tensors, on the thread
that issued it — including ops issued from autograd hooks during ``loss.backward()``
(on CPU the engine runs backward on the calling thread and carries the mode along) and
``async_op=True`` calls (counted when issued, not when waited). So a test can assert
exactly what torch's ``fully_shard`` or shardwise sent, without patching either::

    with CommCounter() as comm:
        loss = model(x).sum()
        forward = comm.snapshot()
        loss.backward()
    assert forward.count("all_gather") == 3
    assert (comm.snapshot() - forward).count("reduce_scatter") == 3

Payload bytes follow :mod:`shardwise.comm_stats`: the all-gather output, the
reduce-scatter input, the all-reduce buffer, the all-to-all input (plus the chunk a rank
kept for itself, when its split sizes leave exactly that one out), the broadcast buffer.
Tensor subclasses (DTensor) are let through to desugar first (``NotImplemented``), so
the collectives they issue are counted as plain ops, once.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Mapping
from typing import Any, NamedTuple

import torch
from torch.distributed import ProcessGroup, distributed_c10d
from torch.utils._python_dispatch import TorchDispatchMode

KINDS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "broadcast", "reduce", "gather", "scatter", "send", "recv", "barrier")


class _Rule(NamedTuple):
    """How to read one op: its kind, which argument is the payload, whether to scale it."""

    kind: str
    payload_arg: str | None  # None: no payload (barrier)
    times_group_size: bool = False  # functional all-gather: payload is input * group size


# c10d ops (what torch.distributed's eager API calls), by overload-packet name.
_C10D_RULES = {
    "_allgather_base_": _Rule("all_gather", "output_tensor"),
    "allgather_": _Rule("all_gather", "output_tensors"),
    "allgather_coalesced_": _Rule("all_gather", "output_lists"),
    "allgather_into_tensor_coalesced_": _Rule("all_gather", "outputs"),
    "_reduce_scatter_base_": _Rule("reduce_scatter", "input_tensor"),
    "reduce_scatter_": _Rule("reduce_scatter", "input_tensors"),
    "reduce_scatter_tensor_coalesced_": _Rule("reduce_scatter", "inputs"),
    "allreduce_": _Rule("all_reduce", "tensors"),
    "allreduce_coalesced_": _Rule("all_reduce", "tensors"),
    "alltoall_base_": _Rule("all_to_all", "input"),
    "alltoall_": _Rule("all_to_all", "input_tensors"),
    "broadcast_": _Rule("broadcast", "tensors"),
    "reduce_": _Rule("reduce", "tensors"),
    "gather_": _Rule("gather", "input_tensors"),
    "scatter_": _Rule("scatter", "output_tensors"),
    "send": _Rule("send", "tensors"),
    "recv_": _Rule("recv", "tensors"),
    "recv_any_source_": _Rule("recv", "tensors"),
    "barrier": _Rule("barrier", None),
}

# Functional collectives (DTensor redistribution, torch.distributed._functional_collectives).
_FUNCTIONAL_RULES = {
    "all_gather_into_tensor": _Rule("all_gather", "input", times_group_size=True),
    "all_gather_into_tensor_coalesced": _Rule("all_gather", "inputs", times_group_size=True),
    "all_gather_into_tensor_out": _Rule("all_gather", "input", times_group_size=True),
    "reduce_scatter_tensor": _Rule("reduce_scatter", "input"),
    "reduce_scatter_tensor_coalesced": _Rule("reduce_scatter", "inputs"),
    "reduce_scatter_tensor_out": _Rule("reduce_scatter", "input"),
    "all_reduce": _Rule("all_reduce", "input"),
    "all_reduce_": _Rule("all_reduce", "input"),
    "all_reduce_coalesced": _Rule("all_reduce", "inputs"),
    "all_reduce_coalesced_": _Rule("all_reduce", "inputs"),
    "all_to_all_single": _Rule("all_to_all", "input"),
    "broadcast": _Rule("broadcast", "input"),
    "broadcast_": _Rule("broadcast", "input"),
}


def _rules_by_packet() -> dict[Any, _Rule]:
    """Map op overload packets (``torch.ops.c10d.allreduce_``...) to their rules."""
    rules = {}
    for namespace, table in ((torch.ops.c10d, _C10D_RULES), (torch.ops._c10d_functional, _FUNCTIONAL_RULES)):
        for name, rule in table.items():
            if hasattr(namespace, name):  # an op a future torch dropped is simply not counted
                rules[getattr(namespace, name)] = rule
    return rules


_RULES = _rules_by_packet()


class CommEvent(NamedTuple):
    """One collective as the dispatcher saw it."""

    kind: str  # one of KINDS
    op: str  # the dispatcher op, e.g. "c10d._allgather_base_.default"
    payload_bytes: int
    group_size: int


@dataclasses.dataclass(frozen=True)
class CommTally:
    """Counts and payload bytes per kind at one moment; ``later - earlier`` gives a phase."""

    counts: Mapping[str, int]
    bytes: Mapping[str, int]

    def count(self, kind: str | None = None) -> int:
        """Collectives of ``kind`` (all kinds when None)."""
        return _lookup(self.counts, kind)

    def payload_bytes(self, kind: str | None = None) -> int:
        """Payload bytes of ``kind`` (all kinds when None)."""
        return _lookup(self.bytes, kind)

    def __sub__(self, earlier: CommTally) -> CommTally:
        counts = Counter(self.counts)
        counts.subtract(earlier.counts)
        moved = Counter(self.bytes)
        moved.subtract(earlier.bytes)
        return CommTally(dict(+counts), dict(+moved))


class CommCounter(TorchDispatchMode):
    """A dispatch mode that records every collective issued while it is active.

    Attributes:
        events: every collective seen since construction or the last :meth:`reset`,
            in issue order.
    """

    events: list[CommEvent]

    def __init__(self) -> None:
        super().__init__()
        self.events = []

    def __repr__(self) -> str:
        return f"CommCounter({self.counts})"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        rule = _RULES.get(getattr(func, "_overloadpacket", None))  # higher-order ops have none
        if rule is None:
            return func(*args, **kwargs)  # not a collective: run it (FakeTensor & co. included)
        if any(_is_subclass_with_dispatch(t) for t in types):
            return NotImplemented  # let DTensor & co. desugar; we count what they issue
        self.events.append(_event(func, rule, args, kwargs))
        return func(*args, **kwargs)

    @property
    def counts(self) -> dict[str, int]:
        """kind -> number of collectives, for the kinds seen."""
        return dict(self.snapshot().counts)

    def count(self, kind: str | None = None) -> int:
        """Number of collectives of ``kind`` (e.g. ``"all_gather"``), or of all kinds."""
        return self.snapshot().count(kind)

    def payload_bytes(self, kind: str | None = None) -> int:
        """Payload bytes of ``kind``, or of all kinds (see the module docstring)."""
        return self.snapshot().payload_bytes(kind)

    def snapshot(self) -> CommTally:
        """The tally so far, frozen; subtract two snapshots to get one phase."""
        counts: Counter = Counter()
        moved: Counter = Counter()
        for event in self.events:
            counts[event.kind] += 1
            moved[event.kind] += event.payload_bytes
        return CommTally(dict(counts), dict(moved))

    def reset(self) -> None:
        """Forget everything recorded so far (the mode stays active)."""
        self.events = []


def _lookup(table: Mapping[str, int], kind: str | None) -> int:
    if kind is None:
        return sum(table.values())
    if kind not in KINDS:
        raise ValueError(f"unknown collective kind {kind!r}; expected one of {KINDS}")
    return table.get(kind, 0)


def _is_subclass_with_dispatch(cls: type) -> bool:
    handler = getattr(cls, "__torch_dispatch__", None)
    return handler is not None and handler is not torch._C._disabled_torch_dispatch_impl


def _event(func, rule: _Rule, args: tuple, kwargs: dict) -> CommEvent:
    bound = _bind(func, args, kwargs)
    payload = _nbytes(bound[rule.payload_arg]) if rule.payload_arg else 0
    group_size = _group_size(bound)
    if rule.times_group_size:
        payload *= group_size
    if rule.kind == "all_to_all":
        payload += _self_chunk_bytes(bound, payload)
    return CommEvent(rule.kind, str(func), payload, group_size)


def _self_chunk_bytes(bound: Mapping[str, Any], input_bytes: int) -> int:
    """The chunk an all-to-all left out of its input because it was its own (split sizes
    all equal but one zero): counted back in, so the payload is the full N-chunk exchange,
    the same as the reduce-scatter that shardwise's all-to-all reduce replaces."""
    splits = [int(s) for s in bound.get("input_split_sizes") or ()]
    nonzero = [s for s in splits if s]
    if splits.count(0) != 1 or len(set(nonzero)) != 1:
        return 0
    return input_bytes // len(nonzero)


def _bind(func, args: tuple, kwargs: dict) -> dict[str, Any]:
    """Argument name -> value, from the op's schema (positional, keyword or default)."""
    bound = {}
    for i, arg in enumerate(func._schema.arguments):
        if i < len(args):
            bound[arg.name] = args[i]
        elif arg.name in kwargs:
            bound[arg.name] = kwargs[arg.name]
        elif arg.has_default_value():
            bound[arg.name] = arg.default_value
    return bound


def _nbytes(value: Any) -> int:
    """Bytes of a tensor or a (nested) list of tensors."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    return 0


def _group_size(bound: Mapping[str, Any]) -> int:
    """Ranks in the op's group: from the c10d process group, or the functional op's args."""
    if "process_group" in bound:  # a TorchScript-boxed ProcessGroup at the dispatcher
        return ProcessGroup.unbox(bound["process_group"]).size()
    if "group_size" in bound:
        return int(bound["group_size"])
    return distributed_c10d._resolve_process_group(bound["group_name"]).size()
