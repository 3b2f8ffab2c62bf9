"""Drop-in details that torch's own FSDP2 tests rely on (issue #28), each checked against
torch's ``fully_shard`` on the same inputs in the same test where torch can run it:

- ``fully_shard.state(module)`` (and ``replicate.state``): the composable-API accessor, one
  state object per call, reachable through the switch as well; the private names of torch's
  state that torch's own tests read (``_lazy_init()``, ``_is_root``, ``_fsdp_param_group``...)
  give what torch's give;
- a parameter assigned after ``fully_shard`` and before the first forward (meta init, the
  root's parameter computed from its children's sharded weights) is picked up at lazy init
  and trains bit-equal to torch;
- ``channels_last`` (non-contiguous) parameters: torch refuses them, shardwise shards them
  contiguously and trains like a plain model (beyond torch);
- ``set_all_reduce_hook(hook, stream=s)``: the hook runs with ``s`` as the current stream;
- a post-accumulate-grad hook registered on a sharded parameter runs once per backward, after
  its reduced gradient is in ``.grad`` (an optimizer step per parameter trains as torch's);
- the collectives are looked up on ``torch.distributed`` at call time, so a patch of
  ``dist``'s all-gather / reduce-scatter (torch's ``_single`` names, or the older aliases)
  sees every call and its dtypes, exactly the calls torch's FSDP2 makes.
"""

from __future__ import annotations

import copy
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMP
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import distribute_tensor

import shardwise
from _models import MLP, MLPStack, allreduce_mean_grads, apply_fully_shard, assert_all_close
from shardwise.state import ModuleState
from shardwise.testing import run_on_ranks

TIMEOUT = 90
STEPS = 3


# ---------------------------------------------------------------- fully_shard.state


def _state_accessor() -> None:
    model = MLPStack(n_layers=3)
    apply_fully_shard(model, shardwise.fully_shard)
    root = shardwise.fully_shard.state(model)
    states = [root] + [shardwise.fully_shard.state(layer) for layer in model.layers]
    assert all(isinstance(s, ModuleState) for s in states), states
    assert len(set(map(id, states))) == len(states), "each fully_shard call has its own state"
    assert shardwise.fully_shard.state(model.in_proj) is None  # managed by the root's call, not one of its own
    assert root.modules == (model,) and root.groups and root.group.params

    pair = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    shardwise.fully_shard([pair[0], pair[1]])
    assert shardwise.fully_shard.state(pair[0]) is shardwise.fully_shard.state(pair[1])  # one grouped call

    replicated = shardwise.replicate(nn.Linear(4, 4))
    assert shardwise.fully_shard.state(replicated) is None  # another API's state
    assert isinstance(shardwise.replicate.state(replicated), ModuleState)
    assert shardwise.replicate.state(model) is None

    theirs = MLPStack(n_layers=3)
    apply_fully_shard(theirs, torch_fully_shard)
    torch_states = [torch_fully_shard.state(theirs)] + [torch_fully_shard.state(m) for m in theirs.layers]
    assert len(set(map(id, torch_states))) == len(torch_states)
    assert torch_fully_shard.state(theirs.in_proj) is None  # the same answers as torch

    with shardwise.install_as_torch_fsdp():
        from torch.distributed.fsdp import fully_shard as switched

        assert switched is shardwise.fully_shard
        assert switched.state(model) is root


def test_fully_shard_state_is_one_object_per_call_like_torch():
    run_on_ranks(_state_accessor, 2, timeout=TIMEOUT)


def _what_torch_tests_read(fully_shard_fn) -> dict:
    """What torch's test_fully_shard_init reads through torch's private state names."""
    model = nn.Sequential(MLP(8, 8, 8), MLP(8, 8, 8))
    fully_shard_fn(model[0].in_proj)
    fully_shard_fn(model[0].out_proj)
    fully_shard_fn(model)
    root = fully_shard_fn.state(model)
    root._lazy_init()
    states = [root] + [fully_shard_fn.state(m) for m in (model[0].in_proj, model[0].out_proj)]
    return {
        "is_root": [s._is_root for s in states],
        "all_states_are_the_states": root._state_ctx.all_states == states,
        "groups": [
            (s._fsdp_param_group._module_fqn, sorted(p._param_fqn for p in s._fsdp_param_group.fsdp_params))
            for s in states
        ],
        "group_lists": [len(s._fsdp_param_groups) for s in states],
    }


def _torch_private_names() -> None:
    ours, theirs = _what_torch_tests_read(shardwise.fully_shard), _what_torch_tests_read(torch_fully_shard)
    assert ours == theirs, (ours, theirs)
    assert ours["is_root"] == [True, False, False] and ours["all_states_are_the_states"]


def test_torch_private_state_names_read_like_torch():
    run_on_ranks(_torch_private_names, 2, timeout=TIMEOUT)


# ---------------------------------------------------------------- a parameter assigned before lazy init


