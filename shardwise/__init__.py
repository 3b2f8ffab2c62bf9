"""shardwise: fully-sharded data parallel training for PyTorch.

A drop-in for ``torch.distributed.fsdp``'s FSDP2 API: switch the import line and keep
the rest of the training script::

    from shardwise import fully_shard, FSDPModule, MixedPrecisionPolicy

    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
"""

from shardwise.clip import clip_grad_norm_
from shardwise.fully_shard import fully_shard
from shardwise.module import FSDPModule, UnshardHandle, register_fsdp_forward_method, share_comm_ctx
from shardwise.replicate import ReplicateModule, replicate
from shardwise.policies import CPUOffloadPolicy, DataParallelMeshDims, MixedPrecisionPolicy, OffloadPolicy
from shardwise.tracing import trace

__all__ = [
    "fully_shard",
    "FSDPModule",
    "UnshardHandle",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "CPUOffloadPolicy",
    "DataParallelMeshDims",
    "register_fsdp_forward_method",
    "share_comm_ctx",
    "replicate",
    "ReplicateModule",
    "trace",
    "clip_grad_norm_",
]
