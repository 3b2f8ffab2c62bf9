"""Small deterministic models and reference utilities shared by the multi-rank tests.

Everything here runs inside the ranks of :func:`shardwise.testing.run_on_ranks`:

- models: :class:`MLP` (Linear-ReLU-Linear), :class:`MLPStack` (MLP blocks between two
  projections, odd dims so that some ranks hold fewer or zero rows), and a tiny causal
  :class:`Transformer` with the attribute names torchtitan uses;
- :func:`apply_fully_shard`: one group per block, then the root;
- :func:`allreduce_mean_grads`: turns a plain replica into the data-parallel reference;
- :func:`compare_step`: asserts one training step's losses, parameters and gradients
  agree between shardwise, a plain replica and torch's own FSDP2;
- batch makers seeded by rank (each rank trains on different data) and
  :func:`chunk_of`, the ``torch.chunk`` slice a rank owns.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

# ---------------------------------------------------------------- models


class MLP(nn.Module):
    """``Linear(in_dim, hidden) -> ReLU -> Linear(hidden, out_dim)``."""

    def __init__(self, in_dim: int, hidden: int, out_dim: int, bias: bool = True):
        super().__init__()
        self.in_proj = nn.Linear(in_dim, hidden, bias=bias)
        self.out_proj = nn.Linear(hidden, out_dim, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out_proj(F.relu(self.in_proj(x)))


class MLPStack(nn.Module):
    """``in_proj -> layers[0..n) (residual MLPs) -> out_proj``: blocks plus root-owned params."""

    def __init__(self, in_dim: int = 7, dim: int = 5, hidden: int = 7, out_dim: int = 3, n_layers: int = 2):
        super().__init__()
        self.in_proj = nn.Linear(in_dim, dim)
        self.layers = nn.ModuleList(MLP(dim, hidden, dim) for _ in range(n_layers))
        self.out_proj = nn.Linear(dim, out_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.in_proj(x)
        for layer in self.layers:
            h = h + layer(h)
        return self.out_proj(h)


class Attention(nn.Module):
    """Causal multi-head self-attention through ``F.scaled_dot_product_attention``."""

    def __init__(self, dim: int, n_heads: int):
        super().__init__()
        self.n_heads = n_heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        qkv = self.qkv(x).view(b, s, 3, self.n_heads, d // self.n_heads)  # (b, s, 3, h, hd)
        q, k, v = (t.transpose(1, 2) for t in qkv.unbind(2))  # each (b, h, s, hd)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (b, h, s, hd)
        return self.wo(y.transpose(1, 2).reshape(b, s, d))  # (b, s, d)


class Block(nn.Module):
    """Pre-norm transformer block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``."""

    def __init__(self, dim: int, n_heads: int, ffn_hidden: int):
        super().__init__()
        self.attention_norm = nn.LayerNorm(dim)
        self.attention = Attention(dim, n_heads)
        self.ffn_norm = nn.LayerNorm(dim)
        self.feed_forward = MLP(dim, ffn_hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    """A tiny causal language model: token + position embeddings, blocks, norm, output."""

    def __init__(
        self,
        vocab_size: int = 32,
        dim: int = 16,
        n_layers: int = 2,
        n_heads: int = 2,
        max_seq_len: int = 8,
        ffn_hidden: int = 32,
    ):
        super().__init__()
        self.vocab_size = vocab_size
        self.tok_embeddings = nn.Embedding(vocab_size, dim)
        self.pos_embeddings = nn.Embedding(max_seq_len, dim)
        self.layers = nn.ModuleList(Block(dim, n_heads, ffn_hidden) for _ in range(n_layers))
        self.norm = nn.LayerNorm(dim)
        self.output = nn.Linear(dim, vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.size(1), device=tokens.device)
        h = self.tok_embeddings(tokens) + self.pos_embeddings(positions)  # (b, s, dim)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))  # (b, s, vocab)


# ---------------------------------------------------------------- data


def rank_generator(seed: int = 0) -> torch.Generator:
    """A generator seeded by rank: every rank draws different data, the same every run."""
    return torch.Generator().manual_seed(1000 * (seed + 1) + dist.get_rank())


def mlp_batch(gen: torch.Generator, in_dim: int, out_dim: int, batch: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(batch, in_dim, generator=gen), torch.randn(batch, out_dim, generator=gen)


def mlp_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return F.mse_loss(model(x), y)


def token_batch(gen: torch.Generator, vocab_size: int, seq_len: int = 8, batch: int = 2) -> torch.Tensor:
    return torch.randint(0, vocab_size, (batch, seq_len + 1), generator=gen)


def lm_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])  # (b, s, vocab)
    return F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())


# ---------------------------------------------------------------- sharding and references


def apply_fully_shard(model: nn.Module, fully_shard_fn: Callable, **kwargs) -> nn.Module:
    """``fully_shard_fn`` on each of ``model.layers`` (one group per block), then on the root."""
    for layer in model.layers:
        fully_shard_fn(layer, **kwargs)
    fully_shard_fn(model, **kwargs)
    return model


def allreduce_mean_grads(model: nn.Module) -> None:
    """Average the plain replica's gradients over the ranks (what data parallelism computes).

    One all-reduce of all gradients flattened together (the per-element sums are the same
    as one all-reduce per gradient, and one collective keeps the tests fast).
    """
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    flat.div_(dist.get_world_size())
    for g, reduced in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(reduced.view_as(g))


def chunk_of(full: torch.Tensor, rank: int, world: int, dim: int = 0) -> torch.Tensor:
    """Rank ``rank``'s chunk of ``full`` as ``torch.chunk`` makes it (empty past the last chunk)."""
    size = full.size(dim)
    step = math.ceil(size / world) if size else 0
    start = min(rank * step, size)
    return full.narrow(dim, start, min(step, size - start))