class _NormScaled(nn.Module):
    """torch's ``test_reset_sharded_param_in_lazy_init`` model: a root parameter computed
    from its children's weights after they are materialized."""

    def __init__(self):
        super().__init__()
        self.layer1 = nn.Linear(4, 4, bias=False)
        self.layer2 = nn.Linear(4, 4, bias=False)
        self.weight_norm = nn.Parameter(torch.empty(4))

    def init_weight_norm(self) -> None:
        with torch.no_grad():
            norm = torch.linalg.norm(self.layer1.weight, dim=1) + torch.linalg.norm(self.layer2.weight, dim=1)
        self.weight_norm = nn.Parameter(norm)  # a DTensor: computed from the sharded weights

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer2(self.layer1(x)) * self.weight_norm


def _built_on_meta_and_reassigned(fully_shard_fn, values: dict[str, torch.Tensor]) -> _NormScaled:
    with torch.device("meta"):
        model = _NormScaled()
    fully_shard_fn(model.layer1)
    fully_shard_fn(model.layer2)
    fully_shard_fn(model)
    for name in ("layer1", "layer2"):
        layer = getattr(model, name).to_empty(device="cpu")
        with torch.no_grad():
            layer.weight.copy_(distribute_tensor(values[name], layer.weight.device_mesh, layer.weight.placements))
    model.init_weight_norm()
    return model


def _reassigned_param_trains_like_torch() -> None:
    torch.manual_seed(0)
    values = {name: torch.randn(4, 4) / 4 for name in ("layer1", "layer2")}
    ours = _built_on_meta_and_reassigned(shardwise.fully_shard, values)
    theirs = _built_on_meta_and_reassigned(torch_fully_shard, values)
    optims = [torch.optim.SGD(m.parameters(), lr=0.01) for m in (ours, theirs)]
    gen = torch.Generator().manual_seed(dist.get_rank())
    for step in range(STEPS):
        x = torch.randn(3, 4, generator=gen)
        losses = [m(x).square().sum() for m in (ours, theirs)]
        for loss, optim in zip(losses, optims):
            loss.backward()
            optim.step()
            optim.zero_grad()
        assert torch.equal(losses[0], losses[1]) and losses[0].isfinite(), (step, losses)
        assert ours.weight_norm is shardwise.fully_shard.state(ours).group.params[0].sharded_param
        for (name, a), b in zip(ours.named_parameters(), theirs.parameters()):
            assert a.placements == b.placements and torch.equal(a.to_local(), b.to_local()), (step, name)


def test_parameter_assigned_after_fully_shard_is_sharded_at_lazy_init_like_torch():
    run_on_ranks(_reassigned_param_trains_like_torch, 2, timeout=TIMEOUT)


# ---------------------------------------------------------------- channels_last parameters


def _conv_net() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Conv2d(4, 2, 3))


def _channels_last_trains_like_a_plain_model() -> None:
    model = _conv_net().to(memory_format=torch.channels_last)
    assert not model[0].weight.is_contiguous()
    ref = copy.deepcopy(model)
    shardwise.fully_shard(model[0])
    shardwise.fully_shard(model)
    optim, ref_optim = (torch.optim.SGD(m.parameters(), lr=0.01) for m in (model, ref))
    gen = torch.Generator().manual_seed(dist.get_rank())
    for step in range(STEPS):
        x = torch.randn(2, 3, 8, 8, generator=gen).to(memory_format=torch.channels_last)
        loss, ref_loss = model(x).square().mean(), ref(x).square().mean()
        loss.backward()
        ref_loss.backward()
        allreduce_mean_grads(ref)
        pairs = [(f"loss at step {step}", loss.detach(), ref_loss.detach())]
        for (name, p), r in zip(model.named_parameters(), ref.parameters()):
            pairs += [(f"{name} grad at step {step}", p.grad.full_tensor(), r.grad)]
        assert_all_close(pairs)  # the contiguous and channels_last conv kernels may round apart
        optim.step()
        ref_optim.step()
        optim.zero_grad()
        ref_optim.zero_grad()
    assert_all_close([(name, p.full_tensor(), r) for (name, p), r in zip(model.named_parameters(), ref.parameters())])


def test_channels_last_parameters_train_like_a_plain_model():
    run_on_ranks(_channels_last_trains_like_a_plain_model, 2, timeout=TIMEOUT)


# ---------------------------------------------------------------- the all-reduce hook's stream


def _hook_streams(fully_shard_fn, stream) -> list:
    model = MLP(4, 8, 4)
    fully_shard_fn(model)
    seen = []
    model.set_all_reduce_hook(lambda reduced: seen.append(torch.cpu.current_stream()), stream=stream)
    model(torch.ones(2, 4)).sum().backward()
    return seen


def _all_reduce_hook_runs_on_its_stream() -> None:
    """torch's own path cannot run this on CPU (its ``wait_stream`` between CPU streams raises
    "cpu backend doesn't support events"); tests/test_cuda.py compares it with torch on CUDA."""
    default = torch.cpu.current_stream()
    for stream in (torch.cpu.Stream(), torch.Stream("cpu")):
        seen = _hook_streams(shardwise.fully_shard, stream)
        assert len(seen) == 1 and seen[0] is stream, (stream, seen)
        assert torch.cpu.current_stream() is default  # restored after the hook
    assert _hook_streams(shardwise.fully_shard, None) == [default]


