"""The checkpoint matrix: save in one layout and world size, load in another, train on.

Every source trains ``STEPS`` Adam steps on slices of one global batch per step, saves
model and optimizer with ``torch.distributed.checkpoint`` (through ``get_state_dict``), writes
the full state dicts as the expected values, then trains two more steps: the
uninterrupted run. Each load builds a fresh model (another seed) in its own layout and
world size, loads, and must hold every model and optimizer tensor bit-equal to the saved
ones; its next two losses must equal the uninterrupted run's: bit-equal at the same
world size and data-parallel layout, within fp32 reduction tolerance otherwise.

Sources (N ranks) -> loads (M ranks):

- DCP N -> M resharding: 2 -> 4, 4 -> 2, 2 -> 1, 1 -> 2 (and 2 -> 2, exact);
- layouts: FSDP <-> HSDP, ``fully_shard`` <-> ``replicate``, 2-D TP + FSDP -> 1-D FSDP;
- mixed precision -> mixed precision with CPU offload;
- a model sharded on the meta device, loaded with ``set_model_state_dict(...,
  StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))``;
- the full state dict as safetensors, loaded with ``set_model_state_dict(full_state_dict=True)``.

The save runs in one ``run_on_ranks`` call of N ranks, the load in another of M.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)

import shardwise
from _state_dict_helpers import TIMEOUT, assert_equal, build, make_optimizer, shard, train_step
from shardwise.testing import run_on_ranks

STEPS = 2
AFTER = 2  # steps compared after the load
BF16 = shardwise.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)

# name: (model kind, layout, fully_shard kwargs, world size)
SOURCES = {
    "fsdp2": ("plain", "fsdp", {}, 2),
    "replicate2": ("plain", "replicate", {}, 2),
    "mp2": ("plain", "fsdp", {"mp_policy": BF16}, 2),
    "fsdp1": ("plain", "fsdp", {}, 1),
    "fsdp4": ("plain", "fsdp", {}, 4),
    "hsdp4": ("plain", "hsdp", {}, 4),
    "tp_fsdp4": ("tp", "tp_fsdp", {}, 4),
}


# ---------------------------------------------------------------- on the ranks


def _save(names: list[str], root: str) -> dict[str, list[float]]:
    """Train, save (DCP + the expected full state dicts), train on: the uninterrupted losses."""
    losses = {}
    for name in names:
        kind, layout_name, kwargs, _ = SOURCES[name]
        model = build(kind)
        layout = shard(model, layout_name, **dict(kwargs))
        opt = make_optimizer(model)
        for step in range(STEPS):
            train_step(model, opt, step, layout)
        model_sd, optim_sd = get_state_dict(model, opt)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=f"{root}/{name}")
        expected = _full_state_dicts(model, opt)
        if dist.get_rank() == 0:
            torch.save(expected, f"{root}/{name}.expected.pt")
            if name == "fsdp2":
                from safetensors.torch import save_file

                save_file(expected["model"], f"{root}/{name}.safetensors")
        losses[name] = [train_step(model, opt, STEPS + i, layout) for i in range(AFTER)]
    return losses


def _load(cases: list[tuple], root: str) -> dict[str, list[float]]:
    """Each case ``(source, model kind, layout, kwargs, how)``: load, compare, train on."""
    losses = {}
    for source, kind, layout_name, kwargs, how in cases:
        where = f"{source} -> {layout_name}{kwargs or ''} at {dist.get_world_size()} ranks ({how})"
        model = build(kind, seed=5, device="meta" if how == "broadcast_from_rank0" else "cpu")
        layout = shard(model, layout_name, **dict(kwargs))
        opt = _LOADERS[how](model, f"{root}/{source}")
        expected = torch.load(f"{root}/{source}.expected.pt", weights_only=True)
        got = _full_state_dicts(model, opt)
        if dist.get_rank() == 0:
            assert_equal(f"{where}: model", got["model"], expected["model"])
            _assert_optim_equal(where, got["optim"], expected["optim"])
        losses[where] = [train_step(model, opt, STEPS + i, layout) for i in range(AFTER)]
    return losses


def _full_state_dicts(model, opt) -> dict:
    """Model and optimizer as full state dicts on rank 0's CPU (empty elsewhere)."""
    return {"model": get_model_state_dict(model, options=FULL), "optim": get_optimizer_state_dict(model, opt, options=FULL)}


def _load_dcp(model, path: str) -> torch.optim.Optimizer:
    opt = make_optimizer(model)
    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return opt


