"""Ledger: what this rank issued on one process group, numbered the same way on every rank.

Every shardwise collective on a process group gets the next sequence number of that
group's ledger; ranks that run the same program give the same collective the same
number, so "collective #41 on group G" names one thing on every rank. The ledger also
counts steps (root forwards that use the group; on a group no root marks, its collectives:
see :mod:`~shardwise.faults.monitor`) and names the store keys the order check uses. One
ledger per process-group object (ranks can be threads of one process, each with its own
group objects).

Its key prefix adds a generation: how many times this rank made a ledger for a group of
this name *and these members*, counted in the store the keys live in (see
:func:`_generation`). Process groups are destroyed and re-created (torch's threaded test
harness does it between tests, a job may re-initialise): a re-created group never reads a
dead one's keys, and every member of it agrees on the generation, because each member
counts the same creations. A count kept per process would not: with ranks as threads of
one process, a name that came back with other members (group "0" of a 2-rank test, then
of a 4-rank one) left ranks 0-1 on generation 2 and ranks 2-3 on 1, each waiting forever
for keys the others never wrote.
"""

from __future__ import annotations

import weakref
import zlib

import torch.distributed as dist

from shardwise.faults import step_digest
from shardwise.faults.beacon import Beacon, beacon_for
from shardwise.faults.records import Collective, Position
from shardwise.faults.settings import current

__all__ = ["Ledger", "ledger_for", "forget_all"]


class Ledger:
    """The numbered collectives of one process group on this rank."""

    name: str  # the group's name, identical on every rank
    ranks: list[int]  # global ranks of the group
    rank: int  # our global rank
    prefix: str  # store key prefix of this ledger: shardwise/faults/<name>.<members>.<generation>
    seq: int  # number of collectives recorded so far (the next one's index)
    step: int  # current step on this group (0-based)
    last_checked: int | None  # seq of the last order-checked collective (its key is deleted later)
    host_waits: bool  # wait() blocks the host (gloo): the watchdog can wait with a deadline
    root_marked: bool  # a root's forward began a step on this group (else each collective is a step)

    def __init__(self, pg: dist.ProcessGroup, generation: int):
        self.name = pg.group_name
        self.ranks = dist.get_process_group_ranks(pg)
        self.rank = dist.get_rank()
        self.prefix = f"shardwise/faults/{self.name}.{_members_tag(self.ranks)}.{generation}"
        self.host_waits = dist.get_backend(pg) == "gloo"
        self.seq = 0
        self.step = 0
        self.root_marked = False
        self._begun = 0
        self.last_checked = None
        self.init_checks = 0  # fully_shard calls whose initial values were compared (init_values)
        self.digests = step_digest.DigestLog()  # each step's collectives, compared off the main thread
        self._followed: Beacon | None = None  # the beacon that runs our on_beat
        self.beacon  # start publishing now: peers judge us by our status from the first wait

    def __repr__(self) -> str:
        return f"Ledger({self.name!r}, ranks={self.ranks}, seq={self.seq}, step={self.step})"

    @property
    def store(self) -> dist.Store:
        """The default store, looked up each time: a harness may swap it between tasks."""
        return dist.distributed_c10d._get_default_store()

    @property
    def beacon(self) -> Beacon:
        """This rank's status publisher on the current store (it also runs our digest exchange)."""
        beacon = beacon_for(current().heartbeat_interval)
        if beacon is not self._followed:  # a new beacon (first use, a new store or interval)
            beacon.follow(self)
            self._followed = beacon
        return beacon

    def on_beat(self, store: dist.Store, interval: float) -> None:
        """Called on the beacon's thread every heartbeat: the step-digest exchange."""
        if current().compares_digests:
            step_digest.exchange(self, store, wait_s=max(interval, 1.0))

    def record(self, collective: Collective) -> Position:
        """Number ``collective`` (the next on this group) and return its position."""
        position = Position(self.name, self.seq, self.step, collective)
        self.seq += 1
        self.digests.current.append(collective)
        return position

    def begin_step(self) -> None:
        """The next step begins: a root forward that uses this group, or (a group no root
        marks) its next collective."""
        if self._begun:
            settings = current()
            compare = settings.compares_digests and not settings.checks_step(self.step)
            step_digest.file_step(self.digests, self.step, compare)
        self.step = self._begun
        self._begun += 1
        self.beacon  # (re)started if the store changed since the last step

    def peers(self) -> list[int]:
        return [r for r in self.ranks if r != self.rank]


# id(group) -> (weakref(group), its ledger): a plain dict lookup per collective (a
# WeakKeyDictionary makes a weakref per lookup); the weakref rules out a reused id.
_LEDGERS: dict[int, tuple["weakref.ref[dist.ProcessGroup]", Ledger | None]] = {}


def ledger_for(pg: dist.ProcessGroup) -> Ledger | None:
    """The ledger of ``pg`` (made on first use); None for a one-rank group (no collectives)."""
    entry = _LEDGERS.get(id(pg))
    if entry is not None and entry[0]() is pg:
        return entry[1]
    ledger = Ledger(pg, _generation(pg)) if dist.get_world_size(pg) > 1 else None
    for key in [k for k, (ref, _) in _LEDGERS.items() if ref() is None]:  # groups destroyed since
        del _LEDGERS[key]
    _LEDGERS[id(pg)] = (weakref.ref(pg), ledger)
    return ledger


def forget_all() -> None:
    """Drop every ledger: the next collective on a group makes a new one (of the next
    generation, so it never reads the old one's store keys)."""
    _LEDGERS.clear()


def _generation(pg: dist.ProcessGroup) -> int:
    """How many ledgers this rank has made for a group of ``pg``'s name and members, this
    one included, counted in the default store (one ``add``, once per group). A fresh store
    (torch's threaded harness makes one per test) starts every count at 1 with no old keys
    to meet; a kept store (a job re-initialising its groups) gives every member the same
    next count."""
    members = _members_tag(dist.get_process_group_ranks(pg))
    key = f"shardwise/faults/generation/{pg.group_name}.{members}/{dist.get_rank()}"
    return dist.distributed_c10d._get_default_store().add(key, 1)


def _members_tag(ranks: list[int]) -> str:
    """A short tag of a group's members: names alone repeat with other members."""
    return f"{zlib.crc32(','.join(map(str, ranks)).encode()):08x}"
