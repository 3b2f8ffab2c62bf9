"""Named kill points for crash tests: ``SHARDWISE_FAULT=point[@step][:rank],...``.

A crash-safety claim is only as good as the crashes it was tested against, so the code
that must survive a ``SIGKILL`` calls :func:`maybe_kill` at each point where a crash
would leave a different state on disk (the checkpoint writer's commit protocol, the
training loop after a step). Nothing happens unless the environment names the point::

    SHARDWISE_FAULT=ckpt_before_rename@4          # kill whichever rank reaches it at step 4
    SHARDWISE_FAULT=step@5:1                      # kill rank 1 after step 5's optimizer step
    SHARDWISE_FAULT=ckpt_after_shards,step@9      # several points

A fault fires only in a job's first attempt: under torchrun, ``TORCHELASTIC_RESTART_COUNT``
is 0 the first time and counts restarts after that, so a restarted job runs clean (the
test of "a rank dies once, the job restarts and resumes" needs exactly that).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from typing import NamedTuple

__all__ = ["ENV_VAR", "POINTS", "Fault", "parse_faults", "maybe_kill"]

logger = logging.getLogger(__name__)

ENV_VAR = "SHARDWISE_FAULT"

POINTS = (
    "ckpt_after_shards",  # every rank's DCP files written, no manifest yet
    "ckpt_before_rename",  # manifest written and synced, staging dir not yet renamed
    "ckpt_after_rename",  # step-N visible, the `latest` pointer still names the previous one
    "ckpt_before_pointer_replace",  # new pointer written to a temporary file, not yet renamed over
    "ckpt_mid_prune",  # pointer updated, an old checkpoint half deleted
    "step",  # the training loop, after a step's optimizer step and before its checkpoint
    "ft_all_reduce",  # --fault-tolerance torchft: mid-step, in the all-reduce across replica groups
    "prepare_mid_shard",  # `shardwise data prepare`: shard N's tokens half written (step = shard index)
    "prepare_after_shard",  # `shardwise data prepare`: shard N renamed into place with its receipt
)
"""Every point a fault can name; :func:`maybe_kill` rejects others (a typo must not silently pass)."""


class Fault(NamedTuple):
    point: str
    step: int | None  # None: any step
    rank: int | None  # None: any rank


def parse_faults(spec: str) -> list[Fault]:
    """``"step@5:1,ckpt_after_shards"`` -> ``[Fault("step", 5, 1), Fault("ckpt_after_shards", None, None)]``."""
    faults = []
    for item in filter(None, (part.strip() for part in spec.split(","))):
        head, _, rank = item.partition(":")
        point, _, step = head.partition("@")
        if point not in POINTS:
            raise ValueError(f"{ENV_VAR}: unknown fault point {point!r}; expected one of {POINTS}")
        faults.append(Fault(point, int(step) if step else None, int(rank) if rank else None))
    return faults


def _first_attempt() -> bool:
    return os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"


def maybe_kill(point: str, step: int, rank: int) -> None:
    """``SIGKILL`` this process if ``$SHARDWISE_FAULT`` names ``point`` for ``step`` and ``rank``."""
    if point not in POINTS:
        raise ValueError(f"unknown fault point {point!r}; add it to shardwise.checkpoint.faults.POINTS")
    spec = os.environ.get(ENV_VAR)
    if not spec or not _first_attempt():
        return
    for fault in parse_faults(spec):
        if fault.point == point and fault.step in (None, step) and fault.rank in (None, rank):
            logger.error("fault injection: SIGKILL at %s, step %d, rank %d", point, step, rank)
            sys.stdout.flush()
            sys.stderr.flush()
            os.kill(os.getpid(), signal.SIGKILL)
