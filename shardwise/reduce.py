"""GradReducer: turns a group's unsharded gradients into sharded DTensor ``.grad``s.

One synced backward of a group::

    take grads   unsharded .grad (+ what accumulated while sync was off), in reduce_dtype
    pack         (N, Pg) rank-major, each grad split like torch.chunk and padded
    pre-divide   (fp16: a power of two, to keep partial sums in range; shard size 1:
                 the whole division, fused into the packing copy, as DDP does)
    reduce       SUM reduce-scatter over the shard group -> our (Pg,) shard     [async]
    finish       wait; HSDP: SUM all-reduce over the replicate group; post-divide;
                 all-reduce hook; accumulate into each sharded param's .grad DTensor

With ``requires_gradient_sync=False`` nothing is communicated: unsharded grads stay on the
unsharded params (or accumulate in ``reduce_dtype`` when that differs) and are reduced with
the next synced backward. With ``requires_all_reduce=False`` (HSDP) the reduce-scattered
shard accumulates locally and the all-reduce waits for the next backward that allows it.
"""

from __future__ import annotations

import dataclasses
import enum
import weakref
from typing import Any, Callable, Protocol

import torch
import torch.distributed as dist

from shardwise import collectives, tracing
from shardwise.buffers import ReusableBuffer
from shardwise.faults import monitor
from shardwise.mesh import MeshInfo
from shardwise.param import ShardedParam, with_grad_access
from shardwise.policies import MixedPrecisionPolicy


class ReducingGroup(Protocol):
    """What a reducer reads from the group that owns it (``group.ParamGroup``). Declared
    here, below group.py, so imports flow one way: the group owns its reducer, the
    reducer only points back weakly and knows the group by this shape."""

    params: list[ShardedParam]
    mesh_info: MeshInfo
    mp_policy: MixedPrecisionPolicy
    device: torch.device
    fqn: str
    training_state: enum.Enum  # group.TrainingState
    aliases_shard: bool  # the unsharded params are the padded shards: their grads have the shards' metadata


@dataclasses.dataclass
class _PendingReduce:
    work: object | None  # reduce-scatter Work; None at world size 1
    reduced: torch.Tensor | None  # (Pg,) our shard of the summed gradients
    params: list[ShardedParam]  # the params whose grads were packed, in order
    post_divide: float
    packed: torch.Tensor | None  # (N, Pg), kept alive until the collective is done
    divide_before_hook: bool = False  # post_divide stands in for torch's AVG: the hook sees the mean
    all_reduced: bool = False  # replicate-only: the all-reduce was the collective in flight
    receive_buffer: bool = False  # the collective holds a receive buffer besides ``reduced``


