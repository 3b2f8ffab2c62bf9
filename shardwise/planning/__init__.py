"""Plan before you run: units, reshard policies, per-rank peak memory and bytes on the wire.

Modules, one concept each (imports flow down this list)::

    structure.py    which modules become units: repeated blocks found by structure, plus the root
    setting.py      the run's facts the models read: ranks, dtypes, device, optimizer
    comm.py         collectives per step by kind, bytes exactly as comm_stats counts them
    activations.py  activation bytes of one step, from a fake-tensor forward/backward
    memory.py       the peak: shardwise's schedule replayed buffer by buffer
    search.py       the cheapest-communication reshard policies that fit a budget
    plan.py         the Plan: plain data, JSON, the printed table
    api.py          shardwise.plan()
    apply.py        shardwise.auto_shard()
    cli.py          ``shardwise plan`` (shipped configs in configs/)
"""

from shardwise.planning.api import plan
from shardwise.planning.apply import auto_shard
from shardwise.planning.plan import Plan, UnitPlan

__all__ = ["plan", "auto_shard", "Plan", "UnitPlan"]
