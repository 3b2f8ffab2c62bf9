"""The tensor-subclass extension as torch's own FSDP2 tests use it (issue #40), each case
trained side by side with torch's ``fully_shard``, bit-equal every step (losses, every
sharded parameter and gradient), on 4 thread-ranks (``init_process_group("threaded")``)
and on 2 gloo processes:

- methods set on an *instance*: after ``fully_shard`` on the meta device, ``to_empty`` and
  a ``trunc_normal_`` init, ``fsdp_pre_all_gather`` / ``fsdp_post_all_gather`` (a bf16
  all-gather) are set on each weight's sharded local tensor, a TwoTensor whose class has
  no extension and a plain tensor alike; an unevenly sharded weight's local tensor is
  padded anew when shardwise adopts it, and its methods go with it;
- a *wrapper subclass* with the methods on its class (torch's TwoTensor; and a subclass
  whose ``__tensor_flatten__`` gives inner tensors of two dtypes, so its group gathers
  bytes) built on the meta device, ``to_empty``, initialised, trained under a bf16 policy,
  with ``reshard_after_forward`` True and False, both ``fsdp_pre_all_gather`` signatures,
  CPU offload, and a state-dict round trip;
- the *mesh* the hook receives: the 1-D shard mesh on HSDP, and on a per-parameter HSDP mesh
  from ``ShardPlacementResult``, as torch passes it.
"""

from __future__ import annotations

import contextlib
import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy as TorchOffload
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMP
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_common import HSDPMeshInfo, ShardPlacementResult
from torch.distributed.tensor import Shard
from torch.testing._internal.two_tensor import TwoTensor

import shardwise
from shardwise import tensor_extension
from shardwise.testing import run_on_ranks
from _threaded_helpers import ThreadedCase
from tests._extension_helpers import assert_same_params, same_values

TIMEOUT = 120
STEPS = 3
BF16 = torch.bfloat16
SHARDWISE = (shardwise.fully_shard, shardwise.MixedPrecisionPolicy, shardwise.CPUOffloadPolicy)
TORCH = (torch_fully_shard, TorchMP, TorchOffload)


# ---------------------------------------------------------------- the tensors


def _pair_pre(self, mesh):
    return (self.a, self.b), None


def _pair_pre_with_policy(self, mesh, outer_size, outer_stride, module, mp_policy):
    return (self.a, self.b), None


def _pair_post(self, outputs, metadata, param_dtype, *, out=None):
    """TwoTensor rebuilt from its two gathered halves, cast to ``param_dtype``; ``out=``
    refills the cast copy (without a cast it views the outputs: nothing to do)."""
    a, b = outputs
    if out is not None:
        if a.dtype != param_dtype:
            out.a.copy_(a)
            out.b.copy_(b)
        return None
    return TwoTensor(a, b).to(param_dtype), (a, b)


@contextlib.contextmanager
def two_tensor_extension(pre):
    """The extension on TwoTensor's class for the block (every rank sets the same
    functions; one rank removes them once all are done)."""
    TwoTensor.fsdp_pre_all_gather, TwoTensor.fsdp_post_all_gather = pre, _pair_post
    dist.barrier()
    try:
        yield
    finally:
        dist.barrier()
        if dist.get_rank() == 0:
            del TwoTensor.fsdp_pre_all_gather, TwoTensor.fsdp_post_all_gather
        dist.barrier()


_STRUCTURAL = {
    torch.ops.aten.detach.default, torch.ops.aten.empty_like.default, torch.ops.aten.new_zeros.default,
    torch.ops.aten.new_empty.default, torch.ops.aten.slice.Tensor, torch.ops.aten.split.Tensor,
    torch.ops.aten.split_with_sizes.default, torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default,
    torch.ops.aten.as_strided.default, torch.ops.aten.clone.default, torch.ops.aten.alias.default,
    torch.ops.aten._pin_memory.default,
}


