"""FSDP2's tensor-subclass extension (``fsdp_pre_all_gather`` / ``fsdp_post_all_gather``),
each case against torch's FSDP2 on the same seed and data, bit for bit every step.

The subclasses are written here, one per shape of the contract: the 1-argument signature
with one all-gather input whose rebuilt tensor views the all-gather output (``out=`` then
checks and returns); the 5-argument signature with two inputs of different dtypes whose
rebuilt tensor has storage of its own (``out=`` writes into it), padding its inputs to the
padded shard size when sharded unevenly. Every step compares losses, parameters (type and
values), gradients, the number of ``fsdp_pre_all_gather`` calls and the bytes each rank
all-gathers by dtype (:mod:`tests._extension_helpers`).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch.distributed.fsdp import fully_shard as torch_fully_shard

import shardwise
from shardwise.testing import run_on_ranks
from tests._extension_helpers import Case, side_by_side

TIMEOUT = 120
BF16 = torch.bfloat16
CALLS = {"pre": 0, "post": 0, "post_out": 0}

_PRESERVED = {
    torch.ops.aten.detach.default, torch.ops.aten.empty_like.default, torch.ops.aten.new_zeros.default,
    torch.ops.aten.slice.Tensor, torch.ops.aten.copy_.default, torch.ops.aten.view.default,
    torch.ops.aten.as_strided.default, torch.ops.aten._to_copy.default, torch.ops.aten._pin_memory.default,
    torch.ops.aten.split.Tensor, torch.ops.aten.clone.default, torch.ops.aten.alias.default,
}


class Wrapped(torch.Tensor):
    """A wrapper subclass over a plain tensor ``_data``, kept through the ops FSDP shards
    and pads with; every other op computes on the plain data (as torchao's float8 weight)."""

    @staticmethod
    def __new__(cls, data: torch.Tensor):
        return torch.Tensor._make_wrapper_subclass(
            cls, data.size(), strides=data.stride(), storage_offset=data.storage_offset(),
            dtype=data.dtype, device=data.device, requires_grad=data.requires_grad,
        )

    def __init__(self, data: torch.Tensor):
        self._data = data

    @classmethod
    def __torch_dispatch__(cls, func, types, args, kwargs=None):
        args, kwargs = pytree.tree_map_only(Wrapped, lambda t: t._data, (args, kwargs or {}))
        out = func(*args, **kwargs)
        if func not in _PRESERVED:
            return out
        return pytree.tree_map_only(torch.Tensor, cls, out)

    def __tensor_flatten__(self):
        return ["_data"], None

    @classmethod
    def __tensor_unflatten__(cls, inner, meta, outer_size, outer_stride):
        return cls(inner["_data"])

    def __repr__(self):
        return f"{type(self).__name__}({self._data})"


class OneInput(Wrapped):
    """``fsdp_pre_all_gather(mesh)``: the data itself; rebuilt as a view of the output."""

    def fsdp_pre_all_gather(self, mesh):
        CALLS["pre"] += 1
        return (self._data,), mesh.size()

    def fsdp_post_all_gather(self, outputs, metadata, param_dtype, *, out=None):
        (data,) = outputs
        assert metadata in (2, 4), metadata  # the shard mesh's size
        if out is not None:
            CALLS["post_out"] += 1
            if data.dtype == param_dtype:  # the rebuilt tensor views the output: nothing to do
                assert out.untyped_storage().data_ptr() == data.untyped_storage().data_ptr(), "out= must view it"
            else:
                _refill(out, data)
            return
        CALLS["post"] += 1
        rebuilt = data if data.dtype == param_dtype else data.to(param_dtype)
        return rebuilt, (rebuilt,)


class TwoInputs(Wrapped):
    """``fsdp_pre_all_gather(mesh, outer_size, outer_stride, module, mp_policy)``: a bf16
    part and its fp32 remainder (two inputs of different dtypes, padded to the padded
    shard size); rebuilt exactly, in ``param_dtype``, into storage of its own."""

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        CALLS["pre"] += 1
        assert isinstance(module, nn.Module) and outer_stride[-1] == 1, (module, outer_stride)
        rows = -(-outer_size[0] // mesh.size())
        data = F.pad(self._data, (0, 0, 0, rows - self._data.size(0)))
        high = data.to(BF16)
        return (high, data - high.float()), (outer_size, mp_policy.param_dtype)

    def fsdp_post_all_gather(self, outputs, metadata, param_dtype, *, out=None):
        high, low = outputs
        outer_size, policy_dtype = metadata
        assert param_dtype == (policy_dtype or torch.float32), (param_dtype, policy_dtype)
        full = (high.float() + low)[: outer_size[0]].to(param_dtype)
        if out is not None:
            CALLS["post_out"] += 1
            _refill(out, full)
            return
        CALLS["post"] += 1
        return full, (full,)


def _refill(out: torch.Tensor, data: torch.Tensor) -> None:
    """Write the rebuilt values into ``out``: the same parameter again, so autograd's saved
    references to it stay valid (as torchao's subclasses write through inner tensors)."""
    with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(out):
        out.copy_(data)


class Net(nn.Module):
    """Two subclass-weight Linears, a ReLU between them; ``chained``: none, so the second
    unit's input is the first unit's output (its post-backward a pre-hook on that node)."""

    def __init__(self, kind: type, rows: int = 16, chained: bool = False):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(8, rows, bias=False), nn.Linear(rows, 8)])
        for layer in self.layers:
            layer.weight = nn.Parameter(kind(layer.weight.detach().clone()))
        self.chained = chained

    def forward(self, x):
        h = self.layers[0](x)
        return self.layers[1](h if self.chained else torch.relu(h))


