"""shardwise.replicate: DDP on the fully_shard machinery, against torch's DDP and torch's replicate.

Each parity case trains ``STEPS`` Adam steps on real gloo ranks, every rank on its own data.
Three copies of one initialisation train side by side (see ``_replicate_helpers.train``):

- ours: ``shardwise.replicate``;
- theirs: ``torch.distributed._composable.replicate_with_fsdp.replicate``, applied the same way;
- the reference: torch's ``DistributedDataParallel`` or, where DDP cannot express the case
  (non-root forward, a second forward method, TP), a plain replica whose gradients are
  all-reduced to the mean by hand.

After every step the losses, every parameter and every gradient agree to fp32 tolerance,
and ours issued one all-reduce per group and no other collective (no all-gather ever),
exactly as torch's replicate did in the same step.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import shardwise
from _models import MLP, allreduce_mean_grads, lm_loss, mlp_batch, rank_generator, token_batch
from _replicate_helpers import (
    OURS,
    STACK,
    STEPS,
    TORCH,
    TRANSFORMER,
    Copies,
    apply_layout,
    build,
    check_counts,
    compare,
    kinds,
    make_copies,
    replicate_modules,
    train,
)
from shardwise.testing import CommCounter, run_on_ranks

TIMEOUT = 90

# ---------------------------------------------------------------- per-rank cases


def _parity(kind, layout, groups, *, dims=None, policy=None, reference="ddp"):
    copies = make_copies(kind, layout, dims=dims, policy=policy, reference=reference)
    return train(copies, kind, groups, dims=dims)


def _parity_prefetch():
    def prefetch(model, lib):
        if lib is None:
            return
        layers = model.layers
        model.set_modules_to_forward_prefetch([layers[0]])
        layers[0].set_modules_to_forward_prefetch([layers[1]])
        layers[1].set_modules_to_backward_prefetch([layers[0]])
        layers[0].set_modules_to_backward_prefetch([model])

    copies = make_copies("transformer", "per_block", prepare=prefetch)
    return train(copies, "transformer", 3)


def _parity_unshard_in_backward():
    def no_unshard(model, lib):
        if lib is not None:
            model.tok_embeddings.set_unshard_in_backward(False)

    copies = make_copies("transformer", "embedding_group", prepare=no_unshard)
    return train(copies, "transformer", 4)


def _parity_mixed_precision():
    """bf16 compute, fp32 all-reduce: only torch's replicate has the same policy."""
    copies = make_copies("transformer", "per_block", policy="bf16", reference="none")
    numel = sum(p.numel() for p in copies.ours.parameters())

    def step(kind, model, data):
        loss = lm_loss(model, data)
        dtypes = {name: p.dtype for name, p in model.named_parameters()}
        assert set(dtypes.values()) == {torch.bfloat16}, f"{type(model).__name__} forward ran with {dtypes}"
        with CommCounter() as comm:
            loss.backward()
        moved = comm.payload_bytes("all_reduce")
        assert moved == 4 * numel, f"all-reduce payload {moved} B, fp32 is {4 * numel} B"
        return loss.detach()

    def check(step_index, copies):
        for name, p in copies.ours.named_parameters():
            assert p.dtype == torch.float32 and p.grad.dtype == torch.float32, f"{name}: {p.dtype}, grad {p.grad.dtype}"

    return train(copies, "transformer", 3, step_fn=step, after_step=check)


def _parity_float64():
    """``module.to(torch.float64)`` after replicate keeps every parameter object."""
    captured = {}

    def to_float64(model, lib):
        before = [id(p) for p in model.parameters()]
        model.to(torch.float64)
        if lib is OURS:
            captured["ids"] = before
            assert [id(p) for p in model.parameters()] == before, "to(float64) replaced parameter objects"
        for name, p in model.named_parameters():
            assert p.dtype == torch.float64, f"{lib and lib.name}: {name} is {p.dtype} after to(float64)"
            if lib is not None:
                assert isinstance(p, DTensor) and p.placements == (Replicate(),), f"{name}: {type(p).__name__}"

    def check(step_index, copies):
        assert [id(p) for p in copies.ours.parameters()] == captured["ids"], "parameter objects changed in training"
        for name, p in copies.ours.named_parameters():
            assert p.dtype == torch.float64 and p.grad.dtype == torch.float64, f"{name}: {p.dtype}/{p.grad.dtype}"

    copies = make_copies("transformer", "per_block", prepare=to_float64)
    return train(copies, "transformer", 3, after_step=check)


