"""``shardwise.plan`` and ``shardwise.auto_shard``: plan a wrapping, then apply it.

::

    plan = shardwise.plan(model, world_size=1024, memory_budget="80GiB",
                          mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16), batch=(1, 4096))
    print(plan)                       # units, reasons, predicted peak, collectives per step
    plan.save("plan.json")            # plain data: edit, reload, apply
    shardwise.auto_shard(model, plan) # fully_shard per unit as planned, then the root

Planning reads shapes only: the model may live on the meta device (a Transformers model
built from its config under ``torch.device("meta")``) and no process group is needed.
"""

from __future__ import annotations

import dataclasses
import logging
import re

import torch
import torch.distributed as dist
from torch import nn

from shardwise.planning.activations import ActivationTrace, synthetic_marks, trace_activations
from shardwise.planning.plan import Plan, UnitPlan, format_bytes
from shardwise.planning.search import Evaluation, Evaluator, cheapest_fitting, layout
from shardwise.planning.setting import Setting, dtype_name, parse_dtype
from shardwise.planning.structure import UnitShape, find_block_fqns, unit_shapes

__all__ = ["plan", "parse_bytes"]

logger = logging.getLogger(__name__)

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12,
          "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(value: int | str | None) -> int | None:
    """``80GiB``, ``80 GB``, ``1.5e9`` or an int: a byte count (None stays None)."""
    if value is None or isinstance(value, int):
        return value
    m = re.fullmatch(r"\s*([0-9.]+(?:[eE][0-9]+)?)\s*([a-zA-Z]*)\s*", str(value))
    if m is None or m.group(2).lower() not in _UNITS:
        raise ValueError(f"memory size {value!r} is not understood; write e.g. 80GiB, 80GB or 85899345920")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


class _Inputs:
    """The plan() arguments, resolved: units, setting, traces (cached per dtype and checkpointing)."""

    def __init__(self, model, world_size, mesh_shape, mp_policy, optimizer, foreach, batch, device, offload, units):
        self.model = model
        self.mesh_shape = _mesh_shape(world_size, mesh_shape)
        self.block_fqns = list(units) if units is not None else find_block_fqns(model)
        self.units = unit_shapes(model, self.block_fqns)
        self.batch = _batch(batch)
        self.setting = Setting(
            shard_size=self.mesh_shape[-1], replicate_size=self.mesh_shape[0] if len(self.mesh_shape) == 2 else 1,
            device=device or _device_of(model), param_dtype=dtype_name(getattr(mp_policy, "param_dtype", None)),
            reduce_dtype=dtype_name(getattr(mp_policy, "reduce_dtype", None)), optimizer=optimizer,
            foreach=foreach, offload=offload,
        )
        self._traces: dict = {}

    def trace(self, param_dtype: str | None, checkpointed: bool) -> ActivationTrace | None:
        if self.batch is None:
            return None
        key = (param_dtype, checkpointed)
        if key not in self._traces:
            fqns = [""] + self.block_fqns
            try:
                self._traces[key] = trace_activations(self.model, fqns, self.batch, parse_dtype(param_dtype), checkpointed)
            except Exception as e:
                raise RuntimeError(
                    f"shardwise.plan could not run {type(self.model).__name__} on a fake batch of token ids "
                    f"{self.batch} to measure activations ({type(e).__name__}: {e}); pass batch=None to plan "
                    "without activations"
                ) from e
        return self._traces[key]

    def evaluator(self, setting: Setting, checkpointed: bool) -> Evaluator:
        trace = self.trace(setting.param_dtype, checkpointed)
        marks = trace.marks if trace is not None else synthetic_marks([""] + self.block_fqns)
        return Evaluator(self.units, setting, trace, marks)


