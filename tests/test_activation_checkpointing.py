"""Activation checkpointing composed with fully_shard, against a reference and torch.

Three ways to checkpoint each transformer block:

- ``utils``: ``torch.utils.checkpoint.checkpoint(layer, h, use_reentrant=False)`` inside the
  model's forward;
- ``composable``: ``torch.distributed._composable.checkpoint(layer)``;
- ``wrapper``: ``apply_activation_checkpointing`` with a non-reentrant ``checkpoint_wrapper``
  (parameter names gain ``_checkpoint_wrapped_module.``, ignored when comparing);

times three ways to group the parameters:

- ``per_block``: fully_shard on each block, then the root;
- ``nested``: also fully_shard on each block's attention and feed-forward, *inside* the
  checkpointed region (their all-gathers run again during recomputation);
- ``memory_efficient``: ``fully_shard([tok_embeddings, pos_embeddings])`` with
  ``set_unshard_in_backward(False)`` (embedding backward needs no weights), the blocks,
  ``fully_shard([norm, output])``, the root.

Each step is compared with a plain replica without checkpointing (``full_tensor()``) and
with torch's fully_shard under the same checkpointing (placements, ``to_local()``, and the
collectives every step issues: counts and group sizes). A last case runs two forwards
before one backward with nested groups.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed._composable import checkpoint as composable_checkpoint
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    apply_activation_checkpointing,
    checkpoint_wrapper,
)
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.utils.checkpoint import checkpoint

import shardwise
from _models import Block, Transformer
from _nd_helpers import TIMEOUT, generator, lm_loss, make_mesh, tally, token_batches, train
from shardwise.testing import run_on_ranks

STEPS = 3
DIMS = dict(vocab_size=17, dim=8, n_layers=2, n_heads=2, max_seq_len=8, ffn_hidden=12)
FLAVOURS = ["utils", "composable", "wrapper"]
GROUPINGS = ["per_block", "nested", "memory_efficient"]


class CheckpointedTransformer(Transformer):
    """The same model (same parameter names), each block run under torch.utils.checkpoint."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.size(1), device=tokens.device)
        h = self.tok_embeddings(tokens) + self.pos_embeddings(positions)  # (b, s, dim)
        for layer in self.layers:
            h = checkpoint(layer, h, use_reentrant=False)
        return self.output(self.norm(h))  # (b, s, vocab)


def _build(flavour: str) -> nn.Module:
    torch.manual_seed(0)
    return CheckpointedTransformer(**DIMS) if flavour == "utils" else Transformer(**DIMS)


def _apply_checkpointing(model: nn.Module, flavour: str) -> None:
    if flavour == "composable":
        for layer in model.layers:
            composable_checkpoint(layer)
    elif flavour == "wrapper":
        wrapper = functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
        apply_activation_checkpointing(model, checkpoint_wrapper_fn=wrapper, check_fn=lambda m: isinstance(m, Block))


def _inner(layer: nn.Module) -> nn.Module:
    return getattr(layer, "_checkpoint_wrapped_module", layer)


def _shard(model: nn.Module, fully_shard_fn, grouping: str, mesh) -> nn.Module:
    if grouping == "memory_efficient":
        fully_shard_fn([model.tok_embeddings, model.pos_embeddings], mesh=mesh)
        model.tok_embeddings.set_unshard_in_backward(False)
    for layer in model.layers:
        if grouping == "nested":
            fully_shard_fn(_inner(layer).attention, mesh=mesh)
            fully_shard_fn(_inner(layer).feed_forward, mesh=mesh)
        fully_shard_fn(layer, mesh=mesh)
    if grouping == "memory_efficient":
        fully_shard_fn([model.norm, model.output], mesh=mesh)
    return fully_shard_fn(model, mesh=mesh)


def _two_forwards(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """Two forwards (on the two halves of the batch), one backward of their sum."""
    return lm_loss(model, batch[:1]) + lm_loss(model, batch[1:])


def _ac(flavour: str, grouping: str, two_forwards: bool) -> dict:
    mesh = make_mesh((dist.get_world_size(),), None)
    base = _build(flavour)
    torch.manual_seed(0)
    ref = Transformer(**DIMS)  # the same init, no checkpointing
    ref.load_state_dict(base.state_dict())
    copies = []
    for fully_shard_fn in (shardwise.fully_shard, torch_fully_shard):
        model = copy.deepcopy(base)
        _apply_checkpointing(model, flavour)
        copies.append(_shard(model, fully_shard_fn, grouping, mesh))
    ours, theirs = copies
    gen = generator(dist.get_rank())
    batches = [token_batches(gen, DIMS["vocab_size"], 1) for _ in range(STEPS)]
    counts: dict = {}
    loss_fn = _two_forwards if two_forwards else lm_loss
    losses = train(ours, ref, theirs, batches, loss_fn=loss_fn, counts=counts)
    return {
        "losses": losses,
        "ours": [tally(events) for events in counts["ours"]],
        "torch": [tally(events) for events in counts["torch"]],
        "ours_gathers": [sorted(e.payload_bytes for e in ev if e.kind == "all_gather") for ev in counts["ours"]],
        "torch_gathers": [sorted(e.payload_bytes for e in ev if e.kind == "all_gather") for ev in counts["torch"]],
    }


def _check(results: list[dict]) -> None:
    for rank, result in enumerate(results):
        for step, (mine, theirs) in enumerate(zip(result["ours"], result["torch"])):
            assert mine == theirs, f"rank {rank}, step {step}: ours {mine}, torch {theirs}"
            assert mine.get("reduce_scatter", 0) > 0, f"rank {rank}, step {step}: no gradient reduction: {mine}"
        assert result["ours_gathers"] == result["torch_gathers"], f"rank {rank}: all-gather payloads differ"
    assert len({tuple(r["losses"]) for r in results}) == len(results), "ranks saw the same data"


@pytest.mark.parametrize("grouping", GROUPINGS)
@pytest.mark.parametrize("flavour", FLAVOURS)
def test_activation_checkpointing(flavour, grouping):
    _check(run_on_ranks(_ac, 4, flavour, grouping, False, timeout=TIMEOUT))


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_two_forwards_one_backward_nested(flavour):
    _check(run_on_ranks(_ac, 4, flavour, "nested", True, timeout=TIMEOUT))
