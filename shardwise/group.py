"""ParamGroup: the parameters of one ``fully_shard`` call on one mesh, which communicate together.

One unshard is one all-gather for the whole group; one synced backward is one
reduce-scatter (plus one all-reduce over the replicate dim for HSDP). The group owns:

* the **all-gather**: every param's all-gather inputs (a plain param's padded shard, its
  own tensor, see param.py; or what a tensor subclass's ``fsdp_pre_all_gather`` returned,
  see tensor_extension.py) are copied into their segments of our rank's slot of the
  ``(N*P,)`` output, cast and moved on the way, and gathered in place, as FSDP2 does.
  Where each segment lies is the group's :class:`~shardwise.layout.FlatLayout` (widest
  itemsize first, as bytes, when dtypes mix); a group with a subclass param is laid out
  by its first unshard's inputs (and again if they ever change);
* the **unsharded** buffer ``(N*P',)`` holding the plain params' gathered rows; unsharded
  params alias it (with one shard and nothing to cast they alias the padded shards
  themselves). A subclass param's rows land in output tensors its gather owns, which
  ``fsdp_post_all_gather`` rebuilds the unsharded param from.
  Resharding frees its storage but keeps the tensor objects, so views autograd saved stay
  valid and are refilled by the next unshard;
* for ``reshard_after_forward=k``, the **post-forward shard** ``(N/k*P,)`` kept between
  forward and backward, gathered over a block of ``k`` ranks;
* the work handles of an in-flight all-gather and reduction.

Lifecycle verbs come in idempotent pairs: ``unshard``/``wait_for_unshard`` then
``reshard``; ``reducer.reduce_grads`` then ``reducer.finish``. Gradient reduction lives in
:class:`~shardwise.reduce.GradReducer`.
"""

from __future__ import annotations

import dataclasses
import enum
import weakref

import torch

from shardwise import collectives, tracing
from shardwise.faults import monitor
from shardwise.layout import FlatLayout, check_trainable_uniform
from shardwise.mesh import MeshInfo, PostForwardGroup
from shardwise.param import SHARDED, SHARDED_POST_FORWARD, UNSHARDED, ShardedParam, ShardedState
from shardwise.policies import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from shardwise.reduce import GradReducer
from shardwise.torch_names import TorchGroupNames
from shardwise.tensor_extension import compute_dtype


class TrainingState(enum.Enum):
    """Where a group is in the training step."""

    IDLE = "idle"
    FORWARD = "forward"
    PRE_BACKWARD = "pre_backward"
    POST_BACKWARD = "post_backward"


# The members as module constants, for the hot path: reading a member through its Enum class
# costs ~80 ns on CPython 3.11 (the metaclass's attribute lookup), a module global ~10, and
# a step reads about twenty per unit. In definition order.
IDLE, FORWARD, PRE_BACKWARD, POST_BACKWARD = TrainingState


@dataclasses.dataclass
class _PendingGather:
    work: object | None  # c10d Work, None when no collective was needed
    gathered: torch.Tensor  # (n*P',) rank-major all-gather output
    num_shards: int  # n: ranks gathered over (N, or k after an int reshard)
    scratch: list[torch.Tensor] = dataclasses.field(default_factory=list)  # ours to free once copied out


