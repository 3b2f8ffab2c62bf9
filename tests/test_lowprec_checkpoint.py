"""State dicts and checkpoints of low-precision models keep the subclass, as torch's FSDP2 does.

Two models, each trained by shardwise and by torch's FSDP2 side by side (2 gloo ranks):

- **float8**: two ``Float8Linear`` (``enable_fsdp_float8_all_gather=True``); each weight is a
  ``DTensor`` around torchao's ``WeightWithDynamicFloat8CastTensor``.
- **QLoRA**: two blocks, each a frozen NF4 base weight (``DTensor`` around torchao's
  ``NF4Tensor``, bf16) plus trainable bf16 LoRA adapters, as torchtune's
  ``lora_llama3(quantize_base=True)`` builds them.

Checked, every value bit for bit against torch's:

1. ``state_dict()`` after two steps (each step's losses, parameters, gradients and
   all-gathered bytes by dtype equal to torch's): the same keys, each value the same type
   chain (``DTensor`` around the subclass), placements and inner tensors.
2. DCP: ``get_state_dict`` of model and optimizer, ``dcp.save``; a fresh model (other seed)
   loads it (``dcp.load`` + ``set_state_dict``) and trains on in lockstep with the run that
   never stopped: every loss, parameter and gradient equal (shardwise's resumed run, torch's
   resumed run and both uninterrupted runs).
3. torchtune's path for NF4 (``torchtune.training.gather_cpu_state_dict`` /
   ``load_from_full_model_state_dict``; its ``get_full_model_state_dict`` in later
   releases). torchtune 0.6.1 does not import with torchao 0.18 (``torchtune.modules``
   imports ``torchao.dtypes.nf4tensor``, which torchao 0.18 moved to
   ``torchao.quantization``; its package root then needs ``datasets``, ``torchdata``,
   ``omegaconf`` and others): the test makes torchtune's calls itself: gathering an
   NF4 shard through its own ``fsdp_pre_all_gather`` / ``all_gather_into_tensor`` /
   ``fsdp_post_all_gather`` and ``full_tensor()`` for the rest; loading by re-quantizing
   (``to_nf4``), ``torch.chunk`` + ``new_zeros`` + ``copy_`` into a ``DTensor`` built on the
   sharded parameter's spec, ``distribute_tensor`` for the rest, and
   ``load_state_dict(assign=True, strict=False)``, into a model built and sharded on the
   meta device with its LoRA modules materialized by ``to_empty`` (the QLoRA recipe's
   order: adapters loaded, then the base model). The reloaded models then train on in
   lockstep.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torchao.float8 import Float8LinearConfig, convert_to_float8_training
from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor
from torchao.quantization import NF4Tensor, to_nf4
from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import linear_nf4

import shardwise
from _extension_helpers import assert_same_params
from _lowprec_helpers import GatherInputs, assert_same, rank_generator
from shardwise.testing import run_on_ranks

TIMEOUT = 120
DIM = 32
BF16 = torch.bfloat16
NF4_BLOCK, NF4_SCALER_BLOCK = 32, 8  # small blocks so a 16-row shard holds whole scaler blocks


class QLoRALinear(nn.Module):
    """A frozen NF4 base weight plus trainable bf16 LoRA adapters (torchtune's LoRALinear
    with ``quantize_base=True``)."""

    def __init__(self, rank: int = 4):
        super().__init__()
        base = torch.randn(DIM, DIM, dtype=BF16) / DIM**0.5
        self.weight = nn.Parameter(to_nf4(base, NF4_BLOCK, NF4_SCALER_BLOCK), requires_grad=False)
        self.lora_a = nn.Linear(DIM, rank, bias=False, dtype=BF16)
        self.lora_b = nn.Linear(rank, DIM, bias=False, dtype=BF16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear_nf4(x, self.weight) + self.lora_b(self.lora_a(x))


class QLoRABlock(nn.Module):
    """A sharded unit holding two QLoRA projections (torchtune shards its transformer layers,
    which hold the LoRALinear modules)."""

    def __init__(self):
        super().__init__()
        self.q, self.o = QLoRALinear(), QLoRALinear()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.o(F.relu(self.q(x)))


def _build(kind: str, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    if kind == "qlora":
        return nn.Sequential(QLoRABlock(), QLoRABlock())
    model = nn.Sequential(nn.Linear(DIM, DIM), nn.Linear(DIM, DIM))
    return convert_to_float8_training(model, config=Float8LinearConfig(enable_fsdp_float8_all_gather=True))


def _shard(model: nn.Sequential, fully_shard_fn) -> nn.Sequential:
    for block in model:
        fully_shard_fn(block)
    return fully_shard_fn(model)


def _optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)


def _pair(kind: str, seed: int = 0) -> tuple[nn.Module, nn.Module]:
    # built twice from one seed: NF4Tensor's clone (deepcopy) re-quantizes with the default
    # block sizes, which these small weights do not divide
    return _shard(_build(kind, seed), shardwise.fully_shard), _shard(_build(kind, seed), torch_fully_shard)


def _train_in_lockstep(models, opts, gen, steps: int, where: str) -> list[dict]:
    """Step every model on the same batch; each must equal the last (torch's) bit for bit,
    in what it all-gathered too. Returns torch's all-gather tally of each step."""
    dtype = BF16 if isinstance(models[0][0], QLoRABlock) else torch.float32
    tallies = []
    for step in range(steps):
        x = torch.randn(8, DIM, generator=gen).to(dtype)
        losses, gathered = [], []
        for model, opt in zip(models, opts):
            with GatherInputs(WeightWithDynamicFloat8CastTensor, NF4Tensor) as counted:
                loss = model(x).float().pow(2).mean()
                loss.backward()
            opt.step()
            losses.append(loss.detach())
            gathered.append(counted.summary())
        for i, model in enumerate(models[:-1]):
            at = f"{where}, step {step}, model {i}"
            assert torch.equal(losses[i], losses[-1]), f"{at}: loss {losses[i].item()} vs torch's {losses[-1].item()}"
            assert gathered[i] == gathered[-1], f"{at}: all-gathered {gathered[i]} vs torch's {gathered[-1]}"
            assert_same_params(model, models[-1], at, grads=True)
        for opt in opts:
            opt.zero_grad()
        tallies.append(gathered[-1])
    return tallies


# ---------------------------------------------------------------- state_dict()


def _state_dict_values(kind: str) -> list[dict]:
    ours, theirs = _pair(kind)
    tallies = _train_in_lockstep([ours, theirs], [_optimizer(ours), _optimizer(theirs)], rank_generator(), 2, kind)
    sd, sd_t = ours.state_dict(), theirs.state_dict()
    assert list(sd) == list(sd_t), f"{kind}: state_dict keys {list(sd)} vs torch's {list(sd_t)}"
    for key in sd:
        assert_same(sd[key], sd_t[key], f"{kind}: state_dict()[{key!r}]")
    return tallies


@pytest.mark.parametrize("kind", ["float8", "qlora"])
def test_state_dict_values_keep_the_subclass(kind):
    run_on_ranks(_state_dict_values, 2, kind, timeout=TIMEOUT)


# ---------------------------------------------------------------- DCP


def _save(model, opt, path: str) -> None:
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)


