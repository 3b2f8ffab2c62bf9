"""Step digests: after the order-checked steps, ranks still compare what they issued.

The order check (:mod:`~shardwise.faults.order_check`) stops a divergence before it is
issued, at a store round trip per collective: too dear for every step. After the checked
steps a divergence that hangs is the watchdog's; one that does not hang (two ranks
gathering different modules of the same shape) would silently mix parameters. This module
catches that one, a heartbeat late, at no cost to the step::

    main thread, per collective    the ledger appends its descriptor to the step's log
    main thread, per step          begin_step files the previous step's log (a tuple)
    beacon thread, per heartbeat   publishes a CRC per filed step under <prefix>/d/<rank>;
                                   compares the next rank's CRCs with its own
      on a mismatch at step k      sets <prefix>/d/diverged = k and publishes its log of k
    every rank's beacon thread     seeing the flag, publishes its own log of k, waits a
                                   heartbeat for the others', and builds the error
    main thread                    raises it (CollectiveMismatchError) at the next
                                   shardwise collective or step

Each rank compares with the next rank of the group (ring): if any two ranks differ, some
neighbours differ, and the flag tells everyone. Per heartbeat: one set, one get, one
check. Logs are kept for the last :data:`KEEP_STEPS` steps.
"""

from __future__ import annotations

import datetime
import pickle
import zlib
from typing import Protocol

import torch.distributed as dist

from shardwise.faults.errors import CollectiveMismatchError
from shardwise.faults.records import Collective

__all__ = ["DigestLog", "file_step", "exchange", "KEEP_STEPS"]

KEEP_STEPS = 32
"""Steps whose logs and CRCs a rank keeps (a peer more than this far behind is not compared)."""


class DigestLog:
    """One ledger's collectives per step, and what the digest exchange found."""

    def __init__(self) -> None:
        self.current: list[Collective] = []  # the step in progress (main thread)
        self.filed: dict[int, tuple[Collective, ...]] = {}  # step -> its collectives (last KEEP_STEPS)
        self.crcs: dict[int, int] = {}  # step -> CRC, published (beacon thread)
        self.compared: int = -1  # last step compared with the neighbour
        self.error: CollectiveMismatchError | None = None  # found by the beacon thread
        self.reported: set[int] = set()  # diverged steps already turned into an error


class _Ledger(Protocol):  # what this module reads of faults.ledger.Ledger (no import: one-way)
    prefix: str
    rank: int
    ranks: list[int]
    name: str
    digests: DigestLog


def file_step(log: DigestLog, step: int, compare: bool) -> None:
    """File the finished ``step``'s collectives (main thread; ``compare`` False for an
    order-checked step, already compared) and start the next one."""
    if compare and log.current:
        log.filed[step] = tuple(log.current)
        stale = step - KEEP_STEPS
        for old in [s for s in log.filed if s <= stale]:
            del log.filed[old]
    log.current = []


def _crc(collectives: tuple[Collective, ...]) -> int:
    return zlib.crc32(repr([(c.op, c.fqn, c.numel, str(c.dtype)) for c in collectives]).encode())


def exchange(ledger: _Ledger, store: dist.Store, wait_s: float) -> None:
    """One heartbeat of the exchange (beacon thread): publish, compare, explain."""
    log = ledger.digests
    if log.error is not None or len(ledger.ranks) < 2:
        return
    flag = f"{ledger.prefix}/d/diverged"
    if store.check([flag]):
        step = int(store.get(flag))
        if step not in log.reported:
            _explain(ledger, store, step, wait_s)
        return
    _publish(ledger, store)
    step = _first_mismatch(ledger, store)
    if step is not None:
        store.set(flag, str(step))
        _explain(ledger, store, step, wait_s)


def _publish(ledger: _Ledger, store: dist.Store) -> None:
    log = ledger.digests
    filed = dict(log.filed)  # the main thread may file a step meanwhile
    new = {s: _crc(c) for s, c in filed.items() if s not in log.crcs}
    if not new:
        return
    log.crcs.update(new)
    for old in [s for s in log.crcs if s not in filed]:
        del log.crcs[old]
    store.set(f"{ledger.prefix}/d/{ledger.rank}", pickle.dumps(dict(log.crcs)))


def _neighbour(ledger: _Ledger) -> int:
    ranks = ledger.ranks
    return ranks[(ranks.index(ledger.rank) + 1) % len(ranks)]


def _first_mismatch(ledger: _Ledger, store: dist.Store) -> int | None:
    """The first step, not compared yet, whose CRC differs from the neighbour's."""
    key = f"{ledger.prefix}/d/{_neighbour(ledger)}"
    if not store.check([key]):
        return None
    log = ledger.digests
    theirs: dict[int, int] = pickle.loads(store.get(key))
    common = sorted(s for s in theirs if s in log.crcs and s > log.compared)
    for step in common:
        if theirs[step] != log.crcs[step]:
            return step
    if common:
        log.compared = common[-1]
    return None


def _explain(ledger: _Ledger, store: dist.Store, step: int, wait_s: float) -> None:
    """Publish our log of ``step``, wait (a heartbeat at most) for the others', and set the
    error naming the first collective where they differ."""
    log = ledger.digests
    log.reported.add(step)
    mine = log.filed.get(step)
    base = f"{ledger.prefix}/d/log/{step}/"
    store.set(f"{base}{ledger.rank}", pickle.dumps(mine))
    keys = [f"{base}{r}" for r in ledger.ranks]
    try:
        store.wait(keys, datetime.timedelta(seconds=wait_s))
    except RuntimeError:  # some rank is gone or slow: explain with the logs that came
        pass
    logs = {r: pickle.loads(store.get(k)) for r, k in zip(ledger.ranks, keys) if store.check([k])}
    log.error = CollectiveMismatchError(_message(ledger, step, logs))


def _message(ledger: _Ledger, step: int, logs: dict[int, tuple | None]) -> str:
    known = {r: c for r, c in logs.items() if c is not None}
    length = max((len(c) for c in known.values()), default=0)
    index = next(
        (i for i in range(length) if len({_key(c, i) for c in known.values()}) > 1), length
    )
    lines = [f"rank {r}: {_describe(c, index)}" for r, c in sorted(known.items())]
    return (
        f"shardwise step digest: ranks issued different collectives at step {step} on process group "
        f"{ledger.name!r} (ranks {ledger.ranks}), first at collective {index + 1} of that step: "
        + "; ".join(lines)
        + ". They matched in size, so nothing hung, but these modules' parameters were mixed across ranks. "
        "Every rank must run the same fully_shard modules in the same order: look for control flow that "
        "depends on the rank or its data (SHARDWISE_ORDER_CHECK=always stops it before the collective)."
    )


def _key(collectives: tuple[Collective, ...], i: int) -> tuple | None:
    if i >= len(collectives):
        return None
    c = collectives[i]
    return (c.op, c.fqn, c.numel, c.dtype)


def _describe(collectives: tuple[Collective, ...], i: int) -> str:
    if i >= len(collectives):
        return f"no collective (it issued {len(collectives)} in that step)"
    c = collectives[i]
    return f"{c.describe().removeprefix('in ')} ({c.numel} x {c.dtype})"