def _parity_tied():
    """Embedding and output head share one parameter, managed by the root group."""

    def check(step_index, copies):
        for model in (copies.ours, copies.theirs):
            shared = model.tok_embeddings.weight
            assert model.output.weight is shared and isinstance(shared, DTensor), f"step {step_index}: tie broken"
            assert shared.placements == (Replicate(),) and shared.grad is not None

    copies = make_copies("tied", "per_block")
    assert copies.ours.output.weight is copies.ours.tok_embeddings.weight
    return train(copies, "tied", 3, after_step=check)


def _predict_step(kind, model, data):
    x, y = data
    loss = F.mse_loss(model.predict(x), y)
    loss.backward()
    return loss.detach()


def _parity_forward_method():
    def register(model, lib):
        if lib is not None:
            lib.register_fsdp_forward_method(model, "predict")

    copies = make_copies("predict", "per_block", reference="replica", prepare=register)
    return train(copies, "predict", 3, step_fn=_predict_step)


def _parity_non_root():
    """Each step: a root step, then a step through ``layers[0]`` alone (a non-root)."""
    copies = make_copies("stack", "per_block", reference="replica")
    models = (copies.ours, copies.theirs, copies.ref)
    opts = [torch.optim.Adam(m.parameters(), lr=1e-2) for m in models]
    gen = rank_generator()
    history = []
    for step in range(STEPS):
        x, y = mlp_batch(gen, STACK["in_dim"], STACK["out_dim"])
        h = torch.randn(4, STACK["dim"], generator=gen)
        phases = (("root", lambda m: F.mse_loss(m(x), y)), ("non-root", lambda m: m.layers[0](h).pow(2).mean()))
        for phase, fn in phases:
            losses, counts, registered = [], [], []
            for model, opt in zip(models, opts):
                opt.zero_grad()
                with CommCounter() as comm:
                    loss = fn(model)
                    registered.append(kinds(model))
                    loss.backward()
                losses.append(loss.detach())
                counts.append(comm.counts)
            allreduce_mean_grads(copies.ref)
            for opt in opts:
                opt.step()
            where = f"step {step} {phase}"
            compare(step, copies, losses)
            check_counts(where, counts[0], counts[1], {"all_reduce": 3 if phase == "root" else 1})
            assert registered[0] == registered[1], f"{where}: after forward {registered[0]} vs torch {registered[1]}"
            expect_plain = ("layers.0.",) if phase == "non-root" else ("",)
            assert all((v == "Tensor") == k.startswith(expect_plain) for k, v in registered[0].items()), registered[0]
        history.append(losses[0].item())
    return history


def _parity_microbatches(n_micro: int = 3):
    """1F1B-style: unshard(async_op=True) up front, then per microbatch forward + backward with
    gradient sync (and the last-backward flag) on only for the last one."""
    copies = make_copies("transformer", "per_block")
    models = (copies.ours, copies.theirs, copies.ref)
    opts = [torch.optim.Adam(m.parameters(), lr=1e-2) for m in models]
    gen = rank_generator()
    history = []
    for step in range(STEPS):
        micro = [token_batch(gen, TRANSFORMER["vocab_size"]) for _ in range(n_micro)]
        per_micro = {}
        losses = []
        for model, lib, opt in zip(models, (OURS, TORCH, None), opts):
            opt.zero_grad()
            total = torch.zeros(())
            if lib is None:  # DDP: no_sync() for all but the last microbatch
                for i, tokens in enumerate(micro):
                    ctx = model.no_sync() if i < n_micro - 1 else torch.enable_grad()
                    with ctx:
                        loss = lm_loss(model, tokens)
                        loss.backward()
                    total += loss.detach()
                losses.append(total)
                continue
            counts = []
            with CommCounter() as comm:
                handles = [m.unshard(async_op=True) for m in replicate_modules(model, lib)]
                counts.append(comm.counts)
                for i, tokens in enumerate(micro):
                    last = i == n_micro - 1
                    model.set_requires_gradient_sync(last)
                    model.set_is_last_backward(last)
                    before = comm.snapshot()
                    loss = lm_loss(model, tokens)
                    loss.backward()
                    counts.append((comm.snapshot() - before).counts)
                    total += loss.detach()
                for handle in handles:
                    if handle is not None:
                        handle.wait()
            per_micro[lib.name] = counts
            losses.append(total)
        for opt in opts:
            opt.step()
        compare(step, copies, losses)
        expected = [{}] + [{}] * (n_micro - 1) + [{"all_reduce": 3}]  # unshard, then each microbatch
        for name, counts in per_micro.items():
            assert counts == expected, f"step {step}, {name}: collectives per phase {counts}, expected {expected}"
        history.append(losses[0].item())
    return history


