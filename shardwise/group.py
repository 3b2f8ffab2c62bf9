"""ParamGroup: the parameters of one ``fully_shard`` call, which communicate together.

One unshard is one all-gather for the whole group; one synced backward is one
reduce-scatter (plus one all-reduce over the replicate dim for HSDP). The group owns:

* the **flat shard** buffer ``(P,)`` holding every param's padded shard back to back; the
  sharded DTensor parameters are views into it, so the all-gather reads it directly;
* the **unsharded** buffer ``(N*P,)`` holding every param's gathered rows; unsharded params
  alias it. Resharding frees its storage but keeps the tensor objects, so views autograd
  saved stay valid and are refilled by the next unshard;
* for ``reshard_after_forward=k``, the **post-forward shard** ``(N/k*P,)`` kept between
  forward and backward, gathered over a block of ``k`` ranks;
* the work handles of an in-flight all-gather and reduction.

Lifecycle verbs come in idempotent pairs: ``unshard``/``wait_for_unshard`` then
``reshard``; ``reduce_grads`` then ``finish_reduce``. Gradient reduction lives in
:class:`~shardwise.reduce.GradReducer`.
"""

from __future__ import annotations

import dataclasses
import enum

import torch

from shardwise import collectives, tracing
from shardwise.faults import monitor
from shardwise.layout import FlatLayout
from shardwise.mesh import MeshInfo, PostForwardGroup
from shardwise.param import ShardedParam, ShardedState
from shardwise.policies import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from shardwise.reduce import GradReducer


class TrainingState(enum.Enum):
    """Where a group is in the training step."""

    IDLE = "idle"
    FORWARD = "forward"
    PRE_BACKWARD = "pre_backward"
    POST_BACKWARD = "post_backward"