def _case(kind: type, rows: int = 16, chained: bool = False, **kwargs) -> Case:
    return Case(
        build=lambda: Net(kind, rows, chained),
        shard_units=lambda m: list(m.layers),
        batch=lambda gen: torch.randn(4, 8, generator=gen),
        **kwargs,
    )


def _parity(kind_name: str, rows: int, kwargs: dict) -> list:
    kind = {"one": OneInput, "two": TwoInputs}[kind_name]
    ours, theirs, tallies = side_by_side(_case(kind, rows, **kwargs), lambda: CALLS["pre"])
    for name, p in ours.named_parameters():
        if name.endswith("weight"):
            assert type(p.to_local()) is kind, f"{name}: {type(p.to_local())}"
    grads = [(name, p) for name, p in ours.named_parameters() if p.grad is not None]
    assert grads, "no grads left to check after the last step"
    for name, p in grads:  # as torch's: the optimizer's DTensor ops skip a spec comparison
        assert p.grad._spec is p._spec, f"{name}: the grad's spec is not the param's own"
    sd = ours.state_dict()
    assert all(type(sd[k].to_local()) is kind for k in sd if k.endswith("weight")), "state_dict lost the subclass"
    return [(t[0].pre_all_gather_calls, dict(t[0].gathered)) for t in tallies]


@pytest.mark.parametrize(
    "kind_name,rows,kwargs",
    [
        ("one", 16, {}),
        ("one", 16, {"reshard_after_forward": False}),
        ("one", 16, {"param_dtype": BF16, "reduce_dtype": torch.float32}),
        ("two", 16, {}),
        ("two", 15, {}),  # uneven: rank 1's shard is padded, the 5-arg signature returns padded inputs
        ("two", 15, {"param_dtype": BF16, "reduce_dtype": torch.float32}),
        ("one", 16, {"chained": True}),
        ("two", 15, {"chained": True}),
    ],
    ids=[
        "one_input", "one_input_keep", "one_input_bf16", "two_inputs", "two_inputs_uneven", "two_inputs_bf16",
        "one_input_chained", "two_inputs_uneven_chained",
    ],
)
def test_custom_subclass_matches_torch(kind_name, rows, kwargs):
    per_step = run_on_ranks(_parity, 2, kind_name, rows, kwargs, timeout=TIMEOUT)[0]
    assert all(calls > 0 for calls, _ in per_step), per_step  # the extension really ran


