"""Tied weights: ``output.weight = tok_embeddings.weight`` inside one fully_shard group.

The vocabulary (17 rows over 4 ranks: 5, 5, 5, 2) leaves the last rank with 3 rows of
padding in the tied weight's shard. The tied parameter lives in one group — the root
(their common ancestor) or a grouped ``fully_shard([tok_embeddings, output])`` — and gets
one gradient: the sum of the embedding's and the head's. Ten steps are compared with a
plain tied replica and with torch's fully_shard every step; afterwards every row of the
tied weight must have moved (the head gives every row a gradient, padding must not eat
the last real rows). Splitting the tied pair over two groups must fail at the first
forward with a ValueError naming both FQNs.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard as torch_fully_shard

import shardwise
from _models import Transformer
from _nd_helpers import TIMEOUT, generator, lm_loss, make_mesh, token_batches, train
from shardwise.testing import run_on_ranks

STEPS = 10
DIMS = dict(vocab_size=17, dim=8, n_layers=2, n_heads=2, max_seq_len=8, ffn_hidden=12)


class TiedTransformer(Transformer):
    def __init__(self, **dims):
        super().__init__(**dims)
        self.output.weight = self.tok_embeddings.weight  # (vocab, dim) both


def _shard(model, fully_shard_fn, grouping: str, mesh):
    if grouping == "grouped":
        fully_shard_fn([model.tok_embeddings, model.output], mesh=mesh)
    for layer in model.layers:
        fully_shard_fn(layer, mesh=mesh)
    return fully_shard_fn(model, mesh=mesh)


def _tied(grouping: str) -> dict:
    mesh = make_mesh((dist.get_world_size(),), None)
    torch.manual_seed(0)
    base = TiedTransformer(**DIMS)
    ref = copy.deepcopy(base)
    theirs = _shard(copy.deepcopy(base), torch_fully_shard, grouping, mesh)
    ours = _shard(base, shardwise.fully_shard, grouping, mesh)
    initial = ref.tok_embeddings.weight.detach().clone()
    tied = ours.tok_embeddings.weight
    assert ours.output.weight is tied, "the head and the embedding no longer share one parameter"
    local_rows = tied.to_local().size(0)
    gen = generator(dist.get_rank())
    batches = [token_batches(gen, DIMS["vocab_size"], 1) for _ in range(STEPS)]
    losses = train(ours, ref, theirs, batches)
    assert ours.output.weight is tied and ours.tok_embeddings.weight is tied, "tied parameter replaced"
    final = tied.full_tensor()
    unchanged = [row for row in range(final.size(0)) if torch.equal(final[row], initial[row])]
    return {"losses": losses, "unchanged_rows": unchanged, "local_rows": local_rows}


def _split_over_two_groups() -> dict:
    mesh = make_mesh((dist.get_world_size(),), None)
    torch.manual_seed(0)
    base = TiedTransformer(**DIMS)
    tokens = token_batches(generator(dist.get_rank()), DIMS["vocab_size"], 1)[0]
    result = {}
    for name, fully_shard_fn in (("ours", shardwise.fully_shard), ("torch", torch_fully_shard)):
        model = copy.deepcopy(base)
        fully_shard_fn(model.tok_embeddings, mesh=mesh)
        fully_shard_fn(model, mesh=mesh)
        try:
            lm_loss(model, tokens).backward()
            result[name] = ("no error", type(model.output.weight).__name__, model.output.weight is model.tok_embeddings.weight)
        except Exception as err:  # recorded for both; ours must be the ValueError
            result[name] = (type(err).__name__, str(err))
    return result


@pytest.mark.parametrize("grouping", ["root", "grouped"])
def test_tied_weights_train(grouping):
    results = run_on_ranks(_tied, 4, grouping, timeout=TIMEOUT)
    assert [r["local_rows"] for r in results] == [5, 5, 5, 2]
    for rank, result in enumerate(results):
        assert result["unchanged_rows"] == [], f"rank {rank}: rows {result['unchanged_rows']} never changed"
    assert len({tuple(r["losses"]) for r in results}) == len(results), "ranks saw the same data"


def test_tied_weights_split_over_two_groups_raises():
    for rank, result in enumerate(run_on_ranks(_split_over_two_groups, 4, timeout=TIMEOUT)):
        kind, message = result["ours"][:2]
        assert kind == "ValueError", f"rank {rank}: {result['ours']}"
        assert "tok_embeddings.weight" in message and "output.weight" in message, message
        assert result["torch"][0] == "ValueError", f"rank {rank}: torch {result['torch']}"  # torch rejects it too
