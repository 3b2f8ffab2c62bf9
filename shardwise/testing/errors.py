"""The two ways a multi-rank call fails, each carrying per-rank evidence.

A call to :func:`shardwise.testing.run_on_ranks` either returns one value per rank or
raises one of these. Both messages are written for a person reading a pytest report:
a header naming the function, the world size and which ranks did what, then one section
per rank that matters (a traceback for a rank that raised, the Python stacks of a rank
that was still running when the call gave up).
"""

from __future__ import annotations

from collections.abc import Mapping


class RankError(RuntimeError):
    """Base class: a multi-rank call that did not return a value on every rank.

    Attributes:
        fn_name: ``module.qualname`` of the function the ranks ran.
        world_size: number of ranks in the call.
        finished: ranks that returned normally.
    """

    def __init__(self, message: str, fn_name: str, world_size: int, finished: tuple[int, ...]) -> None:
        super().__init__(message)
        self.fn_name = fn_name
        self.world_size = world_size
        self.finished = finished


class RankFailure(RankError):
    """One or more ranks raised (or their process died) while running the function.

    Attributes:
        tracebacks: rank -> the full formatted traceback that rank raised.
        stacks: rank -> Python stacks of a rank still running when the call gave up
            (typically stuck in a collective its failed peer never entered).
    """

    def __init__(
        self,
        fn_name: str,
        world_size: int,
        finished: tuple[int, ...],
        tracebacks: Mapping[int, str],
        stacks: Mapping[int, str],
    ) -> None:
        failed = sorted(tracebacks)
        header = (
            f"{fn_name} failed on rank{'s' if len(failed) > 1 else ''} "
            f"{', '.join(map(str, failed))} of {world_size}"
            f"{_summary(finished, stacks)}"
        )
        sections = [_section(f"rank {r} traceback", tracebacks[r]) for r in failed]
        sections += [_section(f"rank {r} still running; its stacks", stacks[r]) for r in sorted(stacks)]
        super().__init__("\n".join([header, *sections]), fn_name, world_size, finished)
        self.tracebacks = dict(tracebacks)
        self.stacks = dict(stacks)


class RankTimeout(RankError):
    """No rank failed, but not every rank returned within the timeout: a hang.

    Attributes:
        timeout: the limit in seconds that ran out.
        stacks: rank -> Python stacks (all threads) of each rank that had not returned,
            dumped by ``faulthandler`` when the limit ran out, so the message shows where
            each one was stuck.
    """

    def __init__(
        self,
        fn_name: str,
        world_size: int,
        finished: tuple[int, ...],
        timeout: float,
        stacks: Mapping[int, str],
    ) -> None:
        stuck = sorted(stacks)
        header = (
            f"{fn_name} did not finish within {timeout:g} s on {world_size} rank(s): "
            f"rank(s) {', '.join(map(str, stuck))} still running"
            f"{_summary(finished, {})}"
        )
        sections = [_section(f"rank {r} stacks", stacks[r]) for r in stuck]
        super().__init__("\n".join([header, *sections]), fn_name, world_size, finished)
        self.timeout = timeout
        self.stacks = dict(stacks)


def _summary(finished: tuple[int, ...], stacks: Mapping[int, str]) -> str:
    parts = []
    if finished:
        parts.append(f"rank(s) {', '.join(map(str, finished))} returned")
    if stacks:
        parts.append(f"rank(s) {', '.join(map(str, sorted(stacks)))} still running")
    return f" ({'; '.join(parts)})" if parts else ""


def _section(title: str, body: str) -> str:
    return f"\n--- {title} ---\n{body.rstrip()}"
