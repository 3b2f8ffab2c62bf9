"""Where a run's batches come from: a prepared directory, memory-mapped, or a text path read into memory.

``--data DIR`` where ``DIR`` was written by ``shardwise data prepare`` (it has a
``manifest.json``): the training split's shards are memory-mapped and sampled as packed
windows in a global seeded order (:class:`~shardwise.data.windows.WindowSampler`), and
``--eval-every`` reads the manifest's held-out split. Anything else is the quick text path
(:mod:`~shardwise.train.data`): at most ``--data-bytes`` of text on every rank, tokenized at
start-up by the model, its last :data:`HELD_OUT` held out.

:func:`check_data` is the preflight half: the prepared tokens must be ids of the model's
vocabulary, so a manifest whose vocabulary is larger than the model's ``vocab_size``, or
whose tokenizer's vocabulary differs from the model's own tokenizer, is refused before launch.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Union

import torch

from shardwise.data.encoders import vocab_sha256
from shardwise.data.manifest import is_prepared, read_manifest
from shardwise.data.windows import TokenStream, WindowSampler
from shardwise.train.config import TrainConfig
from shardwise.train.data import BatchSampler, load_corpus
from shardwise.train.distributed import DistEnv

__all__ = ["HELD_OUT", "RunData", "run_data", "check_data", "prepared_vocab_size"]

HELD_OUT = 0.1
"""Share of a text corpus (its end) kept out of training when ``--eval-every`` is on."""

Sampler = Union[BatchSampler, WindowSampler]


@dataclasses.dataclass(frozen=True)
class RunData:
    """The training sampler, and a maker of the held-out sampler (a fresh one per evaluation: the same windows)."""

    sampler: Sampler
    held_out: Callable[[int], Sampler] | None  # micro-batch size -> sampler; None without --eval-every


def prepared_vocab_size(data: str | None) -> int | None:
    """The vocabulary of a prepared ``--data`` directory, ``None`` for a text path."""
    return read_manifest(data).vocab_size if is_prepared(data) else None


def check_data(cfg: TrainConfig, spec) -> None:
    """Refuse a prepared ``--data`` whose tokens are not ids of the model's vocabulary, or no held-out split."""
    if not is_prepared(cfg.data):
        return
    manifest = read_manifest(cfg.data)
    tok = manifest.tokenizer
    if manifest.vocab_size > spec.vocab_size:
        raise ValueError(f"--data {cfg.data} was tokenized with {tok['name']} (vocabulary {manifest.vocab_size}), "
                         f"larger than the model's vocab_size={spec.vocab_size}; prepare it with the model's "
                         "tokenizer (--tokenizer DIR), or train a model whose vocab_size covers it")
    own = getattr(spec, "tokenizer", None)
    if own is not None and vocab_sha256(own) != tok["vocab_sha256"]:
        raise ValueError(f"--data {cfg.data} was tokenized with {tok['name']}, whose vocabulary differs from the "
                         "model's own tokenizer's; prepare it with --tokenizer set to the model's directory")
    if cfg.eval_every and manifest.counts()["held_out"]["tokens"] < spec.seq_len + 1:
        raise ValueError(f"--eval-every: --data {cfg.data} holds {manifest.counts()['held_out']['tokens']} held-out "
                         f"tokens, fewer than one window of {spec.seq_len + 1}; prepare it with a larger --held-out")


def _split_corpus(tokens: torch.Tensor, cfg: TrainConfig, seq_len: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(training tokens, held-out tail or ``None``): the last :data:`HELD_OUT` with ``--eval-every``."""
    if not cfg.eval_every:
        return tokens, None
    held = max(int(tokens.numel() * HELD_OUT), seq_len + 1)
    if tokens.numel() - held < seq_len + 1:
        raise ValueError(f"--eval-every: a corpus of {tokens.numel()} tokens is too small to hold out "
                         f"{held} and still train on windows of {seq_len + 1}; raise --data-bytes")
    return tokens[:-held], tokens[-held:]


def run_data(cfg: TrainConfig, env: DistEnv, spec) -> RunData:
    """This rank's samplers for ``cfg.data`` (see the module docstring)."""
    seq_len, rank, ranks = spec.seq_len, env.dp_rank, env.dp_size
    if is_prepared(cfg.data):
        manifest = read_manifest(cfg.data)
        train = WindowSampler(TokenStream(manifest, cfg.data, "train"), cfg.batch_size, seq_len, cfg.seed, rank, ranks)
        held = TokenStream(manifest, cfg.data, "held_out") if cfg.eval_every else None
        make = None if held is None else (lambda b: WindowSampler(held, b, seq_len, cfg.seed + 1, rank, ranks))
        return RunData(train, make)
    tokens, held_tokens = _split_corpus(spec.tokens(load_corpus(cfg.data, cfg.data_bytes)), cfg, seq_len)
    train = BatchSampler(tokens, cfg.batch_size, seq_len, cfg.seed, rank, ranks)
    make = None if held_tokens is None else (lambda b: BatchSampler(held_tokens, b, seq_len, cfg.seed + 1, rank, ranks))
    return RunData(train, make)
