"""The switch: shardwise's FSDP2 names in place of torch's, for code you do not edit.

Frameworks (Accelerate, Transformers, torchtitan, Lightning) call
``torch.distributed.fsdp.fully_shard`` on the user's behalf. The switch puts shardwise's
objects under torch's names, so that code runs on shardwise unchanged::

    import shardwise
    shardwise.install_as_torch_fsdp()       # first lines of the script, before the framework's imports
    ...                                     # torch.distributed.fsdp.fully_shard is shardwise.fully_shard
    shardwise.uninstall_as_torch_fsdp()     # torch's own objects again, exactly as they were

    with shardwise.install_as_torch_fsdp():     # or scoped: uninstalls at exit what it installed
        ...

For a script you do not own, :mod:`shardwise.as_torch_fsdp` installs the switch in every
rank a launcher starts, then runs the script::

    torchrun --nproc-per-node 8 -m shardwise.as_torch_fsdp train.py --lr 3e-4
    accelerate launch -m shardwise.as_torch_fsdp train.py --lr 3e-4

**What is switched** (:data:`HOMES`): in each namespace users import FSDP2 from, every
name of that namespace that shardwise implements — ``fully_shard``, ``FSDPModule``,
``UnshardHandle``, ``MixedPrecisionPolicy``, ``OffloadPolicy``, ``CPUOffloadPolicy``,
``DataParallelMeshDims``, ``register_fsdp_forward_method``, ``share_comm_ctx``, and the
composable ``replicate`` / ``ReplicateModule`` of ``replicate_with_fsdp``. torch's own
implementation modules (``torch.distributed.fsdp._fully_shard.*``) are not touched, so
torch's FSDP2 stays intact underneath and comes back whole on uninstall. The DDP-based
``torch.distributed._composable.replicate`` (``device_mesh=``, ``bucket_cap_mb=``) has a
different API and is not switched.

**The binding rule.** ``from torch.distributed.fsdp import fully_shard`` copies the
object the name holds *when that line runs*. Code that runs it after the switch (Accelerate
and Transformers' Trainer import inside the functions that shard) gets shardwise's; a module
that ran it before keeps torch's, and so do its ``isinstance(x, FSDPModule)`` checks: a
shardwise module is not an instance of torch's ``FSDPModule``. Hence *install first*. On
install, every already-imported module that holds one of torch's objects is named in a
warning (torch's own FSDP packages aside), so a late switch is never silent.

**All or nothing.** Install first imports every home and builds the whole replacement
table (:func:`plan`), checking each entry, before it sets a single name; if a setattr fails
midway, the names already set are put back before the error propagates. Uninstall checks
that every switched name still holds shardwise's object before restoring torch's (by
identity); if anything else rebound one in between it raises and changes nothing.

This is the one module of shardwise that imports ``torch.distributed.fsdp``, and only when
installing: it must, to set names there (``import shardwise`` loads none of torch's FSDP).
The rest of the library never uses torch's FSDP implementation.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import sys
import threading
import types
import warnings

import shardwise.policies
from shardwise.fully_shard import fully_shard
from shardwise.module import FSDPModule, UnshardHandle, register_fsdp_forward_method, share_comm_ctx
from shardwise.replicate import ReplicateModule, replicate

__all__ = [
    "install_as_torch_fsdp", "uninstall_as_torch_fsdp", "installed", "plan", "torch_objects", "HOMES", "SHARDWISE_OBJECTS",
]

_log = logging.getLogger(__name__)

#: torch's public name -> shardwise's object put under it.
SHARDWISE_OBJECTS: dict[str, object] = {
    "fully_shard": fully_shard,
    "FSDPModule": FSDPModule,
    "UnshardHandle": UnshardHandle,
    "MixedPrecisionPolicy": shardwise.policies.MixedPrecisionPolicy,
    "OffloadPolicy": shardwise.policies.OffloadPolicy,
    "CPUOffloadPolicy": shardwise.policies.CPUOffloadPolicy,
    "DataParallelMeshDims": shardwise.policies.DataParallelMeshDims,
    "register_fsdp_forward_method": register_fsdp_forward_method,
    "share_comm_ctx": share_comm_ctx,
    "replicate": replicate,
    "ReplicateModule": ReplicateModule,
}

_FSDP2 = tuple(n for n in SHARDWISE_OBJECTS if n not in ("replicate", "ReplicateModule"))

#: The namespaces users and frameworks import FSDP2 from -> the names looked for there.
#: A name a namespace does not define is skipped (the switch never adds names).
HOMES: dict[str, tuple[str, ...]] = {
    "torch.distributed.fsdp": _FSDP2,  # the public home (Accelerate, torchtitan, Lightning)
    "torch.distributed._composable.fsdp": _FSDP2,  # the older home (Transformers' distributed/fsdp.py)
    "torch.distributed._composable.fsdp.fully_shard": _FSDP2,
    "torch.distributed._composable.replicate_with_fsdp": ("replicate", "ReplicateModule"),
    # torch's pipelining binds FSDP2's names at its import and tests isinstance(stage.submod,
    # FSDPModule) at every step: switched here, it drives shardwise's stages whichever of the
    # two was imported first, and gets torch's objects back on uninstall.
    "torch.distributed.pipelining.stage": ("FSDPModule", "fully_shard", "replicate", "ReplicateModule"),
    "torch.distributed.pipelining.schedules": ("FSDPModule", "UnshardHandle"),
}

# Modules that define or re-export torch's FSDP2 objects: holding them there is no sign of
# a consumer that bound them too early.
_TORCH_FSDP_PACKAGES = ("torch.distributed.fsdp", "torch.distributed._composable")

_LOCK = threading.Lock()
_installed: tuple[Binding, ...] | None = None  # what install set, in order; None when off


@dataclasses.dataclass(frozen=True)
class Binding:
    """One switched name: ``home.name`` holds ``torch_obj`` when off, ``shardwise_obj`` when on."""

    home: types.ModuleType
    name: str
    torch_obj: object
    shardwise_obj: object

    def __repr__(self) -> str:
        return f"Binding({self.home.__name__}.{self.name})"


class _Switched:
    """What :func:`install_as_torch_fsdp` returns: as a context manager it uninstalls on exit,
    but only if that call was the one that installed (a nested ``with`` leaves it on)."""

    def __init__(self, installed_here: bool):
        self.installed_here = installed_here

    def __enter__(self) -> _Switched:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.installed_here:
            uninstall_as_torch_fsdp()


def installed() -> tuple[Binding, ...]:
    """What the switch set in this process, in order; empty (false) when it is off."""
    return _installed or ()


def plan() -> tuple[Binding, ...]:
    """The full replacement table, built and checked without changing anything.

    Raises:
        ImportError: a home cannot be imported (a torch build without distributed).
        RuntimeError: a home already holds a shardwise object the switch did not put there.
    """
    bindings = []
    for home_name, names in HOMES.items():
        home = importlib.import_module(home_name)
        for name in names:
            if name not in vars(home):
                continue
            current, ours = vars(home)[name], SHARDWISE_OBJECTS[name]
            if current is ours:
                raise RuntimeError(
                    f"{home_name}.{name} already holds shardwise's {name}, but the switch did not put it "
                    "there; restore torch's object before shardwise.install_as_torch_fsdp()"
                )
            bindings.append(Binding(home, name, current, ours))
    return tuple(bindings)


def torch_objects() -> dict[str, object]:
    """torch's own FSDP2 objects by name (``fully_shard``, ``MixedPrecisionPolicy``, ...), switch on or off.

    For code that runs both implementations side by side (``shardwise train --impl torch``,
    the benchmarks): while the switch is on, ``torch.distributed.fsdp`` holds shardwise's
    objects, so torch's are read from what the switch set aside.
    """
    home = importlib.import_module("torch.distributed.fsdp")
    set_aside = {b.name: b.torch_obj for b in installed() if b.home is home}
    return {name: set_aside.get(name, vars(home)[name]) for name in _FSDP2 if name in vars(home)}


def install_as_torch_fsdp() -> _Switched:
    """Put shardwise's FSDP2 objects under torch's names (see the module docstring).

    Idempotent: a second call while installed changes nothing. Call it before importing
    modules that bind torch's names at import time; already-imported ones that did are
    named in a warning. Use the result as a context manager to uninstall on exit.

    Returns:
        A handle; ``with shardwise.install_as_torch_fsdp(): ...`` scopes the switch.
    """
    global _installed
    with _LOCK:
        if _installed is not None:
            return _Switched(installed_here=False)
        bindings = plan()
        _set_all(bindings, on=True)
        _installed = bindings
    _log.info("shardwise switched in for torch FSDP2: %s", ", ".join(map(_where, bindings)))
    _warn_early_binders(bindings)
    return _Switched(installed_here=True)


def uninstall_as_torch_fsdp() -> None:
    """Restore exactly the objects torch's names held before the switch. No-op when off.

    Raises:
        RuntimeError: a switched name no longer holds shardwise's object (something else
            rebound it); nothing is changed.
    """
    global _installed
    with _LOCK:
        if _installed is None:
            return
        moved = [b for b in _installed if vars(b.home).get(b.name) is not b.shardwise_obj]
        if moved:
            raise RuntimeError(
                "shardwise.uninstall_as_torch_fsdp: "
                + ", ".join(map(_where, moved))
                + " no longer hold shardwise's objects (rebound after the switch); nothing was restored. "
                "Put shardwise's objects back, or restore torch's by hand."
            )
        _set_all(_installed, on=False)
        _installed = None
    _log.info("torch FSDP2 names restored")


def _set_all(bindings: tuple[Binding, ...], *, on: bool) -> None:
    """Set every binding to shardwise's (``on``) or torch's object; on any failure put back
    the ones already set, so no home is ever left half switched."""
    done: list[Binding] = []
    try:
        for b in bindings:
            setattr(b.home, b.name, b.shardwise_obj if on else b.torch_obj)
            done.append(b)
    except BaseException:
        for b in reversed(done):
            setattr(b.home, b.name, b.torch_obj if on else b.shardwise_obj)
        raise


def _warn_early_binders(bindings: tuple[Binding, ...]) -> None:
    """Warn about imported modules that still hold torch's objects (bound before the switch)."""
    torch_objs = {id(b.torch_obj): b.name for b in bindings}
    holders = []
    for mod_name, mod in list(sys.modules.items()):
        in_torch_fsdp = any(mod_name == p or mod_name.startswith(p + ".") for p in _TORCH_FSDP_PACKAGES)
        if in_torch_fsdp or not isinstance(mod, types.ModuleType):
            continue
        names = sorted({torch_objs[id(v)] for v in list(vars(mod).values()) if id(v) in torch_objs})
        if names:
            holders.append(f"{mod_name} ({', '.join(names)})")
    if holders:
        warnings.warn(
            "shardwise.install_as_torch_fsdp: these modules imported torch's FSDP2 objects before the "
            f"switch and keep them: {'; '.join(holders)}. Install the switch before importing them (the "
            "script's first lines, or run it with `python -m shardwise.as_torch_fsdp script.py`).",
            stacklevel=3,
        )


def _where(b: Binding) -> str:
    return f"{b.home.__name__}.{b.name}"