def _mesh_dims(p: torch.Tensor) -> tuple[str, ...] | None:
    return p.device_mesh.mesh_dim_names if isinstance(p, DTensor) else None


def _tp_parity():
    """TP (colwise/rowwise) on mesh['tp'], replicate over mesh['dp_replicate'] of a 2 x 2 mesh."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "tp"))
    plan = {"in_proj": ColwiseParallel(), "out_proj": RowwiseParallel()}
    torch.manual_seed(0)
    base = MLP(8, 16, 6)
    copies = []
    for lib in (OURS, TORCH, None):
        model = parallelize_module(copy.deepcopy(base), mesh["tp"], plan)
        if lib is not None:
            assert lib.replicate(model, mesh=mesh["dp_replicate"]) is model
        copies.append(model)
    ours, theirs, ref = copies
    expected = {
        "in_proj.weight": (Replicate(), Shard(0)),
        "in_proj.bias": (Replicate(), Shard(0)),
        "out_proj.weight": (Replicate(), Shard(1)),
        "out_proj.bias": (Replicate(), Replicate()),
    }
    for model in (ours, theirs):
        for name, p in model.named_parameters():
            assert isinstance(p, DTensor), f"{name}: {type(p).__name__}"
            assert p.device_mesh.mesh_dim_names == ("dp_replicate", "tp"), f"{name}: mesh {p.device_mesh}"
            assert p.placements == expected[name], f"{name}: {p.placements}, expected {expected[name]}"
            assert p.shape == base.get_parameter(name).shape
    dp_group = mesh.get_group("dp_replicate")
    gen = torch.Generator().manual_seed(1000 + mesh.get_local_rank("dp_replicate"))  # same data across tp
    # DTensor's first sharding propagation of an op runs fake tensors, which fail under the
    # counter's dispatch mode: warm its cache on a throwaway TP copy, outside any counter.
    warm = parallelize_module(copy.deepcopy(base), mesh["tp"], plan)
    F.mse_loss(warm(torch.randn(4, 8)), torch.randn(4, 6)).backward()
    opts = [torch.optim.Adam(m.parameters(), lr=1e-2, foreach=True) for m in copies]
    history = []
    for step in range(STEPS):
        x, y = torch.randn(4, 8, generator=gen), torch.randn(4, 6, generator=gen)
        losses, counts, registered = [], [], []
        for model, opt in zip(copies, opts):
            opt.zero_grad()
            with CommCounter() as comm:
                loss = F.mse_loss(model(x), y)
                registered.append({n: (type(p).__name__, _mesh_dims(p)) for n, p in model.named_parameters()})
                loss.backward()
            counts.append(comm.counts)
            losses.append(loss.detach())
        for p in ref.parameters():  # the TP-only reference: average grads over dp_replicate by hand
            local = p.grad.to_local()
            dist.all_reduce(local, group=dp_group)
            local.div_(mesh.size(0))
        for opt in opts:
            opt.step()
        where = f"step {step}, rank {dist.get_rank()}"
        tp_only = {n: ("DTensor", ("tp",)) for n in expected}
        assert registered[0] == tp_only and registered[1] == tp_only, f"{where}: after forward {registered[:2]}"
        want = dict(counts[2])
        want["all_reduce"] = want.get("all_reduce", 0) + 1  # the TP model's own + one dp all-reduce
        check_counts(where, counts[0], counts[1], want)
        assert counts[0].get("all_gather", 0) == counts[2].get("all_gather", 0), f"{where}: {counts}"
        pairs = [(f"loss vs {w}", losses[0], losses[i]) for i, w in ((1, "torch"), (2, "tp-only"))]
        for name, p in ours.named_parameters():
            theirs_p, ref_p = theirs.get_parameter(name), ref.get_parameter(name)
            assert p.placements == theirs_p.placements == expected[name], f"{where}: {name} {p.placements}"
            assert isinstance(p.grad, DTensor) and p.grad.placements == expected[name], f"{where}: {name}.grad"
            pairs += [
                (f"{name} vs torch", p.to_local(), theirs_p.to_local()),
                (f"{name}.grad vs torch", p.grad.to_local(), theirs_p.grad.to_local()),
                (f"{name} vs tp-only", p.to_local(), ref_p.to_local()),
                (f"{name}.grad vs tp-only", p.grad.to_local(), ref_p.grad.to_local()),
            ]
        for what, a, b in pairs:
            torch.testing.assert_close(a.detach(), b.detach(), msg=lambda m, what=what: f"{where}, {what}: {m}")
        history.append(losses[0].item())
    return history


def _registration():
    """What is registered on the modules at each point, for ours and torch's replicate."""
    world = dist.get_world_size()
    base = build("transformer")
    ref = copy.deepcopy(base)
    theirs = apply_layout(copy.deepcopy(base), TORCH, "per_block")
    orig_cls = type(base.layers[0])
    ours = apply_layout(base, OURS, "per_block")
    for m, cls in [(ours, type(ref)), (ours.layers[0], orig_cls), (ours.layers[1], orig_cls)]:
        assert isinstance(m, shardwise.ReplicateModule) and isinstance(m, shardwise.FSDPModule) and isinstance(m, cls)
        assert type(m).__name__ == f"Replicate{cls.__name__}", type(m).__name__
        assert type(m).__mro__[1:4] == (shardwise.ReplicateModule, shardwise.FSDPModule, cls), type(m).__mro__
    assert not isinstance(ours.layers[0].attention, shardwise.FSDPModule)
    assert type(ours.layers[0].attention) is type(ref.layers[0].attention)
    for name, p in ours.named_parameters():
        assert isinstance(p, DTensor) and p.placements == (Replicate(),), f"{name}: {type(p).__name__}"
        mesh = p.device_mesh
        assert mesh.ndim == 1 and mesh.size() == world and mesh.mesh_dim_names == ("replicate",), f"{name}: {mesh}"
        theirs_p = theirs.get_parameter(name)
        assert theirs_p.placements == p.placements and theirs_p.device_mesh.mesh_dim_names == mesh.mesh_dim_names
        torch.testing.assert_close(p.to_local(), ref.get_parameter(name).detach())  # the whole tensor, every rank
    all_dtensor = {n: "DTensor" for n, _ in ours.named_parameters()}
    all_plain = {n: "Tensor" for n in all_dtensor}
    gen = rank_generator()
    seen: list[tuple[str, dict, dict]] = []  # (point, ours, torch's)

    def note(point):
        seen.append((point, kinds(ours), kinds(theirs)))

    with CommCounter() as comm:
        for it in range(2):
            tokens = token_batch(gen, TRANSFORMER["vocab_size"])
            losses = [lm_loss(m, tokens) for m in (ours, theirs, ref)]
            note(f"iteration {it}: after forward")
            if it == 1:  # reshard() every module between forward and backward
                for m in replicate_modules(ours, OURS) + replicate_modules(theirs, TORCH):
                    m.reshard()
                note(f"iteration {it}: after reshard()")
            for loss in losses:
                loss.backward()
            allreduce_mean_grads(ref)
            note(f"iteration {it}: after backward")
            compare(it, Copies(ours, theirs, ref), losses)
            for m in (ours, theirs, ref):
                m.zero_grad()
        for m in (ours.layers[0], theirs.layers[0]):
            m.unshard()
        note("layers[0].unshard()")
        for m in (ours.layers[0], theirs.layers[0]):
            m.reshard()
        note("layers[0].reshard()")
        handles = [m.unshard(async_op=True) for m in (ours, theirs)]
        for h in handles:
            h.wait()
        note("root unshard(async_op=True).wait()")
        for m in (ours, theirs):
            m.reshard()
        note("root reshard()")
    expected = {
        "after forward": all_plain,
        "after reshard()": all_dtensor,
        "after backward": all_dtensor,
        "layers[0].unshard()": {n: "Tensor" if n.startswith("layers.0.") else "DTensor" for n in all_dtensor},
        "layers[0].reshard()": all_dtensor,
        "root unshard(async_op=True).wait()": {n: "DTensor" if n.startswith("layers") else "Tensor" for n in all_dtensor},
        "root reshard()": all_dtensor,
    }
    for point, mine, torchs in seen:
        assert mine == torchs, f"{point}: shardwise {mine} vs torch {torchs}"
        (want,) = [v for k, v in expected.items() if point.endswith(k)]
        assert mine == want, f"{point}: registered {mine}, expected {want}"
    assert comm.count("all_gather") == 0, f"replicate all-gathered: {comm.counts}"
    assert comm.counts == {"all_reduce": comm.count("all_reduce")}, comm.counts
    return [point for point, _, _ in seen]


