"""ParamGroup: the parameters of one ``fully_shard`` call, which communicate together.

One unshard is one all-gather for the whole group; one synced backward is one
reduce-scatter (plus one all-reduce over the replicate dim for HSDP). The group owns:

* the **flat shard** buffer ``(P,)`` holding every param's padded shard back to back; the
  sharded DTensor parameters are views into it, so the all-gather reads it directly;
* the **unsharded** buffer ``(N*P,)`` holding every param's gathered rows; unsharded params
  alias it. Resharding frees its storage but keeps the tensor objects, so views autograd
  saved stay valid and are refilled by the next unshard;
* the work handles of an in-flight all-gather and reduction.

Lifecycle verbs come in idempotent pairs: ``unshard``/``wait_for_unshard`` then
``reshard``; ``reduce_grads`` then ``finish_reduce``.
"""

from __future__ import annotations

import dataclasses
import enum
import logging

import torch

from shardwise import collectives
from shardwise.mesh import MeshInfo
from shardwise.param import ShardedParam, ShardedState
from shardwise.policies import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

logger = logging.getLogger(__name__)


class TrainingState(enum.Enum):
    """Where a group is in the training step."""

    IDLE = "idle"
    FORWARD = "forward"
    PRE_BACKWARD = "pre_backward"
    POST_BACKWARD = "post_backward"


@dataclasses.dataclass
class _PendingGather:
    work: object | None  # c10d Work, None when no collective was needed
    gathered: torch.Tensor  # (N*P,) rank-major all-gather output


@dataclasses.dataclass
class _PendingReduce:
    work: object | None
    reduced: torch.Tensor  # (Pg,) our shard of the summed gradients
    params: list[ShardedParam]  # the params whose grads were packed, in order
    post_divide: float
    packed: torch.Tensor  # (N, Pg) kept alive until the collective is done