def test_all_reduce_hook_runs_with_its_stream_current():
    run_on_ranks(_all_reduce_hook_runs_on_its_stream, 2, timeout=TIMEOUT)


# ---------------------------------------------------------------- post-accumulate-grad hooks


def _hooked_training(fully_shard_fn, per_param_optim: bool) -> tuple[dict, list[torch.Tensor]]:
    """Three steps of a two-block model with a post-accumulate-grad hook on every sharded
    param, counting calls; the optimizer steps either in the hook (one per parameter, as
    torch's test_post_acc_grad_hook_optim_parity does) or after backward."""
    torch.manual_seed(0)
    model = MLPStack(n_layers=2)
    apply_fully_shard(model, fully_shard_fn)
    counts: dict[str, int] = {}
    optims = {p: torch.optim.AdamW([p], lr=0.01, foreach=False) for p in model.parameters()}
    optim = torch.optim.AdamW(model.parameters(), lr=0.01, foreach=False)
    names = {p: name for name, p in model.named_parameters()}

    def hook(param: torch.Tensor) -> None:
        counts[names[param]] = counts.get(names[param], 0) + 1
        if not torch._C._is_torch_function_enabled():  # user code: tensor subclasses must work in it
            counts["ran without torch functions"] = counts.get("ran without torch functions", 0) + 1
        if per_param_optim:
            optims[param].step()
            optims[param].zero_grad()

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(hook)
    gen = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(STEPS):
        model(torch.randn(4, 7, generator=gen)).sum().backward()
        if not per_param_optim:
            optim.step()
            optim.zero_grad()
    return counts, [p.to_local().clone() for p in model.parameters()]


def _post_accumulate_grad_hooks_run_like_torch() -> None:
    for per_param_optim in (False, True):
        (counts, ours), (their_counts, theirs) = (
            _hooked_training(fs, per_param_optim) for fs in (shardwise.fully_shard, torch_fully_shard)
        )
        assert counts == their_counts and set(counts.values()) == {STEPS}, (counts, their_counts)
        assert all(torch.equal(a, b) for a, b in zip(ours, theirs)), per_param_optim
    _, stepped_after = _hooked_training(shardwise.fully_shard, False)
    _, stepped_in_hook = _hooked_training(shardwise.fully_shard, True)
    assert all(torch.equal(a, b) for a, b in zip(stepped_after, stepped_in_hook))


@pytest.mark.parametrize("world_size", [1, 2])  # 1: each gradient handed over as it is; 2: reduce-scattered
def test_post_accumulate_grad_hooks_on_sharded_params_run_once_per_backward_like_torch(world_size):
    run_on_ranks(_post_accumulate_grad_hooks_run_like_torch, world_size, timeout=TIMEOUT)


# ---------------------------------------------------------------- collectives patched on dist


def _patched_calls(fully_shard_fn, gather_name: str, reduce_name: str, mp_policy) -> list[tuple]:
    """One step of a two-block model under spies on ``dist.<gather_name>`` / ``dist.<reduce_name>``:
    every call as (kind, output dtype, input dtype, output numel)."""
    torch.manual_seed(0)
    model = MLPStack(n_layers=2)
    apply_fully_shard(model, fully_shard_fn, mp_policy=mp_policy)
    calls = []

    def spy(kind: str, real):
        def call(output, input, *args, **kwargs):
            calls.append((kind, output.dtype, input.dtype, output.numel()))
            return real(output, input, *args, **kwargs)

        return call

    with (
        mock.patch.object(dist, gather_name, spy("all_gather", getattr(dist, gather_name))),
        mock.patch.object(dist, reduce_name, spy("reduce_scatter", getattr(dist, reduce_name))),
    ):
        model(torch.randn(4, 7)).sum().backward()
    return calls


def _patches_see_every_collective() -> None:
    single = ("all_gather_single", "reduce_scatter_single")  # what torch 2.13's FSDP2 and tests use
    for param_dtype, reduce_dtype in ((None, None), (torch.bfloat16, torch.float32), (torch.bfloat16, None)):
        ours = _patched_calls(shardwise.fully_shard, *single, shardwise.MixedPrecisionPolicy(param_dtype, reduce_dtype))
        theirs = _patched_calls(torch_fully_shard, *single, TorchMP(param_dtype, reduce_dtype))
        assert ours == theirs, (param_dtype, reduce_dtype, ours, theirs)
        reduces = [c for c in ours if c[0] == "reduce_scatter"]
        assert len(reduces) == 3 and all(c[1] == (reduce_dtype or param_dtype or torch.float32) for c in reduces)
        # the deprecated aliases, patched alone: shardwise's calls go through them (torch 2.13's do not)
        aliases = _patched_calls(
            shardwise.fully_shard, "all_gather_into_tensor", "reduce_scatter_tensor",
            shardwise.MixedPrecisionPolicy(param_dtype, reduce_dtype),
        )
        assert aliases == ours, (aliases, ours)


def test_collectives_patched_on_dist_see_every_call_and_dtype_like_torch():
    run_on_ranks(_patches_see_every_collective, 2, timeout=TIMEOUT)