def _resume(kind: str, fully_shard_fn, path: str) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = _shard(_build(kind, seed=1), fully_shard_fn)  # other values: the load must set them all
    opt = _optimizer(model)
    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return model, opt


def _dcp_round_trip(kind: str, root: str) -> None:
    ours, theirs = _pair(kind)
    opts = [_optimizer(ours), _optimizer(theirs)]
    gen = rank_generator()
    _train_in_lockstep([ours, theirs], opts, gen, 2, f"{kind} before save")
    paths = [f"{root}/shardwise", f"{root}/torch"]
    for model, opt, path in zip((ours, theirs), opts, paths):
        _save(model, opt, path)
    ours_back, ours_back_opt = _resume(kind, shardwise.fully_shard, paths[0])
    theirs_back, theirs_back_opt = _resume(kind, torch_fully_shard, paths[1])
    models = [ours_back, theirs_back, ours, theirs]  # all compared with torch's uninterrupted run
    _train_in_lockstep(models, [ours_back_opt, theirs_back_opt, *opts], gen, 2, f"{kind} after load")


@pytest.mark.parametrize("kind", ["float8", "qlora"])
def test_dcp_save_load_resumes_bit_identically(kind, tmp_path):
    run_on_ranks(_dcp_round_trip, 2, kind, str(tmp_path), timeout=TIMEOUT)


# ---------------------------------------------------------------- torchtune's full state dict


