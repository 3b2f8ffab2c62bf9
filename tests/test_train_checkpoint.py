"""``shardwise train`` resumes exactly: after a stop, at another world size, and under torchrun restarts.

Every comparison reads the ``--metrics`` files (the last record of each step): the losses
of a run stopped and resumed, or killed and restarted by torchrun, must equal the
uninterrupted run's bit for bit at the same world size, and within fp32 reduction
tolerance when 4 ranks resume what 2 saved (same global batch).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from shardwise.testing import run_on_ranks
from shardwise.train import distributed
from shardwise.train.config import TrainConfig
from shardwise.train.loop import train
from shardwise.train.metrics import read_metrics

REPO_ROOT = Path(__file__).resolve().parent.parent
TIMEOUT = 120
BASE = dict(model="nano", steps=6, batch_size=4, seq_len=16, data_bytes=20_000, lr_schedule="cosine", warmup_steps=2)


def _train_on_rank(fields: dict, threads: int = 1) -> list[float]:
    env = distributed.setup("cpu", num_threads=threads)
    return train(TrainConfig(**fields), env).losses


def _curve(path: Path, key: str = "loss") -> dict[int, float]:
    return {step: record[key] for step, record in read_metrics(path).items()}


def test_resume_is_bit_identical_and_four_ranks_resume_what_two_saved(tmp_path):
    ref, stopped, four = tmp_path / "ref.jsonl", tmp_path / "stopped.jsonl", tmp_path / "four.jsonl"
    run_on_ranks(_train_on_rank, 2, {**BASE, "metrics": str(ref)}, timeout=TIMEOUT)
    ckpt = dict(checkpoint_dir=str(tmp_path / "ckpts"), checkpoint_every=2)
    run_on_ranks(_train_on_rank, 2, {**BASE, **ckpt, "metrics": str(stopped), "stop_after": 3,
                                     "async_checkpoint": True}, timeout=TIMEOUT)
    shutil.copytree(tmp_path / "ckpts", tmp_path / "ckpts4")
    run_on_ranks(_train_on_rank, 2, {**BASE, **ckpt, "metrics": str(stopped), "resume": True}, timeout=TIMEOUT)
    assert _curve(stopped) == _curve(ref) and len(_curve(ref)) == 6  # bit-identical: == on floats
    assert _curve(stopped, "lr") == _curve(ref, "lr")

    half_batch = {**BASE, "batch_size": BASE["batch_size"] // 2, "metrics": str(four), "resume": True,
                  "checkpoint_dir": str(tmp_path / "ckpts4")}
    run_on_ranks(_train_on_rank, 4, half_batch, timeout=TIMEOUT)
    resumed = _curve(four)
    assert list(resumed) == [4, 5, 6]
    assert resumed == pytest.approx({s: _curve(ref)[s] for s in resumed}, rel=1e-5, abs=0)


@pytest.mark.launches
def test_torchrun_restart_after_a_killed_rank_finishes_with_the_uninterrupted_curve(tmp_path):
    ref, metrics = tmp_path / "ref.jsonl", tmp_path / "metrics.jsonl"
    threads = distributed.cpu_threads_per_rank(2)  # what each torchrun rank of 2 will use
    run_on_ranks(_train_on_rank, 2, {**BASE, "metrics": str(ref)}, threads, timeout=TIMEOUT)
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in BASE.items()]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "--max-restarts=1",
           "-m", "shardwise", "train", *flags, f"--checkpoint-dir={tmp_path / 'ckpts'}", "--checkpoint-every=2",
           "--resume", f"--metrics={metrics}"]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    env.update(PYTHONPATH=str(REPO_ROOT), SHARDWISE_FAULT="step@5:1")  # rank 1 dies after step 5, once
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # rank 1 died once (the restarted attempt runs clean), and yet the job succeeded: torchrun restarted it
    assert proc.stderr.count("fault injection: SIGKILL at step, step 5, rank 1") == 1, proc.stderr
    assert _curve(metrics) == _curve(ref) and len(_curve(ref)) == 6
