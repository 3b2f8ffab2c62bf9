"""What a checkpoint holds, and how it is captured from and restored into a training run.

Two parts, so that loading never unpickles anything but tensors and plain data:

- **Sharded tensors** through ``torch.distributed.checkpoint`` (DCP): the model and optimizer
  state from ``get_state_dict`` (every rank writes its own shards; DCP reshards on load, so a
  checkpoint of 2 ranks loads on 4). Non-tensor leaves of the optimizer state (``lr``,
  ``betas``...) are read back with ``torch.load(weights_only=True)`` (:class:`SafeLoadPlanner`;
  DCP's default planner uses ``weights_only=False``).
- **Per-rank JSON**, ``rank-<r>.json``: the step, every ``Stateful`` the trainer registers
  (LR scheduler, data sampler) and every RNG stream this process draws from (torch CPU and
  CUDA, ``random``, ``numpy``). With these restored, a resumed run repeats the uninterrupted
  one bit for bit at the same world size.

At another world size, ranks the checkpoint did not have take rank ``r % saved_world_size``'s
JSON (logged): the sampler state is the same on every rank (a global batch), so the data
stream continues; only per-rank RNG streams repeat.
"""

from __future__ import annotations

import base64
import io
import json
import logging
import random
import sys
from pathlib import Path
from typing import Any, Mapping, Protocol

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint._traverse import set_element  # what DefaultLoadPlanner.load_bytes uses
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from shardwise.checkpoint.directory import CheckpointError, write_json

__all__ = [
    "Stateful", "SafeLoadPlanner", "sharded_state", "load_sharded_state", "tensor_shapes", "check_shapes",
    "rng_state", "set_rng_state", "rank_file", "write_rank_state", "read_rank_state",
]

logger = logging.getLogger(__name__)


class Stateful(Protocol):
    """Anything with a JSON-able ``state_dict()`` and the matching ``load_state_dict``."""

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, reading non-tensor values with ``torch.load(weights_only=True)``."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)
"""The optimizer's state keyed by parameter name (``state.<fqn>.exp_avg``, ``param_groups.<fqn>.lr``),
not by group index: a rank that holds only some parameters (a pipeline stage) saves and finds its
own groups' settings, whichever rank's copy of a key DCP keeps."""


def sharded_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``{"model": ..., "optim": ...}`` from DCP's ``get_state_dict``: sharded DTensors, no copies."""
    model_sd, optim_sd = get_state_dict(model, optimizer, options=_OPTIONS)
    return {"model": model_sd, "optim": optim_sd}


def tensor_shapes(model_sd: Mapping[str, Any]) -> dict[str, list[int]]:
    """``{key: global shape}`` of every tensor in a model state dict (DTensors report the global one)."""
    return {k: list(v.shape) for k, v in model_sd.items() if isinstance(v, torch.Tensor)}


def check_shapes(saved: Mapping[str, list[int]], current: Mapping[str, list[int]], where: Path) -> None:
    """Raise :class:`CheckpointError` naming the first key whose shape (or presence) differs."""
    for key in sorted(saved.keys() | current.keys()):
        old, new = saved.get(key), current.get(key)
        if old != new:
            old_s = "absent" if old is None else tuple(old)
            new_s = "absent" if new is None else tuple(new)
            raise CheckpointError(
                f"checkpoint {where} does not fit this model: {key!r} has shape {old_s} in the checkpoint "
                f"and {new_s} in the model (same --model and --seq-len as the saved run?)"
            )


def load_sharded_state(model: nn.Module, optimizer: torch.optim.Optimizer, path: Path) -> None:
    """Load model and optimizer state from the DCP checkpoint at ``path``, resharding as needed."""
    state = sharded_state(model, optimizer)
    try:
        dcp.load(state, checkpoint_id=str(path), planner=SafeLoadPlanner())
    except Exception as e:  # DCP raises CheckpointException (a gather of every rank's failure)
        raise CheckpointError(f"checkpoint {path} could not be read: {type(e).__name__}: {e}") from e
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"], options=_OPTIONS)


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.numpy().tobytes()).decode("ascii")


def _unb64(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8).clone()


def rng_state() -> dict[str, Any]:
    """Every RNG stream of this process, JSON-able (numpy only when it is imported)."""
    state: dict[str, Any] = {"torch": _b64(torch.get_rng_state()), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [_b64(s) for s in torch.cuda.get_rng_state_all()]
    np = sys.modules.get("numpy")
    if np is not None:
        kind, keys, pos, has_gauss, gauss = np.random.get_state()
        state["numpy"] = [kind, keys.tolist(), pos, has_gauss, gauss]
    return state


def set_rng_state(state: Mapping[str, Any]) -> None:
    """Restore what :func:`rng_state` captured (JSON turned tuples into lists: turn them back)."""
    torch.set_rng_state(_unb64(state["torch"]))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([_unb64(s) for s in state["cuda"]])
    if "numpy" in state:
        import numpy as np

        kind, keys, pos, has_gauss, gauss = state["numpy"]
        np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, gauss))


def rank_file(path: Path, rank: int) -> Path:
    return path / f"rank-{rank:05d}.json"


def write_rank_state(path: Path, rank: int, step: int, stateful: Mapping[str, Stateful]) -> None:
    """Write this rank's step, ``stateful`` objects and RNG streams to ``path/rank-<r>.json``."""
    path.mkdir(parents=True, exist_ok=True)
    payload = {"step": step, "rng": rng_state(), "stateful": {k: v.state_dict() for k, v in stateful.items()}}
    write_json(rank_file(path, rank), payload)


def read_rank_state(path: Path, rank: int, saved_world_size: int, stateful: Mapping[str, Stateful]) -> int:
    """Restore ``stateful`` and the RNG streams from the checkpoint at ``path``; returns its step."""
    source = rank % saved_world_size
    if source != rank:
        logger.warning("rank %d resumes the RNG streams of saved rank %d (checkpoint of %d ranks)",
                       rank, source, saved_world_size)
    try:
        payload = json.loads(rank_file(path, source).read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint {path}: unreadable {rank_file(path, source).name} ({e})") from None
    missing = stateful.keys() - payload["stateful"].keys()
    if missing:
        raise CheckpointError(f"checkpoint {path} has no state for {sorted(missing)} (saved: "
                              f"{sorted(payload['stateful'])})")
    for key, obj in stateful.items():
        obj.load_state_dict(payload["stateful"][key])
    set_rng_state(payload["rng"])
    return int(payload["step"])
