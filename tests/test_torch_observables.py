"""What users' own tests and debugging tools observe, compared with torch's FSDP2 (issue 14).

Each case is a difference a drop-in must not have:

- **collective kinds**: under torch's ``CommDebugMode`` a synced backward shows the same
  number of ``c10d._reduce_scatter_base_`` calls as torch's (one per group): shardwise's
  faster gloo all-to-all reduction is opt-in, not the default;
- **chunked-loss heads**: with ``fully_shard([norm, head])`` and ``head`` run alone per
  chunk after the root's forward, ``head.weight.grad`` is set after the first chunk's
  backward and grows with every chunk, as torch's;
- **``set_gradient_divide_factor(f)``**: torch's PREMUL_SUM numerics: each rank's gradient
  is multiplied by ``1/f`` before the SUM (bit-equal to a replica doing exactly that),
  and at world size 1 exactly one division by ``f``;
- **setter order**, **``set_post_optim_event(None)``** and the **error phrase** of a
  parameter shared across two groups ("already managed by another"), as torch's;
- **a gradient's spec is its parameter's**: ``p.grad._spec is p._spec``, as torch's (also
  after ``load_state_dict(assign=True)``). DTensor's sharding-propagation cache compares
  specs by identity first, so the optimizer's ``param.add_(grad)`` skips a field-by-field
  ``DTensorSpec.__eq__`` per parameter and step (about 1 µs each on CPU).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor.debug import CommDebugMode

import shardwise
from _control_helpers import ChunkedHead, Stack, batch, make_trio, rank_gen, shard_chunked_head, shard_stack
from shardwise.collectives import AllGather
from shardwise.testing import run_on_ranks

TIMEOUT = 60
RS = torch.ops.c10d._reduce_scatter_base_
A2A = torch.ops.c10d.alltoall_base_


# ---------------------------------------------------------------- collective kinds


def _c10d_counts(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict:
    with CommDebugMode() as mode:
        F.mse_loss(model(x), y).backward()
    counts = mode.get_comm_counts()
    return {"reduce_scatter": counts.get(RS, 0), "all_to_all": counts.get(A2A, 0)}


def _comm_debug_mode_kinds() -> None:
    ours, theirs, _ = make_trio(Stack, shard_stack)
    x, y = batch(rank_gen())
    mine, torchs = _c10d_counts(ours, x, y), _c10d_counts(theirs, x, y)
    assert mine == torchs and torchs["reduce_scatter"] > 0, f"c10d ops: shardwise {mine}, torch {torchs}"


def test_comm_debug_mode_sees_torchs_reduce_scatters():
    run_on_ranks(_comm_debug_mode_kinds, 2, timeout=TIMEOUT)


# ---------------------------------------------------------------- chunked-loss head


def _chunk_grads(model: ChunkedHead, x: torch.Tensor, y: torch.Tensor, chunks: int) -> list:
    """``head.weight.grad`` (local shard, or None) after each chunk's backward."""
    h = model(x).detach().requires_grad_()
    seen = []
    for hc, yc in zip(h.chunk(chunks), y.chunk(chunks)):
        F.mse_loss(model.output(hc), yc).backward()
        grad = model.output.weight.grad
        seen.append(None if grad is None else grad.to_local().clone())
    return seen


def _chunked_head_grads() -> None:
    torch.manual_seed(0)
    base = ChunkedHead()
    theirs = shard_chunked_head(copy.deepcopy(base), torch_fully_shard)
    ours = shard_chunked_head(base, shardwise.fully_shard)
    x, y = batch(rank_gen(), n=6)
    mine, torchs = _chunk_grads(ours, x, y, 3), _chunk_grads(theirs, x, y, 3)
    assert all(g is not None for g in torchs), "torch sets the grad after each chunk"
    for i, (a, b) in enumerate(zip(mine, torchs)):
        assert a is not None, f"head.weight.grad is None after chunk {i}'s backward (torch: set)"
        torch.testing.assert_close(a, b, msg=lambda m: f"after chunk {i}: {m}")


