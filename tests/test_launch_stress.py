"""``./dev stress --cli``: what it launches and how it reads a launch's end (no launch here)."""

from __future__ import annotations

import json

from shardwise.testing.launch_stress import HF_CONFIGS, PRESETS, WORLD_SIZES, classify, launches, write_configs

TORCHRUN_FAILURE = """\
final loss 5.49 | 287 tokens/s
terminate called without an active exception
torch.distributed.elastic.multiprocessing.api:failed (exitcode: -6) local_rank: 1 (pid: 4242) of binary: python
Root Cause (first observed failure):
[0]:
  time      : 2026-11-29_03:40:00
  host      : box
  rank      : 1 (local_rank: 1)
  exitcode  : -6 (pid: 4242)
  error_file: <N/A>
  traceback : Signal 6 (SIGABRT) received by PID 4242
"""


def test_launches_cover_every_model_and_world_size_shuffled():
    grid = len(PRESETS + tuple(HF_CONFIGS)) * len(WORLD_SIZES)
    first = launches(grid, seed=1)
    assert len(set(first)) == grid  # each combination once per round
    assert launches(grid, seed=1) == first and launches(grid, seed=2) != first
    assert len(launches(2 * grid + 3, seed=1)) == 2 * grid + 3


def test_an_abort_after_a_finished_run_is_counted_with_its_rank_and_message():
    outcome = classify(1, TORCHRUN_FAILURE)
    assert outcome.crashed and not outcome.ok
    assert outcome.rank == "1 (exit -6)"
    assert "terminate called without an active exception" in outcome.message
    assert classify(0, "final loss 5.49\n").ok
    failed = classify(1, "ValueError: bad config\n")
    assert not failed.crashed and failed.message == "ValueError: bad config"


def test_configs_are_written_for_every_family(tmp_path):
    root = write_configs(tmp_path)
    for family in HF_CONFIGS:
        assert json.loads((root / family / "config.json").read_text())["model_type"] == family
