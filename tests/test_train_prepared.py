"""``shardwise train --data DIR`` on a prepared directory: parity with torch, exact resume, vocabulary checks.

The corpus is prepared once per module (bytes, a few hundred tiny documents). Losses come
from ``--metrics`` (the last record of each step); parity and same-world-size resume are
bit-equal (``==`` on floats), 4 ranks resuming what 2 saved (same global batch: the same
windows) within fp32 reduction tolerance.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from shardwise import cli
from shardwise.data.prepare import PrepareOptions, prepare
from shardwise.testing import run_on_ranks
from shardwise.train import distributed
from shardwise.train.config import TrainConfig
from shardwise.train.inputs import run_data
from shardwise.train.loop import train
from shardwise.train.metrics import read_metrics
from shardwise.train.models import model_spec

pytest.importorskip("datasets")

TIMEOUT = 180
DOCS = [f"doc {i}: " + "the quick brown fox jumps " * (1 + i % 5) for i in range(300)]
BASE = dict(model="nano", steps=6, batch_size=4, seq_len=16, lr_schedule="cosine", warmup_steps=2)


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("prepared")
    src = root / "corpus.jsonl"
    src.write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS))
    prepare(src, root / "tokens", PrepareOptions("bytes", workers=1, shard_bytes=2000, held_out=0.05),
            show_progress=False)
    return str(root / "tokens")


def _train_on_rank(fields: dict):
    result = train(TrainConfig(**fields), distributed.setup("cpu", num_threads=1))
    return result.losses, result.eval_losses


def _sampler_on_rank(fields: dict) -> tuple[str, bool]:
    env = distributed.setup("cpu", num_threads=1)
    cfg = TrainConfig(**fields)
    sampler = run_data(cfg, env, model_spec(cfg)).sampler
    return type(sampler).__name__, all(isinstance(s, np.memmap) for s in sampler.stream.shards)


def _curve(path: Path) -> dict[int, float]:
    return {step: record["loss"] for step, record in read_metrics(path).items()}


def test_two_ranks_train_on_memory_mapped_shards_bit_equal_to_torch_with_held_out_eval(prepared, tmp_path):
    fields = {**BASE, "data": prepared, "eval_every": 3}
    mine = run_on_ranks(_train_on_rank, 2, fields, timeout=TIMEOUT)
    ref = run_on_ranks(_train_on_rank, 2, {**fields, "impl": "torch"}, timeout=TIMEOUT)
    assert [m[0] for m in mine] == [r[0] for r in ref] and len(mine[0][0]) == 6
    assert mine[0][0] != mine[1][0]  # ranks see different windows
    assert mine[0][1] == ref[0][1] and sorted(mine[0][1]) == [3, 6]  # held-out losses, every rank's mean
    assert run_on_ranks(_sampler_on_rank, 2, {**BASE, "data": prepared}, timeout=TIMEOUT) == [("WindowSampler", True)] * 2


def test_resume_sees_the_uninterrupted_batches_at_two_and_at_four_ranks(prepared, tmp_path):
    ref, stopped, four = tmp_path / "ref.jsonl", tmp_path / "stopped.jsonl", tmp_path / "four.jsonl"
    fields = {**BASE, "data": prepared}
    run_on_ranks(_train_on_rank, 2, {**fields, "metrics": str(ref)}, timeout=TIMEOUT)
    ckpt = dict(checkpoint_dir=str(tmp_path / "ckpts"), checkpoint_every=3)
    run_on_ranks(_train_on_rank, 2, {**fields, **ckpt, "metrics": str(stopped), "stop_after": 3}, timeout=TIMEOUT)
    saved = json.loads(next((tmp_path / "ckpts").glob("step-*/rank-00000.json")).read_text())
    assert saved["stateful"]["sampler"]["position"] == 3 * 8  # three global batches of 8 windows
    shutil.copytree(tmp_path / "ckpts", tmp_path / "ckpts4")
    run_on_ranks(_train_on_rank, 2, {**fields, **ckpt, "metrics": str(stopped), "resume": True}, timeout=TIMEOUT)
    assert _curve(stopped) == _curve(ref) and len(_curve(ref)) == 6
    # 4 ranks resume the step-3 checkpoint with half the per-rank batch: the same global windows
    ckpt4 = tmp_path / "ckpts4"
    run_on_ranks(_train_on_rank, 4, {**fields, "batch_size": 2, "checkpoint_dir": str(ckpt4), "resume": True,
                                     "metrics": str(four)}, timeout=TIMEOUT)
    assert list(_curve(four)) == [4, 5, 6]
    assert _curve(four) == pytest.approx({s: _curve(ref)[s] for s in (4, 5, 6)}, rel=1e-5, abs=0)


def test_a_preset_takes_the_prepared_vocabulary_and_a_smaller_model_vocabulary_is_refused(prepared, tmp_path,
                                                                                          no_launch):
    assert model_spec(TrainConfig(data=prepared)).vocab_size == 256
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "llama", "vocab_size": 128, "hidden_size": 32, "intermediate_size": 64,
                                  "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}))
    with pytest.raises(SystemExit, match=r"tokenized with bytes \(vocabulary 256\), larger than the model's "
                                         r"vocab_size=128; prepare it with the model's tokenizer"):
        cli.main(["train", "--data", prepared, "--hf-config", str(config)])
    unfinished = tmp_path / "unfinished"
    unfinished.mkdir()
    (unfinished / "shard-00000.bin").write_bytes(b"\0" * 64)
    with pytest.raises(SystemExit, match="has no manifest.json: its `shardwise data prepare` did not finish"):
        cli.main(["train", "--data", str(unfinished)])


def test_a_model_tokenizer_of_another_vocabulary_and_eval_without_held_out_tokens_are_refused(prepared, tmp_path):
    from types import SimpleNamespace

    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    from shardwise.train.inputs import check_data

    vocab = {chr(i): i for i in range(300)}
    own = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="a")), eos_token="b")
    spec = SimpleNamespace(vocab_size=300, tokenizer=own, seq_len=16)
    with pytest.raises(ValueError, match="whose vocabulary differs from the model's own tokenizer's"):
        check_data(TrainConfig(data=prepared), spec)
    check_data(TrainConfig(data=prepared), SimpleNamespace(vocab_size=300, tokenizer=None, seq_len=16))
    src = tmp_path / "c.jsonl"
    src.write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS[:20]))
    prepare(src, tmp_path / "none", PrepareOptions("bytes", workers=1, held_out=0), show_progress=False)
    with pytest.raises(ValueError, match="--eval-every: .* holds 0 held-out tokens, fewer than one window of 17"):
        check_data(TrainConfig(data=str(tmp_path / "none"), eval_every=2), SimpleNamespace(vocab_size=256, seq_len=16))


def test_a_data_position_of_the_other_kind_is_refused_by_name():
    """A text-corpus sampler given a prepared directory's position (and the reverse) says which --data to use."""
    import torch

    from shardwise.train.data import BatchSampler

    text = BatchSampler(torch.arange(1000) % 256, 2, 16, 0, 0, 1)
    with pytest.raises(ValueError, match="data position is of a prepared directory"):
        text.load_state_dict({"position": 3, "windows": 10, "seq_len": 16, "seed": 0, "global_batch_size": 2})
