"""Models, layouts, data and checks shared by test_state_dict.py and test_checkpoint_matrix.py.

Everything here runs inside the ranks of :func:`shardwise.testing.run_on_ranks`.

- :func:`build` makes a tiny causal LM (``tied``: embedding and head share a weight;
  ``tp``: the separate-projection model tensor parallelism splits);
- :func:`shard` applies a layout: ``fsdp`` (one group per block, then the root), ``hsdp``
  (2-D mesh), ``replicate``, ``tp_fsdp`` (TP over pairs of ranks, FSDP over the rest);
- :func:`train_step` trains on a slice of one *global* batch per step, so the same step
  at any world size and layout is the same mathematics (within fp32 reduction order);
- :func:`check_contract` asserts FSDP2's state-dict contract on a model in whatever state
  it is in (sharded DTensors of the original dtype, no shared storage, torch.save
  round trip, the expected values).
"""

from __future__ import annotations

import copy
import io

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

import shardwise
from _models import Transformer
from _nd_helpers import TPTransformer, lm_loss, make_mesh, parallelize

DIMS = dict(vocab_size=16, dim=8, n_layers=2, n_heads=2, max_seq_len=8, ffn_hidden=12)
TP_DIMS = dict(vocab_size=16, dim=8, n_layers=2, n_heads=2, hidden=12, max_seq_len=8)
GLOBAL_BATCH = 4  # sequences per step, split over the data-parallel ranks (1, 2 or 4)
LR = 1e-2
TIMEOUT = 180


class TiedTransformer(Transformer):
    def __init__(self, **dims):
        super().__init__(**dims)
        self.output.weight = self.tok_embeddings.weight  # (vocab, dim) both


def build(kind: str = "plain", seed: int = 0, device: str = "cpu") -> nn.Module:
    torch.manual_seed(seed)
    with torch.device(device):
        if kind == "tp":
            return TPTransformer(**TP_DIMS)
        return TiedTransformer(**DIMS) if kind == "tied" else Transformer(**DIMS)


class Layout:
    """A sharded model's layout: which ranks hold a data-parallel slice of the batch."""

    def __init__(self, name: str, dp_rank: int, dp_size: int):
        self.name, self.dp_rank, self.dp_size = name, dp_rank, dp_size


def shard(model: nn.Module, layout: str, **kwargs) -> Layout:
    """Apply ``layout`` to ``model`` in place (``kwargs`` go to every fully_shard call)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if layout == "replicate":
        for layer in model.layers:
            shardwise.replicate(layer, **kwargs)
        shardwise.replicate(model, **kwargs)
        return Layout(layout, rank, world)
    if layout == "tp_fsdp":
        mesh = make_mesh((world // 2, 2), ("dp", "tp"))
        parallelize(model, mesh["tp"])
        dp_mesh = mesh["dp"]
        _fully_shard_blocks(model, mesh=dp_mesh, **kwargs)
        return Layout(layout, dp_mesh.get_local_rank(), dp_mesh.size())
    if layout == "hsdp":
        kwargs["mesh"] = make_mesh((2, world // 2), ("replicate", "shard"))
    elif layout == "fsdp":
        kwargs["mesh"] = make_mesh((world,), ("shard",))
    else:
        raise ValueError(f"unknown layout {layout!r}")
    _fully_shard_blocks(model, **kwargs)
    return Layout(layout, rank, world)


def _fully_shard_blocks(model: nn.Module, **kwargs) -> None:
    root_kwargs = {k: v for k, v in kwargs.items() if k != "reshard_after_forward"}
    for layer in model.layers:
        shardwise.fully_shard(layer, **kwargs)
    shardwise.fully_shard(model, **root_kwargs)


def global_batch(step: int, vocab: int = 16, seq_len: int = 8) -> torch.Tensor:
    gen = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, vocab, (GLOBAL_BATCH, seq_len + 1), generator=gen)


def local_batch(step: int, layout: Layout) -> torch.Tensor:
    per_rank = GLOBAL_BATCH // layout.dp_size
    return global_batch(step)[layout.dp_rank * per_rank : (layout.dp_rank + 1) * per_rank]


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    # foreach=False: the params of a TP + FSDP model live on two meshes
    return torch.optim.Adam(model.parameters(), lr=LR, foreach=False)


def train_step(model: nn.Module, opt: torch.optim.Optimizer, step: int, layout: Layout) -> float:
    """One Adam step on this rank's slice of global batch ``step``; the global mean loss."""
    opt.zero_grad(set_to_none=True)
    loss = lm_loss(model, local_batch(step, layout))
    loss.backward()
    opt.step()
    return global_mean(loss.detach())


