"""SIGTERM and SIGINT: a job asked to stop stops at a step boundary, on every rank at once.

torchrun hands a signal it gets (SIGTERM from a scheduler, SIGINT from Ctrl-C) to every
rank, and SIGKILLs them 30 s later. Python's default ends a rank wherever it is: SIGTERM
kills it mid-collective, SIGINT raises ``KeyboardInterrupt`` there, and the peers of a rank
that left wait in a collective it will never join. Instead, while :func:`stop_on_signals`
is active, the signal only records a request (:class:`StopRequest`), and after each step::

    every rank     all-reduces (MAX) the signal it got, 0 for none   (one tiny collective)
    all ranks      see the same number, so all stop after the same step:
                   that step is the run's last (its checkpoint is due with --checkpoint-dir),
                   the job tears down in order and each rank exits with 128 + the signal

A signal that comes during set-up stops the run after its first step. A rank that is
SIGKILLed (torchrun's grace period ran out) abandons its step; so does a job whose peer died
(the watchdog names it).
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from typing import Iterator

import torch
import torch.distributed as dist

from shardwise.faults import monitor

__all__ = ["StopRequest", "stop_on_signals", "STOP_SIGNALS"]

logger = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopRequest:
    """The signal this rank got (``received``) and the one its ranks agreed on (``agreed``)."""

    received: int  # the first stop signal this rank got (0: none), set by the handler
    agreed: int  # the signal the ranks stopped on (0: none), set by :meth:`should_stop`

    def __init__(self) -> None:
        self.received = 0
        self.agreed = 0

    def handle(self, signum: int, frame) -> None:
        """The signal handler (main thread, between bytecodes): record the first signal."""
        if not self.received:
            self.received = signum
            logger.warning("shardwise train: %s received, stopping after this step", signal.Signals(signum).name)

    def should_stop(self, device: torch.device) -> bool:
        """Whether any rank got a stop signal (a collective: every rank calls it after each step)."""
        flag = torch.tensor([self.received], dtype=torch.int64, device=device)
        monitor.all_reduce(flag, dist.group.WORLD, dist.ReduceOp.MAX, "shardwise train's stop request")
        self.agreed = int(flag.item())
        return self.agreed != 0


@contextlib.contextmanager
def stop_on_signals() -> Iterator[StopRequest]:
    """Turn SIGTERM and SIGINT into a :class:`StopRequest` inside the block (main thread
    only; elsewhere the request never fires); the previous handlers come back after it."""
    request = StopRequest()
    if threading.current_thread() is not threading.main_thread():
        yield request
        return
    previous = {sig: signal.signal(sig, request.handle) for sig in STOP_SIGNALS}
    try:
        yield request
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