def _gather_full(model: nn.Module) -> dict[str, torch.Tensor]:
    """torchtune's ``gather_cpu_state_dict``: NF4 shards gathered through the extension
    (it cannot ``full_tensor()`` them) and dequantized, every other DTensor ``full_tensor()``."""
    full = {}
    for name, value in model.state_dict().items():
        if isinstance(value, DTensor) and isinstance(value._local_tensor, NF4Tensor):
            value = _gather_nf4(value)
        elif isinstance(value, DTensor):
            value = value.full_tensor()
        if isinstance(value, NF4Tensor):
            value = value.to(value.dtype)  # dequantize
        full[name] = value.cpu()
    return full


def _gather_nf4(sharded: DTensor) -> NF4Tensor:
    group = sharded.device_mesh.get_group()
    shard = sharded._local_tensor
    inputs, metadata = shard.fsdp_pre_all_gather(sharded.device_mesh)
    outputs = []
    for t in inputs:
        out = torch.empty((t.size(0) * group.size(), *t.shape[1:]), dtype=t.dtype, device=t.device)
        dist.all_gather_into_tensor(out, t, group)
        outputs.append(out)
    full, _ = shard.fsdp_post_all_gather(outputs, metadata, shard.dtype)
    return full


def _load_full(model: nn.Module, full_sd: dict[str, torch.Tensor]) -> None:
    """torchtune's ``load_from_full_model_state_dict`` (the NF4 branch it always takes when
    the model has an NF4 parameter): ``strict=False``, the keys given only."""
    sharded_sd = {}
    current = model.state_dict()
    for name, full in full_sd.items():
        meta = current[name]
        full = full.to(meta.dtype)
        if isinstance(meta._local_tensor, NF4Tensor):
            local = meta._local_tensor
            quantized = to_nf4(full, local.block_size, local.scaler_block_size)
            group = meta.device_mesh.get_group(0)
            chunk = torch.chunk(quantized, group.size(), dim=0)[group.rank()]
            padded = quantized.new_zeros(chunk.size())
            padded[: chunk.size(0)].copy_(chunk)
            spec = DTensorSpec(meta.device_mesh, meta.placements, TensorMeta(meta.size(), meta.stride(), meta.dtype))
            value = DTensor(padded, spec, requires_grad=meta.requires_grad)
        else:
            value = distribute_tensor(full, meta.device_mesh, meta.placements)
        sharded_sd[name] = nn.Parameter(value, requires_grad=meta.requires_grad)
    missing, unexpected = model.load_state_dict(sharded_sd, strict=False, assign=True)
    assert not unexpected and set(missing) == set(current) - set(full_sd), (missing, unexpected)


def _meta_model(fully_shard_fn) -> nn.Module:
    """torchtune's QLoRA recipe: the model is built on the meta device (NF4 included) and
    sharded there; the LoRA modules (inside the sharded blocks) are materialized with
    ``to_empty`` before the loads."""
    with torch.device("meta"):
        model = _shard(_build("qlora"), fully_shard_fn)
    for module in model.modules():
        if isinstance(module, QLoRALinear):
            module.to_empty(device="cpu")
    assert not any(p.is_meta for p in model.parameters()), "a parameter left on meta"
    return model


def _torchtune_round_trip() -> None:
    ours, theirs = _pair("qlora")
    gen = rank_generator()
    _train_in_lockstep([ours, theirs], [_optimizer(ours), _optimizer(theirs)], gen, 1, "qlora before gather")
    full, full_t = _gather_full(ours), _gather_full(theirs)
    assert list(full) == list(full_t), f"full state dict keys {list(full)} vs torch's {list(full_t)}"
    for key in full:
        assert_same(full[key], full_t[key], f"full state dict[{key!r}]")
    models = [_meta_model(shardwise.fully_shard), _meta_model(torch_fully_shard)]
    for model in models:  # the recipe loads the adapters, then the base model
        _load_full(model, {k: v for k, v in full_t.items() if "lora" in k})
        _load_full(model, {k: v for k, v in full_t.items() if "lora" not in k})
    assert_same_params(*models, "qlora after load_from_full_model_state_dict", grads=False)
    _train_in_lockstep(models, [_optimizer(m) for m in models], gen, 2, "qlora after load")


def test_torchtune_full_state_dict_round_trip_for_nf4():
    run_on_ranks(_torchtune_round_trip, 2, timeout=TIMEOUT)