class GradReducer:
    """The reduction half of a ParamGroup, with the knobs that steer it."""

    requires_gradient_sync: bool
    requires_all_reduce: bool  # HSDP: all-reduce over the replicate dim in this backward
    divide_factor: float | None  # None: the data-parallel world size
    force_sum: bool  # collectives are SUMs already; recorded for torch compatibility
    reduce_scatter_comm: collectives.ReduceScatter
    reduce_scatter_group: dist.ProcessGroup | None  # None: the shard group
    all_reduce_hook: Callable[[torch.Tensor], None] | None
    all_reduce_hook_stream: Any  # the stream the hook runs on (torch.Stream of the device); None: current
    reduce_scatter_unused_params: bool
    max_input_buffers: int  # scheduling only: how many packed buffers may be in flight
    frees_buffer_when_done: bool  # a reduction in flight holds a buffer that is garbage once done
    pending: _PendingReduce | None  # the reduction in flight (issued, not yet finished)
    _partial: _PendingReduce | None  # HSDP shard reduced but not yet all-reduced
    _grad_buffer: ReusableBuffer  # shard size 1: the buffer the gradients live in
    _holds_unsynced_grads: bool  # some param's unsharded_accumulated_grad is set (sync was off)

    def __init__(self, group: ReducingGroup):
        self._group_ref = weakref.ref(group)
        self.requires_gradient_sync = True
        self.requires_all_reduce = True
        self.divide_factor = None
        self.force_sum = False
        self.reduce_scatter_comm = collectives.DefaultReduceScatter()
        self.reduce_scatter_group = None
        self.all_reduce_hook = None
        self.all_reduce_hook_stream = None
        self.reduce_scatter_unused_params = False
        self.max_input_buffers = 1
        self.pending = None
        self._partial = None
        self._grad_buffer = ReusableBuffer()
        self._holds_unsynced_grads = False
        # Whether a reduction in flight holds a buffer that is garbage once it completes: the
        # reduce-scatter's ``(N, Pg)`` input. Post-backward then finishes the previous group's
        # reduction before packing its own, so at most one such buffer is alive. With shard
        # size 1 (``replicate``) the packed buffer *becomes* the gradients, so every group's
        # all-reduce stays in flight until the end of backward, as DDP's buckets do.
        self.frees_buffer_when_done = group.mesh_info.shard_size > 1
        self._one_rank = group.mesh_info.shard_size == 1 and group.mesh_info.replicate_size == 1  # the mesh is fixed
        mp = group.mp_policy  # fixed for the group's life
        self._policy_reduce_dtype = mp.reduce_dtype or mp.param_dtype  # None: each gradient's own dtype

    @property
    def group(self) -> ReducingGroup:
        return self._group_ref()

    def _reduce_dtype(self, grad_dtype: torch.dtype | None) -> torch.dtype | None:
        """What gradients are reduced in: the policy's ``reduce_dtype``, else its
        ``param_dtype``, else ``grad_dtype`` (the gradient's own)."""
        return self._policy_reduce_dtype or grad_dtype

    @property
    def holds_receive_buffer(self) -> bool:
        """Whether the reduction in flight holds a receive buffer besides its output: gloo's
        all-to-all reduce over more than 2 ranks, (N-1, Pg). The next group's pre-backward
        then finishes it before gathering, so that buffer never coexists with a copy-out
        (where a step's memory peaks): the live buffers are then those of FSDP2, which
        reduce-scatters synchronously on gloo. Over 2 ranks the one received chunk lands in
        the output, and the reduction overlaps the next group's backward."""
        return self.pending is not None and self.pending.receive_buffer

    # ---- gradients --------------------------------------------------------------------

    def reduce_grads(self) -> None:
        """Reduce this backward's grads (async), or keep accumulating them when sync is off."""
        if not self.requires_gradient_sync:
            self._accumulate_unsynced()
            return
        group = self._group_ref()
        if self._hands_over_directly(group) and with_grad_access(group.params, self._hand_over, group):
            return
        params, grads = self._take_grads()
        if not params:
            return
        self.finish()
        self._start(params, grads)

    def _accumulate_unsynced(self) -> None:
        """Sync off: move grads whose dtype differs from ``reduce_dtype`` into an accumulator."""
        for p in self.group.params:
            unsharded = p.unsharded_param
            if unsharded is None or unsharded.grad is None:
                continue
            dtype = self._reduce_dtype(unsharded.grad.dtype)
            if dtype == unsharded.grad.dtype and p.unsharded_accumulated_grad is None:
                continue  # autograd keeps accumulating into .grad itself
            grad = p.local_grad(unsharded.grad)
            unsharded.grad = None
            acc = p.unsharded_accumulated_grad
            # Add in the gradient's precision and round once into reduce_dtype.
            p.unsharded_accumulated_grad = grad.to(dtype) if acc is None else acc.add_(grad)
            self._holds_unsynced_grads = True

    def _take_grads(self) -> tuple[list[ShardedParam], list[torch.Tensor]]:
        """Detach every unsharded grad (plus accumulated ones) from the unsharded params."""
        params, grads = [], []
        for p in self.group.params:
            unsharded = p.unsharded_param
            grad = None if unsharded is None else unsharded.grad
            acc = p.unsharded_accumulated_grad
            if grad is None and acc is None:
                if not (self.reduce_scatter_unused_params and p.requires_grad):
                    continue
                dtype = self._reduce_dtype(p.sharded_param.dtype)
                grad = torch.zeros(p.unsharded_size, dtype=dtype, device=self.group.device)
            if unsharded is not None:
                unsharded.grad = None
            if grad is not None and type(grad) is not torch.Tensor:  # a DTensor (TP) or subclass grad
                grad = p.local_grad(grad)
            if acc is not None:
                p.unsharded_accumulated_grad = None
                grad = acc if grad is None else acc.add_(grad)
            params.append(p)
            grads.append(grad)
        self._holds_unsynced_grads = False
        return params, grads

    def _start(self, params: list[ShardedParam], grads: list[torch.Tensor]) -> None:
        group = self.group
        mesh_info = group.mesh_info
        n = mesh_info.shard_size
        dtype = self._reduce_dtype(grads[0].dtype)
        plan = collectives.plan_reduction(dtype, n * mesh_info.replicate_size, self.divide_factor, n, self.force_sum)
        packed = self._pack(params, grads, dtype, plan.pre_divide)  # (N, Pg) in reduce_dtype
        if plan.pre_multiply != 1.0:
            packed.mul_(plan.pre_multiply)
        tracing.emit("reduce", group.fqn, group.training_state)
        if n == 1:
            self.pending = self._start_without_shards(params, packed, plan.post_divide)  # never an AVG stand-in
            return
        comm = self.reduce_scatter_comm
        reduced = comm.allocate((packed.size(1),), dtype=dtype, device=packed.device)
        pg = self.reduce_scatter_group or mesh_info.shard_group
        start = tracing.comm_clock()
        work = monitor.issue(
            "reduce-scatter", group.fqn, pg, packed,
            lambda: comm(reduced, packed.view(-1), pg, dist.ReduceOp.SUM, async_op=True),
        )
        tracing.comm_issued("reduce_scatter", group.fqn, group.training_state, start, work)
        receive_buffer = isinstance(comm, collectives.DefaultReduceScatter) and collectives.all_to_all_receive_buffer(pg)
        self.pending = _PendingReduce(
            work, reduced, params, plan.post_divide, packed, receive_buffer=receive_buffer,
            divide_before_hook=plan.divides_as_collective,
        )

    def _hands_over_directly(self, group: ReducingGroup) -> bool:
        """World size 1 with nothing to do to the gradients: no cast, no division, no hook, no
        device move. Each unsharded gradient then *is* its sharded gradient (the same shape,
        values and layout the pack-and-split would give), so :meth:`_hand_over` sets it as
        the sharded ``.grad`` in the post-backward (nothing is in flight to wait for; FSDP2
        sets ``.grad`` there too): packing would only copy it into a buffer and split it out.

        The unsharded params of such a group are its padded shards (``aliases_shard``): no
        cast or move. With one rank the reduction divides only by a ``divide_factor``. These
        take the general path: a reduction still pending (which it finishes first), gradients
        accumulated while sync was off (added in the reduce dtype) and unused params reduced
        as zeros (``reduce_scatter_unused_params``)."""
        return (
            self.pending is None and self._one_rank and group.aliases_shard and not self._holds_unsynced_grads
            and self.all_reduce_hook is None
            and (self.divide_factor is None or self.divide_factor == 1.0) and not self.reduce_scatter_unused_params
        )  # fmt: skip

    def _hand_over(self, group: ReducingGroup) -> bool:
        """Set each unsharded gradient as its param's sharded ``.grad`` (see
        :meth:`_hands_over_directly`), in param order; False at the first param whose
        gradient is not what the hand-over needs: a plain tensor in the reduce dtype. The
        general path then reduces that param's and the rest's: a param handed over has no
        unsharded gradient left, and its values are what the general path would give it.

        torch gives a plain tensor's ``.grad`` its tensor's dtype, device and shape (autograd
        and the setter both check), and the unsharded params here are the shards: what is
        left to check per gradient is its type and dtype. Its layout is the shard's:
        autograd stores a leaf's gradient with the leaf's strides (its layout contract), and
        these leaves are contiguous (``Shard(0)``, one shard). One plain loop: no list of
        params and grads is built."""
        reduce_dtype = self._policy_reduce_dtype  # None: the grads' own
        traced = tracing.wanted()
        handed, complete = False, True
        for p in group.params:
            unsharded = p.unsharded_param
            grad = unsharded.grad
            if grad is None:
                continue  # not used in this backward
            if type(grad) is not torch.Tensor or (reduce_dtype is not None and grad.dtype != reduce_dtype):
                complete = False
                break
            if not handed:
                handed = True
                if traced:
                    tracing.emit("reduce", group.fqn, group.training_state)
            unsharded.grad = None
            p.accumulate_grad(grad)
        if handed and traced:
            tracing.emit("reduce_done", group.fqn, group.training_state)
        return complete

    def _start_without_shards(self, params, packed: torch.Tensor, post_divide: float) -> _PendingReduce:
        """Shard size 1: nothing to reduce-scatter; replicate issues its all-reduce right away
        so it overlaps the rest of backward."""
        flat = packed.view(-1)  # (Pg,)
        group = self.group
        mesh_info = group.mesh_info
        if mesh_info.replicate_size == 1 and post_divide != 1.0:  # world size 1: torch's one division
            return _PendingReduce(None, flat / post_divide, params, 1.0, packed)
        if mesh_info.replicate_size == 1 or not self.requires_all_reduce or self._partial is not None:
            return _PendingReduce(None, flat, params, post_divide, packed)
        start = tracing.comm_clock()
        pg = mesh_info.replicate_group
        work = monitor.issue("all-reduce", group.fqn, pg, flat, lambda: collectives.all_reduce(flat, pg, async_op=True))
        tracing.comm_issued("all_reduce", group.fqn, group.training_state, start, work)
        return _PendingReduce(work, flat, params, post_divide, packed, all_reduced=True)

    # ---- finishing --------------------------------------------------------------------

    def finish(self) -> None:
        """Wait for the in-flight reduction and accumulate it into the sharded ``.grad``s."""
        pending = self.pending
        if pending is None:
            return
        self.pending = None
        group = self.group
        if pending.work is not None:
            kind = "all_reduce" if pending.all_reduced else "reduce_scatter"
            tracing.wait(pending.work, kind, group.fqn, group.training_state)
        if group.mesh_info.shard_size > 1:  # else the packed buffer is the gradient itself
            collectives.free_storage(pending.packed)
        if group.mesh_info.replicate_size > 1 and not pending.all_reduced:  # HSDP
            pending = self._all_reduce_or_defer(pending)
        if pending is None:
            return
        reduced = pending.reduced
        divide = pending.post_divide != 1.0
        if divide and pending.divide_before_hook:
            reduced.div_(pending.post_divide)
        if self.all_reduce_hook is not None:  # on what torch's collectives give: before its post-division
            self._run_all_reduce_hook(reduced)
        if divide and not pending.divide_before_hook:
            reduced.div_(pending.post_divide)
        params = pending.params
        pieces = torch.split_with_sizes(reduced, [p.padded_numel for p in params])  # one op: each param's segment
        shards = [p.shard_view(piece) for p, piece in zip(params, pieces)]  # our real rows
        with_grad_access(params, _accumulate_each, params, _to_sharded_devices(params, shards))
        tracing.emit("reduce_done", group.fqn, group.training_state)

    def _run_all_reduce_hook(self, reduced: torch.Tensor) -> None:
        """``all_reduce_hook(reduced)``, on ``all_reduce_hook_stream`` when one was set.

        On that stream the hook sees ``current_stream()`` as the stream, as torch's does,
        and may overlap the next group's reduction on an accelerator. The stream first
        waits for the current one (``reduced`` is made there) and the current one waits
        for it after, so the gradient is written into ``.grad`` once the hook is done. On
        CPU kernels run synchronously in issue order: no waits are needed (nor possible
        with a ``torch.Stream("cpu")``).
        """
        stream = self.all_reduce_hook_stream
        if stream is None:
            self.all_reduce_hook(reduced)
            return
        device_module = torch.get_device_module(reduced.device)
        ordered = reduced.device.type != "cpu"
        if ordered:
            stream.wait_stream(device_module.current_stream())
        with device_module.stream(stream):
            self.all_reduce_hook(reduced)
        if ordered:
            device_module.current_stream().wait_stream(stream)

    def _all_reduce_or_defer(self, pending: _PendingReduce) -> _PendingReduce | None:
        """HSDP: add any deferred shard, then all-reduce now or keep deferring."""
        mesh_info = self.group.mesh_info
        if mesh_info.replicate_size == 1 or pending.all_reduced:
            return pending
        if self._partial is not None:
            if [p.fqn for p in self._partial.params] != [p.fqn for p in pending.params]:
                raise RuntimeError(
                    f"{self.group.fqn}: the parameters with gradients changed between backwards while the "
                    "HSDP all-reduce was deferred (set_requires_all_reduce(False)); keep them the same"
                )
            pending.reduced.add_(self._partial.reduced)
            self._partial = None
        if not self.requires_all_reduce:
            self._partial = pending
            return None
        start, fqn, state = tracing.comm_clock(), self.group.fqn, self.group.training_state
        pg, reduced = mesh_info.replicate_group, pending.reduced
        monitor.issue("all-reduce", fqn, pg, reduced, lambda: collectives.all_reduce(reduced, pg, async_op=True)).wait()
        tracing.comm_issued("all_reduce", fqn, state, start, None)  # waited here: blocked throughout
        return pending

    def discard(self) -> None:
        """Forget an aborted iteration's reductions and unsynced gradients."""
        if self.pending is not None and self.pending.work is not None:
            self.pending.work.wait()
        self.pending = None
        self._partial = None
        self._holds_unsynced_grads = False
        for p in self.group.params:
            p.unsharded_accumulated_grad = None
            if p.unsharded_param is not None:
                p.unsharded_param.grad = None

    def _pack(
        self, params: list[ShardedParam], grads: list[torch.Tensor], dtype: torch.dtype, pre_divide: float
    ) -> torch.Tensor:
        """Pack ``grads`` (emptying the list, so they die once copied) into the (N, Pg) reduce
        input in ``dtype``, divided by ``pre_divide``.

        Shard size 1 has nothing to lay out rank-major: concatenating and dividing is one
        pass, into the buffer the previous step's gradients lived in once they are all
        dropped (:class:`~shardwise.buffers.ReusableBuffer`), as DDP keeps its buckets.
        """
        if params[0].num_shards > 1:
            return _pack_rank_major(params, grads, dtype, pre_divide)
        out = self._grad_buffer.get(sum(g.numel() for g in grads), dtype, grads[0].device)
        packed = collectives.pack_dividing(grads, dtype, pre_divide, out=out)
        grads.clear()
        return packed


