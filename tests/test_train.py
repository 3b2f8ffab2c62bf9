"""Tests of ``shardwise train``: model presets, data sampling, the loop, and the CLI end to end.

The end-to-end tests launch real torchrun jobs of 2 gloo ranks on CPU with shardwise's
``fully_shard`` (the comparison with torch's FSDP2 lives in ``bench/``).
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from shardwise import cli
from shardwise.train.data import BatchSampler, decode, encode, load_corpus
from shardwise.train.loop import TrainConfig, train
from shardwise.train.model import GPT, GPTConfig, count_params
from shardwise.train.summary import ProgressBar, format_bytes
from shardwise.train.sharding import IMPLS

REPO_ROOT = Path(__file__).resolve().parent.parent
FINAL_LINE = re.compile(r"^final loss (\S+) \| ([\d,]+) tokens/s \| (.+)$", re.MULTILINE)


# ---------------------------------------------------------------- model


@pytest.mark.parametrize("name,target", [("tiny", 1e6), ("small", 10e6), ("medium", 50e6)])
def test_preset_param_counts_near_target(name, target):
    n = count_params(GPTConfig.preset(name))
    assert abs(n - target) / target < 0.1, f"{name}: {n:,} params, target {target:,.0f}"


def test_model_is_causal_and_shaped():
    torch.manual_seed(0)
    model = GPT(GPTConfig(seq_len=16, dim=32, n_layers=2, n_heads=4)).eval()
    x = torch.randint(0, 256, (2, 16))
    logits = model(x)
    assert logits.shape == (2, 16, 256)
    x2 = x.clone()
    x2[:, 10] = (x2[:, 10] + 1) % 256
    logits2 = model(x2)
    torch.testing.assert_close(logits[:, :10], logits2[:, :10])
    assert not torch.allclose(logits[:, 10:], logits2[:, 10:])


def test_tied_weights_share_one_parameter():
    model = GPT(GPTConfig(seq_len=8, dim=16, n_layers=1, n_heads=2, tie_weights=True))
    assert model.output.weight is model.tok_embeddings.weight
    untied = GPTConfig(seq_len=8, dim=16, n_layers=1, n_heads=2)
    assert count_params(model.cfg) == model.num_params() == count_params(untied) - 256 * 16


def test_config_validation():
    with pytest.raises(ValueError, match="divisible"):
        GPTConfig(dim=30, n_heads=4)
    with pytest.raises(ValueError, match="model must be one of"):
        TrainConfig(model="huge")
    with pytest.raises(ValueError, match="impl"):
        TrainConfig(impl="deepspeed")


# ---------------------------------------------------------------- data


@pytest.fixture
def corpus(tmp_path) -> torch.Tensor:
    (tmp_path / "a.txt").write_text("hello, shardwise! " * 200)
    (tmp_path / "b.txt").write_text("the quick brown fox jumps over the lazy dog. " * 100)
    return load_corpus(tmp_path)


def test_batches_deterministic_per_rank(corpus):
    def batches(rank):
        sampler = BatchSampler(corpus, batch_size=4, seq_len=32, seed=7, rank=rank, world_size=2)
        return [sampler.next_batch() for _ in range(3)]

    for (x0, y0), (x0b, y0b), (x1, _) in zip(batches(0), batches(0), batches(1)):
        assert x0.shape == y0.shape == (4, 32) and x0.dtype == torch.long
        assert torch.equal(x0, x0b) and torch.equal(y0, y0b)
        assert not torch.equal(x0, x1)
        assert torch.equal(x0[:, 1:], y0[:, :-1])


def test_stdlib_corpus_is_capped_and_repeatable():
    a = load_corpus(max_bytes=200_000)
    b = load_corpus(max_bytes=200_000)
    assert a.dtype == torch.uint8 and a.numel() == 200_000
    assert torch.equal(a, b)
    assert "def " in decode(a[:50_000])


def test_encode_decode_roundtrip():
    text = "naïve → bytes"
    assert decode(encode(text)) == text


# ---------------------------------------------------------------- loop (one in-process gloo rank)


@pytest.mark.parametrize("impl", IMPLS)
def test_loss_decreases_on_tiny_model(single_rank, impl):
    cfg = TrainConfig(model="tiny", steps=30, batch_size=8, seq_len=64, lr=2e-3, impl=impl, data_bytes=500_000)
    result = train(cfg, single_rank)
    assert len(result.losses) == 30 and all(math.isfinite(v) for v in result.losses)
    assert result.first_loss == pytest.approx(math.log(256), abs=0.3)
    assert sum(result.losses[-5:]) / 5 < 0.75 * result.first_loss, result.losses


# ---------------------------------------------------------------- reporting and CLI


def test_progress_bar_writes_lines_when_piped(tmp_path):
    with open(tmp_path / "log", "w+") as f:
        bar = ProgressBar(total=20, stream=f)
        for step in range(1, 21):
            bar.update(step, loss=1.0, tokens_per_s=1234.0)
        bar.close()
        f.seek(0)
        lines = f.read().splitlines()
    assert len(lines) == 11 and lines[-1].endswith("20/20 | loss 1.0000 | 1,234 tokens/s")
    assert format_bytes(1_234_567) == "1.2 MB" and format_bytes(999) == "999 B"


def test_cli_launches_torchrun_when_not_under_it(monkeypatch):
    for var in ("RANK", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    calls = []

    class FakeLauncher:
        def __init__(self, cmd, env):
            calls.append((cmd, env))

        def wait(self):
            return 0

    monkeypatch.setattr(subprocess, "Popen", FakeLauncher)
    assert cli.main(["train", "--steps", "3", "--nproc", "3", "--impl", "shardwise"]) == 0
    ((cmd, env),) = calls
    launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=3"]
    assert cmd[1:] == [*launcher, "-m", "shardwise", "train", "--steps", "3", "--impl", "shardwise"]
    assert str(REPO_ROOT) in env["PYTHONPATH"].split(os.pathsep)


def test_help_says_what_each_command_does_today():
    """``shardwise --help``'s one-liners and ``train --help``'s description name the job's inputs and knobs."""
    import argparse

    parser = cli.build_parser()
    (commands,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    helps = {a.dest: a.help for a in commands._choices_actions}
    for text in ("GPT preset", "Transformers", "--hf-config", "--data", "--replicate", "--tp", "checkpoints"):
        assert text in helps["train"], text
    assert "small GPT" not in helps["train"] and "Transformers" in helps["export"]
    description = commands.choices["train"].format_help()
    for text in ("--hf-config", "--hf-model", "_no_split_modules", "--data", "--replicate", "--tp", "--checkpoint-dir",
                 "--resume", "shardwise export"):
        assert text in description, text
    for family in ("gpt2", "gpt_neox", "opt", "falcon", "bloom", "mixtral", "qwen3_moe"):
        assert family in description, family  # the Transformers models group names the tested families


def test_cli_rejects_bad_config_before_launching():
    with pytest.raises(SystemExit, match="steps must be >= 1"):
        cli.main(["train", "--steps", "0"])


@pytest.mark.parametrize("impl", ["shardwise"])  # --impl torch: the parity tests of test_train_hf.py
def test_cli_end_to_end_two_ranks(impl):
    cmd = [sys.executable, "-m", "shardwise", "train", "--steps", "3", "--model", "tiny", "--impl", impl,
           "--nproc", "2", "--batch-size", "4", "--seq-len", "64", "--data-bytes", "500000"]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    match = FINAL_LINE.search(proc.stdout)
    assert match, proc.stdout
    assert math.isfinite(float(match.group(1)))
    assert int(match.group(2).replace(",", "")) > 0
    if impl == "shardwise":
        assert match.group(3).endswith("/step/rank") and not match.group(3).startswith("0 B"), match.group(0)
    else:
        assert match.group(3) == "comm n/a"
