"""Gradient reduction numerics at the world sizes where they differ: 4 and 8 ranks, every mesh
shape, default averaging and divide factors, bit-equal to torch's FSDP2 every step.

At 2 ranks any of the ways to average (AVG, SUM then a division, a premultiplied SUM) give
the same bits; at 4 and 8 the op decides gloo's algorithm and its summation order, and
HSDP's split (reduce-scatter over ``shard``, all-reduce over ``replicate``) decides which
partial sums meet. torch 2.13 picks per case: AVG for the mean, AVG for a factor equal to
the reduce-scatter group's size, ``PREMUL_SUM(1/f)`` for any other factor (which gloo
lacks: torch then runs with ``set_force_sum_reduction_for_comms(True)``, the same bits for
a power-of-two factor, or for any factor with a custom reduce-scatter that premultiplies as
NCCL's PREMUL_SUM does), and SUM for the HSDP all-reduce under a factor. shardwise must give
the same losses, parameters and gradients with no such help.

The root alone gets the factor (``set_gradient_divide_factor`` is not recursive), the
blocks keep the mean; ``reshard_after_forward=False``; AdamW amplifies any bit of
difference into visible drift within a few steps.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter as TorchReduceScatter
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard

import shardwise
from _models import Transformer
from _nd_helpers import TIMEOUT, generator, lm_loss, make_mesh, token_batches
from shardwise.testing import run_on_ranks

STEPS = 4
DIMS = dict(vocab_size=17, dim=8, n_layers=2, n_heads=2, max_seq_len=8, ffn_hidden=12)


def _shard(model, fully_shard_fn, mesh):
    for layer in model.layers:
        fully_shard_fn(layer, mesh=mesh, reshard_after_forward=False)
    return fully_shard_fn(model, mesh=mesh, reshard_after_forward=False)


def _mesh(shape: tuple[int, ...]):
    return make_mesh(shape, ("replicate", "shard") if len(shape) == 2 else None)


def _torch_can_premultiply(shape: tuple[int, ...], factor: float | None) -> bool:
    """Whether torch's FSDP2 runs this case on gloo as it is (no PREMUL_SUM there)."""
    shard_size = shape[-1]
    return factor is None or shard_size == 1 or factor == shard_size


class PremulSumOnGloo(TorchReduceScatter):
    """torch's reduce-scatter with ``PREMUL_SUM(s)`` done as NCCL defines it (each rank's
    input times ``s``, then a SUM), for gloo, which lacks the op: torch's own FSDP2 code
    path becomes the premultiplied reference."""

    def __init__(self, scale: float):
        self.scale = scale

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        if op not in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):  # torch passes PREMUL_SUM(1/f)
            input_tensor.mul_(self.scale)
            op = dist.ReduceOp.SUM
        return dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group, async_op=async_op)


def _parity(shape: tuple[int, ...], factor: float | None, reference: str = "torch") -> list[float]:
    mesh = _mesh(shape)
    torch.manual_seed(0)
    base = Transformer(**DIMS)
    theirs = _shard(copy.deepcopy(base), torch_fully_shard, mesh)
    ours = _shard(base, shardwise.fully_shard, mesh)
    if factor is not None:
        ours.set_gradient_divide_factor(factor)
        theirs.set_gradient_divide_factor(factor)
        if reference == "premul":
            theirs.set_custom_reduce_scatter(PremulSumOnGloo(1.0 / factor))
        elif not _torch_can_premultiply(shape, factor):
            theirs.set_force_sum_reduction_for_comms(True)  # SUMs, then / factor: same bits for 2**k
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ours, theirs)]
    gen = generator(dist.get_rank())
    losses = []
    for step in range(STEPS):
        (tokens,) = token_batches(gen, DIMS["vocab_size"], 1)
        step_losses = []
        for model, opt in zip((ours, theirs), opts):
            opt.zero_grad()
            loss = lm_loss(model, tokens)
            loss.backward()
            step_losses.append(loss.detach())
        where = f"rank {dist.get_rank()}, step {step}, mesh {shape}, factor {factor}"
        assert torch.equal(*step_losses), f"loss at {where}: {step_losses}"
        for (name, p), q in zip(ours.named_parameters(), theirs.parameters()):
            assert torch.equal(p.to_local(), q.to_local()), f"{name} at {where}"
            assert torch.equal(p.grad.to_local(), q.grad.to_local()), (
                f"{name}.grad at {where}: max diff {(p.grad.to_local() - q.grad.to_local()).abs().max()}"
            )
        for opt in opts:
            opt.step()
        losses.append(step_losses[0].item())
    return losses