def test_chunked_head_grad_after_each_chunk():
    run_on_ranks(_chunked_head_grads, 2, timeout=TIMEOUT)


# ---------------------------------------------------------------- a grad's spec


def _spec_objects(model: nn.Module) -> list[str]:
    """The params whose ``.grad`` carries a spec object other than the param's own."""
    x, y = batch(rank_gen())
    F.mse_loss(model(x), y).backward()
    return [n for n, p in model.named_parameters() if p.grad is None or p.grad._spec is not p._spec]


def _grads_share_param_specs() -> None:
    ours, theirs, _ = make_trio(Stack, shard_stack)
    assert _spec_objects(theirs) == [], "torch's grads share their params' spec objects"
    assert _spec_objects(ours) == [], "grads with spec objects of their own"
    ours.zero_grad()
    ours.load_state_dict(theirs.state_dict(), assign=True)  # new DTensor params, adopted lazily
    assert _spec_objects(ours) == [], "after load_state_dict(assign=True)"


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_grads_share_their_params_spec(world_size):
    run_on_ranks(_grads_share_param_specs, world_size, timeout=TIMEOUT)


# ---------------------------------------------------------------- divide factor


def _premul_sum_numerics(factor: float, steps: int) -> None:
    """Bit-equal, every step, to a replica that multiplies by 1/f then SUM-all-reduces."""
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    ours = shardwise.fully_shard(copy.deepcopy(ref))
    ours.set_gradient_divide_factor(factor)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ours, ref)]
    gen = rank_gen()
    for step in range(steps):
        x, y = torch.randn(4, 8, generator=gen), torch.randn(4, 4, generator=gen)
        for model, opt in zip((ours, ref), opts):
            opt.zero_grad()
            F.mse_loss(model(x), y).backward()
        for p in ref.parameters():
            if dist.get_world_size() == 1:
                p.grad.div_(factor)  # torch at world size 1: exactly one division
            else:
                p.grad.mul_(1 / factor)
                dist.all_reduce(p.grad)
        for (name, p), q in zip(ours.named_parameters(), ref.parameters()):
            full = p.grad.full_tensor()
            assert torch.equal(full, q.grad), f"step {step}: {name}.grad differs by {(full - q.grad).abs().max()}"
        for opt in opts:
            opt.step()


@pytest.mark.parametrize("world_size, factor", [(2, 3.0), (1, 2.0)])
def test_gradient_divide_factor_is_premul_sum(world_size, factor):
    run_on_ranks(_premul_sum_numerics, world_size, factor, 10, timeout=TIMEOUT)


# ---------------------------------------------------------------- setters and errors


class _NoOpAllGather(AllGather):
    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        return dist.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)


def _setters_and_errors() -> None:
    model = shardwise.fully_shard(nn.Linear(4, 4))
    model.set_post_optim_event(None)  # what current_stream().record_event() is on CPU
    model.set_allocate_memory_from_process_group_for_comm(True)
    model.set_custom_all_gather(_NoOpAllGather())  # the custom comm overrides the flag
    with pytest.raises(AssertionError):
        model.set_allocate_memory_from_process_group_for_comm(True)
    model(torch.randn(2, 4)).sum().backward()

    a, b = nn.Linear(4, 4), nn.Linear(4, 4)
    b.weight = a.weight
    root = nn.Sequential(a, b)
    shardwise.fully_shard(a)
    shardwise.fully_shard(b)
    shardwise.fully_shard(root)
    with pytest.raises(ValueError, match="already managed by another") as err:
        root(torch.randn(2, 4))
    assert "fully_shard([module_a, module_b])" in str(err.value), str(err.value)


def test_setters_and_error_phrases_as_torch():
    run_on_ranks(_setters_and_errors, 1, timeout=TIMEOUT)
