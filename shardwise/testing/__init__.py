"""Test helpers for shardwise: real gloo ranks in warm processes, and a collective counter.

- :func:`run_on_ranks` runs a module-level function on N rank processes (each inside an
  initialized gloo default group) and returns every rank's value; a rank's exception
  becomes :class:`RankFailure` with its traceback, a hang becomes :class:`RankTimeout`
  with every stuck rank's Python stacks.
- :func:`multirank` turns a per-rank function into a pytest test.
- :class:`CommCounter` counts collectives (and their payload bytes) at the dispatcher,
  for assertions like "forward did N+1 all-gathers".
- :func:`kill_job` stops a launched job (``torchrun``) with every worker under it.

Pools of rank processes are kept per world size for the whole process; call
:func:`shutdown_pools` to stop them early (``tests/conftest.py`` does at session end).
"""

from shardwise.testing.comm_count import CommCounter, CommEvent, CommTally
from shardwise.testing.errors import RankError, RankFailure, RankTimeout
from shardwise.testing.jobs import kill_job
from shardwise.testing.runner import multirank, pool_pids, run_on_ranks, shutdown_pools

__all__ = [
    "CommCounter",
    "CommEvent",
    "CommTally",
    "RankError",
    "RankFailure",
    "RankTimeout",
    "kill_job",
    "multirank",
    "pool_pids",
    "run_on_ranks",
    "shutdown_pools",
]
