"""Exception classes that are shardwise's type and torch FSDP2's at once.

torch's ``fully_shard`` refuses some inputs with ``AssertionError`` (applied twice, an
unnamed 2-D mesh, a shard dim past the parameter's dims, a deepcopy); users' tests match
those types and phrases (``assertRaisesRegex(AssertionError, "FSDP does not support
deepcopy")``). shardwise raises the type a Python user expects for the mistake
(``ValueError`` for a bad argument, ``RuntimeError`` for a bad operation) *and* torch's,
through one class deriving from both, with torch's phrase verbatim at the start of the
message followed by what to do. ``except ValueError`` and ``except AssertionError`` both
catch it. docs/errors.md lists torch's phrase beside shardwise's message for each case.
"""

from __future__ import annotations

__all__ = ["InvalidUsageError", "UnsupportedOperationError"]


class InvalidUsageError(ValueError, AssertionError):
    """A bad argument that torch's FSDP2 refuses with ``AssertionError``: a ``ValueError``
    for shardwise's callers, an ``AssertionError`` for code written against torch."""


class UnsupportedOperationError(RuntimeError, AssertionError):
    """An operation on a sharded module (``copy.deepcopy``) that torch's FSDP2 refuses
    with ``AssertionError``: a ``RuntimeError`` for shardwise's callers, an
    ``AssertionError`` for code written against torch."""
