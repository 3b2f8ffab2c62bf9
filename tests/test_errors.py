"""Bad input gets a clear error: the right exception type, a message naming the module or
parameter and the fix, and never a hang or a silently wrong answer.

Every case runs on real gloo ranks (2 unless stated). The check itself happens inside
the rank function with ``pytest.raises(..., match=...)``, so each rank verifies its own
error; the rank returns the message and the test asserts on what came back. Where
torch's own ``fully_shard`` deliberately raises for the same input (not an accidental
``AttributeError``), the rank also checks that shardwise raises the same exception type;
shardwise's messages may say more than torch's.

Each ``_name`` function runs inside the ranks (module level, so it pickles by reference);
each ``test_`` function runs in pytest. The test that lets the ranks fail (and so throws
the pool away) comes last.
"""

from __future__ import annotations

import copy
import gc
import re
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor, Shard

import shardwise
from shardwise import MixedPrecisionPolicy
from shardwise.testing import RankFailure, pool_pids, run_on_ranks

TIMEOUT_S = 60.0


def _raises(exc: type[BaseException], match: str | None, fn, *args, **kwargs) -> str:
    """Call ``fn`` expecting ``exc`` whose message matches ``match``; return the message."""
    with pytest.raises(exc, match=match) as info:
        fn(*args, **kwargs)
    return str(info.value)


# -- models -------------------------------------------------------------------------


class Scaled(nn.Module):
    """A Linear times a learnable 0-d scale."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.scale = nn.Parameter(torch.tensor(1.0))

    def forward(self, x):
        return self.lin(x) * self.scale


class TiedLM(nn.Module):
    """Embedding and output projection sharing one (8, 4) weight."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(8, 4)
        self.out = nn.Linear(4, 8, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, tokens):
        return self.out(self.emb(tokens))


class TwoLayers(nn.Module):
    def __init__(self, out_features: int = 4, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.body = nn.Linear(8, 8)
        self.proj = nn.Linear(8, out_features, dtype=dtype)

    def forward(self, x):
        return self.proj(self.body(x).to(self.proj.weight.dtype))


def _shard_two_layers(model: nn.Module, shard) -> nn.Module:
    shard(model.proj)
    shard(model)
    return model


# -- functions that run on the ranks ------------------------------------------------


def _bad_module_argument(kind: str) -> str:
    value = {"tensor": torch.zeros(3), "int": 3, "str": "model", "list-with-int": [nn.Linear(2, 2), 7]}[kind]
    type_name = {"tensor": "Tensor", "int": "int", "str": "str", "list-with-int": "int"}[kind]
    return _raises(ValueError, rf"nn\.Module.*{type_name}", shardwise.fully_shard, value)


def _container_without_forward(kind: str) -> str:
    def build():
        if kind == "ModuleList":
            return nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)])
        return nn.ModuleDict({"a": nn.Linear(2, 2)})

    message = _raises(ValueError, rf"{kind}.*forward.*(each child|parent)", shardwise.fully_shard, build())
    _raises(ValueError, None, torch_fully_shard, build())
    return message


def _scalar_parameter() -> str:
    match = r"'scale'.*(reshape.*ignored_params|ignored_params.*reshape)"
    message = _raises(ValueError, match, shardwise.fully_shard, Scaled())
    _raises(ValueError, None, torch_fully_shard, Scaled())
    # the suggested fix works: leave the scalar unmanaged
    model = Scaled()
    shardwise.fully_shard(model, ignored_params={model.scale})
    model(torch.ones(2, 4)).sum().backward()
    assert model.scale.grad is not None and isinstance(model.lin.weight, DTensor)
    return message


def _mesh_of_wrong_type(kind: str) -> str:
    mesh = {"ProcessGroup": dist.group.WORLD, "str": "cpu"}[kind]
    return _raises(ValueError, rf"DeviceMesh.*{kind}", shardwise.fully_shard, nn.Linear(4, 4), mesh=mesh)


def _three_d_mesh() -> str:
    mesh = init_device_mesh("cpu", (2, 2, 1))
    message = _raises(ValueError, r"1D or 2D DeviceMesh.*3-D", shardwise.fully_shard, nn.Linear(4, 4), mesh=mesh)
    _raises(ValueError, None, torch_fully_shard, nn.Linear(4, 4), mesh=mesh)
    return message


