"""Bytes on the wire and collectives per training step, as shardwise issues them.

Per unit with parameters (N = shard size, R = replicate size, P = its padded shard numel,
``b_p`` / ``b_r`` the gather / reduce element sizes; nothing at world size 1)::

    forward        all-gather over N             payload N·P·b_p
    backward       reshard True: all-gather over N, payload N·P·b_p
                   reshard k:    all-gather over k (from the kept 1/k), payload N·P·b_p
                   reshard False: nothing (still gathered)
    reduction      reduce-scatter over N         payload N·Pg·b_r  (Pg: params with grads)
                   HSDP: + all-reduce over R     payload Pg·b_r

Wire bytes per collective are what ``shardwise.comm_stats`` records (the ring model,
rounded down per collective), so a prediction equals the tally of a real step exactly.
Which *kind* the reduction is counted as depends on the backend: that choice lives in
:func:`reduction_kind` alone, so a change in ``collectives.reduce_scatter`` is one edit here.
"""

from __future__ import annotations

import dataclasses
import os
from collections import Counter

from shardwise import comm_stats
from shardwise.planning.setting import Setting
from shardwise.planning.structure import UnitShape

__all__ = ["Collective", "CommCounts", "reduction_kind", "unit_collectives", "step_comm"]


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective a rank issues: its kind, payload (the full buffer) and group size."""

    kind: str
    payload_bytes: int
    group_size: int

    @property
    def wire_bytes(self) -> int:
        return comm_stats.ring_wire_bytes(self.kind, self.payload_bytes, self.group_size)


@dataclasses.dataclass
class CommCounts:
    """Counts and bytes per collective kind for one step (the shape of ``comm_stats``)."""

    counts: dict[str, int]
    payload_bytes: dict[str, int]
    wire_bytes: dict[str, int]

    @property
    def total_wire_bytes(self) -> int:
        return sum(self.wire_bytes.values())

    @property
    def total_count(self) -> int:
        return sum(self.counts.values())


def reduction_kind(setting: Setting) -> tuple[str, bool]:
    """(kind comm_stats records for a gradient reduce-scatter, whether it holds a receive
    buffer of (N-1)/N of its input while in flight).

    Every backend reduce-scatters natively (torch's collective kinds) unless gloo (CPU) is
    asked for an all-to-all plus a local sum with ``SHARDWISE_GLOO_REDUCE_SCATTER=all_to_all``
    (collectives.use_all_to_all_reduce); over more than 2 ranks that all-to-all receives into
    a buffer of its own.
    """
    if setting.device == "cpu" and os.environ.get("SHARDWISE_GLOO_REDUCE_SCATTER", "native") == "all_to_all":
        return "all_to_all", setting.shard_size > 2
    return "reduce_scatter", False


def unit_collectives(unit: UnitShape, policy: bool | int, setting: Setting) -> list[Collective]:
    """The collectives of one unit in one synced training step, in issue order."""
    n, r = setting.shard_size, setting.replicate_size
    if not unit.params or n * r == 1:
        return []
    out = []
    padded = sum(p.padded_shard_numel(n) for p in unit.params)
    gather_payload = n * padded * setting.param_itemsize(unit.itemsize)
    if n > 1:
        out.append(Collective("all_gather", gather_payload, n))
        if policy is True:
            out.append(Collective("all_gather", gather_payload, n))
        elif policy is not False:
            out.append(Collective("all_gather", gather_payload, int(policy)))
    padded_grad = sum(p.padded_shard_numel(n) for p in unit.params if p.requires_grad)
    if padded_grad:
        rb = setting.reduce_itemsize(unit.itemsize)
        if n > 1:
            out.append(Collective(reduction_kind(setting)[0], n * padded_grad * rb, n))
        if r > 1:
            out.append(Collective("all_reduce", padded_grad * rb, r))
    return out


def step_comm(units: list[UnitShape], policies: list[bool | int], setting: Setting) -> CommCounts:
    """Sum :func:`unit_collectives` over every unit: one rank's collectives in one step."""
    counts, payload, wire = Counter(), Counter(), Counter()
    for unit, policy in zip(units, policies):
        for c in unit_collectives(unit, policy, setting):
            counts[c.kind] += 1
            payload[c.kind] += c.payload_bytes
            if c.group_size > 1:
                wire[c.kind] += c.wire_bytes
    return CommCounts(dict(counts), dict(payload), dict(wire))
