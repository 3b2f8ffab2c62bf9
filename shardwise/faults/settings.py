"""How much fault detection runs: the order check's window and the watchdog's deadline.

Defaults come from the environment, so a launcher can change them without code::

    SHARDWISE_ORDER_CHECK=always    # compare every collective of every step (default: first 2 steps)
    SHARDWISE_ORDER_CHECK=5         # the first 5 steps
    SHARDWISE_ORDER_CHECK=off
    SHARDWISE_WATCHDOG_S=60         # seconds a collective may wait before the ranks compare notes
    SHARDWISE_WATCHDOG_S=0          # watchdog off
    SHARDWISE_CHECK_INIT=1          # compare sampled initial values across ranks at fully_shard

or from Python, on every rank, before the first forward: ``shardwise.faults.configure(...)``.
"""

from __future__ import annotations

import dataclasses
import os

__all__ = ["FaultSettings", "configure", "current", "reset"]


@dataclasses.dataclass(frozen=True)
class FaultSettings:
    """Process-wide fault-detection settings (the same on every rank)."""

    order_check_steps: int | None = 2
    """Steps (root forwards) whose collectives are compared across ranks before they are
    issued; ``None``: every step ("always"); ``0``: never."""
    watchdog_s: float = 60.0
    """Seconds a shardwise collective may wait before the ranks compare what they wait on
    (far below gloo's 30 min process-group timeout); ``0`` turns the watchdog off."""
    heartbeat_s: float | None = None
    """How often each rank publishes its status to the store; ``None``: a quarter of
    ``watchdog_s``, at most 5 s."""
    check_init: bool = False
    """Compare a few sampled values of every parameter across ranks at ``fully_shard``
    (ranks seeded differently). Off by default: a job that initialises ranks differently
    and loads a checkpoint after ``fully_shard`` is correct and would be refused."""

    def __post_init__(self) -> None:
        if self.order_check_steps is not None and (
            not isinstance(self.order_check_steps, int) or self.order_check_steps < 0
        ):
            raise ValueError(f"order_check_steps must be None or an int >= 0, got {self.order_check_steps!r}")
        if not self.watchdog_s >= 0:
            raise ValueError(f"watchdog_s must be >= 0 (0: off), got {self.watchdog_s!r}")
        if self.heartbeat_s is not None and not self.heartbeat_s > 0:
            raise ValueError(f"heartbeat_s must be > 0, got {self.heartbeat_s!r}")

    @property
    def heartbeat_interval(self) -> float:
        if self.heartbeat_s is not None:
            return self.heartbeat_s
        return min(max(self.watchdog_s, 0.2) / 4, 5.0)

    @property
    def compares_digests(self) -> bool:
        """After the checked steps, ranks compare each step's collectives a heartbeat late
        (:mod:`~shardwise.faults.step_digest`); not with ``"off"``, nor needed with ``"always"``."""
        return self.order_check_steps is not None and self.order_check_steps > 0

    def checks_step(self, step: int) -> bool:
        """Whether the order check compares the collectives of ``step`` (0-based)."""
        return self.order_check_steps is None or step < self.order_check_steps


def _from_env() -> FaultSettings:
    order = os.environ.get("SHARDWISE_ORDER_CHECK", "").strip().lower()
    steps: int | None = 2
    if order == "always":
        steps = None
    elif order == "off":
        steps = 0
    elif order:
        try:
            steps = int(order)
        except ValueError:
            raise ValueError(f"SHARDWISE_ORDER_CHECK must be 'always', 'off' or a step count, got {order!r}") from None
    watchdog = float(os.environ.get("SHARDWISE_WATCHDOG_S", "60"))
    check_init = os.environ.get("SHARDWISE_CHECK_INIT", "0").strip().lower() in ("1", "true", "yes", "on")
    return FaultSettings(order_check_steps=steps, watchdog_s=watchdog, check_init=check_init)


_CURRENT: list[FaultSettings | None] = [None]  # read from the environment when first needed


def current() -> FaultSettings:
    """This process's settings: the last :func:`configure`, else the environment as it is at
    the first call (not at import: a process may set ``SHARDWISE_*`` after importing
    shardwise, and the test harness's ranks are forked from a server that imported it)."""
    settings = _CURRENT[0]
    if settings is None:
        settings = _CURRENT[0] = _from_env()
    return settings


def reset() -> None:
    """Forget :func:`configure`'s settings: the environment's again, read at the next use."""
    _CURRENT[0] = None


_UNSET = object()


def configure(*, order_check=_UNSET, watchdog_s=_UNSET, heartbeat_s=_UNSET, check_init=_UNSET) -> FaultSettings:
    """Change the fault-detection settings of this process; returns the new settings.

    Call it on every rank, before the first forward (ranks must agree on which steps
    are order-checked).

    Args:
        order_check: ``"always"`` (every step), ``"off"``, or the number of first steps
            to check (default 2).
        watchdog_s: seconds a collective may wait before the ranks compare notes
            (default 60; 0: off).
        heartbeat_s: how often each rank publishes its status (default ``watchdog_s/4``, <= 5 s).
        check_init: compare sampled parameter values across ranks at ``fully_shard``
            (``SHARDWISE_CHECK_INIT=1``; default off).
    """
    old = current()
    steps = old.order_check_steps
    if order_check is not _UNSET:
        steps = {"always": None, "off": 0}.get(order_check, order_check) if isinstance(order_check, str) else order_check
        if isinstance(steps, str):
            raise ValueError(f"order_check must be 'always', 'off' or a step count, got {order_check!r}")
    new = FaultSettings(
        order_check_steps=steps,
        watchdog_s=old.watchdog_s if watchdog_s is _UNSET else float(watchdog_s),
        heartbeat_s=old.heartbeat_s if heartbeat_s is _UNSET else heartbeat_s,
        check_init=old.check_init if check_init is _UNSET else bool(check_init),
    )
    _CURRENT[0] = new
    return new