def _two_d_mesh_without_names() -> str:
    mesh = init_device_mesh("cpu", (2, 2))
    match = r"2-D mesh without dim names.*mesh_dim_names"
    return _raises(ValueError, match, shardwise.fully_shard, nn.Linear(4, 4), mesh=mesh)


def _reshard_after_forward_rejected(value) -> str:
    match = rf"reshard_after_forward.*{re.escape(str(value))}"
    message = _raises(ValueError, match, shardwise.fully_shard, nn.Linear(4, 4), reshard_after_forward=value)
    _raises(ValueError, None, torch_fully_shard, nn.Linear(4, 4), reshard_after_forward=value)
    return message


def _shared_param_in_two_groups() -> str:
    model = TiedLM()
    shardwise.fully_shard(model.emb)
    shardwise.fully_shard(model)  # no error yet: FQNs are known only at the first forward
    tokens = torch.tensor([[1, 2, 3]])
    match = r"('out\.weight'.*'emb\.weight'|'emb\.weight'.*'out\.weight')"
    message = _raises(ValueError, match, model, tokens)
    reference = TiedLM()
    torch_fully_shard(reference.emb)
    torch_fully_shard(reference)
    _raises(ValueError, None, reference, tokens)
    return message


def _layer_by_layer_with_gc(num_layers: int) -> dict:
    """Shard fresh layers one at a time with gc in between; compare with a plain model."""
    torch.manual_seed(0)
    model, reference, original_ids = nn.Sequential(), nn.Sequential(), []
    gc.freeze()  # older objects out of gc's sight: a full collection costs ~1 s with torch loaded
    try:
        for _ in range(num_layers):
            layer = nn.Linear(8, 8)
            reference.append(copy.deepcopy(layer))
            original_ids += [id(p) for p in layer.parameters()]
            shardwise.fully_shard(layer)
            model.append(layer)
            del layer
            gc.collect()
    finally:
        gc.unfreeze()
    shardwise.fully_shard(model)
    x = torch.randn(4, 8)  # same on every rank (same seed): the mean gradient is the local one
    out = model(x)
    out.sum().backward()
    expected = reference(x)
    expected.sum().backward()
    torch.testing.assert_close(out, expected)
    for (name, p), ref in zip(model.named_parameters(), reference.parameters()):
        assert isinstance(p.grad, DTensor), name
        torch.testing.assert_close(p.grad.full_tensor(), ref.grad, msg=name)
    # CPython usually hands a freed parameter's address to a later layer's parameter (a few
    # reuses per run): the case an id-keyed "already sharded" registry would misreport
    return {"ids_reused": len(original_ids) - len(set(original_ids)), "params": len(original_ids)}


def _non_root_forward_first() -> str:
    x = torch.ones(2, 8)
    model = _shard_two_layers(TwoLayers(), shardwise.fully_shard)
    model.proj(x)
    message = _raises(RuntimeError, r"root module first.*Linear", model, x)
    reference = _shard_two_layers(TwoLayers(), torch_fully_shard)
    reference.proj(x)
    _raises(RuntimeError, None, reference, x)
    return message


def _ranks_disagree_model(kind: str) -> nn.Module:
    """Rank 0 builds the standard model; rank 1 differs in ``kind``."""
    if dist.get_rank() == 0 or kind == "same":
        return TwoLayers()
    if kind == "shape":
        return TwoLayers(out_features=5)
    return TwoLayers(dtype=torch.float64)


def _ranks_disagree(kind: str) -> str:
    model = _shard_two_layers(_ranks_disagree_model(kind), shardwise.fully_shard)
    return _raises(ValueError, r"ranks disagree.*'proj\.weight'", model, torch.ones(2, 8))


def _ranks_disagree_uncaught(kind: str) -> None:
    model = _shard_two_layers(_ranks_disagree_model(kind), shardwise.fully_shard)
    model(torch.ones(2, 8))


def _policy_of_wrong_type(argument: str) -> str:
    kwargs = {"mp_policy": {"mp_policy": "bf16"}, "offload_policy": {"offload_policy": True}}[argument]
    return _raises(TypeError, rf"{argument}.*Policy", shardwise.fully_shard, nn.Linear(4, 4), **kwargs)