def _checkpointing_and_offload(kind_name: str) -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    kind = {"one": OneInput, "two": TwoInputs}[kind_name]

    def checkpointed():
        model = Net(kind)
        model.layers[0] = checkpoint_wrapper(model.layers[0])
        return model

    checkpointing = _case(kind)
    checkpointing.build = checkpointed
    side_by_side(checkpointing, lambda: CALLS["pre"])
    side_by_side(_case(kind, offload=True), lambda: CALLS["pre"])


def _explicit_prefetch(model: nn.Module) -> None:
    first, second = model.layers
    model.set_modules_to_forward_prefetch([first])
    first.set_modules_to_forward_prefetch([second])
    second.set_modules_to_backward_prefetch([first])


def _prefetch(kind_name: str) -> None:
    kind = {"one": OneInput, "two": TwoInputs}[kind_name]
    side_by_side(_case(kind, configure=_explicit_prefetch), lambda: CALLS["pre"])


@pytest.mark.parametrize("kind_name", ["one", "two"])
def test_custom_subclass_with_explicit_prefetch(kind_name):
    run_on_ranks(_prefetch, 2, kind_name, timeout=TIMEOUT)


@pytest.mark.parametrize("kind_name", ["one", "two"])
def test_custom_subclass_with_checkpointing_and_offload(kind_name):
    run_on_ranks(_checkpointing_and_offload, 2, kind_name, timeout=TIMEOUT)


def _hsdp() -> None:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    for kind in (OneInput, TwoInputs):
        side_by_side(_case(kind, 16, shard_kwargs={"mesh": mesh}), lambda: CALLS["pre"])


def test_custom_subclass_hsdp_matches_torch():
    run_on_ranks(_hsdp, 4, timeout=TIMEOUT)


def _int_reshard() -> None:
    for fully_shard in (torch_fully_shard, shardwise.fully_shard):
        torch.manual_seed(0)
        model = Net(OneInput)
        for layer in model.layers:
            fully_shard(layer, reshard_after_forward=2)
        fully_shard(model, reshard_after_forward=2)
        with pytest.raises(NotImplementedError):
            model(torch.randn(4, 8)).sum().backward()


def test_int_reshard_after_forward_is_refused_like_torch():
    """torch's FSDP2 has no post-forward shard for an extension param: both raise."""
    run_on_ranks(_int_reshard, 4, timeout=TIMEOUT)


class Unchunkable(torch.Tensor):
    """A subclass without the extension whose dispatch knows no aten.split/slice."""

    @staticmethod
    def __new__(cls, data):
        return torch.Tensor._make_wrapper_subclass(cls, data.size(), dtype=data.dtype, device=data.device)

    def __init__(self, data):
        self._data = data

    @classmethod
    def __torch_dispatch__(cls, func, types, args, kwargs=None):
        if func is torch.ops.aten.detach.default:
            return cls(args[0]._data)
        raise NotImplementedError(f"Unchunkable: {func}")


class HalfExtension(Wrapped):
    def fsdp_pre_all_gather(self, mesh):
        return (self._data,), None


def _refused() -> None:
    model = nn.Linear(4, 4)
    model.weight = nn.Parameter(Unchunkable(torch.randn(4, 4)), requires_grad=False)
    with pytest.raises(TypeError, match=r"'weight' of Linear.*Unchunkable.*torch.chunk.*ignored_params"):
        shardwise.fully_shard(model)
    model = nn.Linear(4, 4)
    model.weight = nn.Parameter(HalfExtension(torch.randn(4, 4)))
    with pytest.raises(TypeError, match=r"'weight' of Linear.*HalfExtension.*fsdp_post_all_gather"):
        shardwise.fully_shard(model)


def test_subclass_that_cannot_be_sharded_is_refused_by_name():
    run_on_ranks(_refused, 2, timeout=TIMEOUT)
