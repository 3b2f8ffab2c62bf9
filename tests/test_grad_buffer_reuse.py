"""replicate keeps each group's gradient buffer across steps, and never overwrites a held gradient.

(At world size 1 there is nothing to pack: each gradient is autograd's own, no buffer.)

The gradients of a replicate group are views of one buffer (the all-reduce's). Once
``zero_grad(set_to_none=True)`` has dropped them, the next backward packs into the same
memory instead of fresh pages (``shardwise.buffers.ReusableBuffer``). A gradient somebody
still holds keeps its values: the next backward then packs into a new buffer.
"""

from __future__ import annotations

import copy

import torch

import shardwise
from _models import Transformer, allreduce_mean_grads, lm_loss, rank_generator, token_batch
from shardwise.buffers import ReusableBuffer
from shardwise.testing import run_on_ranks

TIMEOUT = 60

# ---------------------------------------------------------------- the buffer alone


def test_the_same_tensor_comes_back_while_nothing_views_it():
    buffers = ReusableBuffer()
    first = buffers.get(12, torch.float32, torch.device("cpu"))
    assert buffers.get(12, torch.float32, torch.device("cpu")) is first
    view = first[3:7]
    second = buffers.get(12, torch.float32, torch.device("cpu"))
    assert second is not first and second.data_ptr() != first.data_ptr(), "handed out memory a view still uses"
    del view
    assert buffers.get(12, torch.float32, torch.device("cpu")) is second, "the newest buffer is the one kept"
    assert buffers.get(13, torch.float32, torch.device("cpu")) is not second  # size changed
    kept = buffers.get(13, torch.float32, torch.device("cpu"))
    assert buffers.get(13, torch.float64, torch.device("cpu")) is not kept  # dtype changed


# ---------------------------------------------------------------- on ranks


def _models():
    torch.manual_seed(0)
    ref = Transformer()
    ours = copy.deepcopy(ref)
    for layer in ours.layers:
        shardwise.replicate(layer)
    shardwise.replicate(ours)
    return ours, ref


def _backward(ours, ref, tokens) -> None:
    lm_loss(ours, tokens).backward()
    lm_loss(ref, tokens).backward()
    allreduce_mean_grads(ref)


def _assert_grads_match(ours, ref, where: str) -> None:
    for (name, p), q in zip(ours.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad.to_local(), q.grad, rtol=1e-6, atol=1e-7, msg=lambda m: f"{where} {name}: {m}")


def _addresses(model) -> list[int]:
    return [p.grad.to_local().data_ptr() for p in model.parameters()]


def _reuse_after_set_to_none():
    ours, ref = _models()
    gen = rank_generator()
    addresses = []
    for step in range(3):
        _backward(ours, ref, token_batch(gen, ours.vocab_size))
        _assert_grads_match(ours, ref, f"step {step}")
        addresses.append(_addresses(ours))
        ours.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
    assert addresses[0] == addresses[1] == addresses[2], "the gradient buffers were reallocated every step"


def _held_gradient_keeps_its_values():
    ours, ref = _models()
    gen = rank_generator()
    _backward(ours, ref, token_batch(gen, ours.vocab_size))
    held = {name: p.grad for name, p in ours.named_parameters()}  # e.g. kept for logging
    snapshot = {name: g.to_local().clone() for name, g in held.items()}
    ours.zero_grad(set_to_none=True)
    ref.zero_grad(set_to_none=True)
    _backward(ours, ref, token_batch(gen, ours.vocab_size))
    _assert_grads_match(ours, ref, "second backward")
    for name, g in held.items():
        assert torch.equal(g.to_local(), snapshot[name]), f"{name}: a held gradient was overwritten by the next backward"
        assert g.to_local().data_ptr() != dict(ours.named_parameters())[name].grad.to_local().data_ptr()


def _zeroed_in_place_then_accumulated():
    """``zero_grad(set_to_none=False)`` keeps the gradient tensors; two backwards then add up."""
    ours, ref = _models()
    gen = rank_generator()
    for step in range(3):
        ours.zero_grad(set_to_none=False)
        ref.zero_grad(set_to_none=False)
        for _ in range(2):
            _backward(ours, ref, token_batch(gen, ours.vocab_size))
        _assert_grads_match(ours, ref, f"step {step}")


def test_gradient_buffers_are_reused_after_zero_grad():
    run_on_ranks(_reuse_after_set_to_none, 2, timeout=TIMEOUT)


def test_a_held_gradient_is_never_overwritten():
    run_on_ranks(_held_gradient_keeps_its_values, 2, timeout=TIMEOUT)


def test_gradients_zeroed_in_place_accumulate():
    run_on_ranks(_zeroed_in_place_then_accumulated, 2, timeout=TIMEOUT)


def _world_of_one_packs_nothing():
    """World size 1: nothing to reduce, cast or divide, so each gradient autograd made is
    handed over as the sharded gradient: no buffer is ever packed (no copy to reuse memory
    for), the values are the plain model's, and a held gradient keeps them."""
    from shardwise.state import get_state

    ours, ref = _models()
    gen = rank_generator()
    held = None
    for step in range(3):
        _backward(ours, ref, token_batch(gen, ours.vocab_size))
        _assert_grads_match(ours, ref, f"step {step}")
        if step == 1:
            held = {name: (p.grad, p.grad.to_local().clone()) for name, p in ours.named_parameters()}
        ours.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
    for name, (grad, values) in held.items():
        assert torch.equal(grad.to_local(), values), f"{name}: a held gradient was overwritten by the next backward"
    groups = [g for m in ours.modules() if (state := get_state(m)) is not None for g in state.groups]
    assert groups and all(g.reducer._grad_buffer._tensor is None for g in groups), "a gradient buffer was packed"


def test_world_of_one_hands_the_gradients_over_without_a_buffer():
    run_on_ranks(_world_of_one_packs_nothing, 1, timeout=TIMEOUT)
