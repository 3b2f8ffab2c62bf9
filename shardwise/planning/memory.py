"""Per-rank peak memory of one steady-state training step, replaying shardwise's schedule.

The model walks the marks of :mod:`shardwise.planning.activations` (each unit's pre/post
forward and backward, in the order the step runs them) and applies at each one what
state.py, prefetch.py, group.py and reduce.py do there, buffer by buffer::

    pre_forward(u)   all-gather u (output buffer: each param's padded shard is copied in,
                     cast under mixed precision, to our rank's row, and gathered in
                     place), then - CPU only - start the all-gathers of the
                     prefetch.DEPTH units that followed u last forward, then copy-out
                     (unsharded buffer allocated while the gather output still lives)
    post_forward(u)  reshard True: free; k: keep an N/k share (cat, then free); False: keep
    pre_backward(u)  finish the previous reduction if it holds a receive buffer (gloo, N>2);
                     all-gather + copy-out if resharded; prefetch the unit that finished
                     forward before u
    segment          u's unsharded grads arrive (when the trace saw them accumulate)
    post_backward(u) finish the previous reduction (free its packed input); reshard u;
                     pack the grads rank-major (N·Pg in reduce dtype, grads still alive),
                     free the grads; reduce into a (Pg,) shard that *is* the sharded grad
    end              finish every reduction; the optimizer step (foreach: one temporary
                     of all shards; loop: two of the largest); zero_grad frees the grads

Peak = max over every point of (live FSDP bytes + live activation bytes), where
activations take their value at the mark for the events at a mark and their segment
maximum for the compute between marks. Sizes follow param.py exactly: dim 0 padded to
``ceil(D0/N)`` rows; optimizer state like the params' unpadded local shards (rank 0, the
largest).
"""

from __future__ import annotations

import dataclasses
from collections import Counter

from shardwise import prefetch
from shardwise.planning.activations import ActivationTrace, Mark
from shardwise.planning.comm import reduction_kind
from shardwise.planning.setting import OPTIMIZER_STATES, Setting
from shardwise.planning.structure import UnitShape

__all__ = ["CATEGORIES", "MemoryBreakdown", "UnitBytes", "peak_memory"]

CATEGORIES = (
    "sharded_params", "grads", "optimizer_state", "unsharded", "unsharded_grads", "reduction",
    "optimizer_temp", "activations",
)
"""Where a rank's bytes go: unsharded = gather outputs, unsharded params and post-forward
shards in flight; reduction = packed reduce inputs, receive buffers and
outputs not yet turned into grads; optimizer_temp = the optimizer step's temporaries."""


@dataclasses.dataclass
class MemoryBreakdown:
    """Bytes per category at the peak, and where in the step the peak happens."""

    bytes: dict[str, int]
    at: str

    @property
    def total(self) -> int:
        return sum(self.bytes.values())


