"""FSDP2's state-dict contract, in every state a user can be in.

``state_dict()`` gives sharded DTensors of the original dtype that share no storage with
one another; ``torch.save`` / ``torch.load(weights_only=True)`` round-trips them;
``load_state_dict`` copies into the sharded parameters, or adopts them with
``assign=True`` (see ``shardwise/state_dict.py``).

- ``test_torch_save_right_after_fully_shard``: saving failed with "Attempted to access the
  data pointer on an invalid python storage" (the sharded DTensors were views at an offset
  into one flat buffer).
- ``test_state_dict_after_eval_forward``: the root stays gathered after a no-grad forward;
  ``state_dict()`` returned its unsharded bf16 views (one shared buffer: safetensors
  dropped them), a load there went into temporaries, DCP's optimizer state dict failed.
- ``test_assign_into_meta_model``: Accelerate's ``fsdp2_load_full_state_dict`` (the real
  function) into a model sharded on the meta device: the first forward failed.
- ``test_contract_in_every_state``: two copies train the same steps; one checks the
  contract (and a load) after init, after an eval forward, between a training forward and
  its backward, mid-accumulation and after the step; both must end bit-equal. For plain
  FSDP, mixed precision, offload, tied weights, ``replicate`` (2 ranks) and HSDP, TP +
  FSDP, an int reshard (4 ranks).
"""

from __future__ import annotations

import types

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_state_dict
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

import shardwise
from _nd_helpers import lm_loss
from _state_dict_helpers import (
    TIMEOUT,
    assert_equal,
    build,
    check_contract,
    check_forward,
    check_load,
    full_values,
    local_batch,
    local_values,
    make_optimizer,
    shard,
    train_step,
)
from shardwise.testing import run_on_ranks

BF16 = shardwise.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def _torch_save_after_fully_shard(path: str) -> None:
    model = build()
    shard(model, "fsdp")
    expected = full_values(model.state_dict())
    torch.save(model.state_dict(), f"{path}.{dist.get_rank()}")
    fresh = build(seed=7)
    layout = shard(fresh, "fsdp")
    fresh.load_state_dict(torch.load(f"{path}.{dist.get_rank()}", weights_only=True))
    assert_equal("reloaded", full_values(fresh.state_dict()), expected)
    train_step(fresh, make_optimizer(fresh), 0, layout)


def test_torch_save_right_after_fully_shard(tmp_path):
    run_on_ranks(_torch_save_after_fully_shard, 2, str(tmp_path / "sd.pt"), timeout=TIMEOUT)


def _after_eval_forward(path: str) -> None:
    model = build()
    layout = shard(model, "fsdp", mp_policy=BF16)
    opt = make_optimizer(model)
    train_step(model, opt, 0, layout)
    expected = full_values(model.state_dict())
    tokens = local_batch(1, layout)[:, :-1]
    expected_local = local_values(model.state_dict())
    with torch.no_grad():
        model(tokens)  # the root keeps its bf16 params gathered
    check_contract(model, expected_local, "after an eval forward")
    with torch.no_grad():
        model(tokens)
    full_sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() == 0:
        from safetensors.torch import load_file, save_file

        save_file(full_sd, path)
        loaded = load_file(path)
        assert set(loaded) == set(expected), f"safetensors lost {sorted(set(expected) - set(loaded))}"
        assert_equal("safetensors", {k: loaded[k] for k in expected}, expected)
    with torch.no_grad():
        model(tokens)
    model_sd, optim_sd = get_state_dict(model, opt)  # failed with a KeyError on the optimizer
    assert set(optim_sd["state"]) == set(model_sd), sorted(optim_sd["state"])
    with torch.no_grad():
        model(tokens)
    check_load(model, "after an eval forward")
    check_forward(model, "plain", tokens, "after an eval forward", rtol=0.05, atol=0.05)  # bf16 compute


def test_state_dict_after_eval_forward(tmp_path):
    run_on_ranks(_after_eval_forward, 2, str(tmp_path / "model.safetensors"), timeout=TIMEOUT)


