"""Models, references and step checks shared by the N-D mesh and composition tests.

Everything here runs inside the ranks of :func:`shardwise.testing.run_on_ranks`.

- :class:`TPTransformer`: a tiny causal LM whose attention and feed-forward use separate
  projections (``wq``/``wk``/``wv``/``wo``, ``w1``/``w2``) so tensor parallelism can split
  them by heads and hidden units; :func:`tp_plan` / :func:`parallelize` apply torch's
  ``ColwiseParallel`` / ``RowwiseParallel`` (optionally ``SequenceParallel`` norms);
- :func:`average_grads`: turns a plain (or TP-only) replica into the data-parallel
  reference: its gradients are all-reduced and averaged over the data-parallel ranks;
- :func:`check_step`: asserts one step's losses, ``full_tensor()`` of every parameter and
  gradient against the reference, and placements plus ``to_local()`` of every parameter
  and gradient against torch's ``fully_shard`` (same layout);
- :func:`train`: a few SGD steps of the three copies with :func:`check_step` after every
  step; :func:`tally`: collective counts with shardwise's gloo reduce-scatter named as such.
"""

from __future__ import annotations

import copy
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._redistribute import _gen_transform_infos
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from _models import assert_all_close
from shardwise.testing import CommCounter

TIMEOUT = 180  # the machine is shared and loaded: generous, but a hang still fails
LR = 0.1
AC_PREFIX = "_checkpoint_wrapped_module."

# ---------------------------------------------------------------- meshes


def make_mesh(shape: tuple[int, ...], names: tuple[str, ...] | None) -> DeviceMesh:
    """``init_device_mesh("cpu", shape, mesh_dim_names=names)`` after clearing DTensor's
    sharding-propagation caches.

    The harness destroys the process groups a task created; a mesh of the next task with
    the same shape and names compares equal to the old one (DeviceMesh equality ignores its
    groups), so a cached propagation result would hand back a spec on the *old* mesh and
    its destroyed groups ("Could not resolve the process group registered under the name").
    """
    clear_dtensor_caches()
    return init_device_mesh("cpu", shape, mesh_dim_names=names)


def clear_dtensor_caches() -> None:
    """DTensor's sharding-propagation caches, emptied before a task builds its meshes (see
    :func:`make_mesh`)."""
    propagator = DTensor._op_dispatcher.sharding_propagator
    propagator.propagate_op_sharding.cache_clear()
    propagator._propagate_tensor_meta_cached.cache_clear()
    torch._C._clear_DTensor_sharding_propagator_cache()  # the C++ fast path's copy
    _gen_transform_infos.cache_clear()


def unflattened(world: DeviceMesh, dims: dict[str, int]) -> DeviceMesh:
    """``world._unflatten`` into ``dims`` (name -> size), as torchtitan's ``ParallelDims``
    builds each of its meshes: a dim of size 1 gets the ``fake`` backend (no process group)."""
    fake = {name: "fake" for name, size in dims.items() if size == 1}
    return world._unflatten(0, tuple(dims.values()), tuple(dims), backend_override=fake)