class Mixed(torch.Tensor):
    """A wrapper over ``value`` (its dtype is the tensor's) and ``coarse``, a bf16 copy kept
    in step after every in-place op: two inner tensors of two dtypes. Layout ops act on
    both and keep the type; every other op computes on ``value``. The extension gathers
    both (a group of two dtypes: bytes) and rebuilds the pair in ``param_dtype``."""

    @staticmethod
    def __new__(cls, value: torch.Tensor, coarse: torch.Tensor | None = None):
        return torch.Tensor._make_wrapper_subclass(
            cls, value.size(), strides=value.stride(), storage_offset=value.storage_offset(),
            dtype=value.dtype, device=value.device, requires_grad=value.requires_grad,
        )

    def __init__(self, value: torch.Tensor, coarse: torch.Tensor | None = None):
        self.value = value
        self.coarse = value.detach().to(BF16) if coarse is None else coarse

    @classmethod
    def __torch_dispatch__(cls, func, types, args, kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten.copy_.default:
            dst, src = args[:2]
            dst.value.copy_(src.value if isinstance(src, Mixed) else src)
            dst.coarse.copy_(src.coarse if isinstance(src, Mixed) else src)
            return dst
        if func is torch.ops.aten._to_copy.default:  # a dtype applies to the value; coarse stays bf16
            (t,) = args
            other = {k: v for k, v in kwargs.items() if k != "dtype"}
            return Mixed(func(t.value, **kwargs), func(t.coarse, **other))
        if func in _STRUCTURAL:
            values = func(*pytree.tree_map_only(Mixed, lambda t: t.value, args), **kwargs)
            coarses = func(*pytree.tree_map_only(Mixed, lambda t: t.coarse, args), **kwargs)
            if isinstance(values, (list, tuple)):
                return type(values)(Mixed(v, c) for v, c in zip(values, coarses))
            return Mixed(values, coarses)
        out = func(*pytree.tree_map_only(Mixed, lambda t: t.value, args), **kwargs)
        if func._schema.is_mutable:
            for t in pytree.tree_leaves((args, kwargs)):
                if isinstance(t, Mixed):
                    t.coarse.copy_(t.value)
        return out

    def __tensor_flatten__(self):
        return ["value", "coarse"], None

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        return Mixed(inner["value"], inner["coarse"])

    def __repr__(self):
        return f"Mixed({self.value}, {self.coarse})"

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        return (self.value, self.coarse), None

    def fsdp_post_all_gather(self, outputs, metadata, param_dtype, *, out=None):
        value, coarse = outputs
        if out is not None:
            if value.dtype != param_dtype:
                with torch.autograd._unsafe_preserve_version_counter(out):
                    out.value.copy_(value)
            return None
        rebuilt = value if value.dtype == param_dtype else value.to(param_dtype)
        return Mixed(rebuilt, coarse), (value, coarse, rebuilt)


# ---------------------------------------------------------------- the model


KINDS = {
    "plain": lambda w: w,
    "two": lambda w: TwoTensor(w, w.clone()),
    "mixed": Mixed,
}


def _blocks(weight_kinds: tuple[str, str], rows: int = 32, meta: bool = False) -> nn.Sequential:
    """Three blocks ``Linear(8, rows) -> ReLU -> Linear(rows, 8)`` without biases (torch's
    test model's shape), weights of the given kinds, the same on every rank."""
    gen = torch.Generator().manual_seed(0)
    blocks = []
    for _ in range(3):
        layers = [nn.Linear(8, rows, bias=False, device="meta"), nn.ReLU(), nn.Linear(rows, 8, bias=False, device="meta")]
        for lin, kind in zip((layers[0], layers[2]), weight_kinds):
            w = torch.empty(lin.weight.shape, device="meta") if meta else torch.randn(lin.weight.shape, generator=gen) * 0.3
            lin.weight = nn.Parameter(KINDS[kind](w))
        blocks.append(nn.Sequential(*layers))
    return nn.Sequential(*blocks)


def _shard(model: nn.Module, api, **kwargs) -> nn.Module:
    fully_shard, mp, offload = api
    if "param_dtype" in kwargs:
        kwargs["mp_policy"] = mp(param_dtype=kwargs.pop("param_dtype"))
    if kwargs.pop("offload", False):
        kwargs["offload_policy"] = offload(pin_memory=False)
    for block in model:
        fully_shard(block, **kwargs)
    return fully_shard(model, **kwargs)


def _init_locals(model: nn.Module) -> None:
    """``trunc_normal_`` on each sharded local tensor, from a per-rank generator (threads
    share torch's global one): the same values for both models."""
    gen = torch.Generator().manual_seed(1 + dist.get_rank())
    with torch.no_grad():
        for p in model.parameters():
            nn.init.trunc_normal_(p.to_local(), generator=gen)


def _train_both(ours: nn.Module, theirs: nn.Module, steps: int = STEPS) -> None:
    """Adam on both, one batch per rank and step; losses, params and grads bit-equal."""
    optims = [torch.optim.Adam(m.parameters(), lr=1e-2, foreach=True) for m in (ours, theirs)]
    gen = torch.Generator().manual_seed(100 + dist.get_rank())
    for step in range(steps):
        x = torch.randn(2, 8, generator=gen)
        losses = []
        for model in (ours, theirs):
            loss = model(x).sum()
            loss.backward()
            losses.append(loss.detach())
        where = f"step {step}, rank {dist.get_rank()}"
        assert same_values(*losses), f"{where}: losses {losses}"
        assert_same_params(ours, theirs, where, grads=True)
        for opt in optims:
            opt.step()
            opt.zero_grad(set_to_none=step % 2 == 0)
        assert_same_params(ours, theirs, f"{where}, after the step")


# ---------------------------------------------------------------- methods on an instance


def _bf16_pre(calls: list, pad: bool):
    """An instance's ``fsdp_pre_all_gather``: the shard in bf16 (padded to the padded shard
    size when ``pad``)."""

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        calls.append(mesh.size())
        shard = self.to(BF16)
        if pad:
            rows = -(-outer_size[0] // mesh.size())
            shard = F.pad(shard, (0, 0, 0, rows - shard.size(0)))
        return (shard,), None

    return fsdp_pre_all_gather


@torch.no_grad()
def _bf16_post(self, outputs, metadata, param_dtype, *, out=None):
    (gathered,) = outputs  # (N * padded rows, cols): the unsharded param views its leading rows
    if out is not None:
        with torch.autograd._unsafe_preserve_version_counter(out):
            out.copy_(gathered[: out.size(0)])
        return None
    upcast = gathered.to(param_dtype)
    return upcast, (gathered, upcast)


def _set_instance_methods(model: nn.Module, calls: list, pad: bool) -> None:
    for _, param in model.named_parameters():
        local = param._local_tensor
        local.fsdp_pre_all_gather = _bf16_pre(calls, pad).__get__(local)
        local.fsdp_post_all_gather = _bf16_post.__get__(local)


def _instance_methods(weight_kinds: tuple[str, str], rows: int) -> int:
    pad = rows % dist.get_world_size() != 0
    models, calls = [], []
    for api in (SHARDWISE, TORCH):
        model = _shard(_blocks(weight_kinds, rows, meta=True), api)
        model.to_empty(device="cpu")
        _init_locals(model)
        _set_instance_methods(model, calls, pad)  # after to_empty: the local tensors are new objects
        models.append(model)
    _train_both(*models)
    ours = calls[: len(calls) // 2]
    assert ours and calls[len(calls) // 2 :] == ours, f"rank {dist.get_rank()}: {calls}"
    return len(ours)


INSTANCE_CASES = [(("two", "two"), 32), (("plain", "two"), 32), (("plain", "plain"), 30)]
INSTANCE_IDS = ["two_tensor", "plain_and_two_tensor", "plain_uneven"]


# ---------------------------------------------------------------- methods on the class


def _class_methods(kind: str, reshard: bool, offload: bool = False) -> None:
    models = []
    for api in (SHARDWISE, TORCH):
        model = _shard(_blocks((kind, kind), meta=True), api, reshard_after_forward=reshard, param_dtype=BF16,
                       offload=offload)
        model.to_empty(device="cpu")
        _init_locals(model)
        models.append(model)
    _train_both(*models)
    _state_dict_round_trip(*models)


def _state_dict_round_trip(ours: nn.Module, theirs: nn.Module) -> None:
    """Our state dict keeps each local tensor's type and values (torch's are equal), loads
    back in place, and a step after it still matches torch."""
    sd, ref = ours.state_dict(), theirs.state_dict()
    assert sd.keys() == ref.keys()
    for k in sd:
        assert same_values(sd[k].to_local(), ref[k].to_local()), k
    ours.load_state_dict(sd)
    _train_both(ours, theirs, steps=1)


def _wrapper_subclasses(kind: str) -> None:
    if kind == "mixed":
        for reshard in (True, False):
            _class_methods("mixed", reshard)
        _class_methods("mixed", True, offload=True)
        return
    for pre in (_pair_pre, _pair_pre_with_policy):
        with two_tensor_extension(pre):
            for reshard in (True, False):
                _class_methods("two", reshard)
    with two_tensor_extension(_pair_pre):
        _class_methods("two", True, offload=True)


# ---------------------------------------------------------------- the mesh the hook receives


def _recording_pre(seen: list):
    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        seen.append((mesh.ndim, mesh.size(), mesh.mesh.tolist(), mesh.mesh_dim_names))
        return (self,), None

    return fsdp_pre_all_gather


@torch.no_grad()
def _identity_post(self, outputs, metadata, param_dtype, *, out=None):
    (gathered,) = outputs
    return None if out is not None else (gathered, (gathered,))


def _hook_mesh(per_param: bool) -> list:
    """The meshes each weight's hook saw on an HSDP (2, N/2) mesh: the call's, or each
    weight's own from ``ShardPlacementResult`` next to a 1-D call mesh."""
    world = dist.get_world_size()
    hsdp = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    if per_param:
        info = HSDPMeshInfo(mesh=hsdp, shard_mesh_dim=1, replicate_mesh_dim=0)
        flat = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
        kwargs = dict(mesh=flat, shard_placement_fn=lambda p: ShardPlacementResult(placement=Shard(0), mesh_info=info))
    else:
        kwargs = dict(mesh=hsdp)
    seen = {}
    for name, api in (("shardwise", SHARDWISE), ("torch", TORCH)):
        model = _shard(_blocks(("two", "plain")), api, **kwargs)
        seen[name] = []
        for param in model.parameters():
            local = param._local_tensor
            local.fsdp_pre_all_gather = _recording_pre(seen[name]).__get__(local)
            local.fsdp_post_all_gather = _identity_post.__get__(local)
        model(torch.randn(2, 8, generator=torch.Generator().manual_seed(dist.get_rank())))
    assert seen["shardwise"] and seen["shardwise"] == seen["torch"], seen
    assert all(ndim == 1 and size == world // 2 for ndim, size, *_ in seen["shardwise"]), seen
    return seen["shardwise"]


# ---------------------------------------------------------------- 4 thread-ranks


class TestExtensionThreaded(ThreadedCase):
    WORLD_SIZE = 4

    def test_instance_methods_after_to_empty_match_torch(self) -> None:
        for weight_kinds, rows in INSTANCE_CASES:
            _instance_methods(weight_kinds, rows)

    def test_two_tensor_class_methods_meta_init_match_torch(self) -> None:
        _wrapper_subclasses("two")

    def test_mixed_dtype_wrapper_meta_init_matches_torch(self) -> None:
        _wrapper_subclasses("mixed")

    def test_hook_receives_the_hsdp_shard_mesh_like_torch(self) -> None:
        _hook_mesh(per_param=False)
        _hook_mesh(per_param=True)


# ---------------------------------------------------------------- 2 gloo processes


@pytest.mark.parametrize("weight_kinds,rows", INSTANCE_CASES, ids=INSTANCE_IDS)
def test_instance_methods_after_to_empty_match_torch_gloo(weight_kinds, rows):
    calls = run_on_ranks(_instance_methods, 2, weight_kinds, rows, timeout=TIMEOUT)
    assert all(n > 0 for n in calls), calls


@pytest.mark.parametrize("kind", ["two", "mixed"])
def test_wrapper_subclass_meta_init_trains_like_torch_gloo(kind):
    run_on_ranks(_wrapper_subclasses, 2, kind, timeout=TIMEOUT)


# ---------------------------------------------------------------- one process


def test_wrapper_storage_is_freed_through_its_inner_tensors():
    pair = TwoTensor(torch.ones(4), torch.zeros(4))
    tensor_extension.free_storage(pair)
    assert pair.a.untyped_storage().size() == 0 and pair.b.untyped_storage().size() == 0
    tensor_extension.alloc_storage(pair)
    assert pair.a.untyped_storage().size() == 16 and pair.b.untyped_storage().size() == 16
    mixed = Mixed(torch.ones(4))
    assert [t.dtype for t in tensor_extension.storage_holders(mixed)] == [torch.float32, BF16]


def _half_set_on_an_instance() -> None:
    model = _shard(_blocks(("plain", "plain")), SHARDWISE)
    local = model[0][0].weight._local_tensor
    local.fsdp_pre_all_gather = _bf16_pre([], False).__get__(local)  # no fsdp_post_all_gather
    with pytest.raises(TypeError, match=r"parameter '0\.0\.weight' of Linear .*fsdp_post_all_gather"):
        model(torch.randn(2, 8))


def test_half_an_extension_set_on_an_instance_is_refused_by_name():
    """Found at lazy init (the first forward), named, before any collective."""
    run_on_ranks(_half_set_on_an_instance, 2, timeout=TIMEOUT)