def compare_step(
    step: int,
    ours: nn.Module,
    loss: torch.Tensor | None,
    *,
    ref: nn.Module | None = None,
    ref_loss: torch.Tensor | None = None,
    torch_model: nn.Module | None = None,
    torch_loss: torch.Tensor | None = None,
    sharded: bool = True,
    full: bool = True,
) -> None:
    """Assert one step agrees: losses, every parameter and every gradient (fp32 tolerance).

    ``ours`` (shardwise) against ``ref`` (a plain replica: full tensors) and against
    ``torch_model`` (torch's FSDP2, the same sharding layout: ``to_local()`` and the
    placements must match). With ``full``, sharded values are compared to the replica
    through ``full_tensor()`` (a collective per tensor: every rank must call this);
    without it, each rank compares its ``to_local()`` shard with its chunk of the
    replica's tensor (no collective; together the ranks cover every element). With
    ``sharded`` (between iterations), every parameter and gradient of ``ours`` must be a
    DTensor.
    """
    where = f"step {step}, rank {dist.get_rank()}"
    pairs: list[tuple[str, torch.Tensor, torch.Tensor]] = []  # (what, ours, expected)
    if ref_loss is not None:
        pairs.append((f"loss vs replica at {where}", loss.detach(), ref_loss.detach()))
    if torch_loss is not None:
        pairs.append((f"loss vs torch at {where}", loss.detach(), torch_loss.detach()))
    mine = dict(ours.named_parameters())
    for other in (ref, torch_model):
        if other is not None:
            names = dict(other.named_parameters()).keys()
            assert mine.keys() == names, f"parameter names differ at {where}: {sorted(mine)} vs {sorted(names)}"
    for name, p in mine.items():
        if sharded:
            assert isinstance(p, DTensor), f"{name} is a {type(p).__name__}, not a sharded DTensor, at {where}"
            assert p.grad is None or isinstance(p.grad, DTensor), f"{name}.grad is not a DTensor at {where}"
        if ref is not None:
            pairs += _replica_pairs(f"{name} at {where}", p, ref.get_parameter(name), full)
        if torch_model is not None:
            pairs += _torch_pairs(f"{name} at {where}", p, torch_model.get_parameter(name))
    assert_all_close(pairs)


def assert_all_close(pairs: list[tuple[str, torch.Tensor, torch.Tensor]]) -> None:
    """``torch.testing.assert_close`` on every pair, in one check (many small ones are slow).

    On a mismatch, the first failing pair is reported with its name.
    """
    for what, a, b in pairs:
        same = a.shape == b.shape and a.dtype == b.dtype
        assert same, f"{what}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
    if not pairs:
        return
    flat_a = torch.cat([a.reshape(-1).float() for _, a, _ in pairs])
    flat_b = torch.cat([b.reshape(-1).float() for _, _, b in pairs])
    try:
        torch.testing.assert_close(flat_a, flat_b)
        return
    except AssertionError:
        pass
    for what, a, b in pairs:
        torch.testing.assert_close(a, b, msg=lambda m, what=what: f"{what}: {m}")
    raise AssertionError("values differ (but no single pair does?)")


def _replica_view(t: torch.Tensor, like: torch.Tensor, full: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(ours, replica's) values to compare: full tensors, or our shard and the replica's chunk."""
    if not isinstance(like, DTensor):
        return like, t
    if full:
        return like.full_tensor(), t
    (placement,) = [p for p in like.placements if p.is_shard()] or [None]
    if placement is None:
        return like.to_local(), t
    mesh = like.device_mesh
    dim = like.placements.index(placement)
    return like.to_local(), chunk_of(t, mesh.get_local_rank(dim), mesh.size(dim), placement.dim)


def _replica_pairs(what: str, p: torch.Tensor, ref: torch.Tensor, full: bool) -> list:
    assert p.shape == ref.shape, f"{what}: global shape {tuple(p.shape)}, replica {tuple(ref.shape)}"
    pairs = [(f"param {what} vs replica", *_replica_view(ref.detach(), p.detach(), full))]
    has = (p.grad is not None, ref.grad is not None)
    assert has[0] == has[1], f"grad of {what}: ours {has[0]}, replica {has[1]}"
    if p.grad is not None:
        pairs.append((f"grad {what} vs replica", *_replica_view(ref.grad, p.grad, full)))
    return pairs


def _torch_pairs(what: str, p: torch.Tensor, theirs: torch.Tensor) -> list:
    """Same layout as torch FSDP2: same type, placements, local shard values (params and grads)."""
    pairs = [(f"param {what} vs torch", *_same_layout(what, p.detach(), theirs.detach()))]
    has = (p.grad is not None, theirs.grad is not None)
    assert has[0] == has[1], f"grad of {what}: ours {has[0]}, torch {has[1]}"
    if p.grad is not None:
        pairs.append((f"grad {what} vs torch", *_same_layout(f"grad {what}", p.grad, theirs.grad)))
    return pairs


def _same_layout(what: str, ours: torch.Tensor, theirs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    assert isinstance(ours, DTensor) == isinstance(theirs, DTensor), f"{what}: ours {type(ours)}, torch {type(theirs)}"
    if not isinstance(ours, DTensor):
        return ours, theirs
    assert ours.placements == theirs.placements, f"{what}: placements {ours.placements} vs torch {theirs.placements}"
    assert ours.shape == theirs.shape, f"{what}: global shape {tuple(ours.shape)} vs torch {tuple(theirs.shape)}"
    return ours.to_local(), theirs.to_local()