def titan_meshes(*, dp_replicate: int = 1, dp_shard: int = 1, cp: int = 1, tp: int = 1, ep: int = 1, pp: int = 1) -> dict:
    """The 1-D meshes torchtitan's trainer hands its parallelisms, made its way: one 1-D
    ``world`` mesh unflattened three times (data loading, dense params, MoE experts). The
    root of every mesh is ``world``, which has none of these names. ``fsdp`` folds ``cp``
    in (torchtitan's default), ``efsdp`` is the experts' data-parallel dim."""
    clear_dtensor_caches()
    world = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("world",))
    fsdp, batch = dp_shard * cp, dp_replicate * dp_shard
    loading = unflattened(world, dict(pp=pp, batch=batch, cp=cp, tp=tp))
    dense = unflattened(world, dict(pp=pp, dp_replicate=dp_replicate, fsdp=fsdp, tp=tp))
    sparse = unflattened(world, dict(pp=pp, dp_replicate=dp_replicate, efsdp=fsdp * tp // ep, ep=ep))
    return {
        "world": world,
        "pp": loading["pp"],
        "batch": loading["batch"],
        "tp": loading["tp"],
        "fsdp": dense["fsdp"],
        "dp": dense["dp_replicate", "fsdp"] if dp_replicate > 1 else dense["fsdp"],
        "dp_replicate": dense["dp_replicate"],
        "ep": sparse["ep"],
        "efsdp": sparse["dp_replicate", "efsdp"] if dp_replicate > 1 else sparse["efsdp"],
    }


# ---------------------------------------------------------------- models


class FeedForward(nn.Module):
    """``w2(relu(w1(x)))``; TP splits ``w1`` by output and ``w2`` by input units."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden)
        self.w2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.relu(self.w1(x)))


class TPAttention(nn.Module):
    """Causal attention with separate q/k/v projections; the head count comes from the
    (possibly TP-local) projection width, so the same code runs on a head shard."""

    def __init__(self, dim: int, n_heads: int):
        super().__init__()
        self.head_dim = dim // n_heads
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, dim, bias=False)
        self.wv = nn.Linear(dim, dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (w(x).view(b, s, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (b, local heads, s, hd)
        return self.wo(y.transpose(1, 2).reshape(b, s, -1))  # (b, s, dim)


class TPBlock(nn.Module):
    def __init__(self, dim: int, n_heads: int, hidden: int):
        super().__init__()
        self.attention_norm = nn.LayerNorm(dim)
        self.attention = TPAttention(dim, n_heads)
        self.ffn_norm = nn.LayerNorm(dim)
        self.feed_forward = FeedForward(dim, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class TPTransformer(nn.Module):
    """Embeddings -> blocks -> norm -> output (the attribute names torchtitan uses)."""

    def __init__(self, vocab_size=16, dim=8, n_layers=2, n_heads=2, hidden=10, max_seq_len=8):
        super().__init__()
        self.vocab_size = vocab_size
        self.tok_embeddings = nn.Embedding(vocab_size, dim)
        self.pos_embeddings = nn.Embedding(max_seq_len, dim)
        self.layers = nn.ModuleList(TPBlock(dim, n_heads, hidden) for _ in range(n_layers))
        self.norm = nn.LayerNorm(dim)
        self.output = nn.Linear(dim, vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.size(1), device=tokens.device)
        h = self.tok_embeddings(tokens) + self.pos_embeddings(positions)  # (b, s, dim)
        for layer in self.layers:
            h = layer(h)
        if isinstance(h, DTensor):  # sequence parallel: (b, s/tp, dim) shards back to (b, s, dim)
            h = h.full_tensor()
        return self.output(self.norm(h))  # (b, s, vocab)


def tp_plan(sequence_parallel: bool = False) -> dict:
    """Megatron-style plan for one :class:`TPBlock` (heads and hidden units split)."""
    plan = {
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(),
    }
    if sequence_parallel:  # the residual stream is sharded over the sequence between blocks
        seq_to_full = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
        plan.update(
            {
                "attention_norm": SequenceParallel(),
                "attention": seq_to_full,
                "attention.wo": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
                "ffn_norm": SequenceParallel(),
                "feed_forward": copy.deepcopy(seq_to_full),
                "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
            }
        )
    return plan


def parallelize(model: TPTransformer, tp_mesh, sequence_parallel: bool = False) -> TPTransformer:
    """TP on every block; with ``sequence_parallel`` the blocks' input/output is the
    sequence-sharded DTensor, converted at the model's edges."""
    for layer in model.layers:
        parallelize_module(layer, tp_mesh, tp_plan(sequence_parallel))
    if sequence_parallel:
        to_seq_shards = PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),))
        parallelize_module(model.layers[0], tp_mesh, to_seq_shards)
    return model


