"""Models and step comparisons shared by the mixed-precision, offload and dtype-change tests.

Everything here runs inside the ranks of :func:`shardwise.testing.run_on_ranks`.

- :class:`MPNet`: the tiny transformer of ``_models`` plus a *grouped* pair of modules
  (``fully_shard([mid, head])``) with an fp32 intermediate between the two members and an
  integer tensor passed to the second one; every module records the dtypes it saw;
- :func:`shard_mpnet`: one group per block, the grouped pair, then the root;
- :class:`Agreement` / :func:`compare_with_torch`: compare losses, sharded params and
  sharded grads against torch's FSDP2 every step, bit for bit where the case is expected
  to be bit-equal, else within a tolerance, and remember what was bit-equal.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_flatten

from _models import Block

VOCAB, DIM, SEQ = 32, 16, 8

# torch's fully_shard warns that a Linear's 3-d output is a view (an in-place op on it would
# drop its pre-backward hook); these models never modify outputs in place.
warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")


class Mid(nn.Module):
    """First member of the grouped pair: ``Linear(dim, dim)`` plus an integer marker output;
    records (input, weight) dtypes."""

    def __init__(self, dim: int):
        super().__init__()
        self.lin = nn.Linear(dim, dim)
        self.seen: list[tuple[torch.dtype, torch.dtype]] = []

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.seen.append((h.dtype, self.lin.weight.dtype))
        marker = torch.ones(1, dtype=torch.int64)  # an integer output: output_dtype must not cast it
        return self.lin(h), marker


class Head(nn.Module):
    """Second member of the grouped pair; also receives the integer tokens (never cast).

    It casts its floating input to its weight's dtype itself, so the model also runs with
    ``cast_forward_inputs=False`` and the recorded input dtype shows what FSDP passed in.
    """

    def __init__(self, dim: int, vocab: int):
        super().__init__()
        self.proj = nn.Linear(dim, vocab)
        self.seen: list[tuple[torch.dtype, torch.dtype, torch.dtype]] = []  # (h, tokens, weight)

    def forward(self, h: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        self.seen.append((h.dtype, tokens.dtype, self.proj.weight.dtype))
        return self.proj(h.to(self.proj.weight.dtype))


class MPNet(nn.Module):
    """Embeddings -> blocks -> norm -> mid -> (fp32 intermediate) -> head(h, tokens)."""

    def __init__(self, n_layers: int = 2):
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.pos_embeddings = nn.Embedding(SEQ, DIM)
        self.layers = nn.ModuleList(Block(DIM, 2, 2 * DIM) for _ in range(n_layers))
        self.norm = nn.LayerNorm(DIM)
        self.mid = Mid(DIM)
        self.head = Head(DIM, VOCAB)
        self.seen: list[tuple[torch.dtype, torch.dtype, torch.dtype]] = []  # (tokens, embedding weight, marker)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        embedding_dtype = self.tok_embeddings.weight.dtype
        positions = torch.arange(tokens.size(1), device=tokens.device)
        h = self.tok_embeddings(tokens) + self.pos_embeddings(positions)  # (b, s, dim)
        for layer in self.layers:
            h = layer(h)
        h, marker = self.mid(self.norm(h.to(self.norm.weight.dtype)))  # blocks may output output_dtype
        self.seen.append((tokens.dtype, embedding_dtype, marker.dtype))
        h = h.float() * 0.5  # an fp32 intermediate fed into the grouped pair's second member
        return self.head(h, tokens)  # (b, s, vocab)


def shard_mpnet(model: MPNet, fully_shard_fn: Callable, **kwargs) -> MPNet:
    for layer in model.layers:
        fully_shard_fn(layer, **kwargs)
    fully_shard_fn([model.mid, model.head], **kwargs)
    fully_shard_fn(model, **kwargs)
    return model


def record_output_dtypes(model: nn.Module) -> dict[str, list[torch.dtype]]:
    """Forward hooks (registered after fully_shard, so they run after its output cast) that
    record the dtypes of the floating outputs of every sharded module, by name."""
    seen: dict[str, list[torch.dtype]] = {}

    def hook(name: str, output) -> None:
        flat = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.is_floating_point()]
        seen[name].extend(t.dtype for t in flat)

    names = ["", "mid", "head"] + [f"layers.{i}" for i in range(len(model.layers))]
    for name in names:
        seen[name] = []
        model.get_submodule(name).register_forward_hook(lambda m, args, out, name=name: hook(name, out))
    return seen


def lm_loss_fp32(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])  # (b, s, vocab)
    return F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())


# ---------------------------------------------------------------- comparisons against torch


@dataclasses.dataclass
class Agreement:
    """What matched torch's FSDP2 bit for bit over a run (False once anything differed)."""

    loss: bool = True
    params: bool = True
    grads: bool = True
    max_param_diff: float = 0.0
    max_grad_diff: float = 0.0

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def compare_with_torch(
    where: str,
    ours: nn.Module,
    theirs: nn.Module,
    loss: torch.Tensor,
    torch_loss: torch.Tensor,
    agreement: Agreement,
    *,
    exact: bool,
    rtol: float,
    atol: float,
) -> None:
    """Our loss, sharded params and grads vs torch's (same layout: ``to_local()`` and
    placements). ``exact``: every value must be bit-equal; else within (rtol, atol).
    Updates ``agreement`` with what was bit-equal."""
    theirs_params = dict(theirs.named_parameters())
    mine = dict(ours.named_parameters())
    assert mine.keys() == theirs_params.keys(), f"{where}: names {sorted(mine)} vs {sorted(theirs_params)}"
    pairs = [("loss", loss.detach(), torch_loss.detach())]
    for name, p in mine.items():
        q = theirs_params[name]
        assert isinstance(p, DTensor) and isinstance(q, DTensor), f"{where}: {name} is {type(p).__name__}"
        assert p.placements == q.placements, f"{where}: {name} placements {p.placements} vs {q.placements}"
        pairs.append((f"param {name}", _local(p.detach()), _local(q.detach())))
        assert (p.grad is None) == (q.grad is None), f"{where}: grad of {name}: ours {p.grad is not None}"
        if p.grad is not None:
            assert isinstance(p.grad, DTensor), f"{where}: {name}.grad is a {type(p.grad).__name__}"
            pairs.append((f"grad {name}", _local(p.grad), _local(q.grad)))
    for what, a, b in pairs:
        assert a.dtype == b.dtype and a.shape == b.shape, (
            f"{where}: {what}: {a.dtype}{tuple(a.shape)} vs torch {b.dtype}{tuple(b.shape)}"
        )
        equal = torch.equal(a, b)
        kind = what.split(" ")[0]
        diff = (a.double() - b.double()).abs().max().item() if a.numel() else 0.0
        if kind == "loss":
            agreement.loss &= equal
        elif kind == "param":
            agreement.params &= equal
            agreement.max_param_diff = max(agreement.max_param_diff, diff)
        else:
            agreement.grads &= equal
            agreement.max_grad_diff = max(agreement.max_grad_diff, diff)
        if exact:
            assert equal, f"{where}: {what} is not bit-equal to torch's (max abs diff {diff:.3e})"
        else:
            torch.testing.assert_close(a, b, rtol=rtol, atol=atol, msg=lambda m, what=what: f"{where}: {what}: {m}")
