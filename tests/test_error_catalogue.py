"""The catalogue of bad inputs: each one raises a short error naming the module or
parameter and the fix (issue #16). docs/errors.md lists these together with the cases of
tests/test_errors.py and tests/test_faults.py.

Every case runs on 2 real gloo ranks, all of them in one call (the ranks return each
case's exception type and message, and each parametrized test checks one case), so the
whole catalogue costs one round trip to the warm pool.
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard

import shardwise
import shardwise.faults
from shardwise import MixedPrecisionPolicy
from shardwise.testing import run_on_ranks

TIMEOUT_S = 60.0
MAX_MESSAGE = 600  # characters: an error is a sentence or three, never a data dump


class Pair(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x):
        return self.b(self.a(x))


class TwoDtypes(Pair):
    def __init__(self):
        super().__init__()
        self.b = nn.Linear(4, 4, dtype=torch.float64)


def _sharded(model: nn.Module, *blocks: str) -> nn.Module:
    for name in blocks:
        shardwise.fully_shard(getattr(model, name))
    return shardwise.fully_shard(model)


def _optimizer_before_fully_shard():
    model = Pair()
    optim = torch.optim.AdamW(model.parameters())
    _sharded(model, "a")
    model(torch.ones(2, 4)).sum().backward()
    optim.step()


def _fully_shard_after_optimizer_stepped():
    model = Pair()
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.ones(2, 4)).sum().backward()
    optim.step()  # fine: nothing sharded yet
    _sharded(model, "a")
    model(torch.ones(2, 4)).sum().backward()
    optim.step()


def _module_shared_by_two_blocks():
    model, shared = Pair(), nn.Linear(4, 4)
    model.a.shared, model.b.shared = shared, shared  # one submodule inside two fully_shard blocks
    _sharded(model, "a", "b")(torch.ones(2, 4))


def _forward_on_meta():
    with torch.device("meta"):
        model = Pair()
    _sharded(model, "a")(torch.ones(2, 4))


def _grouped_root():
    model = Pair()
    shardwise.fully_shard([model.a, model.b])
    model.a(torch.ones(2, 4))


def _reset_iter_state_on_a_child():
    model = _sharded(Pair(), "a")
    model(torch.ones(2, 4))
    model.a.reset_iter_state()


def _ranks_seeded_differently():
    shardwise.faults.configure(check_init=True)
    try:
        torch.manual_seed(dist.get_rank())
        shardwise.fully_shard(nn.Linear(4, 4))
    finally:
        shardwise.faults.configure(check_init=False)


def _setter(name: str, value):
    def call():
        getattr(_sharded(Pair(), "a"), name)(value)

    return call


def _fully_shard(module=None, mesh_on=None, **kwargs):
    """fully_shard a fresh module; ``mesh_on``: a 2-rank DeviceMesh of that device type."""

    def call():
        if mesh_on is not None:
            kwargs["mesh"] = DeviceMesh(mesh_on, [0, 1])
        return shardwise.fully_shard(nn.Linear(4, 4) if module is None else module(), **kwargs)

    return call


def _replicate_after_fully_shard():
    shardwise.replicate(shardwise.fully_shard(nn.Linear(4, 4)))


def _fully_shard_after_replicate():
    shardwise.fully_shard(shardwise.replicate(nn.Linear(4, 4)))


# id -> (what the user did, exception, regex the message must match)
CASES = {
    "module-is-a-big-tensor": (lambda: shardwise.fully_shard(torch.zeros(1000, 1000)), ValueError, r"nn\.Module.*Tensor of shape \(1000, 1000\)"),
    "module-is-none": (lambda: shardwise.fully_shard(None), ValueError, r"nn\.Module.*NoneType"),
    "module-is-a-dict": (lambda: shardwise.fully_shard({"a": nn.Linear(2, 2)}), ValueError, r"nn\.Module.*dict"),
    "module-list-is-empty": (lambda: shardwise.fully_shard([]), ValueError, r"empty list"),
    "replicate-a-tensor": (lambda: shardwise.replicate(torch.zeros(3, 3)), ValueError, r"nn\.Module.*Tensor of shape \(3, 3\)"),
    "mesh-on-meta": (_fully_shard(mesh_on="meta"), ValueError, r"'meta' device.*'cpu' or 'cuda'"),
    "mesh-on-missing-accelerator": (_fully_shard(mesh_on="xpu"), ValueError, r"'xpu'.*cannot use"),
    "replicate-mesh-on-meta": (lambda: shardwise.replicate(nn.Linear(4, 4), mesh=DeviceMesh("meta", [0, 1])), ValueError, r"replicate.*'meta' device"),
    "mesh-is-a-torch-device": (_fully_shard(mesh=torch.device("cpu")), ValueError, r"DeviceMesh.*device.*init_device_mesh"),
    "reshard-int-not-dividing-2": (_fully_shard(reshard_after_forward=3), ValueError, r"reshard_after_forward=3 must divide the shard group size 2"),
    "ignored-params-of-ints": (_fully_shard(ignored_params=[3]), TypeError, r"ignored_params.*int"),
    "ignored-params-a-tensor": (_fully_shard(ignored_params=torch.zeros(2)), TypeError, r"ignored_params.*Tensor of shape \(2,\)"),
    "placement-not-shard": (_fully_shard(shard_placement_fn=lambda p: Replicate()), ValueError, r"Shard.* or None.*Replicate.*'weight'"),
    "placement-dim-out-of-range": (_fully_shard(shard_placement_fn=lambda p: Shard(5)), ValueError, r"2-d parameter 'weight'"),
    "dp-mesh-dims-a-string": (_fully_shard(dp_mesh_dims="dp"), TypeError, r"dp_mesh_dims.*DataParallelMeshDims"),
    "mp-dtype-a-string": (lambda: MixedPrecisionPolicy(param_dtype="bf16"), TypeError, r"param_dtype must be a torch\.dtype.*'bf16'"),
    "two-dtypes-in-one-group": (_fully_shard(TwoDtypes), NotImplementedError, r"one dtype per group.*b\.weight: torch\.float64.*separately"),
    "replicate-after-fully-shard": (_replicate_after_fully_shard, RuntimeError, r"replicate.*already managed by fully_shard"),
    "fully-shard-after-replicate": (_fully_shard_after_replicate, ValueError, r"replicate was already applied"),
    "set-reshard-after-backward-str": (_setter("set_reshard_after_backward", "x"), TypeError, r"reshard_after_backward must be a bool"),
    "set-requires-gradient-sync-str": (_setter("set_requires_gradient_sync", "x"), TypeError, r"requires_gradient_sync must be a bool"),
    "set-gradient-divide-factor-0": (_setter("set_gradient_divide_factor", 0), ValueError, r"positive number, got 0"),
    "set-custom-all-gather-int": (_setter("set_custom_all_gather", 3), TypeError, r"AllGather.*got int"),
    "set-custom-reduce-scatter-int": (_setter("set_custom_reduce_scatter", 3), TypeError, r"ReduceScatter.*got int"),
    "set-post-optim-event-int": (_setter("set_post_optim_event", 3), TypeError, r"torch\.Event( or None)?, got int"),
    "set-all-reduce-hook-int": (_setter("set_all_reduce_hook", 3), TypeError, r"callable, got int"),
    "set-is-last-backward-str": (_setter("set_is_last_backward", "x"), TypeError, r"is_last_backward must be a bool"),
    "set-requires-all-reduce-str": (_setter("set_requires_all_reduce", "x"), TypeError, r"requires_all_reduce must be a bool"),
    "optimizer-before-fully-shard": (_optimizer_before_fully_shard, RuntimeError, r"AdamW\.step\(\).*'a\.weight'.*create it after every fully_shard"),
    "fully-shard-after-optimizer-stepped": (_fully_shard_after_optimizer_stepped, RuntimeError, r"SGD\.step\(\).*'a\.weight'.*fully_shard was applied after it"),
    "module-shared-by-two-blocks": (_module_shared_by_two_blocks, ValueError, r"'shared\.weight'.*already sharded.*as 'shared\.weight'.*two fully_shard-ed modules.*shared module itself"),
    "forward-with-meta-params": (_forward_on_meta, RuntimeError, r"meta device.*to_empty"),
    "grouped-call-as-root": (_grouped_root, RuntimeError, r"grouped fully_shard\(\[(FSDP)?Linear, (FSDP)?Linear\]\) cannot be the root"),
    "ranks-seeded-differently": (_ranks_seeded_differently, ValueError, r"ranks initialised parameter 'weight' differently.*manual_seed"),
    "reset-iter-state-on-a-child": (_reset_iter_state_on_a_child, RuntimeError, r"reset_iter_state\(\) must be called on the root"),
}


def _run_catalogue() -> dict[str, tuple[str, str]]:
    """Every case on this rank: id -> (exception type name, message); 'no error' if none."""
    results = {}
    for case_id, (call, _, _) in CASES.items():
        try:
            call()
            results[case_id] = ("no error", "")
        except Exception as err:  # noqa: BLE001 - the test checks the type
            results[case_id] = (type(err).__name__, str(err))
    return results


@pytest.fixture(scope="module")
def catalogue() -> list[dict[str, tuple[str, str]]]:
    return run_on_ranks(_run_catalogue, 2, timeout=TIMEOUT_S)


@pytest.mark.parametrize("case_id", list(CASES))
def test_bad_input_gets_a_short_error_naming_what_and_the_fix(catalogue, case_id):
    _, exc, pattern = CASES[case_id]
    for rank, results in enumerate(catalogue):
        kind, message = results[case_id]
        assert kind == exc.__name__, (rank, kind, message)
        assert re.search(pattern, message, flags=re.S), (rank, message)
        assert len(message) < MAX_MESSAGE and "tensor(" not in message, (rank, message)
