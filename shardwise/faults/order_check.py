"""The order check: before a collective is issued, every rank of its group agrees on it.

During the checked steps (the first two by default, every step with
``SHARDWISE_ORDER_CHECK=always``), each rank writes the descriptor of its next collective
(step, op, module FQN, size, dtype) under ``<ledger prefix>/o/<seq>/<rank>`` in the c10d
store, waits for the other ranks' entries for the same number and compares. A mismatch
raises :class:`CollectiveMismatchError` on every rank *before* the collective is issued,
so data-dependent control flow around a sharded module can neither hang the job nor
silently mix two modules' parameters (same-shaped modules gather "fine" otherwise).

The end of each checked step is recorded like a collective (``END_OF_STEP``), so a rank
that issues fewer collectives in a step meets the others' marker instead of waiting.
No collective is added to the step: the store round trips (about 0.2 ms each here) are
paid in the checked steps only. Keys are deleted one check later, when every peer has
provably read them (a peer publishes #k+1 only after comparing #k).
"""

from __future__ import annotations

import datetime
import pickle
import time

from shardwise.faults.errors import CollectiveMismatchError
from shardwise.faults.ledger import Ledger
from shardwise.faults.records import Position
from shardwise.faults.watchdog import diagnose

__all__ = ["agree"]


def agree(ledger: Ledger, position: Position, deadline: float) -> None:
    """Publish ``position`` and compare it with every peer's; raise on a mismatch."""
    store = ledger.store
    base = f"{ledger.prefix}/o/{position.seq}/"
    store.set(f"{base}{ledger.rank}", pickle.dumps(position))
    peers = ledger.peers()
    keys = [f"{base}{r}" for r in peers]
    _wait_for(ledger, position, keys, deadline)
    theirs = {r: pickle.loads(v) for r, v in zip(peers, store.multi_get(keys))}
    differing = {r: p for r, p in theirs.items() if not _same(p, position)}
    if differing:
        raise CollectiveMismatchError(_message(ledger, position, theirs))
    if ledger.last_checked is not None:
        store.delete_key(f"{ledger.prefix}/o/{ledger.last_checked}/{ledger.rank}")
    ledger.last_checked = position.seq


def _same(a: Position, b: Position) -> bool:
    return a.step == b.step and a.collective.same_as(b.collective)


def _wait_for(ledger: Ledger, position: Position, keys: list[str], deadline: float) -> None:
    """Wait for the peers' entries; past the deadline, the watchdog's diagnosis decides."""
    store = ledger.store
    if deadline <= 0:
        store.wait(keys)
        return
    ledger.beacon.block(position, checking=True)
    try:
        waited, slice_s = 0.0, deadline
        while True:
            start = time.monotonic()
            try:
                store.wait(keys, datetime.timedelta(seconds=slice_s))
                return
            except RuntimeError:  # DistStoreError: timed out (a lost store raises again below)
                pass
            waited += time.monotonic() - start
            diagnose(ledger, position, waited, deadline, done=lambda: store.check(keys))
            slice_s = ledger.beacon.interval
    finally:
        ledger.beacon.unblock()


def _message(ledger: Ledger, mine: Position, theirs: dict[int, Position]) -> str:
    entries = dict(theirs)
    entries[ledger.rank] = mine
    lines = []
    for rank in sorted(entries):
        p = entries[rank]
        c = p.collective
        what = c.describe().removeprefix("in ")
        size = f", {c.numel} x {c.dtype}" if c.numel else ""
        lines.append(f"rank {rank}: {what} (step {p.step}{size})")
    return (
        f"shardwise order check: ranks diverged at step {mine.step}, collective #{mine.seq + 1} on process "
        f"group {ledger.name!r} (ranks {ledger.ranks}), before it was issued. " + "; ".join(lines) + ". "
        "Every rank must run the same fully_shard modules in the same order: look for control flow that "
        "depends on the rank or its data around these modules (run the module on every rank, e.g. with a "
        "zero-weight input, instead of skipping it)."
    )
