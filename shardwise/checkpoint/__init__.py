"""Checkpoints you can trust: atomic, exactly resumable, in torch's DCP format.

One module per concept:

- :mod:`~shardwise.checkpoint.directory` — the on-disk layout, the atomic commit (staging
  directory, fsync, rename, then the ``latest`` pointer), verification and retention.
- :mod:`~shardwise.checkpoint.trainer_state` — what a checkpoint holds: model and optimizer
  through ``torch.distributed.checkpoint`` (resharded on load), plus per-rank JSON for the
  step, the scheduler and sampler state and every RNG stream.
- :mod:`~shardwise.checkpoint.manager` — :class:`Checkpointer`: when to save, blocking or
  with ``dcp.async_save``, and resuming from the newest committed checkpoint.
- :mod:`~shardwise.checkpoint.faults` — named ``SIGKILL`` points for crash tests
  (``SHARDWISE_FAULT``).

It works with any module and optimizer (``fully_shard``-ed or not); ``shardwise train``
wires it to its flags (``--checkpoint-dir``, ``--resume``...).
"""

from shardwise.checkpoint.directory import CheckpointDir, CheckpointError
from shardwise.checkpoint.manager import CheckpointPolicy, Checkpointer

__all__ = ["CheckpointDir", "CheckpointError", "CheckpointPolicy", "Checkpointer"]
