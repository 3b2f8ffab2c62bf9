"""A small GPT-style decoder: the model ``shardwise train`` and the benchmarks shard.

The architecture is nanoGPT's (GPT-2 with pre-norm blocks)::

    tokens -> tok_embeddings + pos_embeddings -> layers[0] -> ... -> layers[N-1] -> norm -> output -> logits

    Block(x):  x = x + attn(ln_1(x))     # causal self-attention, scaled_dot_product_attention
               x = x + mlp(ln_2(x))      # Linear(dim, mlp_ratio*dim) -> GELU -> Linear(mlp_ratio*dim, dim)

Each block is a natural FSDP unit: ``fully_shard(block)`` for every entry of
``model.layers``, then ``fully_shard(model)`` for the embeddings, final norm and head.

Presets (byte-level vocabulary of 256), used by ``--model`` and by the benchmark::

    >>> from shardwise.train.model import GPTConfig, count_params
    >>> count_params(GPTConfig.preset("tiny"))     # 1_073_536   (~1M)
    >>> count_params(GPTConfig.preset("small"))    # 9_674_240   (~10M)
    >>> count_params(GPTConfig.preset("medium"))   # 50_963_456  (~50M)
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import nn

from shardwise.train.pipeline import pruned, stage_blocks

__all__ = ["GPTConfig", "GPT", "Block", "CausalSelfAttention", "MLP", "PRESETS", "count_params"]


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """Shape of a :class:`GPT`; validated on construction."""

    vocab_size: int = 256
    """Number of distinct tokens; 256 for the byte-level tokenizer of :mod:`shardwise.train.data`."""
    seq_len: int = 128
    """Longest sequence the model accepts: the number of rows of ``pos_embeddings``."""
    dim: int = 128
    """Width of the residual stream (embedding size)."""
    n_layers: int = 4
    """Number of transformer blocks in ``model.layers``."""
    n_heads: int = 4
    """Attention heads per block; must divide ``dim``."""
    mlp_ratio: int = 4
    """Hidden width of each MLP as a multiple of ``dim``."""
    dropout: float = 0.0
    """Dropout probability on attention weights and residual branches (0 keeps runs deterministic)."""
    tie_weights: bool = False
    """Share one matrix between ``tok_embeddings`` and ``output`` (off: two separate FSDP parameters)."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "seq_len", "dim", "n_layers", "n_heads", "mlp_ratio"):
            if getattr(self, name) < 1:
                raise ValueError(f"GPTConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.dim % self.n_heads:
            raise ValueError(f"GPTConfig.dim={self.dim} is not divisible by n_heads={self.n_heads}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout must be in [0, 1), got {self.dropout}")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @classmethod
    def preset(cls, name: str, **overrides) -> "GPTConfig":
        """The named preset (``nano``, ``tiny``, ``small``, ``medium``), with fields replaced by ``overrides``."""
        if name not in PRESETS:
            raise ValueError(f"unknown model preset {name!r}; expected one of {sorted(PRESETS)}")
        return dataclasses.replace(PRESETS[name], **overrides)


PRESETS: dict[str, GPTConfig] = {
    # 2 blocks x 12*32^2 + embeddings and head: 42K parameters; for tests and smoke runs.
    "nano": GPTConfig(seq_len=32, dim=32, n_layers=2, n_heads=2),
    # 5 blocks x 12*128^2 + embeddings and head: 1.07M parameters.
    "tiny": GPTConfig(seq_len=128, dim=128, n_layers=5, n_heads=4),
    # 12 blocks x 12*256^2 + embeddings and head: 9.67M parameters.
    "small": GPTConfig(seq_len=256, dim=256, n_layers=12, n_heads=4),
    # 16 blocks x 12*512^2 + embeddings and head: 51.0M parameters.
    "medium": GPTConfig(seq_len=512, dim=512, n_layers=16, n_heads=8),
}


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention: one fused QKV projection, SDPA, an output projection.

    The fused weight's rows are grouped by head (``[q; k; v]`` of head 0, then of head 1, ...),
    so a column-wise tensor-parallel split of ``qkv`` hands each rank whole heads, and the
    forward reads the number of heads it holds from the projection's width.
    """

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.head_dim = cfg.head_dim
        self.dropout = cfg.dropout
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim)  # weight: (3*dim, dim), rows are [q; k; v] per head
        self.proj = nn.Linear(cfg.dim, cfg.dim)
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape  # batch, time, channels (= dim)
        qkv = self.qkv(x).view(B, T, -1, 3, self.head_dim)  # (B, T, nh, 3, hd); nh = n_heads / tp under TP
        q, k, v = (t.transpose(1, 2) for t in qkv.unbind(3))  # 3 x (B, nh, T, hd)
        dropout_p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)  # (B, nh, T, hd)
        y = y.transpose(1, 2).reshape(B, T, -1)  # (B, T, nh*hd): heads side by side again
        return self.resid_dropout(self.proj(y))


class MLP(nn.Module):
    """Position-wise feed-forward: ``Linear(dim, r*dim) -> GELU -> Linear(r*dim, dim)``."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.dim, cfg.mlp_ratio * cfg.dim)
        self.proj = nn.Linear(cfg.mlp_ratio * cfg.dim, cfg.dim)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    """One pre-norm transformer block: ``x + attn(ln_1(x))`` then ``x + mlp(ln_2(x))``."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.dim)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.dim)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Decoder-only transformer mapping token ids ``(B, T)`` to next-token logits ``(B, T, vocab)``.

    Weights follow GPT-2's initialisation: normal(0, 0.02) everywhere, with the two
    projections that write into the residual stream scaled by ``1/sqrt(2 * n_layers)``.
    """

    tok_embeddings: nn.Embedding  # weight: (vocab_size, dim)
    pos_embeddings: nn.Embedding  # weight: (seq_len, dim)
    layers: nn.ModuleList  # n_layers x Block
    norm: nn.LayerNorm  # final LayerNorm over dim
    output: nn.Linear  # weight: (vocab_size, dim), no bias; tied to tok_embeddings if cfg.tie_weights

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.pos_embeddings = nn.Embedding(cfg.seq_len, cfg.dim)
        self.dropout = nn.Dropout(cfg.dropout)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = nn.LayerNorm(cfg.dim)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_weights:
            self.output.weight = self.tok_embeddings.weight
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """GPT-2 initialisation; call again after materialising a meta-device model."""
        residual_std = 0.02 / math.sqrt(2 * self.cfg.n_layers)
        for name, module in self.named_modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                std = residual_std if name.endswith(".proj") else 0.02
                nn.init.normal_(module.weight, mean=0.0, std=std)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.LayerNorm):
                module.reset_parameters()

    def num_params(self) -> int:
        """Number of distinct parameter elements (a tied matrix counts once)."""
        return sum(p.numel() for p in self.parameters())

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits ``(B, T, vocab)`` of token ids ``(B, T)``.

        A pipeline stage (:mod:`~shardwise.train.pipeline`) is a copy without some parts: with no
        ``tok_embeddings`` its input is the previous stage's hidden states ``(B, T, C)``; with no
        ``output`` it returns its hidden states.
        """
        if self.tok_embeddings is None:
            x = tokens  # (B, T, C) from the previous stage
        else:
            x = self._embed(tokens)
        for block in self.layers:
            x = block(x)  # (B, T, C)
        if self.output is None:
            return x
        return self.output(self.norm(x))  # (B, T, vocab_size)

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        B, T = tokens.shape  # batch, time
        if T > self.cfg.seq_len:
            raise ValueError(f"sequence length {T} exceeds the model's seq_len={self.cfg.seq_len}")
        positions = torch.arange(T, device=tokens.device)  # (T,)
        x = self.tok_embeddings(tokens) + self.pos_embeddings(positions)  # (B, T, C) + (T, C) -> (B, T, C)
        return self.dropout(x)

    def stage(self, keep: range, first: bool, last: bool) -> "GPT":
        """A pipeline stage of this model: the blocks of ``keep`` (the others' places held), the
        embeddings when ``first``, the final norm and head when ``last``; names unchanged."""
        ends = {"tok_embeddings": first, "pos_embeddings": first, "norm": last, "output": last}
        return pruned(self, {"layers": stage_blocks(self.layers, keep),
                             **{name: getattr(self, name) if kept else None for name, kept in ends.items()}})


def count_params(cfg: GPTConfig) -> int:
    """Parameter count of ``GPT(cfg)``, from a meta-device instance (no memory allocated)."""
    with torch.device("meta"):
        return GPT(cfg).num_params()