FOUR = [((4,), None), ((4,), 8.0), ((4,), 3.0), ((2, 2), None), ((2, 2), 8.0), ((2, 2), 4.0), ((2, 2), 3.0),
        ((4, 1), None), ((4, 1), 8.0)]
EIGHT = [((8,), None), ((2, 4), 16.0), ((8, 1), None), ((8, 1), 16.0)]


def _ids(cases):
    names = {1: "fsdp", 2: "hsdp"}
    return [f"{'replicate' if s[-1] == 1 else names[len(s)]}_{'x'.join(map(str, s))}-{'mean' if f is None else f'factor_{f:g}'}"
            for s, f in cases]


@pytest.mark.parametrize("shape,factor", FOUR, ids=_ids(FOUR))
def test_four_ranks_like_torch(shape, factor):
    reference = "premul" if not _torch_can_premultiply(shape, factor) and factor == 3.0 else "torch"
    run_on_ranks(_parity, 4, shape, factor, reference, timeout=TIMEOUT)


@pytest.mark.parametrize("shape,factor", EIGHT, ids=_ids(EIGHT))
def test_eight_ranks_like_torch(shape, factor):
    run_on_ranks(_parity, 8, shape, factor, timeout=2 * TIMEOUT)


class _DivCounter(TorchDispatchMode):
    """Counts ``aten.div.Tensor`` calls (torch's tests watch the division this way)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.div.Tensor:
            self.count += 1
        return func(*args, **(kwargs or {}))


def _world_size_one_divisions(factor: float | None) -> dict[str, int]:
    """One backward of a single-group model at world size 1 under a divide factor."""
    mesh = _mesh((1,))
    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4))
    plain = copy.deepcopy(base)
    counts, grads = {}, {}
    for name, fully_shard_fn, model in (("ours", shardwise.fully_shard, base),
                                        ("torch", torch_fully_shard, copy.deepcopy(base))):
        fully_shard_fn(model, mesh=mesh)
        if factor is not None:
            model.set_gradient_divide_factor(factor)
        loss = model(torch.ones(2, 8)).sum()
        with _DivCounter() as counter:
            loss.backward()
        counts[name] = counter.count
        grads[name] = [p.grad.to_local() for p in model.parameters()]
    plain(torch.ones(2, 8)).sum().backward()
    for ours, theirs, p in zip(grads["ours"], grads["torch"], plain.parameters()):
        assert torch.equal(ours, theirs) and torch.equal(ours, p.grad / (factor or 1.0))
    return counts


@pytest.mark.parametrize("factor", [None, 1.0, 2.0])
def test_world_size_one_divides_once_like_torch(factor):
    """Nothing is communicated at world size 1: torch divides the packed gradients once
    (one ``aten.div.Tensor``) under a factor, never without one. A factor of 1 divides
    nothing in shardwise (torch divides by 1.0: one call, kept out on purpose)."""
    (counts,) = run_on_ranks(_world_size_one_divisions, 1, factor, timeout=TIMEOUT)
    expected = counts["torch"] if factor != 1.0 else 0
    assert counts["ours"] == expected, counts


def _world_size_one_training() -> None:
    """Three AdamW steps at world size 1, each two micro-batches (the first with gradient
    sync off, then on; the last step syncs both, adding into the sharded ``.grad``):
    losses, gradients and parameters ``torch.equal`` to torch's FSDP2 every step. At world
    size 1 with nothing to cast or divide, each gradient is handed over as it is."""
    mesh = _mesh((1,))
    torch.manual_seed(0)
    base = Transformer(**DIMS)
    models = {"ours": _shard(copy.deepcopy(base), shardwise.fully_shard, mesh),
              "torch": _shard(copy.deepcopy(base), torch_fully_shard, mesh)}  # fmt: skip
    optims = {k: torch.optim.AdamW(m.parameters(), lr=1e-2) for k, m in models.items()}
    batches = token_batches(generator(0), DIMS["vocab_size"], 2 * 3, seq_len=DIMS["max_seq_len"] - 1)
    for step in range(3):
        for name, model in models.items():
            for micro in range(2):
                model.set_requires_gradient_sync(micro == 1 or step == 2)
                lm_loss(model, batches[2 * step + micro]).backward()
        ours, theirs = (list(models[k].parameters()) for k in ("ours", "torch"))
        for a, b in zip(ours, theirs):
            assert isinstance(a.grad, type(b.grad)) and a.grad.placements == b.grad.placements
            assert torch.equal(a.grad.to_local(), b.grad.to_local()), f"step {step}"
        for opt in optims.values():
            opt.step()
            opt.zero_grad()
        assert all(torch.equal(a.to_local(), b.to_local()) for a, b in zip(ours, theirs)), f"step {step}"


def test_world_size_one_trains_like_torch():
    run_on_ranks(_world_size_one_training, 1, timeout=TIMEOUT)


class _WithUnused(torch.nn.Module):
    """A root whose ``unused`` Linear never runs, around one sharded block."""

    def __init__(self):
        super().__init__()
        self.used = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4))
        self.unused = torch.nn.Linear(8, 4)

    def forward(self, x):
        return self.used(x)


def _world_size_one_knob(knob: str) -> None:
    """At world size 1 a gradient is handed over as it is only when nothing is to be done to
    it; each knob here makes something to do (zeros for an unused param, a hook that adds 1,
    an fp16 reduction). Three SGD steps: gradients (``None`` where torch's are) and
    parameters ``torch.equal`` to torch's FSDP2 every step."""
    mesh = _mesh((1,))
    torch.manual_seed(0)
    base = _WithUnused()
    models = {}
    for name, fully_shard_fn, mp_cls in (("ours", shardwise.fully_shard, shardwise.MixedPrecisionPolicy),
                                         ("torch", torch_fully_shard, TorchMixedPrecisionPolicy)):
        model = copy.deepcopy(base)
        extra = {"mp_policy": mp_cls(reduce_dtype=torch.float16)} if knob == "fp16_reduce" else {}
        fully_shard_fn(model.used, mesh=mesh, **extra)
        fully_shard_fn(model, mesh=mesh, **extra)
        if knob == "unused_params":
            model.set_reduce_scatter_unused_params(True)
        if knob == "all_reduce_hook":
            for module in (model.used, model):
                module.set_all_reduce_hook(lambda grad: grad.add_(1.0))
        models[name] = model
    optims = {k: torch.optim.SGD(m.parameters(), lr=0.1) for k, m in models.items()}
    gen = generator(0)
    for step in range(3):
        x = torch.randn(4, 8, generator=gen)
        for model in models.values():
            model(x).pow(2).sum().backward()
        for (name, a), b in zip(models["ours"].named_parameters(), models["torch"].parameters()):
            assert (a.grad is None) == (b.grad is None), f"step {step} {name}: grad {a.grad} against torch's {b.grad}"
            if a.grad is not None:
                assert a.grad._spec is a._spec, f"step {step} {name}: the grad's spec is not the param's"
                assert torch.equal(a.grad.to_local(), b.grad.to_local()), f"step {step} {name}.grad ({knob})"
        for opt in optims.values():
            opt.step()
            opt.zero_grad()
        for (name, a), b in zip(models["ours"].named_parameters(), models["torch"].parameters()):
            assert torch.equal(a.to_local(), b.to_local()), f"step {step} {name} ({knob})"


@pytest.mark.parametrize("knob", ["none", "unused_params", "all_reduce_hook", "fp16_reduce"])
def test_world_size_one_knobs_like_torch(knob):
    run_on_ranks(_world_size_one_knob, 1, knob, timeout=TIMEOUT)


class _Marked(torch.Tensor):
    """A plain tensor subclass: a gradient of this type is not handed over as it is."""


def _world_size_one_partial_hand_over() -> None:
    """At world size 1 the hand-over stops at the first gradient it cannot take as it is (here
    one of another tensor type, left by a micro-batch with sync off): the params before it
    keep what was handed over, the general path reduces that one and the rest. Gradients
    equal torch's FSDP2, and every param's post-accumulate-grad hook runs once."""
    mesh = _mesh((1,))
    torch.manual_seed(0)
    base = _WithUnused()
    models = {}
    for name, fully_shard_fn in (("ours", shardwise.fully_shard), ("torch", torch_fully_shard)):
        model = copy.deepcopy(base)
        fully_shard_fn(model.used, mesh=mesh)
        fully_shard_fn(model, mesh=mesh)
        models[name] = model
    calls = {name: 0 for name, _ in models["ours"].used.named_parameters()}
    for name, param in models["ours"].used.named_parameters():
        param.register_post_accumulate_grad_hook(lambda p, name=name: calls.__setitem__(name, calls[name] + 1))
    gen = generator(0)
    xs = [torch.randn(4, 8, generator=gen) for _ in range(2)]
    for model in models.values():
        model.set_requires_gradient_sync(False)
        model(xs[0]).pow(2).sum().backward()
    (group,) = shardwise.fully_shard.state(models["ours"].used).groups
    marked = group.params[2]  # used.2.weight: after used.0's weight and bias, before used.2.bias
    assert marked.fqn == "used.2.weight", [p.fqn for p in group.params]
    marked.unsharded_param.grad = marked.unsharded_param.grad.as_subclass(_Marked)
    for model in models.values():
        model.set_requires_gradient_sync(True)
        model(xs[1]).pow(2).sum().backward()
    assert calls == {name: 1 for name in calls}, f"post-accumulate-grad hook calls: {calls}"
    for (name, a), b in zip(models["ours"].named_parameters(), models["torch"].parameters()):
        assert (a.grad is None) == (b.grad is None), name
        if a.grad is not None:
            assert torch.equal(a.grad.to_local(), b.grad.to_local()), f"{name}.grad"


def test_world_size_one_hand_over_stops_at_a_gradient_it_cannot_take():
    run_on_ranks(_world_size_one_partial_hand_over, 1, timeout=TIMEOUT)


def _hook_sees_what_torchs_sees(shape: tuple[int, ...], knob: str) -> None:
    """An all-reduce hook that changes the gradient (adds 1): where it runs relative to the
    division decides the result. torch runs it on its collectives' output, before its own
    post-division (forced SUMs, fp16 reduction) and after an AVG."""
    mesh = _mesh(shape)
    torch.manual_seed(0)
    base = Transformer(**DIMS)
    kwargs = {}
    if knob == "fp16_reduce":
        kwargs["mp_policy"] = shardwise.MixedPrecisionPolicy(reduce_dtype=torch.float16)
    models = {}
    for name, fully_shard_fn in (("ours", shardwise.fully_shard), ("torch", torch_fully_shard)):
        model = copy.deepcopy(base)
        mp = kwargs.get("mp_policy")
        extra = {} if mp is None else {"mp_policy": mp if name == "ours" else TorchMixedPrecisionPolicy(reduce_dtype=torch.float16)}
        for layer in model.layers:
            fully_shard_fn(layer, mesh=mesh, **extra)
        fully_shard_fn(model, mesh=mesh, **extra)
        for module in (*model.layers, model):
            if knob == "force_sum":
                module.set_force_sum_reduction_for_comms(True)
            module.set_all_reduce_hook(lambda grad: grad.add_(1.0))
        models[name] = model
    (tokens,) = token_batches(generator(dist.get_rank()), DIMS["vocab_size"], 1)
    for model in models.values():
        lm_loss(model, tokens).backward()
    for (name, p), q in zip(models["ours"].named_parameters(), models["torch"].parameters()):
        assert torch.equal(p.grad.to_local(), q.grad.to_local()), (
            f"{name}.grad, {knob} on {shape}: max diff {(p.grad.to_local() - q.grad.to_local()).abs().max()}"
        )


@pytest.mark.parametrize("knob", ["mean", "force_sum", "fp16_reduce"])
@pytest.mark.parametrize("shape", [(4,), (2, 2)], ids=["fsdp_4", "hsdp_2x2"])
def test_all_reduce_hook_runs_where_torchs_does(shape, knob):
    run_on_ranks(_hook_sees_what_torchs_sees, 4, shape, knob, timeout=TIMEOUT)
