"""Which modules become ``fully_shard`` units: repeated blocks found by structure.

A transformer is a stack of identical blocks, and the block is the natural unit: one
all-gather brings in one block's parameters, so only a block or two is ever unsharded.
The blocks are found by *structure*, not by class name (torch removed FSDP1's
``auto_wrap_policy``; Megatron-FSDP takes a hand-written list of classes)::

    walk the module tree from the root; at each child:
        a ModuleList / Sequential of >= 2 children with the same class and the same
        parameter names, shapes and dtypes (and at least one parameter)
            -> each child is a unit; do not descend into them
        otherwise -> descend

The root is always a unit too: it takes every parameter no block owns (embeddings,
final norm, output head). Everything here reads shapes only, so it works on a
meta-device model as well as on a real one.
"""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import nn

__all__ = ["ParamShape", "UnitShape", "find_block_fqns", "unit_shapes"]


@dataclasses.dataclass(frozen=True)
class ParamShape:
    """One parameter as the planner sees it: its shape and element size, never its data."""

    shape: tuple[int, ...]
    itemsize: int  # bytes per element of the parameter's own dtype
    requires_grad: bool

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def padded_shard_numel(self, n: int) -> int:
        """Elements of one rank's padded shard over ``n`` ranks (dim 0 split like torch.chunk,
        padded to ``ceil(dim0 / n)`` rows: what param.py lays out and all-gathers)."""
        rows = math.ceil(self.shape[0] / n) if self.shape[0] else 0
        return rows * (self.numel // self.shape[0] if self.shape[0] else 0)

    def rank0_numel(self, n: int) -> int:
        """Elements rank 0 really holds (the largest real shard; padding excluded)."""
        rows = math.ceil(self.shape[0] / n) if self.shape[0] else 0
        rows = min(rows, self.shape[0])
        return rows * (self.numel // self.shape[0] if self.shape[0] else 0)


@dataclasses.dataclass(frozen=True)
class UnitShape:
    """The parameters one ``fully_shard`` call would manage."""

    fqn: str  # "" for the root
    params: tuple[ParamShape, ...]
    names: tuple[str, ...] = ()  # each param's FQN in the model (as named_parameters() gives it)

    @property
    def numel(self) -> int:
        return sum(p.numel for p in self.params)

    @property
    def itemsize(self) -> int:
        return self.params[0].itemsize if self.params else 4


def _signature(module: nn.Module) -> tuple:
    shapes = tuple((n, tuple(p.shape), p.dtype) for n, p in module.named_parameters())
    return type(module), shapes


def _repeated(container: nn.Module) -> bool:
    """A ModuleList/Sequential of >= 2 structurally identical children that hold parameters."""
    if not isinstance(container, (nn.ModuleList, nn.Sequential)):
        return False
    children = list(container.children())
    if len(children) < 2:
        return False
    first = _signature(children[0])
    return bool(first[1]) and all(_signature(c) == first for c in children[1:])


def find_block_fqns(model: nn.Module) -> list[str]:
    """FQNs of the repeated blocks of ``model``, in module order (outermost lists only)."""
    found: list[str] = []

    def walk(module: nn.Module, prefix: str) -> None:
        for name, child in module.named_children():
            fqn = f"{prefix}{name}"
            if _repeated(child):
                found.extend(f"{fqn}.{sub}" for sub, _ in child.named_children())
            else:
                walk(child, f"{fqn}.")

    walk(model, "")
    return found


def unit_shapes(model: nn.Module, block_fqns: list[str]) -> list[UnitShape]:
    """The root's unit first, then one per block: each parameter belongs to the innermost
    unit containing it (a tied parameter to the first one that meets it, as fully_shard)."""
    modules = dict(model.named_modules())
    missing = [f for f in block_fqns if f not in modules]
    if missing:
        raise ValueError(f"plan names units {missing} that are not submodules of {type(model).__name__}")
    names = {id(p): n for n, p in model.named_parameters()}
    seen: set[int] = set()
    units = []
    for fqn in sorted(block_fqns, key=lambda f: -f.count(".")):  # deeper first, as fully_shard is applied
        params = [p for p in modules[fqn].parameters() if id(p) not in seen]
        seen.update(id(p) for p in params)
        units.append((fqn, params))
    root = [p for p in model.parameters() if id(p) not in seen]
    order = {f: i for i, f in enumerate(block_fqns)}
    units.sort(key=lambda u: order[u[0]])
    return [_unit("", root, names)] + [_unit(f, ps, names) for f, ps in units]


def _unit(fqn: str, params: list[torch.Tensor], names: dict[int, str]) -> UnitShape:
    shapes = tuple(ParamShape(tuple(p.shape), p.element_size(), p.requires_grad) for p in params)
    return UnitShape(fqn, shapes, tuple(names[id(p)] for p in params))