# ---------------------------------------------------------------- data and references


def generator(data_rank: int, seed: int = 0) -> torch.Generator:
    """Data differs by data-parallel rank (ranks of one TP group share their batch)."""
    return torch.Generator().manual_seed(1000 * (seed + 1) + data_rank)


def token_batches(gen: torch.Generator, vocab: int, n: int, seq_len: int = 8, batch: int = 2) -> list[torch.Tensor]:
    return [torch.randint(0, vocab, (batch, seq_len + 1), generator=gen) for _ in range(n)]


def lm_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])  # (b, s, vocab)
    if isinstance(logits, DTensor):
        logits = logits.full_tensor()
    return F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def full_all(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """``[full(t) for t in tensors]`` with one ``all_gather_object`` per 1-D mesh instead of
    one all-gather per DTensor (a step check compares hundreds). A DTensor on a 1-D mesh
    with a ``Shard(d)`` placement is its ranks' local tensors concatenated along ``d`` in
    rank order (``torch.chunk``'s split, empty shards included), with ``Replicate()`` any
    rank's local tensor; others (n-D meshes, strided or partial placements) call
    ``full_tensor()`` themselves. Every rank must call it with the same list."""
    out: list[torch.Tensor | None] = [None if isinstance(t, DTensor) else t for t in tensors]
    by_mesh: dict[DeviceMesh, list[int]] = {}
    for i, t in enumerate(tensors):
        if isinstance(t, DTensor) and t.device_mesh.ndim == 1 and type(t.placements[0]) in (Shard, Replicate):
            by_mesh.setdefault(t.device_mesh, []).append(i)
        elif isinstance(t, DTensor):
            out[i] = t.full_tensor()
    for mesh, indices in by_mesh.items():
        group = mesh.get_group()
        gathered: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, [tensors[i].to_local().detach().cpu() for i in indices], group=group)
        for j, i in enumerate(indices):
            placement, locals_ = tensors[i].placements[0], [per_rank[j] for per_rank in gathered]
            whole = torch.cat(locals_, dim=placement.dim) if isinstance(placement, Shard) else locals_[0]
            out[i] = whole.to(tensors[i].device)
    return out