def plan(
    model: nn.Module,
    *,
    world_size: int | None = None,
    mesh_shape: tuple[int, ...] | None = None,
    memory_budget: int | str | None = None,
    mp_policy=None,
    optimizer: str = "adamw",
    batch=None,
    activation_checkpointing: bool | None = None,
    device: str | None = None,
    foreach: bool | None = None,
    offload: bool = False,
    units: list[str] | None = None,
    reshard_after_forward: bool | int | None = None,
) -> Plan:
    """Plan how to ``fully_shard`` ``model`` and predict one training step's per-rank cost.

    Args:
        model: the model to plan for, on any device (meta included); it is not modified.
        world_size: data-parallel ranks; default the process group's, else 1.
        mesh_shape: ``(shard,)`` or ``(replicate, shard)`` (HSDP); overrides ``world_size``.
        memory_budget: bytes per rank (``"80GiB"`` works). With it, blocks are kept gathered
            after forward (or kept as a 1/k share) as far as the budget allows, cheapest
            communication first; without, every block reshards (FSDP2's default).
        mp_policy: a :class:`~shardwise.MixedPrecisionPolicy` (its param and reduce dtypes).
        optimizer: ``adamw``/``adam`` (2 state tensors per param), ``sgd`` (1) or ``none``.
        batch: ``(batch_size, seq_len)`` token ids per rank, or such a tensor: activations
            are measured with a fake forward/backward and a cross-entropy loss; None leaves
            them out.
        activation_checkpointing: True: checkpoint every block; None: only if that is what
            makes the plan fit the budget; False: never.
        device: ``cpu`` or ``cuda``; default the model's (``cuda`` for a meta model).
        foreach: the optimizer's multi-tensor step (default: torch's, foreach on CUDA only).
        offload: plan for ``CPUOffloadPolicy`` (sharded state in host memory).
        units: FQNs of the blocks to wrap instead of the repeated blocks found by structure.
        reshard_after_forward: one policy for every block instead of searching.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"shardwise.plan expects an nn.Module, got {type(model).__name__}")
    inputs = _Inputs(model, world_size, mesh_shape, mp_policy, optimizer, foreach, batch, device, offload, units)
    budget = parse_bytes(memory_budget)
    ev, chosen, fits, checkpointed, advice = _choose(inputs, budget, activation_checkpointing, reshard_after_forward)
    return _make_plan(inputs, ev, chosen, budget, fits, checkpointed, advice, reshard_after_forward is not None)


def _choose(inputs: _Inputs, budget: int | None, activation_checkpointing, reshard_after_forward):
    """(evaluator, chosen evaluation, fits, checkpointed, advice): the fixed policy when one is
    given or there is no budget; else the cheapest fitting plan, turning activation
    checkpointing on (when left to us) only if nothing fits without it."""
    n_blocks = len(inputs.block_fqns)
    checkpointed = bool(activation_checkpointing)
    ev = inputs.evaluator(inputs.setting, checkpointed)
    if reshard_after_forward is not None or budget is None:
        rest = True if reshard_after_forward is None else reshard_after_forward
        chosen = ev.evaluate(layout(n_blocks, rest, 0), 0, rest)
        fits = None if budget is None else chosen.peak.total <= budget
        advice = _advice(inputs, budget, checkpointed) if fits is False else _notes(inputs)
        return ev, chosen, fits, checkpointed, advice
    chosen, leanest = cheapest_fitting(ev, n_blocks, budget)
    notes = []
    if chosen is None and activation_checkpointing is None and inputs.batch is not None:
        ev_ac = inputs.evaluator(inputs.setting, True)
        chosen, _ = cheapest_fitting(ev_ac, n_blocks, budget)
        if chosen is not None:
            ev, checkpointed = ev_ac, True
            notes.append("activation checkpointing turned on: without it even the leanest plan needs "
                         f"{format_bytes(leanest.peak.total)}")
    if chosen is None:
        return ev, leanest, False, checkpointed, _advice(inputs, budget, checkpointed)
    return ev, chosen, True, checkpointed, notes + _notes(inputs)


def _make_plan(inputs: _Inputs, ev: Evaluator, chosen: Evaluation, budget, fits, checkpointed, advice, forced) -> Plan:
    s = inputs.setting
    without = ev.peak_without_activations(list(chosen.policies))
    units = [
        UnitPlan(u.fqn, p, _reason(u, p, chosen, budget, forced), u.numel)
        for u, p in zip(inputs.units, chosen.policies)
    ]
    return Plan(
        model=type(inputs.model).__name__, world_size=s.world_size, mesh_shape=list(inputs.mesh_shape),
        device=s.device, units=units, param_dtype=s.param_dtype, reduce_dtype=s.reduce_dtype, optimizer=s.optimizer,
        foreach=s.foreach, offload=s.offload, activation_checkpointing=checkpointed,
        batch=list(inputs.batch) if inputs.batch else None, memory=dict(chosen.peak.bytes), peak_at=chosen.peak.at,
        peak_bytes=chosen.peak.total, peak_bytes_without_activations=without.total,
        comm_counts=dict(chosen.comm.counts), comm_wire_bytes=dict(chosen.comm.wire_bytes),
        memory_budget=budget, fits=fits, advice=advice,
    )


def _reason(unit: UnitShape, policy, chosen: Evaluation, budget, forced: bool) -> str:
    if not unit.fqn:
        return "root: backward needs its params first, right after forward (FSDP2's root default)"
    if forced:
        return "as requested (reshard_after_forward)"
    if budget is None:
        return "FSDP2's default: free after forward, gather again in backward (no memory_budget given)"
    if policy is False:
        return "kept gathered: backward needs no all-gather; fits the budget"
    if policy is True:
        return "resharded: keeping it gathered would not fit the budget" if chosen.peak.total <= budget else "resharded: least memory"
    return f"keeps a 1/{policy} share: backward gathers over {policy} ranks only; fits the budget"


def _notes(inputs: _Inputs) -> list[str]:
    if inputs.batch is None:
        return ["activations not counted: pass batch=(batch_size, seq_len) to include them"]
    return []


def _advice(inputs: _Inputs, budget: int, checkpointed: bool) -> list[str]:
    """What would make the least-memory plan fit: each remedy alone, predicted."""
    n_blocks = len(inputs.block_fqns)
    s = inputs.setting
    lean = layout(n_blocks, True, 0)
    out = []

    def tried(label: str, setting: Setting, ac: bool) -> None:
        peak = inputs.evaluator(setting, ac).evaluate(lean).peak.total
        verdict = "fits" if peak <= budget else f"still misses by {format_bytes(peak - budget)}"
        out.append(f"{label}: peak {format_bytes(peak)}, {verdict}")

    for factor in (2, 4, 8, 16, 32, 64):
        bigger = dataclasses.replace(s, shard_size=s.shard_size * factor)
        peak = inputs.evaluator(bigger, checkpointed).evaluate(lean).peak.total
        if peak <= budget or factor == 64:
            verdict = "fits" if peak <= budget else f"still misses by {format_bytes(peak - budget)}"
            out.append(f"{s.world_size * factor} ranks: peak {format_bytes(peak)}, {verdict}")
            break
    if s.param_dtype is None and inputs.units[0].itemsize == 4:
        tried("bf16 mixed precision (param bfloat16, reduce float32)",
              dataclasses.replace(s, param_dtype="bfloat16", reduce_dtype="float32"), checkpointed)
    if not checkpointed and inputs.batch is not None:
        tried("activation checkpointing of every block", s, True)
    if not s.offload:
        tried("CPU offload (CPUOffloadPolicy)", dataclasses.replace(s, offload=True), checkpointed)
    return out


def _mesh_shape(world_size: int | None, mesh_shape) -> tuple[int, ...]:
    if mesh_shape is not None:
        shape = tuple(int(x) for x in mesh_shape)
        if len(shape) not in (1, 2) or min(shape) < 1:
            raise ValueError(f"mesh_shape must be (shard,) or (replicate, shard) of positive sizes, got {mesh_shape!r}")
        if world_size is not None and world_size != _prod(shape):
            raise ValueError(f"world_size={world_size} disagrees with mesh_shape={shape} ({_prod(shape)} ranks)")
        return shape
    if world_size is None:
        world_size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    return (world_size,)


def _prod(shape) -> int:
    out = 1
    for x in shape:
        out *= x
    return out


def _batch(batch) -> tuple[int, int] | None:
    if batch is None:
        return None
    if isinstance(batch, torch.Tensor):
        batch = tuple(batch.shape)
    batch = tuple(int(x) for x in batch)
    if len(batch) != 2 or min(batch) < 1:
        raise ValueError(f"batch must be (batch_size, seq_len) token ids per rank, got {batch!r}")
    return batch


def _device_of(model: nn.Module) -> str:
    p = next(model.parameters(), None)
    if p is None or p.device.type == "meta":
        return "cuda"
    return "cpu" if p.device.type == "cpu" else "cuda"