class ParamGroup(TorchGroupNames):
    """All params of one fully_shard call on one mesh: one all-gather, one reduce-scatter."""

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
    _layout: FlatLayout | None  # where each all-gather input lies in a rank's (P,) row; None until a
    #                             subclass param's first inputs are known
    _param_segments: list[range]  # per param: the indices of its all-gather inputs (segments)
    _extended: tuple[ShardedParam, ...]  # params whose tensor subclass gathers through the extension
    _own_outputs: tuple[torch.Tensor, ...]  # their output tensors (outside _unsharded_flat)
    _params_replaced: bool  # module._apply / load_state_dict(assign=True) replaced params: adopt lazily
    _on_meta: list[ShardedParam]  # params whose shard is on meta (changes only where shards are made)
    _unsharded_flat: torch.Tensor | None  # (N*P',) plain params' rows, row dtype; storage empty while sharded
    aliases_shard: bool  # shard size 1, nothing to cast or move: segments (and the unsharded params) are the padded shards
    _segments: list[torch.Tensor]  # per segment (N*width,) in row units: into _unsharded_flat, or an own output
    _param_views: list[torch.Tensor | None]  # per param: a plain param's segment viewed in its dtype
    _post_forward_shard: torch.Tensor | None  # (N/k*P,) our block's share, between fwd and bwd
    _sites: tuple[tuple, ...]  # (module, name, param) for every site of every param: what a swap writes
    pending_gather: _PendingGather | None  # the all-gather in flight (unshard issued, not yet waited)
    _own_unsharded_params: tuple[ShardedParam, ...]  # Shard(d != 0): unsharded storage of their own
    owner: "weakref.ref | None"  # the ModuleState that drives this group (weak: the state owns the group)

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
        # A param's sites never change after fully_shard: each swap of the group is one loop
        # over them (2 swaps per unshard, 2 unshards per step), not a method call per param.
        self._sites = tuple((site.module, site.name, p) for p in params for site in p.sites)
        self._own_unsharded_params = tuple(p for p in params if p.shard_dim != 0)
        self.mesh_info = mesh_info
        self.device = device
        self.mp_policy = mp_policy
        self.offload = isinstance(offload_policy, CPUOffloadPolicy)
        self.pin_memory = self.offload and offload_policy.pin_memory and device.type != "cpu"
        self.fqn = ""
        self.training_state = IDLE
        self.sharded_state = SHARDED
        self.post_forward = None
        self.pending_gather = None
        self.owner = None
        self._gathered_version = -1  # the shards' version (_shard_version) when last gathered
        self._drop_unsharded_buffers()
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
        names = [p.fqn for p in params]
        check_trainable_uniform(names, [o.dtype for o in originals], [p.requires_grad for p in params])
        for p, original in zip(params, originals):
            p.init_sharded_param(p.local_chunk(original), self._storage_device(), self.pin_memory)
        self._on_meta = [p for p in self.params if p.padded_shard.is_meta]
        self._lay_out()
        self.reducer = GradReducer(self)

    def __repr__(self) -> str:
        return f"ParamGroup({self.fqn!r}, {len(self.params)} params, {self.sharded_state.value})"

    # ---- the sharded params -----------------------------------------------------------

    def _lay_out(self) -> None:
        """Place the params' all-gather inputs in the row (:class:`~shardwise.layout.FlatLayout`):
        now when every param is plain (its padded shard is its input), else at the first
        unshard, from the inputs the subclasses return (:meth:`_fit_layout`)."""
        self._extended = tuple(p for p in self.params if p.gather.own_outputs)
        self._signature: list | None = None
        self._layout = None
        if not self._extended:
            self._fit_layout([(p.padded_shard,) for p in self.params])

    def _fit_layout(self, per_param: list) -> None:
        """Lay out ``per_param`` inputs unless the current layout already fits them (same
        numels and dtypes); a new layout drops the unsharded buffers built for the old one."""
        signature = [(t.numel(), t.dtype) for inputs in per_param for t in inputs]
        if signature == self._signature:
            return
        numels, dtypes, segments = [], [], []
        for p, inputs in zip(self.params, per_param):
            segments.append(range(len(numels), len(numels) + len(inputs)))
            numels += [t.numel() for t in inputs]
            dtypes += [t.dtype if p.gather.own_outputs else compute_dtype(self.mp_policy, t.dtype) for t in inputs]
        self._signature, self._param_segments = signature, segments
        self._layout = FlatLayout.build(numels, dtypes)
        self._drop_unsharded_buffers()

    def _drop_unsharded_buffers(self) -> None:
        """Forget the unsharded buffers and params; the next unshard builds them again."""
        self._unsharded_flat = None
        self.aliases_shard = False
        self._segments, self._param_views, self._own_outputs = [], [], ()
        self._buffer_layout = None
        for p in self.params:
            p.unsharded_param = None
            p.gather.reset()

    def _storage_device(self) -> torch.device:
        return torch.device("cpu") if self.offload else self.device

    def reset_sharded_params(self) -> None:
        """The modules hold new data for our params: after ``module._apply`` (``.to(dtype)``,
        ``to_empty``: same objects, new local tensors) or ``load_state_dict(assign=True)``
        (new objects, which become the params as in FSDP2).

        Nothing is adopted here: ``_apply`` on a parent (and a parent's load) visits a
        grouped call's members one at a time (``fully_shard([norm, output])``), so when the
        first member is converted the others are still on meta, in the old dtype or not yet
        loaded. The params are adopted on the group's next use (unshard, or any read of
        :attr:`layout`), after the user's weight init, once every member is converted.
        """
        self.reshard()
        for p, param in zip(self.params, self._registered_params()):
            p.check_adoptable(param)  # a wrong layout is refused by the load that assigned it
        self._params_replaced = True

    def _registered_params(self) -> list[torch.Tensor]:
        """What the modules hold now under each param's (first) name."""
        return [p.sites[0].module._parameters[p.sites[0].name] for p in self.params]

    @property
    def layout(self) -> FlatLayout:
        """Where each param's padded shard lies in the all-gather row; adopts replaced
        params first (see :meth:`reset_sharded_params`)."""
        if self._params_replaced:
            self._adopt_registered_params()
        return self._layout

    def _adopt_registered_params(self) -> None:
        """Adopt what the modules hold now as the sharded params (:meth:`ShardedParam.adopt`),
        lay them out again in their (maybe new) dtypes and drop the unsharded buffers, which
        the next unshard rebuilds. Until that succeeds the adoption stays pending (an error
        repeats at every use)."""
        held = self._registered_params()
        on_meta = [p.fqn for p, t in zip(self.params, held) if t.is_meta]
        if on_meta and len(on_meta) < len(held):
            raise RuntimeError(
                f"{self.fqn or 'a fully_shard group'}: parameters {on_meta} are still on the meta device while "
                "the rest of their group was materialized; call to_empty(device=...) on a module containing "
                "every module of the group (e.g. the root)"
            )
        for p, param in zip(self.params, held):
            p.adopt(param, self._storage_device(), self.pin_memory)
        self._on_meta = [p for p in self.params if p.padded_shard.is_meta]
        self._drop_unsharded_buffers()
        self._lay_out()
        self._params_replaced = False

    def registered_params_replaced(self) -> bool:
        """Whether a module holds another object than our sharded param (``assign=True``)."""
        return any(
            site.module._parameters.get(site.name) is not p.sharded_param for p in self.params for site in p.sites
        )

    def adopt_if_replaced(self) -> None:
        """Take what the modules hold now as our params if anything replaced them: after
        ``load_state_dict(assign=True)``, and at lazy init, for a parameter user code assigned
        after fully_shard (``model.scale = nn.Parameter(...)`` computed from the sharded
        weights of submodules), as torch's lazy init re-reads the module's parameters."""
        if self.registered_params_replaced():
            self.reset_sharded_params()

    def resolve_gathers(self) -> None:
        """At lazy init: choose each param's gather from its sharded local tensor as it is
        now, so extension methods set on the local tensors after ``fully_shard`` (or after
        ``to_empty``) and before the first forward are used, as torch's lazy init does; lay
        out again when a gather changed. Replaced params wait for their adoption, which
        resolves them the same way."""
        if self._params_replaced:
            return
        changed = [p.resolve_gather() for p in self.params]  # every param: no short-circuit
        if any(changed):
            self.reshard()
            self._drop_unsharded_buffers()
            self._lay_out()

    @property
    def is_unsharded(self) -> bool:
        return self.sharded_state == UNSHARDED

    @property
    def gathered_or_gathering(self) -> bool:
        """Unsharded, or an all-gather (e.g. a prefetch) is in flight."""
        return self.is_unsharded or self.pending_gather is not None

    # ---- unshard ----------------------------------------------------------------------

    @property
    def _can_alias_shard(self) -> bool:
        """One shard of the whole params (world size 1, replicate) needing no cast or device
        copy: the unsharded params alias the padded shards, and nothing is copied or freed."""
        dtypes = self._layout.dtypes
        return self.mesh_info.shard_size == 1 and not self._extended and all(
            p.padded_shard.dtype == dtypes[i] and p.padded_shard.device == self.device and p.shard_dim == 0
            for i, p in enumerate(self.params)
        )

    def _ensure_unsharded_buffer(self) -> None:
        """Create the unsharded buffers for the current layout and the plain params aliasing
        them (once per layout; storage starts freed). Not before a layout exists."""
        layout = self._layout
        if layout is None or (self._segments and self._buffer_layout is layout):
            return
        self._buffer_layout = layout
        self.aliases_shard = self._can_alias_shard
        if self.aliases_shard:
            self._unsharded_flat = None
            self._segments = [p.padded_shard.view(-1) for p in self.params]
        else:
            self._segments = self._new_segments(layout, self.mesh_info.shard_size)
        self._param_views = [
            None if p.gather.own_outputs else layout.as_param(self._segments[segs[0]], segs[0])
            for p, segs in zip(self.params, self._param_segments)
        ]
        for p, view in zip(self.params, self._param_views):
            if view is not None:
                p.init_unsharded_param(view)
        if self._unsharded_flat is not None:
            self._unsharded_flat.untyped_storage().resize_(0)

    def _new_segments(self, layout: FlatLayout, n: int) -> list[torch.Tensor]:
        """Per segment, where its N gathered rows land: the plain params' in one buffer (in
        row order), a subclass param's in output tensors its gather owns."""
        segments: list = [None] * len(layout.widths)
        owned = {j for p, segs in zip(self.params, self._param_segments) if p.gather.own_outputs for j in segs}
        plain = [j for j in layout.order if j not in owned]
        self._unsharded_flat = None
        if plain:
            widths = [n * layout.widths[j] for j in plain]
            self._unsharded_flat = torch.empty(sum(widths), dtype=layout.storage_dtype, device=self.device)
            for j, piece in zip(plain, self._unsharded_flat.split(widths)):
                segments[j] = piece
        outputs = []
        for p, segs in zip(self.params, self._param_segments):
            if p.gather.own_outputs:
                dtype = compute_dtype(self.mp_policy, p.sharded_param.dtype)
                outs = p.gather.allocate_outputs([layout.numels[j] for j in segs], [layout.dtypes[j] for j in segs],
                                                 n, self.device, dtype)
                outputs += outs
                for j, out in zip(segs, outs):
                    segments[j] = layout.as_row(out)
        self._own_outputs = tuple(outputs)
        return segments

    def _in_gather_order(self, per_segment: list) -> list:
        return [per_segment[i] for i in self._layout.order]

    def _allocate_unsharded_storage(self) -> None:
        """Give the unsharded buffer its bytes — as late as possible: at copy-out, so an
        in-flight all-gather never holds its output and the unsharded copy at once."""
        if self._unsharded_flat is not None:
            storage = self._unsharded_flat.untyped_storage()
            if storage.size() == 0:
                storage.resize_(self._unsharded_flat.numel() * self._unsharded_flat.element_size())
        for p in self._extended:
            p.gather.alloc()

    def _gather_io(self) -> tuple[torch.Tensor, torch.Tensor, object, int]:
        """(output, input, process group, ranks) of the next all-gather. From the full shards:
        every param's all-gather inputs are copied (cast to their row dtype, moved to the
        device) into their layout segments of our rank's slot of the output, which is the
        input (gathered in place, as FSDP2 does). After an int reshard: from the
        post-forward shard, over the block of k ranks."""
        if self._post_forward_shard is not None:
            pf = self.post_forward
            return self._gather_output(pf.size), self._post_forward_shard, pf.group, pf.size
        inputs = self._gather_inputs()
        self._ensure_unsharded_buffer()
        n, layout = self.mesh_info.shard_size, self._layout
        gathered = self._gather_output(n)
        slot = gathered.view(n, -1)[self.mesh_info.shard_rank]  # (P,)
        collectives.copy_in(slot, self._in_gather_order(inputs), layout.row_widths, layout.row_dtypes)
        return gathered, slot, self.mesh_info.shard_group, n

    def _gather_inputs(self) -> list[torch.Tensor]:
        """This unshard's all-gather inputs, in segment order (each param's, in param order,
        as torch calls ``fsdp_pre_all_gather``); a group with subclass params fits its
        layout to them."""
        per_param = [p.gather.inputs(p, self.mp_policy, self.device) for p in self.params]
        if self._extended:
            self._fit_layout(per_param)
        return [t for inputs in per_param for t in inputs]

    def unshard(self, async_op: bool = False) -> None:
        """Start gathering the group's params (idempotent); ``wait_for_unshard`` finishes it,
        or this call itself unless ``async_op`` (a gather already in flight included).

        Params kept gathered (``reshard_after_forward=False`` after a no-grad forward, say)
        whose shards changed since they were gathered (an optimizer step, a checkpoint
        load) are stale: they are gathered again rather than computed with.

        A group whose unsharded params are its shards (``aliases_shard``) only registers
        them: nothing is gathered, copied or ever stale.
        """
        if self.aliases_shard and not self._params_replaced and self.post_optim_event is None:
            if self.sharded_state is not UNSHARDED:
                if tracing.wanted():  # nothing to gather: issued and waited at once
                    tracing.emit("unshard", self.fqn, self.training_state)
                    tracing.emit("wait_unshard", self.fqn, self.training_state)
                self._register_unsharded()
            return
        if self.sharded_state is UNSHARDED or self.pending_gather is not None:
            if not self._gathered_stale():
                if not async_op:
                    self.wait_for_unshard()  # a prefetch in flight: gathered when we return
                return
            self.reshard()  # now SHARDED, nothing in flight: gathered again below
        if self._params_replaced:  # module._apply or an assigning load replaced them
            self._adopt_registered_params()
        if self._on_meta:
            names = [p.fqn for p in self._on_meta]
            raise RuntimeError(
                "FSDP parameters should be materialized from meta device before training, but the following "
                f"were still on meta device: {names}; call module.to_empty(device=...) on the root and "
                "initialise them (reset_parameters()) before the first forward"
            )
        if self.post_optim_event is not None:
            self._wait_post_optim_event()
        self._ensure_unsharded_buffer()
        tracing.emit("unshard", self.fqn, self.training_state)
        if self.aliases_shard:
            tracing.emit("wait_unshard", self.fqn, self.training_state)
            self._register_unsharded()
            return
        self._gathered_version = self._shard_version()
        scratch_input = self._post_forward_shard  # freed once copied out; a slot of ``gathered`` is not
        gathered, gather_input, group, n = self._gather_io()
        scratch = self._gather_scratch(gathered, scratch_input)
        work = None
        if n > 1:
            start = tracing.comm_clock()
            work = monitor.issue(
                "all-gather", self.fqn, group, gather_input,
                lambda: self.all_gather_comm(gathered, gather_input, group, async_op=True),
            )
            tracing.comm_issued("all_gather", self.fqn, self.training_state, start, work)
        self.pending_gather = _PendingGather(work, gathered, n, scratch)
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
        return not self.aliases_shard and self._shard_version() != self._gathered_version

    def _gather_scratch(self, gathered: torch.Tensor, post_forward_shard: torch.Tensor | None) -> list[torch.Tensor]:
        """The buffers of this all-gather that die at copy-out: the post-forward shard it
        read, and our own output buffer (a custom comm's output is its own memory: left to
        it; the unsharded segment a one-param group gathers into is the result)."""
        scratch = [] if post_forward_shard is None else [post_forward_shard]
        if not self._lands_unsharded(gathered) and isinstance(self.all_gather_comm, collectives.DefaultAllGather):
            scratch.append(gathered)
        return scratch

    def _gather_output(self, n: int) -> torch.Tensor:
        """Where the all-gather lands. Straight in the unsharded buffer when its layout is the
        gather's: one param gathered over all N ranks (N rows of it), or a shard size of 1
        (the one row is every param back to back, in gather order: a cast and a device move,
        nothing to copy out); else in a buffer of its own, copied out at the wait."""
        single = len(self._segments) == 1
        direct = n == self.mesh_info.shard_size and (single or (n == 1 and not self._extended))
        if direct and isinstance(self.all_gather_comm, collectives.DefaultAllGather):
            self._allocate_unsharded_storage()
            return self._segments[0] if single else self._unsharded_flat
        size = self.mesh_info.shard_size * self._layout.total
        return self.all_gather_comm.allocate((size,), dtype=self._layout.storage_dtype, device=self.device)

    def _lands_unsharded(self, gathered: torch.Tensor) -> bool:
        """Whether ``gathered`` is the unsharded buffer itself (see :meth:`_gather_output`)."""
        return gathered is self._segments[0] or gathered is self._unsharded_flat

    def _wait_post_optim_event(self) -> None:
        event = self.post_optim_event
        if event is not None:
            self.post_optim_event = None
            event.wait()

    def wait_for_unshard(self) -> None:
        """Finish an in-flight all-gather: copy out, then register the unsharded params."""
        pending = self.pending_gather
        if pending is None:
            return
        self.pending_gather = None
        if pending.work is not None:
            tracing.wait(pending.work, "all_gather", self.fqn, self.training_state)
        if not self._lands_unsharded(pending.gathered):
            self._allocate_unsharded_storage()
            self._copy_out(pending)
        for buffer in pending.scratch:
            collectives.free_storage(buffer)
        self._post_forward_shard = None
        for p, view in zip(self.params, self._param_views):
            p.gather.finish(p, view)
        if tracing.wanted():
            tracing.emit("wait_unshard", self.fqn, self.training_state)
        self._register_unsharded()

    def _copy_out(self, pending: _PendingGather) -> None:
        n = pending.num_shards
        rows = self.mesh_info.shard_size // n  # N/k rows of each param per rank after an int reshard
        sizes = [rows * w for w in self._layout.row_widths]
        targets = self._in_gather_order(self._segments)
        outputs = tuple(t for t in self._own_outputs if not t.is_inference())
        if not outputs:
            collectives.copy_out(pending.gathered, n, sizes, targets)
            return
        # A subclass's rebuilt tensor may view its outputs (autograd saved it): refilling
        # them is the same parameter again, not an in-place change (as in torch).
        with torch.autograd._unsafe_preserve_version_counter(outputs):
            collectives.copy_out(pending.gathered, n, sizes, targets)

    def _register_unsharded(self) -> None:
        """Every site of every param holds its unsharded tensor (what
        :attr:`ShardedParam.sharded_state` reads as UNSHARDED)."""
        for module, name, p in self._sites:
            module._parameters[name] = p.unsharded_param  # a direct write: a plain tensor is no Parameter
        self.sharded_state = UNSHARDED

    # ---- reshard ----------------------------------------------------------------------

    def reshard(self) -> None:
        """Register the sharded params and free every unsharded byte (idempotent)."""
        if self.pending_gather is not None:
            self.wait_for_unshard()
        self._post_forward_shard = None
        if self.sharded_state is UNSHARDED:  # SHARDED_POST_FORWARD was freed already
            self._free_unsharded()
        self.sharded_state = SHARDED

    def _free_unsharded(self) -> None:
        """Register the sharded params on every site (:meth:`ShardedParam.register_sharded` for
        the whole group, in one loop) and free the unsharded storage."""
        for module, name, p in self._sites:
            module._parameters[name] = p.sharded_param
        for p in self._own_unsharded_params:  # Shard(d != 0): storage of its own
            p.free_own_unsharded()
        for p in self._extended:
            p.gather.free()
        if self._unsharded_flat is not None:
            self._unsharded_flat.untyped_storage().resize_(0)
        if tracing.wanted():
            tracing.emit("reshard", self.fqn, self.training_state)

    def post_forward_reshard(self) -> None:
        """After forward: reshard fully (True), to a block of k ranks (int), or keep (False)."""
        policy = self.reshard_after_forward
        if policy is False or self.sharded_state is not UNSHARDED:
            return
        if policy is True or self.post_forward is None:
            self.reshard()
            return
        if self._extended:
            raise NotImplementedError(
                f"reshard_after_forward={policy} on {self.fqn or 'the root module'}: parameters "
                f"{[p.fqn for p in self._extended]} gather through fsdp_pre_all_gather, which has no smaller "
                "post-forward shard to gather from (torch's FSDP2 raises NotImplementedError too); "
                "use reshard_after_forward=True or False for this module"
            )
        k, j = self.post_forward.size, self.post_forward.rank
        pieces = [segment.view(k, -1)[j] for segment in self._in_gather_order(self._segments)]  # each (N/k*w,)
        self._post_forward_shard = torch.cat(pieces)  # (N/k*P,)
        self._free_unsharded()
        self.sharded_state = SHARDED_POST_FORWARD

    # ---- an aborted iteration -----------------------------------------------------------

    def discard_iteration(self) -> None:
        """Drop in-flight work and gradients of an aborted iteration; reshard."""
        if self.pending_gather is not None and self.pending_gather.work is not None:
            self.pending_gather.work.wait()
        self.pending_gather = None
        self.reducer.discard()
        self.reshard()
        self.training_state = IDLE
