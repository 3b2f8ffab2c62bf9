"""Bytes on the wire per rank per step: counted, theoretical minimum, and what hit the sockets.

Three views of the same traffic, per rank and per step:

- **counted**: the collectives :class:`~shardwise.testing.CommCounter` saw in one untimed
  step, converted to what one rank sends with a bandwidth-optimal ring over ``n`` ranks:
  ``(n-1)/n`` of the payload for all-gather, reduce-scatter and all-to-all, ``2(n-1)/n``
  for all-reduce (payload = the unsharded all-gather output, the reduce-scatter input,
  the all-reduce buffer).
- **theoretical minimum** for ``Ψ`` parameters on ``N`` ranks, gathers in ``param_dtype``
  (``b_p`` bytes per element) and reductions in ``reduce_dtype`` (``b_r``)::

      fsdp, reshard after forward:  (2·Ψ·b_p + Ψ·b_r)·(N−1)/N   all-gather in forward and backward, one reduce-scatter
      fsdp, keep after forward:     (  Ψ·b_p + Ψ·b_r)·(N−1)/N   one all-gather, one reduce-scatter
      replicate / DDP:               2·Ψ·b_r·(N−1)/N            one all-reduce

  With fp32 both ``b`` are 4 and these are the familiar 3Ψb and 2Ψb (N−1)/N.
- **socket bytes**: ``wchar`` of ``/proc/self/io`` (bytes this process passed to
  ``write``/``writev``, which is how gloo's TCP transport sends), read around each timed
  step. Includes gloo's framing and whatever algorithm gloo picked, so it can differ from
  the ring model in either direction.
"""

from __future__ import annotations

from collections import Counter
from typing import Iterable, NamedTuple

from bench.cases import REPLICATE_KINDS
from shardwise.testing import CommEvent

__all__ = ["RING_FACTOR", "CountedComm", "count_events", "TheoryMin", "theoretical_min", "read_wchar"]

RING_FACTOR = {"all_gather": 1, "reduce_scatter": 1, "all_to_all": 1, "all_reduce": 2}
"""Multiple of ``(n-1)/n · payload`` one rank sends in a ring, per collective kind."""

_PROC_IO = "/proc/self/io"


class CountedComm(NamedTuple):
    """What one rank issued in one step, by collective kind."""

    counts: dict[str, int]  # kind -> number of collectives (barriers included)
    payload_bytes: dict[str, int]  # kind -> summed payload
    wire_bytes: dict[str, int]  # kind -> ring bytes sent; only the kinds of RING_FACTOR

    @property
    def total_wire_bytes(self) -> int:
        return sum(self.wire_bytes.values())


def count_events(events: Iterable[CommEvent]) -> CountedComm:
    """Sum CommCounter events into counts, payload and ring wire bytes per kind."""
    counts: Counter = Counter()
    payload: Counter = Counter()
    wire: Counter = Counter()
    for e in events:
        counts[e.kind] += 1
        payload[e.kind] += e.payload_bytes
        if e.kind in RING_FACTOR and e.group_size > 1:
            wire[e.kind] += RING_FACTOR[e.kind] * e.payload_bytes * (e.group_size - 1) // e.group_size
    return CountedComm(dict(counts), dict(payload), dict(wire))


class TheoryMin(NamedTuple):
    """The least one rank must send per step, split into gathers and reductions."""

    gather_bytes: float  # all-gathers of parameters, in param_dtype
    reduce_bytes: float  # reduce-scatter or all-reduce of gradients, in reduce_dtype

    @property
    def total_bytes(self) -> float:
        return self.gather_bytes + self.reduce_bytes


def theoretical_min(kind: str, n_params: int, world_size: int, reshard: bool | None, param_bytes: int, reduce_bytes: int) -> TheoryMin:
    """Minimum ring bytes per rank per step (see the module docstring for the formulas).

    Args:
        kind: ``fsdp``, or ``replicate`` / ``torch_replicate`` (one all-reduce of the gradients).
        n_params: Ψ, the unsharded parameter count.
        world_size: N.
        reshard: ``reshard_after_forward`` (fsdp only): parameters are gathered twice when True.
        param_bytes: bytes per element of ``param_dtype`` (what the all-gathers move).
        reduce_bytes: bytes per element of ``reduce_dtype`` (what the reductions move).
    """
    ring = (world_size - 1) / world_size
    if kind in REPLICATE_KINDS:
        return TheoryMin(0.0, 2 * n_params * reduce_bytes * ring)
    if kind not in ("fsdp", "report"):
        raise ValueError(f"kind must be 'fsdp', 'replicate' or 'torch_replicate', got {kind!r}")
    gathers = 2 if reshard else 1
    return TheoryMin(gathers * n_params * param_bytes * ring, n_params * reduce_bytes * ring)


def read_wchar() -> int | None:
    """Bytes this process has written through ``write``-family syscalls; None off Linux."""
    try:
        with open(_PROC_IO) as f:
            for line in f:
                if line.startswith("wchar:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None
