"""ModuleState: the hooks and lifecycle of one ``fully_shard`` call.

Per training step, for each state (see ARCHITECTURE.md, "One training step")::

    pre-forward   unshard + wait, forward-prefetch, wrap inputs in the post-backward trigger
    post-forward  reshard (unless kept), hook the outputs for pre-backward, record order
    pre-backward  unshard + wait, prefetch the module that ran just before in forward
    post-backward reduce grads (async), reshard
    final (root)  reduce what no trigger reached (the root, unused inputs), wait all, reset

All states under one root share an :class:`IterationContext` (made at lazy init, on the
root's first forward): the list of states, the forward order of this iteration, and the
flag that the end-of-backward callback is queued.

A state owns one :class:`ParamGroup` per distinct mesh its parameters resolved to
(``shard_placement_fn`` may return a per-parameter mesh: experts on their own mesh next to
the dense params of a block), in the order of each mesh's first parameter, as torch's
``_fsdp_param_groups``. Almost always that is one group. Every hook drives all of them:
forward and pre-backward gather them in order, post-backward reduces them in reverse
order (torch nests one post-backward trigger per group around the inputs, so the last
group's fires first), with their reductions all in flight together.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any, Callable

import torch
import torch.nn as nn
from torch.distributed._composable_state import _State
from torch.utils._pytree import tree_flatten, tree_map

from shardwise import init_checks, tracing
from shardwise.backward_hooks import Boundaries, PostBackwardTrigger, PreBackwardHook, weak_post_backward
from shardwise.dynamo_compat import run_eagerly
from shardwise.faults import monitor as faults
from shardwise.group import FORWARD, IDLE, POST_BACKWARD, PRE_BACKWARD, ParamGroup
from shardwise.mesh import MeshInfo
from shardwise.policies import MixedPrecisionPolicy
from shardwise.prefetch import ForwardPrefetcher
from shardwise.torch_names import TorchContextNames, TorchStateNames

logger = logging.getLogger(__name__)

# Read once per hook call: bound here, not looked up on ``torch`` each time.
_graph_task_id = torch._C._current_graph_task_id  # -1 outside a backward
_grad_enabled = torch.is_grad_enabled

STATE_ATTR = "_shardwise_module_state"


def get_state(module: nn.Module) -> "ModuleState | None":
    return module.__dict__.get(STATE_ATTR)


def state_accessor(api: str) -> Callable[[nn.Module], "ModuleState | None"]:
    """The ``state`` attribute of the public call ``api`` ("fully_shard" or "replicate"),
    as torch's composable-API contract gives its functions: ``fully_shard.state(module)``
    is the :class:`ModuleState` of the ``fully_shard`` call that manages ``module`` (one
    object per call, shared by the modules of a grouped call), or None when that call was
    not applied to it (a submodule, or a module of the other API)."""

    def state(module: nn.Module) -> "ModuleState | None":
        found = get_state(module)
        return found if found is not None and found.api == api else None

    state.__qualname__ = f"{api}.state"
    return state


class IterationContext(TorchContextNames):
    """What the states under one root share: membership and per-iteration bookkeeping."""

    root: "ModuleState"
    states: list["ModuleState"]  # pre-order from the root
    post_forward_order: list["ModuleState"]  # states in the order their forward finished
    final_callback_queued: bool
    partial_callback_queued: bool  # a standalone (chunked-loss) backward's callback
    reducing: list[ParamGroup]  # the groups of the state whose reductions were issued last
    forward_prefetcher: ForwardPrefetcher  # implicit forward prefetch (CPU devices)

    is_last_backward: bool  # False: leave reductions in flight at the end of this backward
    iter_root: "ModuleState | None"  # the first state whose forward ran this iteration
    process_groups: list  # every process group the states communicate on (faults' step marks)
    boundaries: Boundaries  # this forward pass's hooked tensors: where backward meets each state
    orders_backward_prefetch: bool  # some state gathers: post_forward_order steers the implicit backward prefetch
    grouped_states: list["ModuleState"]  # the states of grouped calls (fully_shard([a, b])): their members' passes

    def __init__(self, root: "ModuleState", states: list["ModuleState"]):
        self.root = root
        self.states = states
        self.post_forward_order = []
        self.final_callback_queued = False
        self.partial_callback_queued = False
        self.reducing = []
        self.is_last_backward = True
        self.iter_root = None
        self.forward_prefetcher = ForwardPrefetcher()
        self.process_groups = _process_groups(states)
        self.boundaries = Boundaries()
        self.orders_backward_prefetch = any(state.gathers for state in states)
        self.grouped_states = [state for state in states if state._grouped]

    def queue_final_callback(self, state: "ModuleState") -> None:
        """Queue the end-of-backward callback, from the root or the iteration's first module.

        A standalone call of a non-root module after the root's forward (a chunked loss head)
        backpropagates without ending the iteration; at the end of that backward only the
        reductions it issued are finished, so its ``.grad`` is set and grows per chunk, as
        torch's.
        """
        if self.final_callback_queued:
            return
        engine = torch.autograd.Variable._execution_engine
        if state.is_root or state is self.iter_root:
            self.final_callback_queued = True
            engine.queue_callback(self.final_callback)
        elif not self.partial_callback_queued:
            self.partial_callback_queued = True
            engine.queue_callback(self._partial_callback)

    def _partial_callback(self) -> None:
        """End of a standalone module's backward: finish the reductions it left in flight.

        A backward whose first pre-backward was a block's (the root's output is its last
        block's) queues this callback before the root queues the final one, which runs
        after it and finishes everything: nothing is left to do here then."""
        self.partial_callback_queued = False
        if self.final_callback_queued:
            return
        for state in self.states:
            for group in state.groups:
                if group.training_state == POST_BACKWARD:
                    group.reducer.finish()
        self.reducing.clear()

    def final_callback(self) -> None:
        """End of the iteration's backward: reduce what no trigger reached (the root, whose
        inputs need no grad; modules kept unsharded or prefetched whose outputs never reached
        the loss),
        wait for every reduction, reshard, go IDLE. A state's groups in reverse, as its
        post-backward."""
        for state in self.states:
            for group in state.reversed_groups:
                if group.training_state is POST_BACKWARD:
                    continue
                if group.gathered_or_gathering or group.training_state is PRE_BACKWARD:
                    state.post_backward_group(group)
        for state in self.states:
            state.finish_iteration(wait_for_reductions=self.is_last_backward)
        self._clear()
        faults.end_step(self.process_groups)

    def _clear(self) -> None:
        self.boundaries.clear()
        self.post_forward_order.clear()
        self.reducing.clear()
        self.final_callback_queued = False
        self.iter_root = None

    def reset(self) -> None:
        """Recover from an exception mid-iteration: drop in-flight work, reshard, clear."""
        for state in self.states:
            state.discard_iteration()
        self._clear()
        self.forward_prefetcher.abort()
        self.is_last_backward = True


class ModuleState(TorchStateNames, _State):
    """Hooks for the module(s) of one fully_shard call, delegating the work to its groups."""

    modules: tuple[nn.Module, ...]
    groups: tuple[ParamGroup, ...]  # one per mesh, in torch's order; () when no parameters
    reversed_groups: tuple[ParamGroup, ...]  # the same, last first (post-backward's order)
    gathers: bool  # some group all-gathers (shard size > 1); else a prefetch has nothing to start
    mesh_info: MeshInfo
    device: torch.device
    mp_policy: MixedPrecisionPolicy
    reshard_after_forward: bool | int | None  # None: resolved at lazy init (root False, else True)
    is_root: bool | None  # None until lazy init
    ctx: IterationContext | None
    forward_prefetch: list["ModuleState"] | None  # None: implicit on CPU (next in forward order)
    backward_prefetch: list["ModuleState"] | None  # None: implicit (reverse forward order)
    pre_forward_hook: Callable  # _pre_forward_hook, never traced by torch.compile (dynamo_compat)
    post_forward_hook: Callable  # _post_forward_hook, likewise

    def __init__(self, modules, groups, mesh_info, device, mp_policy, reshard_after_forward):
        super().__init__()
        self.modules = tuple(modules)
        self.groups = tuple(groups)
        for group in self.groups:
            group.owner = weakref.ref(self)
        self.reversed_groups = self.groups[::-1]
        self.gathers = any(g.mesh_info.shard_size > 1 for g in self.groups)
        self.mesh_info = mesh_info
        self.device = device
        self.mp_policy = mp_policy
        self._input_dtype = mp_policy.param_dtype if mp_policy.cast_forward_inputs else None  # None: no cast
        self.reshard_after_forward = reshard_after_forward
        self.is_root = None
        self._moves_inputs = False  # the root of a non-CPU device moves its inputs there (set at lazy init)
        self.ctx = None
        self.fqn = ""
        self.api = "fully_shard"  # or "replicate": which public call made this state
        self.forward_prefetch = None
        self.backward_prefetch = None
        self.unshard_async_op = False  # torch's _set_unshard_async_op; shardwise is always async inside
        self._post_forward_indices: list[int] = []
        self._grouped = len(self.modules) > 1  # a grouped call: its members' forwards make one pass
        self._members_to_run: set[int] = {id(m) for m in self.modules}  # grouped call: who has not run
        self._on_backward = weak_post_backward(weakref.ref(self))  # what the graph holds: never keeps us alive
        # The hooks as every caller must use them: never traced by torch.compile (dynamo_compat).
        self.pre_forward_hook = run_eagerly(self._pre_forward_hook)
        self.post_forward_hook = run_eagerly(self._post_forward_hook)
        for module in self.modules:
            module.register_forward_pre_hook(self.pre_forward_hook, prepend=True, with_kwargs=True)
            module.register_forward_hook(self.post_forward_hook, prepend=False, with_kwargs=True)

    def __repr__(self) -> str:
        return f"ModuleState({self.fqn or type(self.modules[0]).__name__!r}, root={self.is_root})"

    @property
    def group(self) -> ParamGroup | None:
        """The one group (None without params), as torch's ``_fsdp_param_group``: raises when
        the call made several (a per-parameter mesh); use :attr:`groups` then."""
        if len(self.groups) > 1:
            raise RuntimeError(
                f"{self!r} has {len(self.groups)} param groups (one per mesh from shard_placement_fn); "
                "use state.groups"
            )
        return self.groups[0] if self.groups else None

    # ---- lazy init --------------------------------------------------------------------

    def lazy_init(self) -> None:
        """On the first forward (or unshard) of the root: find every state, fix FQNs, check."""
        if self.ctx is not None:
            return
        if len(self.modules) > 1:
            names = ", ".join(type(m).__name__ for m in self.modules)
            raise RuntimeError(
                f"FSDP requires a single root module but got a grouped fully_shard([{names}]): it cannot be the "
                "root; apply fully_shard to the module that contains them as well, and run forward through that root"
            )
        states = _states_under(self.modules)
        for state in states[1:]:
            if state.ctx is not None:
                names = {id(m): name for name, m in self.modules[0].named_modules()}
                child = state.modules[0]
                name = names.get(id(child), "?")
                raise RuntimeError(
                    f"FSDP state has already been lazily initialized for {name}\nFSDP requires running forward "
                    f"through the root module first: submodule {name!r} ({type(child).__name__}) already ran forward "
                    f"as its own root before its parent {type(self.modules[0]).__name__} (the root) ran"
                )
        ctx = IterationContext(self, states)
        for state in states:
            state.ctx = ctx
            state.is_root = state is self
            state._moves_inputs = state.is_root and state.device.type != "cpu"
        init_checks.assign_fqns(self.modules[0], states)
        for state in states:
            state._resolve_reshard_after_forward()
            for group in state.groups:
                group.adopt_if_replaced()
                group.resolve_gathers()
        init_checks.check_no_param_in_two_groups(states)
        init_checks.check_ranks_agree(states)
        logger.debug("shardwise lazy init: root %s with %d states", self, len(states))

    def _resolve_reshard_after_forward(self) -> None:
        policy = self.reshard_after_forward
        for group in self.groups:
            group.reshard_after_forward = (not self.is_root) if policy is None else policy

    # ---- forward ----------------------------------------------------------------------

    def _pre_forward_hook(self, module: nn.Module, args: tuple, kwargs: dict):
        if self.ctx is None:
            self.lazy_init()
        if self._moves_inputs:
            args, kwargs = tree_map(self._to_device, (args, kwargs))
        if self._input_dtype is not None:
            args, kwargs = _cast_floating(self._input_dtype, (args, kwargs))
        # Inside a backward (a graph task runs): activation checkpointing re-runs forward. The
        # params are gathered (by our pre-backward, or here for modules nested in the
        # checkpointed region) and stay so until our post-backward: no reshard, hooks or
        # order bookkeeping then (the post-forward hook tests the same).
        if _graph_task_id() != -1:
            self._unshard_and_wait()  # nested modules were resharded after forward
            return args, kwargs
        # A grouped call's later members join the pass the first member opened: one
        # post-backward trigger (one reduction) per pass.
        groups = self.groups
        entering_pass = not groups or groups[0].training_state is not FORWARD
        if entering_pass and (self.is_root or self.gathers):  # else _enter_forward has nothing to do
            self._enter_forward()
        if groups:
            for group in groups:
                group.training_state = FORWARD
                group.unshard(async_op=True)
            if self.forward_prefetch is not None or self.gathers:  # else _prefetch_forward has nothing to start
                self._prefetch_forward()  # queued behind our own all-gathers, before we wait for them
            for group in groups:
                if group.pending_gather is not None:
                    group.wait_for_unshard()
        if _grad_enabled():
            ctx = self.ctx
            if ctx.iter_root is None:
                ctx.iter_root = self
            if entering_pass:
                args, kwargs = self._wrap_post_backward_trigger(args, kwargs)
        return args, kwargs

    def _unshard_and_wait(self) -> None:
        """Gather every group (all-gathers issued in order, then waited on in order)."""
        for group in self.groups:
            group.unshard(async_op=True)
        for group in self.groups:
            group.wait_for_unshard()

    def _enter_forward(self) -> None:
        prefetcher = self.ctx.forward_prefetcher
        if self.is_root:
            self.ctx.boundaries.clear()  # a new pass: no hooked tensor of the last one is an input now
            faults.begin_step(self.ctx.process_groups)
            prefetcher.start()
        if self.gathers:  # the prefetcher follows only states whose unshard communicates
            prefetcher.enter(self)

    def _prefetch_forward(self) -> None:
        """Explicit targets; else, on CPU, the module that followed this one last forward
        (:mod:`shardwise.prefetch` says why only CPU)."""
        if self.forward_prefetch is not None:
            for target in self.forward_prefetch:
                target.prefetch()
        elif self.gathers and self.device.type == "cpu":  # the prefetcher follows only gathering states
            self.ctx.forward_prefetcher.prefetch_after(self)

    def _to_device(self, x: Any) -> Any:
        return x.to(self.device, non_blocking=True) if isinstance(x, torch.Tensor) else x

    def _wrap_post_backward_trigger(self, args: tuple, kwargs: dict):
        """Arrange this state's post-backward for when its inputs' gradients are complete: in
        the hooks of the one input that needs grad when a block before returned it
        (:mod:`shardwise.backward_hooks`), else torch's identity Function around them all."""
        if len(args) == 1 and not kwargs and type(args[0]) is torch.Tensor:  # one plain tensor: most blocks
            x = args[0]
            if not x.requires_grad or not self.groups:
                return args, kwargs
            if self.ctx.boundaries.hook_input(x, self._on_backward):  # in the hooks it carries
                return args, kwargs
            return tuple(PostBackwardTrigger.apply(self._on_backward, x)), kwargs
        plain = not kwargs and all(isinstance(x, torch.Tensor) for x in args)  # positional tensors: no pytree
        flat, spec = (list(args), None) if plain else tree_flatten((args, kwargs))
        positions = [i for i, x in enumerate(flat) if isinstance(x, torch.Tensor) and x.requires_grad]
        if not positions or not self.groups:
            return args, kwargs
        if len(positions) == 1 and type(flat[positions[0]]) is torch.Tensor:  # hidden states next to masks
            if self.ctx.boundaries.hook_input(flat[positions[0]], self._on_backward):
                return args, kwargs
        outputs = PostBackwardTrigger.apply(self._on_backward, *(flat[i] for i in positions))
        for i, out in zip(positions, outputs):
            flat[i] = out
        return (tuple(flat), kwargs) if spec is None else spec.unflatten(flat)

    def _post_forward_hook(self, module: nn.Module, args: tuple, kwargs: dict, output: Any):
        if _graph_task_id() != -1:  # recomputing (see the pre-forward hook)
            return _cast_floating(self.mp_policy.output_dtype, output) if self.mp_policy.output_dtype else output
        if self.groups and (not self._grouped or self._last_member_ran(module)):
            for group in self.groups:
                group.post_forward_reshard()
                group.training_state = IDLE
        if _grad_enabled():
            ctx = self.ctx
            if ctx.orders_backward_prefetch:
                self._post_forward_indices.append(len(ctx.post_forward_order))
                ctx.post_forward_order.append(self)
            if type(output) is torch.Tensor:  # most blocks: no pytree walk
                if output.requires_grad:  # its hook runs once per backward by itself: no PreBackwardHook
                    ctx.boundaries.hook_output(output, self._pre_backward)
            else:
                self._hook_outputs(output)
        if self.is_root:
            if self.ctx.grouped_states:
                self._complete_partial_groups()
            self.ctx.forward_prefetcher.finish()
        if self.mp_policy.output_dtype is not None:
            output = _cast_floating(self.mp_policy.output_dtype, output)
        return output

    def _hook_outputs(self, output: Any) -> None:
        """Hook the tensors that need grad in ``output`` (any pytree) for our pre-backward."""
        leaves = (output,) if isinstance(output, torch.Tensor) else tree_flatten(output)[0]
        tensors = [t for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad]
        if tensors:  # one output's hook runs once per backward by itself (no PreBackwardHook needed)
            hook = self._pre_backward if len(tensors) == 1 else PreBackwardHook(self)
            self.ctx.boundaries.hook_outputs(tensors, hook)

    def _complete_partial_groups(self) -> None:
        """At the root's post-forward, finish grouped states whose forward ran only some
        members (a chunked-loss head): reshard per policy; later standalone member calls
        then keep the params gathered until backward."""
        for state in self.ctx.grouped_states:
            if state is self or not state.groups or len(state._members_to_run) in (0, len(state.modules)):
                continue
            for group in state.groups:
                group.post_forward_reshard()
                group.training_state = IDLE
            state._reset_members()

    def _last_member_ran(self, module: nn.Module) -> bool:
        """A grouped call keeps the params gathered until every member ran forward once."""
        self._members_to_run.discard(id(module))
        if self._members_to_run:
            return False
        self._reset_members()
        return True

    # ---- backward ---------------------------------------------------------------------

    def _pre_backward(self, *unused: Any) -> None:
        ctx = self.ctx
        if not ctx.final_callback_queued:
            ctx.queue_final_callback(self)
        groups = self.groups
        if not groups:
            return
        for reducing in ctx.reducing:  # their receive buffers never meet our copy-out (the peak)
            if reducing not in groups and reducing.reducer.holds_receive_buffer:
                reducing.reducer.finish()
        for group in groups:
            group.training_state = PRE_BACKWARD
            if group.unshard_in_backward:
                group.unshard()  # and wait: a prefetch in flight included
        if self.backward_prefetch is not None or self._post_forward_indices:  # else nothing to prefetch
            self._prefetch_backward()  # after our copy-out: its gather buffer never coexists with ours

    def _prefetch_backward(self) -> None:
        if self.backward_prefetch is not None:
            for target in self.backward_prefetch:
                target.prefetch(in_backward=True)
            return
        if not self._post_forward_indices:
            return
        index = self._post_forward_indices.pop()
        if index > 0:
            target = self.ctx.post_forward_order[index - 1]
            if target.gathers:  # else none of its groups has anything to gather
                target.prefetch(in_backward=True)

    def prefetch(self, in_backward: bool = False) -> None:
        """Start this state's all-gathers without waiting (forward/backward prefetch); in
        backward the last group first, as torch prefetches them. A group of shard size 1
        gathers nothing: its own pre-hook unshards it (registers its params) in time."""
        for group in self.reversed_groups if in_backward else self.groups:
            if group.mesh_info.shard_size > 1 and (not in_backward or group.unshard_in_backward):
                group.unshard(async_op=True)

    def post_backward(self) -> None:
        """This state's grads are complete: reduce each group's, the last group first."""
        for group in self.reversed_groups:
            self.post_backward_group(group)

    def post_backward_group(self, group: ParamGroup) -> None:
        """One group's grads are complete: reshard, then start their reduction.

        Resharding first frees the unsharded params before the grads are packed (the
        grads are separate tensors, untouched by a reshard), so the two never coexist.
        Reductions of an earlier state are finished first (at most one state's in flight,
        as FSDP2); this state's groups stay in flight together.
        """
        group.training_state = POST_BACKWARD
        if tracing.wanted():
            tracing.emit("post_backward", group.fqn, group.training_state)
        ctx = self.ctx
        if ctx is not None and ctx.reducing and ctx.reducing[0] not in self.groups:
            for previous in ctx.reducing:
                previous.reducer.finish()
            ctx.reducing.clear()
        if group.reshard_after_backward:
            group.reshard()
        group.reducer.reduce_grads()
        if group.reducer.frees_buffer_when_done and ctx is not None and group not in ctx.reducing:
            ctx.reducing.append(group)  # the next state's post-backward waits for it, bounding memory

    def finish_iteration(self, wait_for_reductions: bool) -> None:
        """End of backward: wait for our reduction, reshard, return to IDLE."""
        if self._post_forward_indices:
            self._post_forward_indices.clear()
        for group in self.groups:
            reducer = group.reducer
            if wait_for_reductions and reducer.pending is not None:
                reducer.finish()
            if group.training_state is POST_BACKWARD and group.reshard_after_backward:
                group.reshard()
            group.training_state = IDLE
        if self._grouped:
            self._reset_members()

    def _reset_members(self) -> None:
        """Every member of a grouped call is yet to run (a one-module call never counts)."""
        if self._grouped:
            self._members_to_run = {id(m) for m in self.modules}

    def discard_iteration(self) -> None:
        self._post_forward_indices.clear()
        self._reset_members()
        for group in self.groups:
            group.discard_iteration()

    def reset_iter_state(self) -> None:
        """Root only: recover from an exception that aborted forward or backward."""
        if self.is_root is False:
            raise RuntimeError(
                f"reset_iter_state() must be called on the root module, not on {self!r}; call it on the "
                "module you run forward through"
            )
        if self.ctx is None:
            self.discard_iteration()
            return
        self.ctx.reset()


def _states_under(modules: tuple[nn.Module, ...]) -> list[ModuleState]:
    """Every distinct state in the subtrees of ``modules``, in pre-order."""
    seen: dict[int, ModuleState] = {}
    for module in modules:
        for sub in module.modules():
            state = get_state(sub)
            if state is not None and id(state) not in seen:
                seen[id(state)] = state
    return list(seen.values())


def _process_groups(states: list[ModuleState]) -> list:
    """The distinct process groups the states' collectives run on."""
    groups: list = []
    for group in (group for state in states for group in state.groups):
        mesh_info = group.mesh_info
        post_forward = group.post_forward.group if group.post_forward is not None else None
        for pg in (mesh_info.shard_group, mesh_info.replicate_group, post_forward):
            if pg is not None and not any(pg is g for g in groups):
                groups.append(pg)
    return groups


def _cast_floating(dtype: torch.dtype, tree: Any) -> Any:
    def cast(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != dtype:
            return x.to(dtype)
        return x

    return tree_map(cast, tree)