def _trace_backward():
    model = apply_layout(build("transformer"), OURS, "per_block")
    gen = rank_generator()
    tokens = token_batch(gen, TRANSFORMER["vocab_size"])
    lm_loss(model, tokens).backward()  # lazy init outside the trace
    tokens = token_batch(gen, TRANSFORMER["vocab_size"])
    with shardwise.trace() as t:
        loss = lm_loss(model, tokens)
        loss.backward()
    return t.of()


def _errors():
    world = dist.get_world_size()
    mesh_2d = init_device_mesh("cpu", (1, world), mesh_dim_names=("a", "b"))
    for lib in (OURS, TORCH):  # a 2-D mesh
        with pytest.raises(ValueError, match="1-?D"):
            lib.replicate(MLP(4, 4, 4), mesh=mesh_2d)
    sharded = shardwise.fully_shard(MLP(4, 4, 4))
    with pytest.raises(RuntimeError, match="fully_shard"):
        shardwise.replicate(sharded)
    assert not isinstance(sharded, shardwise.ReplicateModule), type(sharded).__mro__
    assert all(p.placements == (Shard(0),) for p in sharded.parameters()), "a failed replicate changed the params"
    with pytest.raises(RuntimeError, match="fully_shard"):  # torch's replicate says the same
        TORCH.replicate(torch_fully_shard(MLP(4, 4, 4)))
    replicated = shardwise.replicate(MLP(4, 4, 4))
    with pytest.raises(ValueError, match="replicate"):
        shardwise.fully_shard(replicated)
    assert all(p.placements == (Replicate(),) for p in replicated.parameters()), "a failed fully_shard changed params"
    named = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    model = shardwise.replicate(MLP(4, 4, 4), mesh=named)
    assert all(p.device_mesh.mesh_dim_names == ("dp",) and p.placements == (Replicate(),) for p in model.parameters())


