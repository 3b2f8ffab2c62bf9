"""Shared pytest setup: stop the warm rank pools when the session ends.

The pools of :func:`shardwise.testing.run_on_ranks` also stop at interpreter exit; doing
it here keeps that out of the time pytest reports and frees the ranks before any other
session hook runs.
"""

from shardwise.testing import shutdown_pools


def pytest_sessionfinish(session, exitstatus):
    shutdown_pools()