def _load_full(model, path: str, source: str, broadcast: bool) -> torch.optim.Optimizer:
    """Load full state dicts; with ``broadcast`` only rank 0 reads them (the others pass {})."""
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=broadcast)
    reads = dist.get_rank() == 0 or not broadcast
    expected = torch.load(f"{path}.expected.pt", weights_only=True) if reads else {"model": {}, "optim": {}}
    if source == "safetensors":
        from safetensors.torch import load_file

        expected["model"] = load_file(f"{path}.safetensors")
    set_model_state_dict(model, expected["model"], options=options)
    opt = make_optimizer(model)  # after the load: assign=True into a meta model makes new params
    set_optimizer_state_dict(model, opt, expected["optim"], options=options)
    return opt


_LOADERS = {
    "dcp": _load_dcp,
    "broadcast_from_rank0": lambda model, path: _load_full(model, path, "expected", broadcast=True),
    "safetensors": lambda model, path: _load_full(model, path, "safetensors", broadcast=False),
}


def _assert_optim_equal(where: str, got: dict, want: dict) -> None:
    groups = [_lists(got["param_groups"]), _lists(want["param_groups"])]  # a broadcast turns tuples into lists
    assert groups[0] == groups[1], f"{where}: optimizer param_groups {groups[0]} != {groups[1]}"
    assert list(got["state"]) == list(want["state"]), f"{where}: optimizer state keys differ"
    for fqn, state in want["state"].items():
        assert_equal(f"{where}: optimizer state of {fqn}", got["state"][fqn], state)


def _lists(x):
    if isinstance(x, (list, tuple)):
        return [_lists(v) for v in x]
    return {k: _lists(v) for k, v in x.items()} if isinstance(x, dict) else x


# ---------------------------------------------------------------- tests


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Every source saved once (one call per world size); their uninterrupted losses."""
    root = str(tmp_path_factory.mktemp("checkpoints"))
    losses = {}
    for world in (2, 1, 4):
        names = [n for n, (*_, w) in SOURCES.items() if w == world]
        losses.update(run_on_ranks(_save, world, names, root, timeout=TIMEOUT)[0])
    return root, losses


def _check_losses(results: dict, cases: list[tuple], uninterrupted: dict, exact: set[str]) -> None:
    for where, case in zip(results, cases):
        source = case[0]
        want = uninterrupted[source]
        if where in exact:
            assert results[where] == want, f"{where}: next losses {results[where]} != uninterrupted {want}"
        else:
            torch.testing.assert_close(results[where], want, rtol=1e-5, atol=1e-6, msg=lambda m: f"{where}: {m}")


def _run(saved, world: int, cases: list[tuple], exact_cases: list[int]) -> None:
    root, uninterrupted = saved
    results = run_on_ranks(_load, world, cases, root, timeout=TIMEOUT)[0]
    exact = {list(results)[i] for i in exact_cases}
    _check_losses(results, cases, uninterrupted, exact)


def test_load_at_2_ranks(saved):
    cases = [
        ("fsdp2", "plain", "fsdp", {}, "dcp"),  # 2 -> 2
        ("mp2", "plain", "fsdp", {"mp_policy": BF16, "offload_policy": shardwise.CPUOffloadPolicy()}, "dcp"),
        ("fsdp4", "plain", "fsdp", {}, "dcp"),  # 4 -> 2
        ("fsdp1", "plain", "fsdp", {}, "dcp"),  # 1 -> 2
        ("hsdp4", "plain", "fsdp", {}, "dcp"),  # HSDP -> FSDP
        ("replicate2", "plain", "fsdp", {}, "dcp"),  # replicate -> fully_shard
        ("fsdp2", "plain", "replicate", {}, "dcp"),  # fully_shard -> replicate
        ("tp_fsdp4", "tp", "fsdp", {}, "dcp"),  # 2-D TP + FSDP -> 1-D FSDP
    ]
    _run(saved, 2, cases, exact_cases=[0, 1])


def test_load_at_4_ranks(saved):
    cases = [
        ("fsdp2", "plain", "fsdp", {}, "dcp"),  # 2 -> 4
        ("fsdp2", "plain", "hsdp", {}, "dcp"),  # FSDP -> HSDP
    ]
    _run(saved, 4, cases, exact_cases=[])


def test_load_at_1_rank(saved):
    _run(saved, 1, [("fsdp2", "plain", "fsdp", {}, "dcp")], exact_cases=[])  # 2 -> 1


def test_full_state_dict_loads(saved):
    cases = [
        ("fsdp2", "plain", "fsdp", {}, "broadcast_from_rank0"),  # meta init
        ("fsdp2", "plain", "fsdp", {}, "safetensors"),
    ]
    _run(saved, 2, cases, exact_cases=[0, 1])