def _integer_mixed_precision(field: str) -> str:
    return _raises(ValueError, rf"{field}.*floating.*int32", MixedPrecisionPolicy, **{field: torch.int32})


def _uneven_shard_placement() -> str:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(3, 4))  # weights (4, 4) and (4, 3)

    def placement(param):
        return Shard(1) if param.dim() == 2 else None

    match = r"Shard\(1\).*1\.weight.*\(4, 3\).*divide"
    # torch raises NotImplementedError for uneven Shard(d != 0); shardwise matches the type.
    return _raises(NotImplementedError, match, shardwise.fully_shard, model, shard_placement_fn=placement)


def _fully_shard_twice() -> str:
    layer = nn.Linear(4, 4)
    shardwise.fully_shard(layer)
    return _raises(ValueError, r"already applied.*Linear", shardwise.fully_shard, layer)


def _prefetch_non_fsdp_module(setter: str) -> str:
    sharded = shardwise.fully_shard(nn.Linear(2, 2))
    message = _raises(ValueError, rf"{setter}.*FSDPModule.*Linear", getattr(sharded, setter), [nn.Linear(2, 2)])
    reference = torch_fully_shard(nn.Linear(2, 2))
    _raises(ValueError, None, getattr(reference, setter), [nn.Linear(2, 2)])
    return message


def _deepcopy_sharded(after_forward: bool) -> str:
    model = _shard_two_layers(TwoLayers(), shardwise.fully_shard)
    if after_forward:
        model(torch.ones(2, 8)).sum().backward()
    return _raises(RuntimeError, r"deepcopy.*TwoLayers|TwoLayers.*deepcopy", copy.deepcopy, model)


# -- tests: fully_shard's arguments -------------------------------------------------


@pytest.mark.parametrize("kind", ["tensor", "int", "str", "list-with-int"])
def test_non_module_is_a_value_error_naming_the_type(kind):
    messages = run_on_ranks(_bad_module_argument, 2, kind, timeout=TIMEOUT_S)

    assert len(set(messages)) == 1, messages


@pytest.mark.parametrize("kind", ["ModuleList", "ModuleDict"])
def test_container_without_forward_is_a_value_error_saying_what_to_shard(kind):
    messages = run_on_ranks(_container_without_forward, 2, kind, timeout=TIMEOUT_S)

    assert all("forward" in m for m in messages), messages


def test_scalar_parameter_is_a_value_error_naming_it_and_ignoring_it_works():
    messages = run_on_ranks(_scalar_parameter, 2, timeout=TIMEOUT_S)

    assert all("'scale'" in m for m in messages), messages


@pytest.mark.parametrize("kind", ["ProcessGroup", "str"])
def test_mesh_that_is_not_a_device_mesh_is_a_value_error(kind):
    messages = run_on_ranks(_mesh_of_wrong_type, 2, kind, timeout=TIMEOUT_S)

    assert all(kind in m for m in messages), messages


@pytest.mark.parametrize("value", ["yes", 1.5])
def test_reshard_after_forward_of_wrong_type_is_a_value_error(value):
    messages = run_on_ranks(_reshard_after_forward_rejected, 2, value, timeout=TIMEOUT_S)

    assert all(repr(value) in m or str(value) in m for m in messages), messages


@pytest.mark.parametrize("kind", ["mp_policy", "offload_policy"])
def test_policy_of_wrong_type_is_a_type_error(kind):
    messages = run_on_ranks(_policy_of_wrong_type, 2, kind, timeout=TIMEOUT_S)

    assert all(kind in m for m in messages), messages


@pytest.mark.parametrize("field", ["param_dtype", "reduce_dtype"])
def test_integer_mixed_precision_dtype_is_a_value_error(field):
    messages = run_on_ranks(_integer_mixed_precision, 2, field, timeout=TIMEOUT_S)

    assert all("torch.int32" in m for m in messages), messages


def test_uneven_shard_placement_is_not_implemented_naming_the_parameter():
    messages = run_on_ranks(_uneven_shard_placement, 2, timeout=TIMEOUT_S)

    assert all("1.weight" in m and "(4, 3)" in m for m in messages), messages


def test_fully_shard_twice_is_a_value_error():
    messages = run_on_ranks(_fully_shard_twice, 2, timeout=TIMEOUT_S)

    assert all("already applied" in m for m in messages), messages


