"""Process-wide tally of the collectives shardwise issues.

Every collective in :mod:`shardwise.collectives` records itself here (a few integer
additions, no synchronisation), so a training loop can report what it moved::

    from shardwise import comm_stats
    comm_stats.reset()
    ...train a step...
    print(comm_stats.snapshot())

``payload_bytes`` is the size of the collective's full buffer (the unsharded all-gather
output, the unsharded reduce-scatter input, the all-reduce buffer). ``wire_bytes`` is what
one rank sends with a bandwidth-optimal ring over ``group_size`` ranks:
``(n-1)/n`` of the payload for all-gather, reduce-scatter and all-to-all, ``2(n-1)/n``
for all-reduce. ``payload_bytes_by_dtype`` splits the payload by the dtype the collective
moved, keyed ``(kind, dtype)``: float8 weights gathered as float8 show as
``("all_gather", torch.float8_e4m3fn)``; a group whose all-gather inputs differ in dtype
moves bytes (``torch.uint8``), as torch's FSDP2 does.
"""

from __future__ import annotations

import dataclasses
from collections import Counter

_RING_FACTOR = {"all_gather": 1, "reduce_scatter": 1, "all_to_all": 1, "all_reduce": 2}


@dataclasses.dataclass
class CommStats:
    """Counts and bytes per collective kind since the last :func:`reset`."""

    counts: Counter = dataclasses.field(default_factory=Counter)
    payload_bytes: Counter = dataclasses.field(default_factory=Counter)
    wire_bytes: Counter = dataclasses.field(default_factory=Counter)
    payload_bytes_by_dtype: Counter = dataclasses.field(default_factory=Counter)  # (kind, dtype) -> bytes

    @property
    def total_wire_bytes(self) -> int:
        return int(sum(self.wire_bytes.values()))

    def copy(self) -> "CommStats":
        return CommStats(
            Counter(self.counts), Counter(self.payload_bytes), Counter(self.wire_bytes),
            Counter(self.payload_bytes_by_dtype),
        )

    def bytes_by_dtype(self, kind: str) -> dict:
        """``{dtype: payload bytes}`` of the collectives of ``kind``."""
        return {dtype: n for (k, dtype), n in self.payload_bytes_by_dtype.items() if k == kind}


_STATS = CommStats()


def record(kind: str, payload_bytes: int, group_size: int, dtype: object = None) -> None:
    """Add one collective of ``kind`` moving ``payload_bytes`` (of ``dtype``) over ``group_size`` ranks."""
    if kind not in _RING_FACTOR:
        raise ValueError(f"unknown collective kind {kind!r}; expected one of {sorted(_RING_FACTOR)}")
    _STATS.counts[kind] += 1
    _STATS.payload_bytes[kind] += payload_bytes
    _STATS.payload_bytes_by_dtype[kind, dtype] += payload_bytes
    if group_size > 1:
        _STATS.wire_bytes[kind] += ring_wire_bytes(kind, payload_bytes, group_size)


def ring_wire_bytes(kind: str, payload_bytes: int, group_size: int) -> int:
    """Bytes one rank sends for one collective of ``kind`` in a bandwidth-optimal ring."""
    return _RING_FACTOR[kind] * payload_bytes * (group_size - 1) // group_size


def snapshot() -> CommStats:
    """A copy of the tally so far."""
    return _STATS.copy()


def reset() -> None:
    """Zero the tally."""
    global _STATS
    _STATS = CommStats()