@dataclasses.dataclass(frozen=True)
class UnitBytes:
    """One unit's buffers on one rank, in bytes."""

    shard: int  # the params' padded shards, their own dtype
    gathered: int  # N·P in param dtype: the all-gather output and the unsharded buffer
    aliases: bool  # N = 1, no cast, no offload: the unsharded params are the padded shards
    direct: bool  # one param: the all-gather writes the unsharded buffer itself
    packed: int  # N·Pg in reduce dtype
    reduced: int  # Pg in reduce dtype
    grad: int  # the sharded grad: Pg (a view of ``reduced``) or the unpadded local shard cast back
    receive: int  # gloo all-to-all over N > 2: (N-1)·Pg in reduce dtype
    optimizer: int  # state tensors (+ AdamW's step scalars)
    largest_local: int  # bytes of the largest local shard (the loop optimizer's temporaries)
    local: int  # bytes of the unpadded local shards with grads (the foreach temporary)
    grads_by_name: dict  # param FQN -> unsharded grad bytes (param dtype)

    @classmethod
    def of(cls, unit: UnitShape, setting: Setting) -> "UnitBytes":
        n, ob = setting.shard_size, unit.itemsize
        pb, rb = setting.param_itemsize(ob), setting.reduce_itemsize(ob)
        padded = sum(p.padded_shard_numel(n) for p in unit.params)
        padded_grad = sum(p.padded_shard_numel(n) for p in unit.params if p.requires_grad)
        local = sum(p.rank0_numel(n) for p in unit.params if p.requires_grad)
        n_grad = sum(p.requires_grad for p in unit.params)
        states = OPTIMIZER_STATES[setting.optimizer]
        step_scalars = 4 * n_grad if setting.optimizer in ("adam", "adamw") else 0
        _, receive = reduction_kind(setting)
        return cls(
            shard=padded * ob,
            gathered=n * padded * pb,
            aliases=n == 1 and pb == ob and not setting.offload,
            direct=len(unit.params) == 1,
            packed=n * padded_grad * rb,
            reduced=padded_grad * rb,
            grad=padded_grad * ob if rb == ob else local * ob,
            receive=(n - 1) * padded_grad * rb if receive else 0,
            optimizer=states * local * ob + step_scalars,
            largest_local=max((p.rank0_numel(n) * ob for p in unit.params if p.requires_grad), default=0),
            local=local * ob,
            grads_by_name={name: p.numel * pb for name, p in zip(unit.names, unit.params) if p.requires_grad},
        )