@dataclasses.dataclass
class _PendingGather:
    work: object | None  # c10d Work, None when no collective was needed
    gathered: torch.Tensor  # (n*P',) rank-major all-gather output
    num_shards: int  # n: ranks gathered over (N, or k after an int reshard)
    scratch: list[torch.Tensor] = dataclasses.field(default_factory=list)  # ours to free once copied out


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
    reducer: GradReducer
    post_forward: PostForwardGroup | None  # set for reshard_after_forward=int
    _flat: torch.Tensor  # (P,) padded shards, original dtype, on device or host (read via _flat_shard)
    _params_replaced: bool  # module._apply swapped the params' local tensors: rebuild _flat lazily
    _layout: FlatLayout  # where each param's padded shard lives in the flat buffers
    _unsharded_flat: torch.Tensor | None  # (N*P,) in param dtype; storage empty while sharded
    _segments: list[torch.Tensor]  # per param (N*width,) views into _unsharded_flat, in gather units
    _post_forward_shard: torch.Tensor | None  # (N/k*P,) our block's share, between fwd and bwd

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
        self.post_forward = None
        self._pending_gather: _PendingGather | None = None
        self._gathered_version = -1  # the flat shard's version when last gathered
        self._unsharded_flat = None
        self._segments = []
        self._post_forward_shard = None
        # knobs the FSDPModule setters change
        self.reshard_after_forward: bool | int = True
        self.reshard_after_backward = True
        self.unshard_in_backward = True
        self.all_gather_comm: collectives.AllGather = collectives.DefaultAllGather()
        self.post_optim_event = None
        self.allocate_from_process_group = False  # NCCL zero-copy staging; a no-op on gloo
        self.symm_mem = False  # NCCL symmetric-memory staging
        self._params_replaced = False
        self._build_flat_shard([p.local_chunk(o) for p, o in zip(params, originals)])
        for p, local in zip(params, self._shard_views()):
            p.init_sharded_param(local)
        self.reducer = GradReducer(self)

    def __repr__(self) -> str:
        return f"ParamGroup({self.fqn!r}, {len(self.params)} params, {self.sharded_state.value})"

    def _emit(self, kind: str) -> None:
        tracing.emit(kind, self.fqn, self.training_state.value)

    # ---- the flat shard ---------------------------------------------------------------

    def _build_flat_shard(self, locals_: list[torch.Tensor]) -> None:
        """Lay the params out (:class:`~shardwise.layout.FlatLayout`), allocate the flat shard
        buffer and copy each param's real rows into its segment."""
        layout = FlatLayout.build([p.padded_numel for p in self.params], [t.dtype for t in locals_])
        layout.check_trainable_uniform([p.fqn for p in self.params], [p.requires_grad for p in self.params])
        self._layout = layout
        device = locals_[0].device if locals_[0].is_meta else self._storage_device()
        flat = torch.zeros(layout.total, dtype=layout.storage_dtype, device=device)
        if self.pin_memory:
            flat = flat.pin_memory()
        self._flat = flat
        if not flat.is_meta:
            with torch.no_grad():
                for view, local in zip(self._shard_views(), locals_):
                    view.copy_(local)

    def _storage_device(self) -> torch.device:
        return torch.device("cpu") if self.offload else self.device

    def _shard_views(self) -> list[torch.Tensor]:
        return [p.shard_view(self._layout.segment(self._flat, i)) for i, p in enumerate(self.params)]

    @property
    def _flat_shard(self) -> torch.Tensor:
        """The flat shard buffer, rebuilt first if ``module._apply`` replaced the params' data."""
        if self._params_replaced:
            self._rebuild_flat_shard()
        return self._flat

    def reset_sharded_params(self) -> None:
        """After ``module._apply`` (``.to(dtype)``, ``to_empty``) on one member module: the
        params' DTensors now wrap new local tensors, outside the flat shard.

        Nothing is rebuilt here: ``_apply`` on a parent visits a grouped call's members one
        at a time (``fully_shard([norm, output])``), so when the first member is converted
        the others are still on meta or in the old dtype. The flat shard is rebuilt from the
        params' then-current local tensors on its next use (unshard, or any read of
        ``_flat_shard``), after the user's weight init, keeping every param's identity.
        """
        self.reshard()
        self._params_replaced = True

    def _rebuild_flat_shard(self) -> None:
        self._params_replaced = False
        locals_ = [p.sharded_param._local_tensor for p in self.params]
        on_meta = [p.fqn for p, t in zip(self.params, locals_) if t.is_meta]
        if on_meta and len(on_meta) < len(locals_):
            raise RuntimeError(
                f"{self.fqn or 'a fully_shard group'}: parameters {on_meta} are still on the meta device while "
                "the rest of their group was materialized; call to_empty(device=...) on a module containing "
                "every module of the group (e.g. the root)"
            )
        self._build_flat_shard(locals_)
        for p, view in zip(self.params, self._shard_views()):
            p.repoint_local(view)
            p.unsharded_param = None
        self._unsharded_flat = None
        self._segments = []

    @property
    def param_dtype(self) -> torch.dtype:
        return self.mp_policy.param_dtype or self._flat_shard.dtype

    @property
    def is_unsharded(self) -> bool:
        return self.sharded_state == ShardedState.UNSHARDED

    @property
    def gathered_or_gathering(self) -> bool:
        """Unsharded, or an all-gather (e.g. a prefetch) is in flight."""
        return self.is_unsharded or self._pending_gather is not None

    # ---- unshard ----------------------------------------------------------------------

    @property
    def _aliases_shard(self) -> bool:
        """One shard of the whole params (world size 1, replicate) needing no cast or device
        copy: the unsharded params are the flat shard itself, and nothing is copied or freed."""
        flat = self._flat_shard
        return (
            self.mesh_info.shard_size == 1
            and flat.dtype == self.param_dtype
            and flat.device == self.device
            and all(p.shard_dim == 0 for p in self.params)
        )

    def _ensure_unsharded_buffer(self) -> None:
        """Create the unsharded buffer and the params aliasing it (once; storage starts freed)."""
        n = self.mesh_info.shard_size
        if self._unsharded_flat is not None and self._unsharded_flat.dtype == self.param_dtype:
            return
        if self._aliases_shard:
            self._unsharded_flat = self._flat_shard
        else:
            width = sum(self._gather_widths())
            self._unsharded_flat = torch.empty(n * width, dtype=self.param_dtype, device=self.device)
        self._segments = [None] * len(self.params)
        offset, widths = 0, self._gather_widths()
        for i in self._layout.order:
            self._segments[i] = self._unsharded_flat[offset : offset + n * widths[i]]
            self.params[i].init_unsharded_param(self._layout.as_param(self._segments[i], i))
            offset += n * widths[i]
        if self._unsharded_flat is not self._flat_shard:
            self._unsharded_flat.untyped_storage().resize_(0)

    def _gather_widths(self) -> tuple[int, ...]:
        """Each param's length in one rank's all-gather row (param_dtype units)."""
        return self._layout.gather_widths(self.param_dtype)

    def _in_gather_order(self, per_param: list) -> list:
        return [per_param[i] for i in self._layout.order]

    def _allocate_unsharded_storage(self) -> None:
        """Give the unsharded buffer its bytes — as late as possible: at copy-out, so an
        in-flight all-gather never holds its output and the unsharded copy at once."""
        storage = self._unsharded_flat.untyped_storage()
        if storage.size() == 0:
            storage.resize_(self._unsharded_flat.numel() * self._unsharded_flat.element_size())

    def _gather_source(self) -> tuple[torch.Tensor, object, int]:
        """(input, process group, ranks) of the next all-gather: from the full shard, or
        from the post-forward shard over the block of k ranks."""
        if self._post_forward_shard is not None:
            pf = self.post_forward
            return self._post_forward_shard, pf.group, pf.size
        gather_input = self._layout.gather_input(self._flat_shard, self.device, self.param_dtype)
        return gather_input, self.mesh_info.shard_group, self.mesh_info.shard_size

    def unshard(self, async_op: bool = False) -> None:
        """Start gathering the group's params (idempotent); ``wait_for_unshard`` finishes it.

        Params kept gathered (``reshard_after_forward=False`` after a no-grad forward, say)
        whose shards changed since they were gathered (an optimizer step, a checkpoint
        load) are stale: they are gathered again rather than computed with.
        """
        if self.gathered_or_gathering and self._gathered_stale():
            self.reshard()
        if self.is_unsharded or self._pending_gather is not None:
            return
        if self._flat_shard.is_meta:
            names = [p.fqn for p in self.params]
            raise RuntimeError(
                f"cannot unshard {self.fqn or 'the root module'}: parameters {names} are on the meta device; "
                "call module.to_empty(device=...) and initialise them first"
            )
        self._wait_post_optim_event()
        self._ensure_unsharded_buffer()
        self._emit("unshard")
        if self._unsharded_flat is self._flat_shard:
            self._register_unsharded()
            return
        self._gathered_version = self._shard_version()
        gather_input, group, n = self._gather_source()
        if n == 1:
            self._pending_gather = _PendingGather(None, gather_input, 1)
        else:
            gathered = self._gather_output(n)
            start = tracing.comm_clock()
            work = monitor.issue(
                "all-gather", self.fqn, group, gather_input,
                lambda: self.all_gather_comm(gathered, gather_input, group, async_op=True),
            )
            tracing.comm_issued("all_gather", self.fqn, self.training_state.value, start, work)
            self._pending_gather = _PendingGather(work, gathered, n, self._gather_scratch(gathered, gather_input))
        if not async_op:
            self.wait_for_unshard()

    def _shard_version(self) -> int:
        """Grows whenever a sharded param is written in place: the sum of the DTensor
        parameters' version counters (an in-place op on a DTensor bumps the wrapper's
        counter; its local tensor's is below autograd and does not move)."""
        return sum(p.sharded_param._version for p in self.params)

    def _gathered_stale(self) -> bool:
        """Whether a sharded param changed since the last all-gather (an optimizer step, a
        checkpoint load). Aliased params (``replicate``) are the shard: never stale."""
        return self._unsharded_flat is not self._flat_shard and self._shard_version() != self._gathered_version

    def _gather_scratch(self, gathered: torch.Tensor, gather_input: torch.Tensor) -> list[torch.Tensor]:
        """The buffers of this all-gather that die at copy-out: a cast/offload copy of the
        shard or the post-forward shard (the input), and our own output buffer (a custom
        comm's output is its own memory: left to it)."""
        scratch = [] if gather_input is self._flat_shard else [gather_input]
        if gathered is not self._segments[0] and isinstance(self.all_gather_comm, collectives.DefaultAllGather):
            scratch.append(gathered)
        return scratch

    def _gather_output(self, n: int) -> torch.Tensor:
        # A one-param group gathered over all N ranks lands in its unsharded layout directly.
        direct = len(self.params) == 1 and n == self.mesh_info.shard_size
        if direct and isinstance(self.all_gather_comm, collectives.DefaultAllGather):
            self._allocate_unsharded_storage()
            return self._segments[0]
        return self.all_gather_comm.allocate((self._unsharded_flat.numel(),), dtype=self.param_dtype, device=self.device)

    def _wait_post_optim_event(self) -> None:
        event = self.post_optim_event
        if event is not None:
            self.post_optim_event = None
            event.wait()

    def wait_for_unshard(self) -> None:
        """Finish an in-flight all-gather: copy out, then register the unsharded params."""
        pending = self._pending_gather
        if pending is None:
            return
        self._pending_gather = None
        if pending.work is not None:
            tracing.wait(pending.work, "all_gather", self.fqn, self.training_state.value)
        if pending.gathered is not self._segments[0]:
            self._allocate_unsharded_storage()
            n = pending.num_shards
            rows = self.mesh_info.shard_size // n  # N/k rows of each param per rank after an int reshard
            sizes = self._in_gather_order([rows * w for w in self._gather_widths()])
            collectives.copy_out(pending.gathered, n, sizes, self._in_gather_order(self._segments))
        for buffer in pending.scratch:
            collectives.free_storage(buffer)
        self._post_forward_shard = None
        for i, (p, segment) in enumerate(zip(self.params, self._segments)):
            p.finish_copy_out(self._layout.as_param(segment, i))
        self._register_unsharded()

    def _register_unsharded(self) -> None:
        for p in self.params:
            p.register_unsharded()
        self.sharded_state = ShardedState.UNSHARDED
        self._emit("wait_unshard")

    # ---- reshard ----------------------------------------------------------------------

    def reshard(self) -> None:
        """Register the sharded params and free every unsharded byte (idempotent)."""
        if self._pending_gather is not None:
            self.wait_for_unshard()
        self._post_forward_shard = None
        if self.sharded_state == ShardedState.SHARDED:
            return
        if self.is_unsharded:
            self._free_unsharded()
        self.sharded_state = ShardedState.SHARDED

    def _free_unsharded(self) -> None:
        for p in self.params:
            p.register_sharded()
            p.free_own_unsharded()
        if self._unsharded_flat is not None and self._unsharded_flat is not self._flat_shard:
            self._unsharded_flat.untyped_storage().resize_(0)
        self._emit("reshard")

    def post_forward_reshard(self) -> None:
        """After forward: reshard fully (True), to a block of k ranks (int), or keep (False)."""
        policy = self.reshard_after_forward
        if policy is False or not self.is_unsharded:
            return
        if policy is True or self.post_forward is None:
            self.reshard()
            return
        k, j = self.post_forward.size, self.post_forward.rank
        pieces = [segment.view(k, -1)[j] for segment in self._in_gather_order(self._segments)]  # each (N/k*w,)
        self._post_forward_shard = torch.cat(pieces)  # (N/k*P,)
        self._free_unsharded()
        self.sharded_state = ShardedState.SHARDED_POST_FORWARD

    # ---- reduction (delegated) ----------------------------------------------------------

    def reduce_grads(self) -> None:
        self.reducer.reduce_grads()

    def finish_reduce(self) -> None:
        self.reducer.finish()

    def discard_iteration(self) -> None:
        """Drop in-flight work and gradients of an aborted iteration; reshard."""
        if self._pending_gather is not None and self._pending_gather.work is not None:
            self._pending_gather.work.wait()
        self._pending_gather = None
        self.reducer.discard()
        self.reshard()
        self.training_state = TrainingState.IDLE