def _assign_into_meta_model() -> None:
    from accelerate.utils.fsdp_utils import fsdp2_load_full_state_dict

    reference = build()
    full_sd = reference.state_dict()
    model = build(device="meta")
    layout = shard(model, "fsdp")
    rank0 = types.SimpleNamespace(is_main_process=dist.get_rank() == 0)
    fsdp2_load_full_state_dict(rank0, model, full_sd if dist.get_rank() == 0 else {})
    for name, p in model.named_parameters():
        assert isinstance(p, DTensor) and not p.is_meta, f"{name}: {type(p).__name__} on {p.device}"
    opt = make_optimizer(model)  # the assigned DTensors are the parameters now: it trains them
    check_contract(model, local_values(model.state_dict()), "after assign=True into a meta model")
    assert_equal("after assign=True", full_values(model.state_dict()), full_values(full_sd))
    tokens = local_batch(0, layout)[:, :-1]
    check_forward(model, "plain", tokens, "after assign=True")
    ref_layout = shard(reference, "fsdp")
    losses = [train_step(model, opt, 0, layout), train_step(reference, make_optimizer(reference), 0, ref_layout)]
    assert losses[0] == losses[1], losses
    assert_equal("after a step", full_values(model.state_dict()), full_values(reference.state_dict()))
    # a DTensor laid out differently is refused, naming the parameter
    weight = model.tok_embeddings.weight
    bad = {"tok_embeddings.weight": distribute_tensor(weight.detach().full_tensor(), weight.device_mesh, [Replicate()])}
    with pytest.raises(ValueError, match="tok_embeddings.weight.*placements"):
        model.load_state_dict(bad, assign=True, strict=False)


def test_assign_into_meta_model():
    run_on_ranks(_assign_into_meta_model, 2, timeout=TIMEOUT)


# ---------------------------------------------------------------- every state

CONFIGS_2 = {
    "fsdp": ("plain", "fsdp", {}),
    "mixed_precision": ("plain", "fsdp", {"mp_policy": BF16}),
    "offload": ("plain", "fsdp", {"offload_policy": shardwise.CPUOffloadPolicy()}),
    "tied": ("tied", "fsdp", {}),
    "replicate": ("plain", "replicate", {}),
}
CONFIGS_4 = {
    "hsdp": ("plain", "hsdp", {}),
    "tp_fsdp": ("tp", "tp_fsdp", {}),
    "int_reshard": ("plain", "fsdp", {"reshard_after_forward": 2}),
}


def _sync(model, enabled: bool) -> None:
    model.set_requires_gradient_sync(enabled)


def _run_states(kind: str, layout_name: str, kwargs: dict, checked: bool) -> dict:
    """Init -> eval forward -> (forward | backward, sync off) -> forward, backward, step -> one
    more step. With ``checked`` the contract and a load are checked in each state."""
    model = build(kind)
    layout = shard(model, layout_name, **dict(kwargs))
    opt = make_optimizer(model)
    tokens = local_batch(0, layout)
    expected = local_values(model.state_dict())

    tolerance = {"rtol": 0.05, "atol": 0.05} if "mp_policy" in kwargs else {}  # bf16 compute

    def at(where: str) -> None:
        if checked:
            check_contract(model, expected, where)
            check_load(model, where)

    at("after init")
    if checked:
        check_forward(model, kind, tokens[:, :-1], "after init", **tolerance)
    with torch.no_grad():
        model(tokens[:, :-1])
    at("after an eval forward")
    _sync(model, False)
    loss = lm_loss(model, local_batch(1, layout))
    at("between forward and backward")
    loss.backward()
    at("mid-accumulation")
    _sync(model, True)
    lm_loss(model, local_batch(2, layout)).backward()
    opt.step()
    opt.zero_grad()
    expected = local_values(model.state_dict()) if checked else None
    at("after the step")
    if checked:
        check_forward(model, kind, tokens[:, :-1], "after the step", **tolerance)
    last = train_step(model, opt, 3, layout)
    return {"loss": last, "params": local_values(model.state_dict())}


def _every_state(configs: dict) -> None:
    for name, (kind, layout_name, kwargs) in configs.items():
        checked = _run_states(kind, layout_name, kwargs, checked=True)
        plain = _run_states(kind, layout_name, kwargs, checked=False)
        assert checked["loss"] == plain["loss"], f"{name}: {checked['loss']} != {plain['loss']}"
        assert_equal(f"{name}: after training", checked["params"], plain["params"])


@pytest.mark.parametrize("world_size,configs", [(2, CONFIGS_2), (4, CONFIGS_4)], ids=["2_ranks", "4_ranks"])
def test_contract_in_every_state(world_size, configs):
    run_on_ranks(_every_state, world_size, configs, timeout=TIMEOUT)
