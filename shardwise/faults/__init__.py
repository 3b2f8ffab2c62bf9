"""Faults are named, not hung: cross-rank checks that turn a hang or a silent mix-up
into an error on every rank naming the step, the module and the collective.

* :mod:`~shardwise.faults.order_check` — in the first steps (or every step), ranks agree
  on each collective through the c10d store before issuing it.
* :mod:`~shardwise.faults.step_digest` — after the checked steps, each step's collectives
  are compared with the next rank's off the main thread (a heartbeat late): a divergence
  that hangs nothing (same-shaped modules) is still named.
* :mod:`~shardwise.faults.watchdog` — a collective that has not completed by the deadline
  is explained from every rank's published status (beacon): a dead or stopped rank, or
  ranks waiting on different collectives; a slow step is left alone. On NCCL,
  :mod:`~shardwise.faults.poller` polls the in-flight works instead of waiting.
* :mod:`~shardwise.faults.settings` — ``configure()`` and the ``SHARDWISE_ORDER_CHECK`` /
  ``SHARDWISE_WATCHDOG_S`` environment variables.

The library calls :func:`~shardwise.faults.monitor.issue` for each collective and marks
step boundaries; the rest are details of these modules.
"""

from shardwise.faults.errors import CollectiveFailedError, CollectiveMismatchError, CollectiveTimeoutError
from shardwise.faults.settings import FaultSettings, configure, current

__all__ = [
    "CollectiveFailedError",
    "CollectiveMismatchError",
    "CollectiveTimeoutError",
    "FaultSettings",
    "configure",
    "current",
]
