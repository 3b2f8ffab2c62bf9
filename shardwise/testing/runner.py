"""run_on_ranks: call a function on N real gloo ranks, reusing warm processes.

A multi-rank test is written as a plain module-level function that runs on every
rank, plus one line in the test that launches it::

    import torch, torch.distributed as dist
    from shardwise.testing import run_on_ranks

    def _sum_of_ranks():                      # runs on every rank
        t = torch.tensor([float(dist.get_rank())])
        dist.all_reduce(t)
        return t.item()

    def test_all_reduce():
        assert run_on_ranks(_sum_of_ranks, 4) == [6.0] * 4

One :class:`~shardwise.testing.pool.RankPool` per world size is kept for the whole
process (pytest session) and shut down at exit, so only the first call per world size
pays for starting interpreters and the gloo rendezvous. A pool that failed or timed out
is killed, and the next call for that world size starts a fresh one.
"""

from __future__ import annotations

import atexit
import functools
import logging
import sys
from typing import Any, Callable

from shardwise.testing.pool import RankPool

_log = logging.getLogger(__name__)

# world size -> the warm pool serving it. Only touched from the thread calling run_on_ranks.
_POOLS: dict[int, RankPool] = {}

DEFAULT_TIMEOUT_S = 120.0


def run_on_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = DEFAULT_TIMEOUT_S, **kwargs: Any) -> list:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` gloo ranks; return each rank's value.

    Inside ``fn`` the default process group is initialized (``dist.get_rank()``,
    ``dist.get_world_size()``, ``init_device_mesh("cpu", ...)`` and ``dist.new_group``
    all work). Before each call every rank resets ``torch.manual_seed(0)`` and one
    intra-op thread; process groups the call creates are destroyed after it succeeds.
    Calls are serial: use one thread (pytest's) to call this.

    Args:
        fn: a module-level function; it is pickled by reference and imported by name
            in each rank, so lambdas, closures and methods do not work.
        world_size: number of ranks (a pool per world size is kept warm).
        *args, **kwargs: passed to ``fn``; must be picklable. The keyword ``timeout``
            belongs to this function, not to ``fn``.
        timeout: seconds for every rank to return; the pool's startup is not counted.

    Returns:
        ``[value on rank 0, value on rank 1, ...]``; values must be picklable.

    Raises:
        RankFailure: a rank raised (its traceback is in the message) or died.
        RankTimeout: a rank did not return in time; the message shows each stuck
            rank's Python stacks.
        TypeError: ``fn`` or an argument cannot be pickled.
    """
    __tracebackhide__ = True  # pytest: the failing test's frame is the interesting one
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if timeout <= 0:
        raise ValueError(f"timeout must be positive, got {timeout!r}")
    return _pool_for(world_size).run(fn, args, kwargs, timeout)


def pool_pids(world_size: int) -> list[int]:
    """The process ids of the warm pool for ``world_size`` (starting it if needed)."""
    return _pool_for(world_size).pids


def shutdown_pools() -> None:
    """Close every warm pool. Safe to call repeatedly; registered with ``atexit``."""
    while _POOLS:
        _, pool = _POOLS.popitem()
        pool.close()


def multirank(world_size: int, *, timeout: float = DEFAULT_TIMEOUT_S) -> Callable[[Callable[..., Any]], Callable[..., None]]:
    """Decorator: turn a module-level per-rank function into a test that runs it on ranks.

    ::

        @multirank(2, timeout=30)
        def test_broadcast(n):          # body runs on each rank; pytest passes n
            ...

    The test passes when every rank returns; its arguments (parametrize values,
    fixtures such as ``tmp_path``) are forwarded to every rank and must be picklable.
    Rank return values are discarded. The raw function stays reachable for pickling as
    ``_multirank_<name>`` in its module.
    """

    def decorate(fn: Callable[..., Any]) -> Callable[..., None]:
        if "." in fn.__qualname__:
            raise TypeError(f"@multirank needs a module-level function, got {fn.__qualname__}")
        alias = f"_multirank_{fn.__name__}"
        setattr(sys.modules[fn.__module__], alias, fn)
        fn.__qualname__ = alias

        @functools.wraps(fn)
        def test(*args: Any, **kwargs: Any) -> None:
            __tracebackhide__ = True
            run_on_ranks(fn, world_size, *args, timeout=timeout, **kwargs)

        test.__qualname__ = test.__name__
        return test

    return decorate


def _pool_for(world_size: int) -> RankPool:
    pool = _POOLS.get(world_size)
    if pool is not None and pool.healthy():
        return pool
    if pool is not None:
        _log.info("replacing %r", pool)
        pool.kill()
    pool = _POOLS[world_size] = RankPool(world_size)
    return pool


atexit.register(shutdown_pools)
