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
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import Replicate, Shard

import shardwise
import shardwise.faults
from shardwise import MixedPrecisionPolicy
from shardwise.errors import InvalidUsageError
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


def _plain_parameter_assigned_after_fully_shard():
    model = _sharded(Pair(), "a")
    model.b.weight = nn.Parameter(torch.ones(4, 4))  # full and plain: not a shard of anything
    model(torch.ones(2, 4))


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
    "placement-dim-out-of-range": (_fully_shard(shard_placement_fn=lambda p: Shard(5)), InvalidUsageError, r"2-d parameter 'weight'"),
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
    "plain-parameter-assigned-after-fully-shard": (
        _plain_parameter_assigned_after_fully_shard, ValueError,
        r"'b\.weight'.*replaced by a plain Parameter of shape \(4, 4\).*assigned after fully_shard.*DTensor",
    ),
    "grouped-call-as-root": (_grouped_root, RuntimeError, r"single root module.*grouped fully_shard\(\[(FSDP)?Linear, (FSDP)?Linear\]\): it cannot be the root"),
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


# ---------------------------------------------------------------- torch's deliberate errors
#
# The inputs torch's fully_shard refuses on purpose, run through torch's fully_shard and
# shardwise's in the same ranks: both must raise torch's exception type with torch's phrase
# (shardwise's message goes on to say what to do). shardwise's type may be a class deriving
# from both torch's and its own (shardwise.errors), so `except ValueError` keeps working.


class _WithScalar(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.scalar_p = nn.Parameter(torch.tensor(2.0))

    def forward(self, x):
        return self.lin(x) * self.scalar_p


def _twice(fully_shard_fn):
    module = nn.Linear(4, 4)
    fully_shard_fn(module)
    fully_shard_fn(module)


def _deepcopy(fully_shard_fn):
    import copy

    copy.deepcopy(fully_shard_fn(nn.Linear(4, 4)))


def _forward_with_meta_params(fully_shard_fn):
    with torch.device("meta"):
        model = Pair()
    fully_shard_fn(model.a)
    fully_shard_fn(model)
    model(torch.ones(2, 4))


def _grouped_call_as_root(fully_shard_fn):
    model = Pair()
    fully_shard_fn([model.a, model.b])
    model.a(torch.ones(2, 4))


def _child_forward_before_root(fully_shard_fn):
    model = Pair()
    fully_shard_fn(model.a)
    fully_shard_fn(model)
    model.a(torch.ones(2, 4))
    model(torch.ones(2, 4))


def _hook_stream_on_hsdp(fully_shard_fn):
    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("replicate", "shard"))
    fully_shard_fn(nn.Linear(4, 4), mesh=mesh).set_all_reduce_hook(lambda reduced: None, stream=torch.cpu.Stream())


def _on_mesh(shape: tuple[int, ...], names: tuple[str, ...] | None = None):
    return lambda fully_shard_fn: fully_shard_fn(nn.Linear(4, 4), mesh=init_device_mesh("cpu", shape, mesh_dim_names=names))


def _placed(placement_fn, module=lambda: nn.Linear(4, 4)):
    return lambda fully_shard_fn: fully_shard_fn(module(), shard_placement_fn=placement_fn)


META_PHRASE = (
    "FSDP parameters should be materialized from meta device before training, but the following were still on "
    "meta device: "
)

# id -> (what the user did, with fully_shard_fn; torch's exception type; torch's phrase)
TORCH_CASES = {
    "applied-twice": (_twice, AssertionError, "Each distinct composable distributed API can only be applied to a module once."),
    "deepcopy": (_deepcopy, AssertionError, "FSDP does not support deepcopy"),
    "2d-mesh-without-names": (_on_mesh((1, 2)), AssertionError, "Please init the 2D mesh for HSDP with mesh_dim_names specified"),
    "3d-mesh": (_on_mesh((1, 1, 2)), ValueError, "fully_shard expects a 1D or 2D DeviceMesh but got DeviceMesh"),
    "0-d-parameter": (lambda fs: fs(_WithScalar()), ValueError, "Change scalar_p to a 1D tensor with numel equal to 1."),
    "shard-dim-past-a-1d-param": (_placed(lambda p: Shard(1)), AssertionError, "Shard dim 1 is invalid for 1D tensor"),
    "uneven-shard-1": (
        _placed(lambda p: Shard(1) if p.dim() == 2 else None, lambda: nn.Linear(3, 4)),
        NotImplementedError, "FSDP does not support uneven sharding on dim 1",
    ),
    "forward-with-meta-params": (_forward_with_meta_params, RuntimeError, META_PHRASE),
    "container-without-forward": (
        lambda fs: fs(nn.ModuleList([nn.Linear(2, 2)])), ValueError,
        "fully_shard does not support containers that do not implement forward",
    ),
    "grouped-call-as-root": (_grouped_call_as_root, RuntimeError, "FSDP requires a single root module but got "),
    "child-forward-before-root": (
        _child_forward_before_root, RuntimeError,
        "FSDP state has already been lazily initialized for a\nFSDP requires running forward through the root module first",
    ),
    "hook-stream-on-native-hsdp": (_hook_stream_on_hsdp, ValueError, "stream cannot be set when using native HSDP"),
}
EXACT = {"hook-stream-on-native-hsdp"}  # torch's own test compares the whole message: no advice added


def _raised(call, fully_shard_fn, expected: type) -> tuple[str, bool, str]:
    """(type name, whether it is an instance of ``expected``, message) of what ``call`` raised."""
    try:
        call(fully_shard_fn)
    except Exception as err:  # noqa: BLE001 - the test checks the type
        return type(err).__name__, isinstance(err, expected), str(err)
    return "no error", False, ""


def _run_torch_catalogue() -> dict[str, dict[str, tuple[str, bool, str]]]:
    """Every case on this rank, through torch's fully_shard and through shardwise's."""
    return {
        case_id: {
            "torch": _raised(call, torch_fully_shard, expected),
            "shardwise": _raised(call, shardwise.fully_shard, expected),
        }
        for case_id, (call, expected, _) in TORCH_CASES.items()
    }


@pytest.fixture(scope="module")
def torch_catalogue() -> list[dict]:
    return run_on_ranks(_run_torch_catalogue, 2, timeout=TIMEOUT_S)


@pytest.mark.parametrize("case_id", list(TORCH_CASES))
def test_torch_error_is_raised_with_torchs_type_and_phrase(torch_catalogue, case_id):
    _, expected, phrase = TORCH_CASES[case_id]
    for rank, results in enumerate(torch_catalogue):
        for impl in ("torch", "shardwise"):
            kind, is_expected, message = results[case_id][impl]
            assert is_expected, (rank, impl, f"{kind} is not a {expected.__name__}", message)
            assert phrase in message, (rank, impl, message)
        kind, _, message = results[case_id]["shardwise"]
        assert len(message) < MAX_MESSAGE and "tensor(" not in message, (rank, message)
        if case_id in EXACT:
            assert message == phrase, (rank, message)
        else:
            assert len(message) > len(phrase) + 20, f"shardwise's message should go on to say what to do: {message}"
