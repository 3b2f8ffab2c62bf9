"""shardwise: fully-sharded data parallel training for PyTorch.

A drop-in for ``torch.distributed.fsdp``'s FSDP2 API: switch the import line and keep
the rest of the training script::

    from shardwise import fully_shard, FSDPModule, MixedPrecisionPolicy

    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)

For code that imports torch's names (a framework, a script you do not own),
``shardwise.install_as_torch_fsdp()`` or ``python -m shardwise.as_torch_fsdp script.py``
puts shardwise's objects under them (see :mod:`shardwise.switch`).
"""

from shardwise.clip import clip_grad_norm_
from shardwise.fully_shard import fully_shard
from shardwise.module import FSDPModule, UnshardHandle, register_fsdp_forward_method, share_comm_ctx
from shardwise.replicate import ReplicateModule, replicate
from shardwise.policies import CPUOffloadPolicy, DataParallelMeshDims, MixedPrecisionPolicy, OffloadPolicy
from shardwise.switch import install_as_torch_fsdp, uninstall_as_torch_fsdp
from shardwise.tracing import trace
from shardwise.planning import Plan, auto_shard, plan

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
    "install_as_torch_fsdp",
    "uninstall_as_torch_fsdp",
    "plan",
    "auto_shard",
    "Plan",
]
