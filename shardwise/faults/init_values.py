"""Ranks that initialised the model differently (a missing or rank-dependent
``torch.manual_seed``): each rank shards *its own* random values, so the model trains as a
patchwork of several initialisations, and ``replicate``/HSDP replicas drift apart for good.
Nothing fails.

Opt-in (``SHARDWISE_CHECK_INIT=1`` or ``faults.configure(check_init=True)``): at each
``fully_shard`` call every rank samples 8 evenly spaced values of each parameter (O(1) per
parameter), publishes them in the c10d store under its process group's ledger, and compares
with its peers; a difference raises on every rank naming the parameter. Off by default
because initialising ranks differently and loading a checkpoint after ``fully_shard`` is a
correct pattern this check would refuse. Meta-device parameters are skipped.
"""

from __future__ import annotations

import datetime
import pickle

import torch
import torch.distributed as dist

from shardwise.faults.ledger import ledger_for
from shardwise.faults.settings import current

__all__ = ["check_same_init"]

_SAMPLES = 8


def _sample(t: torch.Tensor) -> tuple[float, ...] | None:
    if t.is_meta or t.numel() == 0:
        return None
    flat = t.detach().reshape(-1)
    index = torch.linspace(0, flat.numel() - 1, min(_SAMPLES, flat.numel()), device=flat.device).long()
    return tuple(flat[index].double().cpu().tolist())


def check_same_init(pg: dist.ProcessGroup | None, names: list[str], params: list[torch.Tensor], api: str) -> None:
    """Raise ValueError if the ranks of ``pg`` hold different values for ``params``."""
    if pg is None or not current().check_init:
        return
    ledger = ledger_for(pg)
    if ledger is None:
        return
    ledger.init_checks += 1
    base = f"{ledger.prefix}/init/{ledger.init_checks}/"
    mine = [_sample(p) for p in params]
    store = ledger.store
    store.set(f"{base}{ledger.rank}", pickle.dumps(mine))
    peers = ledger.peers()
    keys = [f"{base}{r}" for r in peers]
    store.wait(keys, datetime.timedelta(seconds=max(current().watchdog_s, 60.0)))
    for rank, value in zip(peers, store.multi_get(keys)):
        for name, a, b in zip(names, mine, pickle.loads(value)):
            if a is not None and b is not None and a != b:
                raise ValueError(
                    f"{api}: ranks initialised parameter {name!r} differently (rank {ledger.rank} samples "
                    f"{a[0]:.6g}, ..., rank {rank} samples {b[0]:.6g}, ...): call torch.manual_seed(seed) with the "
                    "same seed on every rank before building the model, or load the same checkpoint on every rank"
                )