# ---------------------------------------------------------------- tests


def _check_trained(histories: list[list[float]]) -> None:
    assert all(len(h) == STEPS for h in histories)
    assert len({tuple(h) for h in histories}) == len(histories), "ranks saw the same data"


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("in_dim,hidden,out_dim", [(16, 15, 8), (7, 15, 3), (16, 17, 8)])
def test_single_group_mlp(world_size, in_dim, hidden, out_dim):
    dims = dict(in_dim=in_dim, hidden=hidden, out_dim=out_dim)
    _check_trained(run_on_ranks(_parity, world_size, "mlp", "root", 1, dims=dims, timeout=TIMEOUT))


@pytest.mark.parametrize("world_size", [2, 4])
def test_group_per_block_transformer(world_size):
    _check_trained(run_on_ranks(_parity, world_size, "transformer", "per_block", 3, timeout=TIMEOUT))


def test_cpu_offload():
    _check_trained(run_on_ranks(_parity, 2, "transformer", "per_block", 3, policy="cpu_offload", timeout=TIMEOUT))


def test_module_called_twice_in_forward():
    _check_trained(run_on_ranks(_parity, 2, "twice", "twice", 2, timeout=TIMEOUT))


def test_non_root_forward_backward():
    _check_trained(run_on_ranks(_parity_non_root, 2, timeout=TIMEOUT))