def average_grads(model: nn.Module, group: dist.ProcessGroup | None = None, scale: float = 1.0) -> None:
    """The data-parallel reference: all-reduce every gradient's local tensor over ``group``
    (default: all ranks), divide by its size, multiply by ``scale`` (one collective)."""
    grads = [local(p.grad) for p in model.parameters() if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    flat.mul_(scale / dist.get_world_size(group))
    for g, reduced in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(reduced.view_as(g))


def named_params(model: nn.Module) -> dict[str, nn.Parameter]:
    """Parameters by name, ignoring ``checkpoint_wrapper``'s prefix."""
    return {name.replace(AC_PREFIX, ""): p for name, p in model.named_parameters()}


# ---------------------------------------------------------------- step checks


def check_step(
    where: str,
    ours: nn.Module,
    ref: nn.Module,
    loss: torch.Tensor,
    ref_loss: torch.Tensor,
    theirs: nn.Module | None = None,
    torch_loss: torch.Tensor | None = None,
    *,
    rtol: float | None = None,
    atol: float | None = None,
) -> None:
    """Losses, ``full_tensor()`` of params and grads vs the reference; placements and
    ``to_local()`` of params and grads vs torch's fully_shard. Every rank must call it."""
    where = f"{where}, rank {dist.get_rank()}"
    mine, refs = named_params(ours), named_params(ref)
    assert mine.keys() == refs.keys(), f"{where}: names {sorted(mine)} vs reference {sorted(refs)}"
    pairs = [(f"loss vs reference at {where}", loss.detach(), ref_loss.detach())]
    theirs_params = named_params(theirs) if theirs is not None else None
    if theirs is not None:
        assert mine.keys() == theirs_params.keys(), f"{where}: names {sorted(mine)} vs torch {sorted(theirs_params)}"
        pairs.append((f"loss vs torch at {where}", loss.detach(), torch_loss.detach()))
    to_gather = []  # (what, ours, reference), made whole in one batch below
    for name, p in mine.items():
        assert isinstance(p, DTensor), f"{where}: {name} is a {type(p).__name__}, not a sharded DTensor"
        r = refs[name]
        to_gather.append((f"param {name} vs reference at {where}", p.detach(), r.detach()))
        assert (p.grad is None) == (r.grad is None), f"{where}: grad of {name}: ours {p.grad is not None}"
        if p.grad is not None:
            assert isinstance(p.grad, DTensor), f"{where}: {name}.grad is a {type(p.grad).__name__}"
            to_gather.append((f"grad {name} vs reference at {where}", p.grad, r.grad))
        if theirs is not None:
            pairs += _same_layout(f"{name} at {where}", p, theirs_params[name])
    whole = full_all([t for _, a, b in to_gather for t in (a, b)])
    pairs += [(what, whole[2 * k], whole[2 * k + 1]) for k, (what, _, _) in enumerate(to_gather)]
    _assert_close(pairs, rtol, atol)


def _same_layout(what: str, p: torch.Tensor, q: torch.Tensor) -> list:
    assert isinstance(q, DTensor), f"torch's {what} is a {type(q).__name__}"
    pairs = []
    for kind, a, b in (("param", p.detach(), q.detach()), ("grad", p.grad, q.grad)):
        assert (a is None) == (b is None), f"{kind} {what}: ours {a is not None}, torch {b is not None}"
        if a is None:
            continue
        assert a.placements == b.placements, f"{kind} {what}: placements {a.placements} vs torch {b.placements}"
        assert a.device_mesh.mesh.tolist() == b.device_mesh.mesh.tolist(), f"{kind} {what}: mesh {a.device_mesh} vs {b.device_mesh}"
        assert a.shape == b.shape, f"{kind} {what}: shape {tuple(a.shape)} vs torch {tuple(b.shape)}"
        pairs.append((f"{kind} {what} vs torch (to_local)", a.to_local(), b.to_local()))
    return pairs


def _assert_close(pairs: list, rtol: float | None, atol: float | None) -> None:
    if rtol is None:
        assert_all_close(pairs)
        return
    for what, a, b in pairs:
        torch.testing.assert_close(a, b, rtol=rtol, atol=atol, msg=lambda m, what=what: f"{what}: {m}")


def same_as_torch(where: str, ours: nn.Module, theirs: nn.Module, mesh_of: Callable | None = None) -> None:
    """Every param's and grad's placements, mesh and local tensor are torch's, bit for bit;
    with ``mesh_of(name)``, also the mesh that name must be on (None: any)."""
    mine, torch_params = dict(ours.named_parameters()), dict(theirs.named_parameters())
    assert mine.keys() == torch_params.keys(), f"{where}: {sorted(mine)} vs torch {sorted(torch_params)}"
    for name, p in mine.items():
        q = torch_params[name]
        for kind, a, b in (("param", p.detach(), q.detach()), ("grad", p.grad, q.grad)):
            assert (a is None) == (b is None), f"{where}: {kind} {name}: ours {a is not None}, torch {b is not None}"
            if a is None:
                continue
            assert isinstance(a, DTensor), f"{where}: {kind} {name} is a {type(a).__name__}"
            assert a.placements == b.placements, f"{where}: {kind} {name}: {a.placements} vs torch {b.placements}"
            assert a.device_mesh == b.device_mesh, f"{where}: {kind} {name}: {a.device_mesh} vs torch {b.device_mesh}"
            want = mesh_of(name) if mesh_of is not None else None
            assert want is None or a.device_mesh == want, f"{where}: {kind} {name} on {a.device_mesh}, not {want}"
            assert torch.equal(a.to_local(), b.to_local()), f"{where}: {kind} {name} differs from torch's (rank {dist.get_rank()})"



# ---------------------------------------------------------------- training


def step_all(models: list[nn.Module], lr: float = LR) -> None:
    """One plain SGD step (``p -= lr * grad``) on each model: cheap on DTensors."""
    with torch.no_grad():
        for model in models:
            for p in model.parameters():
                if p.grad is not None:
                    p.add_(p.grad, alpha=-lr)


def zero_all(models: list[nn.Module]) -> None:
    for model in models:
        model.zero_grad(set_to_none=True)


def forward_backward(model: nn.Module, batches: list, loss_fn: Callable = lm_loss, before: Callable | None = None) -> torch.Tensor:
    """Every micro-batch's loss with backward on each (grads accumulate); returns the sum.

    ``before(model, i, n)`` runs before micro-batch ``i`` of ``n`` (e.g. to turn sync off)."""
    total = torch.zeros(())
    for i, batch in enumerate(batches):
        if before is not None:
            before(model, i, len(batches))
        loss = loss_fn(model, batch)
        loss.backward()
        total = total + loss.detach()
    return total


def train(
    ours: nn.Module,
    ref: nn.Module,
    theirs: nn.Module | None,
    batches_per_step: list[list],
    *,
    ref_group: dist.ProcessGroup | None = None,
    loss_fn: Callable = lm_loss,
    before: Callable | None = None,
    ref_scale: float = 1.0,
    after_backward: Callable | None = None,
    tolerance: dict | None = None,
    counts: dict | None = None,
) -> list[float]:
    """One SGD step per entry of ``batches_per_step`` (its micro-batches), all three copies,
    :func:`check_step` after every step. Returns our summed loss per step.

    With ``counts`` (a dict), the collectives of each step's forwards and backwards are
    appended to ``counts["ours"]`` and ``counts["torch"]`` as :class:`CommEvent` lists."""
    history = []
    models = [m for m in (ours, ref, theirs) if m is not None]
    for step, batches in enumerate(batches_per_step):
        zero_all(models)
        loss = _counted(counts, "ours", lambda: forward_backward(ours, batches, loss_fn, before))
        ref_loss = forward_backward(ref, batches, loss_fn)
        average_grads(ref, ref_group, ref_scale)
        torch_loss = None
        if theirs is not None:
            torch_loss = _counted(counts, "torch", lambda: forward_backward(theirs, batches, loss_fn, before))
        if after_backward is not None:
            after_backward(ours, ref, theirs)
        check_step(f"step {step} after backward", ours, ref, loss, ref_loss, theirs, torch_loss, **(tolerance or {}))
        step_all(models)
        history.append(loss.item())
    check_step("after the last step", ours, ref, loss, ref_loss, theirs, torch_loss, **(tolerance or {}))
    return history


def _counted(counts: dict | None, key: str, fn: Callable):
    if counts is None:
        return fn()
    with CommCounter() as counter:
        result = fn()
    counts.setdefault(key, []).append(list(counter.events))
    return result


def tally(events: list) -> dict[str, int]:
    """kind -> count, with shardwise's gloo reduce-scatter (an all-to-all plus a local sum,
    see ``shardwise.collectives.reduce_scatter``) counted as the reduce-scatter it is."""
    return {kind: len(of_kind) for kind, of_kind in tally_by_kind(events).items()}


def tally_by_kind(events: list) -> dict[str, list]:
    """kind -> events, an all-to-all (shardwise's gloo reduce-scatter) filed as a reduce-scatter."""
    out: dict[str, list] = {}
    for e in events:
        out.setdefault("reduce_scatter" if e.kind == "all_to_all" else e.kind, []).append(e)
    return out