@pytest.mark.parametrize("setter", ["set_modules_to_forward_prefetch", "set_modules_to_backward_prefetch"])
def test_prefetch_of_a_non_fsdp_module_is_a_value_error(setter):
    messages = run_on_ranks(_prefetch_non_fsdp_module, 2, setter, timeout=TIMEOUT_S)

    assert all(setter in m for m in messages), messages


@pytest.mark.parametrize("after_forward", [False, True], ids=["fresh", "after-step"])
def test_deepcopy_of_a_sharded_module_is_a_runtime_error(after_forward):
    messages = run_on_ranks(_deepcopy_sharded, 2, after_forward, timeout=TIMEOUT_S)

    assert all("deepcopy" in m for m in messages), messages


# -- tests: the first forward -------------------------------------------------------


def test_param_shared_by_two_groups_is_a_value_error_at_first_forward_naming_both():
    messages = run_on_ranks(_shared_param_in_two_groups, 2, timeout=TIMEOUT_S)

    assert all("'emb.weight'" in m and "'out.weight'" in m for m in messages), messages


def test_layer_by_layer_sharding_with_gc_is_no_false_positive():
    reports = run_on_ranks(_layer_by_layer_with_gc, 2, 20, timeout=TIMEOUT_S)

    assert [r["params"] for r in reports] == [40, 40]


def test_non_root_forward_first_is_a_runtime_error_saying_run_the_root():
    messages = run_on_ranks(_non_root_forward_first, 2, timeout=TIMEOUT_S)

    assert all("first" in m for m in messages), messages


@pytest.mark.parametrize(
    "kind,mine,theirs",
    [("shape", "(4, 8)", "(5, 8)"), ("dtype", "torch.float32", "torch.float64")],
)
def test_ranks_that_disagree_get_a_value_error_on_every_rank(kind, mine, theirs):
    pool_pids(2)  # start the ranks first: only the check itself is timed
    start = time.monotonic()
    messages = run_on_ranks(_ranks_disagree, 2, kind, timeout=TIMEOUT_S)

    assert time.monotonic() - start < 10, "the check must not wait for a timeout"
    for rank, message in enumerate(messages):
        assert mine in message and theirs in message, (rank, message)
        assert f"rank {rank}" in message and f"rank {1 - rank}" in message, (rank, message)


def test_ranks_that_agree_pass_the_check():
    run_on_ranks(_ranks_disagree_uncaught, 2, "same", timeout=TIMEOUT_S)


# -- tests on 4 ranks ---------------------------------------------------------------


def test_three_d_mesh_is_a_value_error():
    # (2, 2, 1) on 4 ranks is as 3-D as (2, 2, 2) on 8, and 8 spawned ranks cost ~20 s here
    messages = run_on_ranks(_three_d_mesh, 4, timeout=TIMEOUT_S)

    assert all("3-D" in m for m in messages), messages


def test_two_d_mesh_without_dim_names_is_a_value_error_saying_to_name_them():
    messages = run_on_ranks(_two_d_mesh_without_names, 4, timeout=TIMEOUT_S)

    assert all("mesh_dim_names" in m for m in messages), messages


@pytest.mark.parametrize("value", [3, 0, -2, 8])
def test_reshard_after_forward_int_not_dividing_the_shard_size_is_a_value_error(value):
    messages = run_on_ranks(_reshard_after_forward_rejected, 4, value, timeout=TIMEOUT_S)

    assert all(str(value) in m for m in messages), messages


# -- a test that lets the ranks fail (kept last: it throws the pool away) -----------


def test_ranks_that_disagree_all_fail_and_none_hangs():
    pool_pids(2)
    start = time.monotonic()
    with pytest.raises(RankFailure) as info:
        run_on_ranks(_ranks_disagree_uncaught, 2, "shape", timeout=TIMEOUT_S)

    assert time.monotonic() - start < 10, "a failed rank must not leave its peer waiting"
    assert set(info.value.tracebacks) == {0, 1} and not info.value.stacks, str(info.value)
    for rank, trace in info.value.tracebacks.items():
        assert "ValueError: ranks disagree" in trace and "'proj.weight'" in trace, (rank, trace)
