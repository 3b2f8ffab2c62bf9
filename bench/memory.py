"""Peak live tensor bytes of a region: :class:`PeakMemory` lives in :mod:`shardwise.testing.memory`
(the training job measures with it too, for ``shardwise train --auto``)."""

from shardwise.testing.memory import _ORIGINAL_RESIZE, PeakMemory, tensors_of  # noqa: F401 (tests patch-check it)

__all__ = ["PeakMemory", "tensors_of"]