class _Step:
    """Replays one step's events for a fixed wrapping, keeping the live bytes and the peak."""

    bytes: dict[str, UnitBytes]  # unit FQN -> its buffers (units with params only)
    policy: dict[str, bool | int]  # unit FQN -> reshard_after_forward
    live: Counter  # category -> bytes alive now (activations apart: ``act``)
    act: int  # activation bytes at the current point (from the trace)
    peak: MemoryBreakdown  # the largest total so far and where it happened
    unsharded: set[str]  # units whose unsharded params are registered (copied out)
    pending_gather: dict[str, tuple[int, int, bool]]  # in-flight all-gathers: (output, scratch, direct)
    pf_shard: dict[str, int]  # int reshard: the N/k share kept between forward and backward
    pending_reduce: dict[str, UnitBytes]  # reductions started, not finished
    reducing: str | None  # the unit whose reduction the next post-backward waits for
    unit_grads: Counter  # unit FQN -> unsharded grad bytes alive (until its pack)

    def __init__(self, units: list[UnitShape], policies: list, setting: Setting, trace: ActivationTrace | None):
        self.setting = setting
        self.n = setting.shard_size
        keep = [i for i, u in enumerate(units) if u.params]
        self.fqns = [units[i].fqn for i in keep]
        self.policy = {units[i].fqn: policies[i] for i in keep}
        self.bytes = {units[i].fqn: UnitBytes.of(units[i], setting) for i in keep}
        self.trace = trace
        self.live: Counter = Counter()
        self.peak = MemoryBreakdown({c: 0 for c in CATEGORIES}, "start")
        self.unsharded: set[str] = set()
        self.pending_gather: dict[str, tuple[int, int, bool]] = {}  # fqn -> (gather bytes, scratch bytes, direct)
        self.pf_shard: dict[str, int] = {}
        self.pending_reduce: dict[str, UnitBytes] = {}
        self.reducing: str | None = None
        self.act = 0
        self.unit_grads: Counter = Counter()  # fqn -> unsharded grad bytes alive
        self.owner = {name: f for f, b in self.bytes.items() for name in b.grads_by_name}

    # ---- bookkeeping --------------------------------------------------------------------

    def point(self, where: str) -> None:
        total = sum(self.live.values()) + self.act
        if total > self.peak.total:
            counts = {c: self.live.get(c, 0) for c in CATEGORIES}
            counts["activations"] = self.act
            self.peak = MemoryBreakdown(counts, where)

    def alloc(self, category: str, nbytes: int) -> None:
        self.live[category] += nbytes

    def free(self, category: str, nbytes: int) -> None:
        self.live[category] -= nbytes

    # ---- gathering ----------------------------------------------------------------------

    def unshard(self, f: str) -> None:
        """Start u's all-gather (idempotent), as ParamGroup.unshard(async_op=True): the
        shards are copied into the output (no buffer of their own) and gathered in place."""
        if f in self.unsharded or f in self.pending_gather:
            return
        b = self.bytes[f]
        if b.aliases:
            self.unsharded.add(f)  # the unsharded params alias the shards
            return
        if f in self.pf_shard:  # gather over k from the kept share; the share dies at copy-out
            scratch, direct = self.pf_shard.pop(f), False
        else:
            scratch, direct = 0, b.direct
        gather = b.gathered
        self.alloc("unsharded", gather)
        self.pending_gather[f] = (gather, scratch, direct)

    def wait(self, f: str, where: str) -> None:
        """Copy-out: the unsharded buffer is allocated while the gather output lives."""
        if f not in self.pending_gather:
            return
        gather, scratch, direct = self.pending_gather.pop(f)
        if not direct:
            self.alloc("unsharded", self.bytes[f].gathered)
            self.point(where)
            self.free("unsharded", gather)
        self.free("unsharded", scratch)
        self.unsharded.add(f)

    def reshard(self, f: str) -> None:
        if f in self.pending_gather:
            self.wait(f, f"reshard {f}")
        self.free("unsharded", self.pf_shard.pop(f, 0))
        if f in self.unsharded:
            self.unsharded.discard(f)
            if not self.bytes[f].aliases:
                self.free("unsharded", self.bytes[f].gathered)

    # ---- reduction ----------------------------------------------------------------------

    def reduce(self, f: str, where: str) -> None:
        b = self.bytes[f]
        if not b.packed:
            return
        self.alloc("reduction", b.packed)  # pack: the unsharded grads are still alive
        self.point(where)
        self.free("unsharded_grads", self.unit_grads.pop(f, 0))
        self.alloc("grads" if b.grad == b.reduced else "reduction", b.reduced)
        self.alloc("reduction", b.receive)
        self.point(where)
        self.pending_reduce[f] = b
        if self.n > 1:
            self.reducing = f

    def finish_reduce(self, f: str) -> None:
        b = self.pending_reduce.pop(f, None)
        if b is None:
            return
        self.free("reduction", b.packed + b.receive)
        if b.grad != b.reduced:  # reduced in another dtype: cast into the sharded grad
            self.alloc("grads", b.grad)
            self.point(f"finish reduce {f}")
            self.free("reduction", b.reduced)
        if self.reducing == f:
            self.reducing = None

    # ---- the lifecycle points (state.py) --------------------------------------------------

    def pre_forward(self, f: str, order: list[str]) -> None:
        self.unshard(f)
        if self.setting.device == "cpu":  # prefetch.py: the DEPTH units that followed f last forward
            i = order.index(f)
            for g in order[i + 1 : i + 1 + prefetch.DEPTH]:
                self.unshard(g)
        self.wait(f, f"pre_forward {f or '<root>'}")

    def post_forward(self, f: str) -> None:
        policy = self.policy[f]
        if policy is False or f not in self.unsharded:
            return
        if policy is True:
            self.reshard(f)
            return
        share = self.bytes[f].gathered // int(policy)
        self.alloc("unsharded", share)
        self.point(f"post_forward {f or '<root>'}")
        self.reshard(f)
        self.pf_shard[f] = share

    def pre_backward(self, f: str, forward_done: list[str]) -> None:
        r = self.reducing
        if r is not None and r != f and self.bytes[r].receive:
            self.finish_reduce(r)
        self.unshard(f)
        self.wait(f, f"pre_backward {f or '<root>'}")
        i = forward_done.index(f)
        if i > 0:
            self.unshard(forward_done[i - 1])

    def post_backward(self, f: str) -> None:
        if self.reducing is not None and self.reducing != f:
            self.finish_reduce(self.reducing)
        self.reshard(f)
        self.reduce(f, f"post_backward {f or '<root>'}")

    def grads_arrive(self, f: str, nbytes: int) -> None:
        self.unit_grads[f] += nbytes
        self.alloc("unsharded_grads", nbytes)

    def optimizer_step(self) -> None:
        for f in list(self.pending_reduce):
            self.finish_reduce(f)
        if self.setting.offload:
            return  # the step runs on the host
        if self.setting.uses_foreach:
            temp = sum(b.local for b in self.bytes.values())
        else:
            temp = 2 * max((b.largest_local for b in self.bytes.values()), default=0)
        self.alloc("optimizer_temp", temp)
        self.point("optimizer step")
        self.free("optimizer_temp", temp)