class ParamGroup:
    """All params of one fully_shard call: one all-gather, one reduce-scatter."""

    params: list[ShardedParam]
    mesh_info: MeshInfo
    device: torch.device  # where compute happens
    mp_policy: MixedPrecisionPolicy
    offload: bool  # sharded state lives on the host
    fqn: str  # the module's FQN (filled in at lazy init)
    training_state: TrainingState
    sharded_state: ShardedState
    _flat_shard: torch.Tensor  # (P,) padded shards, original dtype, on device or host
    _offsets: list[int]  # start of each param's padded shard in _flat_shard
    _unsharded_flat: torch.Tensor | None  # (N*P,) in param dtype; storage empty while sharded
    _segments: list[torch.Tensor]  # per param (N*pn,) views into _unsharded_flat

    def __init__(
        self,
        params: list[ShardedParam],
        originals: list[torch.Tensor],
        mesh_info: MeshInfo,
        device: torch.device,
        mp_policy: MixedPrecisionPolicy,
        offload_policy: OffloadPolicy,
    ):
        self.params = params
        self.mesh_info = mesh_info
        self.device = device
        self.mp_policy = mp_policy
        self.offload = isinstance(offload_policy, CPUOffloadPolicy)
        self.pin_memory = self.offload and offload_policy.pin_memory and device.type != "cpu"
        self.fqn = ""
        self.training_state = TrainingState.IDLE
        self.sharded_state = ShardedState.SHARDED
        self._pending_gather: _PendingGather | None = None
        self._pending_reduce: _PendingReduce | None = None
        self._unsharded_flat = None
        self._segments = []
        # knobs the FSDPModule setters change
        self.reshard_after_forward: bool = True
        self.reshard_after_backward: bool = True
        self.requires_gradient_sync: bool = True
        self.gradient_divide_factor: float | None = None
        self.force_sum_reduction: bool = False
        self._offsets = []
        offset = 0
        for p in params:
            self._offsets.append(offset)
            offset += p.padded_numel
        self._total_numel = offset
        self._build_flat_shard([p.local_chunk(o) for p, o in zip(params, originals)])
        for p, local in zip(params, self._shard_views()):
            p.init_sharded_param(local)

    def __repr__(self) -> str:
        return f"ParamGroup({self.fqn!r}, {len(self.params)} params, {self.sharded_state.value})"

    # ---- the flat shard ---------------------------------------------------------------

    def _build_flat_shard(self, locals_: list[torch.Tensor]) -> None:
        """Allocate the flat shard buffer and copy each param's real rows into its segment."""
        dtypes = {t.dtype for t in locals_}
        if len(dtypes) > 1:
            names = ", ".join(f"{p.fqn}: {t.dtype}" for p, t in zip(self.params, locals_))
            raise NotImplementedError(
                f"fully_shard needs one dtype per group, got {names}; call fully_shard separately on the "
                "submodules whose parameters differ in dtype, or cast the module first"
            )
        device = locals_[0].device if locals_[0].is_meta else self._storage_device()
        flat = torch.zeros(self._total_numel, dtype=locals_[0].dtype, device=device)
        if self.pin_memory:
            flat = flat.pin_memory()
        self._flat_shard = flat
        if not flat.is_meta:
            with torch.no_grad():
                for view, local in zip(self._shard_views(), locals_):
                    view.copy_(local)

    def _storage_device(self) -> torch.device:
        return torch.device("cpu") if self.offload else self.device

    def _shard_views(self) -> list[torch.Tensor]:
        flat = self._flat_shard
        return [p.shard_view(flat[o : o + p.padded_numel]) for p, o in zip(self.params, self._offsets)]

    def reset_sharded_params(self) -> None:
        """After ``module._apply`` (``.to(dtype)``, ``to_empty``): rebuild the flat shard from
        the params' current local tensors and repoint them into it, keeping param identity."""
        self.reshard()
        locals_ = [p.sharded_param._local_tensor for p in self.params]
        self._build_flat_shard(locals_)
        for p, view in zip(self.params, self._shard_views()):
            p.repoint_local(view)
            p.unsharded_param = None
        self._unsharded_flat = None
        self._segments = []

    # ---- unshard / reshard ------------------------------------------------------------

    @property
    def param_dtype(self) -> torch.dtype:
        return self.mp_policy.param_dtype or self._flat_shard.dtype

    def _gather_input(self) -> torch.Tensor:
        """The (P,) all-gather input: the flat shard itself unless a cast or device copy is due."""
        return self._flat_shard.to(self.device, self.param_dtype, non_blocking=True)

    def _ensure_unsharded_buffer(self) -> None:
        n = self.mesh_info.shard_size
        if self._unsharded_flat is None or self._unsharded_flat.dtype != self.param_dtype:
            self._unsharded_flat = torch.empty(n * self._total_numel, dtype=self.param_dtype, device=self.device)
            self._segments = []
            offset = 0
            for p in self.params:
                segment = self._unsharded_flat[offset : offset + p.gathered_numel()]
                self._segments.append(segment)
                p.init_unsharded_param(segment)
                offset += p.gathered_numel()
            return
        storage = self._unsharded_flat.untyped_storage()
        if storage.size() == 0:
            storage.resize_(self._unsharded_flat.numel() * self._unsharded_flat.element_size())

    def unshard(self, async_op: bool = False) -> None:
        """Start gathering the group's params (idempotent); ``wait_for_unshard`` finishes it."""
        if self.sharded_state == ShardedState.UNSHARDED or self._pending_gather is not None:
            return
        if self._flat_shard.is_meta:
            raise RuntimeError(
                f"cannot unshard {self.fqn or 'a module'}: its parameters are on the meta device; call "
                "module.to_empty(device=...) and initialise them first"
            )
        self._ensure_unsharded_buffer()
        gather_input = self._gather_input()
        n = self.mesh_info.shard_size
        if n == 1:
            self._pending_gather = _PendingGather(None, gather_input)
            return
        # One param: its segment is laid out exactly like the all-gather output.
        gathered = self._segments[0] if len(self.params) == 1 else torch.empty_like(self._unsharded_flat)
        work = collectives.all_gather(gathered, gather_input, self.mesh_info.shard_group, async_op=True)
        self._pending_gather = _PendingGather(work, gathered)
        if not async_op:
            self.wait_for_unshard()

    def wait_for_unshard(self) -> None:
        """Finish an in-flight all-gather: copy out, then register the unsharded params."""
        pending = self._pending_gather
        if pending is None:
            return
        self._pending_gather = None
        if pending.work is not None:
            pending.work.wait()
        if pending.gathered is not self._segments[0]:
            sizes = [p.gathered_numel() // self.mesh_info.shard_size for p in self.params]
            collectives.copy_out(pending.gathered, self.mesh_info.shard_size, sizes, self._segments)
        for p, segment in zip(self.params, self._segments):
            p.finish_copy_out(segment)
            p.register_unsharded()
        self.sharded_state = ShardedState.UNSHARDED

    def reshard(self) -> None:
        """Register the sharded params and free the unsharded storage (idempotent)."""
        if self._pending_gather is not None:
            self.wait_for_unshard()
        if self.sharded_state == ShardedState.SHARDED:
            return
        for p in self.params:
            p.register_sharded()
            p.free_own_unsharded()
        if self._unsharded_flat is not None:
            self._unsharded_flat.untyped_storage().resize_(0)
        self.sharded_state = ShardedState.SHARDED

    # ---- gradient reduction -----------------------------------------------------------

    def take_unsharded_grads(self) -> tuple[list[ShardedParam], list[torch.Tensor]]:
        """Detach the unsharded grads from the unsharded params (they must not linger)."""
        params, grads = [], []
        for p in self.params:
            unsharded = p.unsharded_param
            if unsharded is None or unsharded.grad is None:
                continue
            params.append(p)
            grads.append(unsharded.grad)
            unsharded.grad = None
        return params, grads

    def reduce_dtype(self, grad_dtype: torch.dtype) -> torch.dtype:
        return self.mp_policy.reduce_dtype or self.mp_policy.param_dtype or grad_dtype

    def reduce_grads(self) -> None:
        """Start reducing this backward's unsharded grads; ``finish_reduce`` stores them."""
        self.finish_reduce()
        params, grads = self.take_unsharded_grads()
        if not params:
            return
        n = self.mesh_info.shard_size
        dtype = self.reduce_dtype(grads[0].dtype)
        chunked = [p.grad_as_chunks(g.to(dtype)) for p, g in zip(params, grads)]
        packed = collectives.pack_for_reduce(chunked, n)  # (N, Pg)
        world = n * self.mesh_info.replicate_size
        plan = collectives.plan_reduction(dtype, world, self.gradient_divide_factor, self.force_sum_reduction)
        if plan.pre_divide != 1.0:
            packed.div_(plan.pre_divide)
        if n == 1:
            self._pending_reduce = _PendingReduce(None, packed.view(-1), params, plan.post_divide, packed)
            return
        reduced = packed.new_empty(packed.size(1))
        work = collectives.reduce_scatter(reduced, packed.view(-1), self.mesh_info.shard_group, async_op=True)
        self._pending_reduce = _PendingReduce(work, reduced, params, plan.post_divide, packed)

    def finish_reduce(self) -> None:
        """Wait for the in-flight reduction and accumulate it into the sharded ``.grad``s."""
        pending = self._pending_reduce
        if pending is None:
            return
        self._pending_reduce = None
        if pending.work is not None:
            pending.work.wait()
        reduced = pending.reduced
        if self.mesh_info.replicate_size > 1:
            collectives.all_reduce(reduced, self.mesh_info.replicate_group, async_op=False)
        if pending.post_divide != 1.0:
            reduced.div_(pending.post_divide)
        offset = 0
        for p in pending.params:
            shard = p.shard_of_reduced(reduced[offset : offset + p.padded_numel])
            offset += p.padded_numel
            self._accumulate_sharded_grad(p, shard)

    def _accumulate_sharded_grad(self, p: ShardedParam, shard: torch.Tensor) -> None:
        sharded = p.sharded_param
        local = shard.to(sharded.device, sharded.dtype, non_blocking=True)
        if sharded.grad is None:
            sharded.grad = p.to_sharded_dtensor(local)
        else:
            sharded.grad._local_tensor.add_(local)

    def has_pending_work(self) -> bool:
        return self._pending_gather is not None or self._pending_reduce is not None

