"""Checkpoints (shardwise.checkpoint) survive SIGKILL at every commit point and fail loudly when damaged.

Crash tests run a one-rank ``shardwise train`` in child processes killed by the
``SHARDWISE_FAULT`` hook at each named point of the commit protocol, then resume in this
process and compare the loss curve with an uninterrupted run, exactly. Error tests damage
a checkpoint one way each and expect :class:`CheckpointError` naming what is wrong.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from shardwise.checkpoint import CheckpointDir, CheckpointError
from shardwise.checkpoint.faults import parse_faults
from shardwise.checkpoint.trainer_state import check_shapes
from shardwise.train.config import TrainConfig
from shardwise.train.loop import train
from shardwise.train.metrics import read_metrics

REPO_ROOT = Path(__file__).resolve().parent.parent
CHILD = Path(__file__).resolve().parent / "_checkpoint_child.py"
BASE = dict(model="nano", steps=3, batch_size=2, seq_len=16, data_bytes=20_000, lr_schedule="cosine", warmup_steps=1)

# kill point (at the save of step 2) -> the step `latest` must name afterwards
KILL_POINTS = {
    "ckpt_after_shards": 1,
    "ckpt_before_rename": 1,
    "ckpt_after_rename": 1,
    "ckpt_before_pointer_replace": 1,
    "ckpt_mid_prune": 2,
}


def _cfg(**kw) -> TrainConfig:
    return TrainConfig(**{**BASE, **kw})


def _kill_at_each_point(root: Path) -> subprocess.Popen:
    """A child process running a 3-step, checkpoint-every-step run killed at each point in turn."""
    cfg = _cfg(checkpoint_dir=str(root), checkpoint_every=1, keep_last=1)  # the child puts each run in root/POINT
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
    env.pop("TORCHELASTIC_RESTART_COUNT", None)
    args = [sys.executable, str(CHILD), json.dumps(dataclasses.asdict(cfg)), str(root), *KILL_POINTS]
    return subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.launches
def test_sigkill_at_every_commit_point_keeps_a_loadable_checkpoint(tmp_path, single_rank):
    child = _kill_at_each_point(tmp_path)
    reference = train(_cfg(), single_rank).losses  # meanwhile, the uninterrupted run
    out, err = child.communicate(timeout=120)
    assert child.returncode == 0, err
    statuses = json.loads(out)
    for point, step in KILL_POINTS.items():
        assert os.WIFSIGNALED(statuses[point]) and os.WTERMSIG(statuses[point]) == signal.SIGKILL, (point, err)
        ckpt = CheckpointDir(tmp_path / point)
        latest = ckpt.latest()
        assert latest == ckpt.root / ckpt.step_name(step), point
        assert ckpt.verify(latest)["step"] == step
        resumed = train(_cfg(checkpoint_dir=str(ckpt.root), checkpoint_every=1, keep_last=1, resume=True), single_rank)
        assert resumed.resumed_from == step and resumed.losses == reference[step:], point
        assert sorted(p.name for p in ckpt.root.iterdir()) == ["latest", "step-00000003"], point


@pytest.fixture
def saved(tmp_path, single_rank) -> tuple[Path, list[float]]:
    """A directory holding the checkpoints of steps 1 and 2 of a 3-step run, and that run's losses."""
    directory = tmp_path / "ckpts"
    losses = train(_cfg(checkpoint_dir=str(directory), checkpoint_every=1, stop_after=2), single_rank).losses
    assert CheckpointDir(directory).committed_steps() == [1, 2]
    return directory, losses


def _resume(directory: Path, env, **kw):
    return train(_cfg(checkpoint_dir=str(directory), resume=True, **kw), env)


def test_resume_starts_fresh_without_checkpoint_and_loads_with_weights_only(saved, single_rank, tmp_path, monkeypatch):
    fresh = _resume(tmp_path / "empty", single_rank, stop_after=1)
    assert fresh.resumed_from == 0 and CheckpointDir(tmp_path / "empty").committed_steps() == [1]
    calls = []
    real_load = torch.load

    def spy(*args, **kwargs):
        calls.append(kwargs.get("weights_only"))
        return real_load(*args, **kwargs)

    monkeypatch.setattr(torch, "load", spy)
    resumed = _resume(saved[0], single_rank)
    assert resumed.resumed_from == 2 and len(resumed.losses) == 1
    assert calls and all(w is True for w in calls), calls


def _damage(directory: Path, how: str) -> None:
    step2 = directory / "step-00000002"
    if how == "missing":
        shutil.rmtree(step2)
    elif how == "truncated":
        shard = step2 / "__0_0.distcp"
        shard.write_bytes(shard.read_bytes()[:-100])
    elif how == "no manifest":
        (step2 / "manifest.json").unlink()
    elif how == "bad pointer":
        (directory / "latest").write_text("{not json")


@pytest.mark.parametrize("how,message", [
    ("missing", "names step-00000002, which does not exist"),
    ("truncated", r"damaged: __0_0.distcp is \d+ bytes, the manifest says \d+"),
    ("no manifest", "incomplete: unreadable manifest.json"),
    ("bad pointer", "not a valid checkpoint pointer"),
])
def test_damaged_checkpoint_is_an_error_not_a_fresh_start(saved, single_rank, how, message):
    _damage(saved[0], how)
    with pytest.raises(CheckpointError, match=message):
        _resume(saved[0], single_rank)


def test_a_run_without_resume_refuses_a_directory_holding_checkpoints(saved, single_rank):
    with pytest.raises(CheckpointError, match="already holds checkpoints .latest: step-00000002.; pass --resume"):
        train(_cfg(checkpoint_dir=str(saved[0])), single_rank)


def test_checkpoint_of_another_shape_names_what_differs(saved, single_rank):
    """The train job compares the saved model card before any rank loads (#24); below it,
    the loader's shape check names the first mismatched key and both shapes."""
    with pytest.raises(ValueError, match=r"of another model \(seq_len=16 there, 32 here\)"):
        _resume(saved[0], single_rank, seq_len=32)
    with pytest.raises(CheckpointError, match=r"'pos_embeddings.weight' has shape \(16, 32\) in the checkpoint "
                                              r"and \(32, 32\) in the model"):
        check_shapes({"pos_embeddings.weight": [16, 32]}, {"pos_embeddings.weight": [32, 32]}, saved[0])


def test_metrics_lines_survive_a_torn_write_and_resume_duplicates(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.5}\n{"step": 2, "loss": 1.25}\n{"step": 3, "lo')
    assert read_metrics(path) == {1: {"step": 1, "loss": 2.0}, 2: {"step": 2, "loss": 1.25}}


def test_fault_spec_rejects_unknown_points():
    assert parse_faults("step@5:1,ckpt_after_shards") == [("step", 5, 1), ("ckpt_after_shards", None, None)]
    with pytest.raises(ValueError, match="unknown fault point 'ckpt_after_shard'"):
        parse_faults("ckpt_after_shard@3")
