"""Ranks that are threads of one process: torch's ``MultiThreadedTestCase`` and
``init_process_group("threaded")`` (FSDP2's own tests and many users' unit tests use it),
at 2, 4 and 8 thread-ranks, with every fault default on (order check, step digests,
watchdog).

Everything shardwise keeps for a rank (lazy init's agreement rounds, the fault monitor's
ledgers, beacons and store keys) must be per rank, not per process, and must survive the
process groups being destroyed and re-created: torch's harness does so between tests,
with a new store each time, and the classes below run one after another in this process
at different world sizes (2, then 4, then 8: the same group names come back with other
members). Each case trains shardwise and torch's FSDP2 side by side in the same threaded
group, bit-equal every step (same collectives, same math).
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import Shard, distribute_tensor

import shardwise
from shardwise import faults

from _threaded_helpers import ThreadedCase

STEPS = 3


class _Net(nn.Module):
    def __init__(self, dim: int = 8):
        super().__init__()
        self.inp = nn.Linear(6, dim)
        self.layers = nn.ModuleList(nn.Linear(dim, dim) for _ in range(2))
        self.out = nn.Linear(dim, 3)

    def forward(self, x: torch.Tensor, order: tuple[int, ...] = (0, 1)) -> torch.Tensor:
        h = self.inp(x)
        for layer in (self.layers[i] for i in order):
            h = h + torch.tanh(layer(h))
        return self.out(h)


class _Block(nn.Module):
    """``x + tanh(lin(x))``, the residual inside: blocks chain output to input directly, so
    shardwise's post-backward is a pre-hook on the node of the previous block's output
    (:mod:`shardwise.backward_hooks`). Records what made its input."""

    def __init__(self, dim: int):
        super().__init__()
        self.lin = nn.Linear(dim, dim)
        self.input_made_by = ""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.input_made_by = type(x.grad_fn).__name__
        return x + torch.tanh(self.lin(x))


class _ChainedNet(_Net):
    def __init__(self, dim: int = 8):
        super().__init__(dim)
        self.layers = nn.ModuleList(_Block(dim) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for layer in self.layers:
            h = layer(h)
        return self.out(h)


def _shard(model: _Net, fully_shard_fn, **kwargs) -> _Net:
    for layer in model.layers:
        fully_shard_fn(layer, **kwargs)
    return fully_shard_fn(model, **kwargs)


def _batch(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(4, 6, generator=gen), torch.randn(4, 3, generator=gen)


def _train_side_by_side(ours: nn.Module, theirs: nn.Module, steps: int = STEPS, check=None) -> None:
    """SGD steps on both; losses, local params and local grads bit-equal at every step."""
    rank = dist.get_rank()
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ours, theirs)]
    gen = torch.Generator().manual_seed(rank)
    for step in range(steps):
        x, y = _batch(gen)
        losses = []
        for model, opt in zip((ours, theirs), opts):
            opt.zero_grad()
            loss = F.mse_loss(model(x), y)
            loss.backward()
            losses.append(loss.detach())
        assert torch.equal(*losses), f"rank {rank} step {step}: losses {losses}"
        for (name, p), q in zip(ours.named_parameters(), theirs.parameters()):
            where = f"rank {rank} step {step}: {name}"
            assert p.placements == q.placements and torch.equal(p.to_local(), q.to_local()), where
            assert torch.equal(p.grad.to_local(), q.grad.to_local()), f"{where}.grad"
            if check is not None:
                check(name, p)
        for opt in opts:
            opt.step()


def _largest_dim_that_divides(world_size: int):
    """A ``shard_placement_fn`` putting each param on its largest evenly divisible dim
    (dim 1 for the ``(dim, 6)`` and ``(dim, dim)`` weights of a wide net)."""

    def placement(param: nn.Parameter) -> Shard:
        dims = [d for d in range(param.ndim) if param.shape[d] % world_size == 0] or [0]
        return Shard(max(dims, key=lambda d: (param.shape[d], d)))

    return placement


class _Cases:
    """The cases every world size runs (mixed into a ThreadedCase per world size)."""

    def test_trains_like_torch_fsdp2(self) -> None:
        mesh = init_device_mesh("cpu", (self.world_size,))
        torch.manual_seed(0)  # per thread: the same initialisation on every rank
        base = _Net()
        theirs = _shard(copy.deepcopy(base), torch_fully_shard, mesh=mesh)
        ours = _shard(base, shardwise.fully_shard, mesh=mesh)
        _train_side_by_side(ours, theirs)

    def test_post_accumulate_grad_hooks_run_once_with_torch_functions_on(self) -> None:
        """A hook on every sharded param runs once per param and backward, with torch
        functions enabled (the reducer's ``.grad`` accesses skip the ``__torch_function__``
        lookup only when no hook is registered); losses, params and grads stay bit-equal to
        torch's FSDP2."""
        mesh = init_device_mesh("cpu", (self.world_size,))
        torch.manual_seed(0)
        base = _Net()
        theirs = _shard(copy.deepcopy(base), torch_fully_shard, mesh=mesh)
        ours = _shard(base, shardwise.fully_shard, mesh=mesh)
        names = {p: name for name, p in ours.named_parameters()}
        calls: dict[str, int] = {}
        without_torch_function: list[str] = []

        def hook(param: torch.Tensor) -> None:
            calls[names[param]] = calls.get(names[param], 0) + 1
            if not torch._C._is_torch_function_enabled():
                without_torch_function.append(names[param])

        for p in ours.parameters():
            p.register_post_accumulate_grad_hook(hook)
        _train_side_by_side(ours, theirs)
        assert calls == {name: STEPS for name in names.values()}, calls
        assert without_torch_function == [], without_torch_function

    def test_chained_blocks_post_backward_on_the_input_node_train_like_torch_fsdp2(self) -> None:
        """Blocks whose input is the previous block's output: no identity Function between
        them (the first block's input comes from the root's own Linear, so it takes one),
        and losses, params and grads bit-equal to torch's FSDP2 every step."""
        mesh = init_device_mesh("cpu", (self.world_size,))
        torch.manual_seed(0)
        base = _ChainedNet()
        theirs = _shard(copy.deepcopy(base), torch_fully_shard, mesh=mesh)
        ours = _shard(base, shardwise.fully_shard, mesh=mesh)
        _train_side_by_side(ours, theirs)
        made_by = [layer.input_made_by for layer in ours.layers]
        assert made_by[0] == "PostBackwardTriggerBackward", made_by
        assert all(name == "AddBackward0" for name in made_by[1:]), made_by

    def test_clip_grad_norm_through_the_fault_monitor_matches_torchs_clip(self) -> None:
        """``shardwise.clip_grad_norm_`` reduces the norm through the fault monitor (a
        group no root marks counts each collective as a step): on thread-ranks, with every
        default on, its norm and clipped grads match torch's ``clip_grad_norm_`` on torch's
        FSDP2 every step, to fp32 tolerance (torch reduces each parameter's norm across
        ranks, then their norm; shardwise this rank's norm of its shards, once: the same
        value, rounded differently)."""
        mesh = init_device_mesh("cpu", (self.world_size,))
        torch.manual_seed(0)
        base = _Net()
        theirs = _shard(copy.deepcopy(base), torch_fully_shard, mesh=mesh)
        ours = _shard(base, shardwise.fully_shard, mesh=mesh)
        opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ours, theirs)]
        gen = torch.Generator().manual_seed(dist.get_rank())
        for step in range(STEPS):
            x, y = _batch(gen)
            for model in (ours, theirs):
                F.mse_loss(model(x), y).backward()
            norm = shardwise.clip_grad_norm_(ours.parameters(), 0.05)
            reference = torch.nn.utils.clip_grad_norm_(theirs.parameters(), 0.05).full_tensor()
            torch.testing.assert_close(norm, reference, msg=f"rank {dist.get_rank()} step {step}: norm")
            assert norm > 0.05  # it clipped
            for (name, p), q in zip(ours.named_parameters(), theirs.parameters()):
                torch.testing.assert_close(p.grad.to_local(), q.grad.to_local(), msg=f"step {step}: {name}.grad")
            for opt in opts:
                opt.step()
                opt.zero_grad()

    def test_shard_placement_on_dim_1_gives_contiguous_grads_like_torch(self) -> None:
        torch.manual_seed(0)
        base = _Net(dim=self.world_size * 3)
        placement = _largest_dim_that_divides(self.world_size)
        theirs = _shard(copy.deepcopy(base), torch_fully_shard, shard_placement_fn=placement)
        ours = _shard(base, shardwise.fully_shard, shard_placement_fn=placement)
        assert any(p.placements[0].dim == 1 for p in ours.parameters())

        def contiguous(name: str, p: nn.Parameter) -> None:
            assert p.grad.to_local().is_contiguous(), f"{name}.grad is not contiguous"

        _train_side_by_side(ours, theirs, check=contiguous)

    def test_order_check_names_a_diverging_thread_rank_on_every_rank(self) -> None:
        mesh = init_device_mesh("cpu", (self.world_size,))
        model = _shard(_Net(), shardwise.fully_shard, mesh=mesh)
        swapped = dist.get_rank() == self.world_size - 1  # this rank runs its same-shaped layers swapped
        try:
            model(torch.randn(4, 6), order=(1, 0) if swapped else (0, 1)).sum().backward()
        except faults.CollectiveMismatchError as err:
            assert "ranks diverged at step 0" in str(err) and "layers.1" in str(err), str(err)
        else:
            raise AssertionError(f"rank {dist.get_rank()}: no CollectiveMismatchError")