def _pack_rank_major(
    params: list[ShardedParam], grads: list[torch.Tensor], dtype: torch.dtype, pre_divide: float
) -> torch.Tensor:
    """Shard size N > 1: split each grad like ``torch.chunk`` and lay the chunks out rank-major."""
    n = params[0].num_shards
    chunked = [p.grad_as_chunks(g) for p, g in zip(params, grads)]
    grads.clear()
    packed = collectives.pack_for_reduce(chunked, n, dtype)
    del chunked
    if pre_divide != 1.0:
        packed.div_(pre_divide)
    return packed


def _accumulate_each(params: list[ShardedParam], locals_: list[torch.Tensor]) -> None:
    """``accumulate_grad`` for each param, in order (what :func:`with_grad_access` runs)."""
    for p, local in zip(params, locals_):
        p.accumulate_grad(local)


def _to_sharded_devices(params: list[ShardedParam], shards: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each reduced shard on its sharded param's device and dtype, its values complete.

    Offloaded params (sharded on the host, reduced on a GPU) copy device-to-host without
    blocking, into pinned memory, then wait once for all of the group's copies: a host
    tensor handed to ``.grad`` must hold its values, since the optimizer (and ``add_`` into
    an existing grad) reads it on the host without any stream ordering.
    """
    locals_ = [
        s if s.dtype == p.padded_shard.dtype and s.device == p.padded_shard.device
        else s.to(p.padded_shard.device, p.padded_shard.dtype, non_blocking=True)
        for p, s in zip(params, shards)
    ]  # fmt: skip
    if shards[0].device.type == "cuda" and locals_[0].device.type == "cpu":  # one device per group
        torch.cuda.current_stream(shards[0].device).synchronize()
    return locals_