def test_explicit_prefetch_lists():
    _check_trained(run_on_ranks(_parity_prefetch, 2, timeout=TIMEOUT))


@pytest.mark.parametrize(
    "kind,layout",
    [("checkpointed", "per_block"), ("transformer", "wrapper_outside"), ("transformer", "wrapper_inside")],
    ids=["checkpoint_inside_block", "replicate_checkpoint_wrapper", "checkpoint_wrapper_of_replicated"],
)
def test_activation_checkpointing(kind, layout):
    _check_trained(run_on_ranks(_parity, 2, kind, layout, 3, timeout=TIMEOUT))


def test_tied_embedding_and_output_in_one_group():
    _check_trained(run_on_ranks(_parity_tied, 2, timeout=TIMEOUT))


def test_microbatching_1f1b():
    _check_trained(run_on_ranks(_parity_microbatches, 2, timeout=TIMEOUT))


def test_register_fsdp_forward_method():
    _check_trained(run_on_ranks(_parity_forward_method, 2, timeout=TIMEOUT))


def test_set_unshard_in_backward():
    _check_trained(run_on_ranks(_parity_unshard_in_backward, 2, timeout=TIMEOUT))


def test_mixed_precision_bf16_params_fp32_reduce():
    _check_trained(run_on_ranks(_parity_mixed_precision, 2, timeout=TIMEOUT))


def test_to_float64_after_init():
    _check_trained(run_on_ranks(_parity_float64, 2, timeout=TIMEOUT))


@pytest.mark.parametrize("layout,groups", [("grouped_layers", 2), ("grouped_projections", 3)])
def test_grouped_modules(layout, groups):
    _check_trained(run_on_ranks(_parity, 2, "stack", layout, groups, timeout=TIMEOUT))


def test_tp_and_replicate_2x2():
    histories = run_on_ranks(_tp_parity, 4, timeout=TIMEOUT)
    assert histories[0] == histories[1] and histories[2] == histories[3], "tp ranks of one dp rank saw different data"
    assert histories[0] != histories[2], "the dp ranks saw the same data"


@pytest.mark.parametrize("world_size", [2, 4])
def test_registration_after_forward_and_backward(world_size):
    points = run_on_ranks(_registration, world_size, timeout=TIMEOUT)
    assert len(points[0]) == 9


def test_all_reduces_overlap_backward():
    """The all-reduce of a later block is issued at its post-backward and left in flight while
    earlier blocks run backward (it is waited for only after the next group's post-backward)."""
    for rank, events in enumerate(run_on_ranks(_trace_backward, 2, timeout=TIMEOUT)):
        order = [(kind, fqn) for kind, fqn in events if kind in ("post_backward", "reduce", "reduce_done")]
        assert order.count(("reduce", "layers.1")) == 1 and order.count(("reduce", "layers.0")) == 1, order
        assert [k for k, _ in events].count("reduce") == 3, f"rank {rank}: {events}"
        reduce_1 = order.index(("reduce", "layers.1"))
        post_backward_0 = order.index(("post_backward", "layers.0"))
        done_1 = order.index(("reduce_done", "layers.1"))
        assert order.index(("post_backward", "layers.1")) < reduce_1 < post_backward_0, f"rank {rank}: {order}"
        assert post_backward_0 < done_1, f"rank {rank}: layers.1's all-reduce waited before layers.0's backward: {order}"


def test_errors():
    run_on_ranks(_errors, 2, timeout=TIMEOUT)