class _Broadcast:
    """Cases that need a mesh of four or more thread-ranks."""

    def test_rank0_broadcast_into_a_meta_model(self) -> None:
        """A full state dict on rank 0, broadcast and sharded into a model built on meta
        (``load_state_dict(assign=True)``), then one step against a model sharded from
        rank 0's copy: equal losses and grads."""
        mesh = init_device_mesh("cpu", (self.world_size,))
        rank = dist.get_rank()
        torch.manual_seed(42)
        full = _Net().state_dict() if rank == 0 else None
        with torch.device("meta"):
            model = _shard(_Net(), shardwise.fully_shard, mesh=mesh)
        loaded = {}
        for name, meta in model.state_dict().items():
            value = full[name].clone() if rank == 0 else torch.empty(meta.shape, dtype=meta.dtype)
            dist.broadcast(value, src=0)
            loaded[name] = nn.Parameter(distribute_tensor(value, meta.device_mesh, meta.placements))
        model.load_state_dict(loaded, assign=True)

        reference = _Net()
        if rank == 0:
            reference.load_state_dict(full)
        for param in reference.parameters():
            dist.broadcast(param.detach(), src=0)
        reference = _shard(reference, shardwise.fully_shard, mesh=mesh)
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            assert torch.equal(p.to_local(), q.to_local()), name
        x = torch.randn(2, 6, generator=torch.Generator().manual_seed(rank))
        losses = [m(x).sum() for m in (model, reference)]
        for loss in losses:
            loss.backward()
        assert torch.equal(*losses)
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            assert torch.equal(p.grad.to_local(), q.grad.to_local()), f"{name}.grad"

    def test_hsdp_by_hand_with_a_custom_all_reduce_hook_like_torch(self) -> None:
        """FSDP over pairs of ranks, an all-reduce hook averaging the gradient shards across
        the pairs (HSDP built by hand, as torchft does): bit-equal to torch's."""
        rank, world = dist.get_rank(), self.world_size
        intra, _ = dist.new_subgroups(group_size=2)
        inter, _ = dist.new_subgroups_by_enumeration([list(range(i, world, 2)) for i in range(2)])
        mesh = DeviceMesh.from_group(intra, "cpu", dist.get_process_group_ranks(intra), mesh_dim_names=("shard",))
        torch.manual_seed(0)
        base = _Net()
        calls = []

        def hook(grad: torch.Tensor) -> None:
            calls.append(grad.dtype)
            dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=inter)
            grad.div_(dist.get_world_size(inter))

        theirs = _shard(copy.deepcopy(base), torch_fully_shard, mesh=mesh)
        ours = _shard(base, shardwise.fully_shard, mesh=mesh)
        for model in (ours, theirs):
            for module in (*model.layers, model):
                module.set_all_reduce_hook(hook)
        _train_side_by_side(ours, theirs)
        assert len(calls) == 2 * 3 * STEPS, f"rank {rank}: {len(calls)} hook calls"


class TestTwoThreadRanks(_Cases, ThreadedCase):
    WORLD_SIZE = 2


class TestFourThreadRanks(_Cases, _Broadcast, ThreadedCase):
    WORLD_SIZE = 4


class TestEightThreadRanks(_Cases, _Broadcast, ThreadedCase):
    WORLD_SIZE = 8


class TestTwoThreadRanksAgain(_Cases, ThreadedCase):
    """After 4 and 8: group "0" has had three other memberships in this process."""

    WORLD_SIZE = 2