def peak_memory(
    units: list[UnitShape], policies: list, setting: Setting, trace: ActivationTrace | None, marks: list[Mark],
    activations: bool = True,
) -> MemoryBreakdown:
    """Peak bytes on one rank over a steady-state step (optimizer state already created).

    Args:
        units: root first, then the blocks (:func:`~shardwise.planning.structure.unit_shapes`).
        policies: ``reshard_after_forward`` per unit (True, False or an int k).
        setting: ranks, dtypes, device, optimizer.
        trace: the fake run's activations, or None to leave activations out.
        marks: the lifecycle points in step order (``trace.marks`` when there is a trace).
        activations: False leaves the trace's activation bytes out (its schedule still counts).
    """
    step = _Step(units, policies, setting, trace)
    for f, b in step.bytes.items():
        if not setting.offload:
            step.alloc("sharded_params", b.shard)
            step.alloc("optimizer_state", b.optimizer)
    arrivals = _arrivals(step, trace, marks)
    order = [f for e, f in marks if e == "pre_forward" and f in step.bytes]
    forward_done = [f for e, f in marks if e == "post_forward" and f in step.bytes]
    acts = trace if activations else None
    for i, (event, f) in enumerate(marks):
        step.act = acts.at_mark[i] if acts is not None else 0
        if f in step.bytes:
            _at_mark(step, event, f, order, forward_done)
        for owner, nbytes in arrivals.get(i, ()):
            step.grads_arrive(owner, nbytes)
        step.act = acts.seg_max[i] if acts is not None else 0
        step.point(f"{event} {f or '<root>'} (compute)")
    step.act = acts.at_mark[-1] if acts is not None else 0
    step.optimizer_step()
    return step.peak


def _at_mark(step: _Step, event: str, f: str, order: list[str], forward_done: list[str]) -> None:
    if event == "pre_forward":
        step.pre_forward(f, order)
    elif event == "post_forward":
        step.post_forward(f)
    elif event == "pre_backward":
        step.pre_backward(f, forward_done)
    elif event == "post_backward":
        step.post_backward(f)


def _arrivals(step: _Step, trace: ActivationTrace | None, marks: list[Mark]) -> dict[int, list[tuple[str, int]]]:
    """mark index -> [(unit, grad bytes)] arriving in the segment after it. Without a trace,
    a unit's grads all arrive at its pre-backward."""
    out: dict[int, list[tuple[str, int]]] = {}
    if trace is not None:
        for i, name in trace.grad_arrivals:
            owner = step.owner.get(name)
            if owner is not None:
                out.setdefault(max(i, 0), []).append((owner, step.bytes[owner].grads_by_name[name]))
        return out
    for i, (event, f) in enumerate(marks):
        if event == "pre_backward" and f in step.bytes:
            out.setdefault(i, []).append((f, sum(step.bytes[f].grads_by_name.values())))
    return out