def global_mean(loss: torch.Tensor) -> float:
    """Mean over all ranks (TP peers hold equal losses, so this is the data-parallel mean)."""
    total = loss.clone()
    dist.all_reduce(total)
    return (total / dist.get_world_size()).item()


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def full_values(sd: dict) -> dict[str, torch.Tensor]:
    return {k: full(v).detach().clone() for k, v in sd.items()}


def assert_equal(where: str, got: dict, want: dict) -> None:
    """Same keys, and every tensor bit-equal (dtype included)."""
    assert list(got) == list(want), f"{where}: keys {list(got)} != {list(want)}"
    for k in want:
        g, w = got[k], want[k]
        assert g.dtype == w.dtype, f"{where}: {k} is {g.dtype}, expected {w.dtype}"
        assert torch.equal(g, w), f"{where}: {k} differs by {(g.float() - w.float()).abs().max().item()}"


# ---------------------------------------------------------------- the contract


def local_values(sd: dict) -> dict[str, torch.Tensor]:
    """Each value's local tensor (this rank's shard), copied: a snapshot without collectives."""
    return {k: (v.to_local() if isinstance(v, DTensor) else v).detach().clone() for k, v in sd.items()}


def with_locals(sd: dict, fn) -> dict[str, DTensor]:
    """DTensors like ``sd``'s whose local tensors are ``fn(local)`` (no DTensor dispatch)."""
    return {
        k: DTensor.from_local(
            fn(v.to_local()), v.device_mesh, v.placements, run_check=False, shape=v.shape, stride=v.stride()
        )
        for k, v in sd.items()
    }


def check_contract(model: nn.Module, expected: dict[str, torch.Tensor], where: str) -> None:
    """FSDP2's state-dict contract, in whatever state ``model`` is.

    Every value is a sharded DTensor laid out like the parameter the module holds
    afterwards, whose local shard equals ``expected`` (bit for bit, dtype included);
    values of different parameters share no storage; ``torch.save`` then
    ``torch.load(weights_only=True)`` gives every local tensor back bit-equal with its
    placements, and so does ``copy.deepcopy``.
    """
    sd = model.state_dict()
    storage_owner: dict[int, int] = {}
    for key, value in sd.items():
        param = model.get_parameter(key)
        assert isinstance(value, DTensor), f"{where}: {key} is a {type(value).__name__}, not a sharded DTensor"
        assert value.placements == param.placements, f"{where}: {key} {value.placements} vs {param.placements}"
        owner = storage_owner.setdefault(value.to_local().untyped_storage().data_ptr(), id(param))
        assert owner == id(param), f"{where}: {key} shares its storage with another parameter's value"
    assert_equal(where, local_values(sd), expected)
    buffer = io.BytesIO()
    torch.save(sd, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    for key, value in sd.items():
        assert loaded[key].placements == value.placements, f"{where}: {key} reloaded as {loaded[key].placements}"
    assert_equal(f"{where} (torch.save/load)", local_values(loaded), expected)
    assert_equal(f"{where} (deepcopy, DCP's async stager)", local_values(copy.deepcopy(sd)), expected)


def reshard_all(model: nn.Module) -> None:
    for module in model.modules():
        if isinstance(module, shardwise.FSDPModule):
            module.reshard()


def check_load(model: nn.Module, where: str) -> None:
    """``load_state_dict`` in the current state lands in the sharded params: load halved
    values, reshard everything (what the next step does), read them back; then restore."""
    original = with_locals(model.state_dict(), torch.clone)
    halved = with_locals(original, lambda t: t * 0.5)
    model.load_state_dict(halved)
    reshard_all(model)
    assert_equal(f"{where}: after load_state_dict", local_values(model.state_dict()), local_values(halved))
    model.load_state_dict(original)


def check_forward(model: nn.Module, kind: str, tokens: torch.Tensor, where: str, **tolerance) -> None:
    """A no-grad forward equals a plain model's holding the full state dict's values
    (fp32 tolerance; pass ``rtol``/``atol`` for a bf16 compute dtype)."""
    plain = build(kind, seed=1)
    plain.load_state_dict(full_values(model.state_dict()))
    with torch.no_grad():
        got, want = full(model(tokens)).float(), plain(tokens)
    torch.testing.assert_close(got, want, msg=lambda m: f"{where}: forward: {m}", **tolerance)
