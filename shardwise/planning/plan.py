"""The Plan: plain data saying how to wrap a model and what that will cost.

A :class:`Plan` holds only numbers, strings and lists, so it round-trips through JSON
(``plan.save(path)``, ``Plan.load(path)``), can be edited by hand (change a unit's
``reshard_after_forward``, drop a unit) and applied with :func:`shardwise.auto_shard`.
Its predictions (memory, communication) describe the plan as it was made: re-plan after
editing to refresh them. ``str(plan)`` is the table the CLI prints.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

__all__ = ["UnitPlan", "Plan", "format_bytes"]

_LABELS = {
    "sharded_params": "sharded parameters",
    "grads": "gradients (sharded)",
    "optimizer_state": "optimizer state",
    "unsharded": "unsharded params in flight",
    "unsharded_grads": "unsharded gradients",
    "reduction": "reduction buffers",
    "optimizer_temp": "optimizer step temporaries",
    "activations": "activations",
}


def format_bytes(n: float) -> str:
    """Binary units: 1.50 GiB, 12.0 MiB, 512 B."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


@dataclasses.dataclass
class UnitPlan:
    """One ``fully_shard`` call: which module, how it reshards after forward, and why."""

    fqn: str  # "" is the root module
    reshard_after_forward: bool | int
    reason: str
    params: int = 0  # unsharded parameter count this unit manages


@dataclasses.dataclass
class Plan:
    """How to shard a model (``units``) and the predicted per-rank cost of one training step."""

    model: str  # the model's class name
    world_size: int
    mesh_shape: list[int]  # [shard] (FSDP) or [replicate, shard] (HSDP)
    device: str  # "cpu" (gloo) or "cuda" (NCCL)
    units: list[UnitPlan]
    param_dtype: str | None = None
    reduce_dtype: str | None = None
    optimizer: str = "adamw"
    foreach: bool | None = None
    offload: bool = False
    activation_checkpointing: bool = False
    batch: list[int] | None = None  # [batch size, sequence length] per rank
    memory: dict[str, int] = dataclasses.field(default_factory=dict)  # bytes per category at the peak
    peak_at: str = ""
    peak_bytes: int = 0  # with activations (when a batch was given)
    peak_bytes_without_activations: int = 0
    comm_counts: dict[str, int] = dataclasses.field(default_factory=dict)  # per step, by kind
    comm_wire_bytes: dict[str, int] = dataclasses.field(default_factory=dict)  # per rank per step, by kind
    memory_budget: int | None = None
    fits: bool | None = None
    advice: list[str] = dataclasses.field(default_factory=list)

    # ---- plain data ---------------------------------------------------------------------

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "Plan":
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - fields)
        if unknown:
            raise ValueError(f"Plan has no fields {unknown}; expected a subset of {sorted(fields)}")
        data = dict(data)
        data["units"] = [UnitPlan(**u) for u in data.get("units", [])]
        return cls(**data)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        return cls.from_dict(json.loads(text))

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json())

    @classmethod
    def load(cls, path: str | Path) -> "Plan":
        return cls.from_json(Path(path).read_text())

    # ---- presentation -------------------------------------------------------------------

    @property
    def total_wire_bytes(self) -> int:
        return sum(self.comm_wire_bytes.values())

    def __str__(self) -> str:
        return "\n".join(self._header() + self._unit_rows() + self._memory_rows() + self._comm_rows() + self._verdict())

    def _header(self) -> list[str]:
        mesh = " x ".join(str(s) for s in self.mesh_shape)
        precision = f"params {self.param_dtype or 'as is'}, reduce {self.reduce_dtype or self.param_dtype or 'as is'}"
        batch = f"batch {self.batch[0]} x {self.batch[1]} tokens/rank" if self.batch else "no batch (activations not counted)"
        extras = [x for x, on in (("activation checkpointing", self.activation_checkpointing), ("CPU offload", self.offload)) if on]
        return [
            f"shardwise plan for {self.model}: {self.world_size} ranks (mesh {mesh}, {self.device}), {precision}",
            f"  optimizer {self.optimizer}, {batch}" + "".join(f", {x}" for x in extras),
            "",
        ]

    def _unit_rows(self) -> list[str]:
        rows = [f"  {'unit':<28} {'params':>14}  reshard_after_forward  reason"]
        groups: list[list[UnitPlan]] = []
        for u in self.units:  # runs of identical rows print once, as "layers.0-79"
            last = groups[-1][0] if groups else None
            if last is not None and last.fqn and u.fqn and (last.reshard_after_forward, last.reason, last.params) == (
                u.reshard_after_forward, u.reason, u.params
            ) and _parent(last.fqn) == _parent(u.fqn):
                groups[-1].append(u)
            else:
                groups.append([u])
        for g in groups:
            name = g[0].fqn or "<root>"
            if len(g) > 1:
                name = f"{g[0].fqn} .. {g[-1].fqn.rsplit('.', 1)[-1]} ({len(g)})"
            params = f"{g[0].params:,}" + (" each" if len(g) > 1 else "")
            rows.append(f"  {name:<28} {params:>14}  {str(g[0].reshard_after_forward):<21}  {g[0].reason}")
        return rows + [""]

    def _memory_rows(self) -> list[str]:
        rows = [f"  predicted peak per rank: {format_bytes(self.peak_bytes)} (at {self.peak_at})"]
        for key, label in _LABELS.items():
            if self.memory.get(key):
                rows.append(f"    {label:<30} {format_bytes(self.memory[key]):>12}")
        rows.append(f"    {'without activations':<30} {format_bytes(self.peak_bytes_without_activations):>12} (peak of that step)")
        return rows + [""]

    def _comm_rows(self) -> list[str]:
        rows = [f"  per step per rank: {sum(self.comm_counts.values())} collectives, {format_bytes(self.total_wire_bytes)} on the wire"]
        for kind in sorted(self.comm_counts):
            rows.append(f"    {kind:<30} {self.comm_counts[kind]:>6} x   {format_bytes(self.comm_wire_bytes.get(kind, 0)):>12}")
        return rows + [""]

    def _verdict(self) -> list[str]:
        if self.memory_budget is None:
            return [f"  {a}" for a in self.advice]
        head = "fits" if self.fits else "does NOT fit"
        margin = self.memory_budget - self.peak_bytes
        line = f"  budget {format_bytes(self.memory_budget)}: {head} ("
        line += f"{format_bytes(margin)} to spare)" if self.fits else f"misses by {format_bytes(-margin)})"
        return [line] + [f"    - {a}" for a in self.advice]


def _parent(fqn: str) -> str:
    return fqn.rsplit(".", 1)[0] if "." in fqn else ""
