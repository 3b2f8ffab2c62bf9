"""``shardwise train --pp N [--pp-schedule S]``: pipeline stages, each ``fully_shard``ed, run by
``torch.distributed.pipelining``.

- A single-stage, a looped and a V-shaped zero-bubble schedule (``1F1B``, ``Interleaved1F1B``,
  ``DualPipeV``) train a GPT preset at PP 2 x FSDP 2 (4 ranks) bit-equal to ``--impl torch``
  (torch's FSDP2 under the same pipeline): every step's loss and grad norm, with the clip
  active. (tests/test_pipelining.py runs all seven schedules of torch 2.13 against torch's
  FSDP2 at the library level, collectives counted.)
- PP composes with TP (PP 2 x FSDP 2 x TP 2) and with HSDP on a Llama (PP 2 x (2, 2)), at 8
  ranks, bit-equal to ``--impl torch``.
- A pipelined run is the run without a pipeline, within fp32 rounding: same weights (each
  stage draws the whole model's random stream), same data (``pp`` ranks share a batch).
- Checkpoints keep the model's parameter names: a stopped pipelined run resumes bit-identically,
  a run without ``--pp`` resumes it, and ``shardwise export`` of it loads in Transformers.
- A model that cannot be split, and flags that do not compose, are refused before launch.
"""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest
import torch

from shardwise import cli
from shardwise.testing import run_on_ranks
from shardwise.train import distributed
from shardwise.train.config import TrainConfig, TrainResult
from shardwise.train.export import export_checkpoint
from shardwise.train.loop import restore_model, train
from shardwise.train.metrics import read_metrics
from shardwise.train.models import model_spec
from shardwise.train.pipeline import split_blocks, stage_ids

TIMEOUT = 240
GPT = dict(model="tiny", steps=2, batch_size=4, seq_len=16, data_bytes=20_000, lr=3e-3, clip_norm=0.5)
LLAMA = {"model_type": "llama", "vocab_size": 256, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 4,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
         "tie_word_embeddings": False}


def _train(fields: dict) -> TrainResult:
    env = distributed.setup("cpu", num_threads=1, replicate=fields.get("replicate", 1), tp=fields.get("tp", 1),
                            pp=fields.get("pp", 1))
    return train(TrainConfig(**fields), env)


def _both_impls(fields: dict, tmp: str) -> dict[str, dict]:
    """The run of ``fields`` with ``--impl shardwise`` then ``--impl torch`` on these ranks:
    each one's per-step records (loss and grad norm are means over ranks)."""
    out = {}
    for impl in ("shardwise", "torch"):
        path = f"{tmp}/{impl}.jsonl"
        _train({**fields, "impl": impl, "metrics": path})
        out[impl] = read_metrics(path)
    return out


KINDS = ("1F1B", "Interleaved1F1B", "DualPipeV")
"""One schedule of each kind: single-stage, looped, V-shaped with split weight gradients."""


def _each_kind(fields: dict, tmp: str) -> dict[str, dict[str, dict]]:
    return {s: _both_impls({**fields, "pp_schedule": s}, f"{tmp}/{s}") for s in KINDS}


def _assert_same(records: dict[str, dict], where: str, steps: int) -> None:
    ours, torchs = records["shardwise"], records["torch"]
    assert len(ours) == steps, where
    for key in ("loss", "grad_norm"):  # bit-equal: == on floats, every step
        assert {s: r[key] for s, r in ours.items()} == {s: r[key] for s, r in torchs.items()}, (where, key)


def _curve(path, key: str) -> dict[int, float]:
    return {step: record[key] for step, record in read_metrics(path).items()}


def _mkdirs(tmp_path, names) -> str:
    for name in names:
        (tmp_path / name).mkdir()
    return str(tmp_path)


def test_stages_are_contiguous_runs_held_looped_or_v_shaped():
    assert split_blocks(5, 4) == [range(0, 2), range(2, 3), range(3, 4), range(4, 5)]
    assert [stage_ids("1F1B", r, 2) for r in (0, 1)] == [[0], [1]]
    assert [stage_ids("Interleaved1F1B", r, 2) for r in (0, 1)] == [[0, 2], [1, 3]]
    assert [stage_ids("DualPipeV", r, 2) for r in (0, 1)] == [[0, 3], [1, 2]]
    with pytest.raises(ValueError, match="2 blocks cannot fill 4 pipeline stages"):
        split_blocks(2, 4)


def test_each_kind_of_schedule_trains_like_torch(tmp_path):
    tmp = _mkdirs(tmp_path, KINDS)
    runs = run_on_ranks(_each_kind, 4, {**GPT, "pp": 2}, tmp, timeout=TIMEOUT)[0]
    for schedule, records in runs.items():
        _assert_same(records, schedule, GPT["steps"])
        assert all(r["grad_norm"] > GPT["clip_norm"] for r in records["torch"].values())  # the clip was active


def test_pipeline_equals_the_run_without_one(tmp_path):
    """PP 2 x FSDP 2 (4 ranks) against FSDP 2 (2 ranks): the same two data-parallel slices."""
    piped, plain = tmp_path / "piped.jsonl", tmp_path / "plain.jsonl"
    fields = {**GPT, "steps": 3}
    run_on_ranks(_train, 4, {**fields, "pp": 2, "pp_schedule": "Interleaved1F1B", "metrics": str(piped)}, timeout=TIMEOUT)
    run_on_ranks(_train, 2, {**fields, "metrics": str(plain)}, timeout=TIMEOUT)
    got, want = read_metrics(piped), read_metrics(plain)
    assert list(got) == list(want) == [1, 2, 3]
    for step in want:
        assert got[step]["loss"] == pytest.approx(want[step]["loss"], rel=1e-5, abs=0), step
        assert got[step]["grad_norm"] == pytest.approx(want[step]["grad_norm"], rel=1e-4, abs=0), step


def test_pp_with_tp_at_eight_ranks_like_torch(tmp_path):
    tmp = _mkdirs(tmp_path, ["tp"])
    records = run_on_ranks(_both_impls, 8, {**GPT, "pp": 2, "tp": 2, "pp_schedule": "GPipe"}, f"{tmp}/tp",
                           timeout=TIMEOUT)[0]
    _assert_same(records, "pp 2 x dp 2 x tp 2", GPT["steps"])


def test_llama_pp_with_hsdp_at_eight_ranks_like_torch(tmp_path):
    config = tmp_path / "llama.json"
    config.write_text(json.dumps(LLAMA))
    tmp = _mkdirs(tmp_path, ["hsdp"])
    fields = {**GPT, "model": "tiny", "hf_config": str(config), "pp": 2, "replicate": 2, "pp_schedule": "ZBVZeroBubble"}
    records = run_on_ranks(_both_impls, 8, fields, f"{tmp}/hsdp", timeout=TIMEOUT)[0]
    _assert_same(records, "llama pp 2 x hsdp (2, 2)", GPT["steps"])


def _logits(fields: dict, tokens: torch.Tensor) -> torch.Tensor:
    cfg = TrainConfig(**fields)
    model = restore_model(cfg, distributed.setup("cpu", num_threads=1))
    with torch.no_grad():
        return model_spec(cfg).logits(model, tokens)


def test_llama_checkpoints_resume_across_layouts_and_export(tmp_path):
    from transformers import AutoModelForCausalLM

    config = tmp_path / "llama.json"
    config.write_text(json.dumps(LLAMA))
    fields = {**GPT, "hf_config": str(config), "steps": 4, "pp": 2, "pp_schedule": "1F1B", "eval_every": 2}
    ref, piped, plain = tmp_path / "ref.jsonl", tmp_path / "piped.jsonl", tmp_path / "plain.jsonl"
    ckpt = {"checkpoint_dir": str(tmp_path / "ckpt"), "metrics": str(piped)}
    whole = run_on_ranks(_train, 4, {**fields, "metrics": str(ref)}, timeout=TIMEOUT)[0]
    run_on_ranks(_train, 4, {**fields, **ckpt, "stop_after": 2}, timeout=TIMEOUT)
    shutil.copytree(tmp_path / "ckpt", tmp_path / "ckpt2")
    second = run_on_ranks(_train, 4, {**fields, **ckpt, "resume": True}, timeout=TIMEOUT)[0]
    for key in ("loss", "grad_norm", "lr"):  # bit-identical: == on floats, every step
        assert _curve(piped, key) == _curve(ref, key) and len(_curve(ref, key)) == 4, key
    assert second.eval_losses == {4: whole.eval_losses[4]} and len(whole.eval_losses) == 2  # eval through the pipeline

    # the same checkpoint, resumed without a pipeline on 2 ranks (the same data-parallel slices)
    no_pp = {**fields, "pp": 1, "pp_schedule": "1F1B", "resume": True, "metrics": str(plain),
             "checkpoint_dir": str(tmp_path / "ckpt2")}
    run_on_ranks(_train, 2, no_pp, timeout=TIMEOUT)
    resumed = read_metrics(plain)
    assert list(resumed) == [3, 4]
    for step in resumed:
        assert resumed[step]["loss"] == pytest.approx(read_metrics(ref)[step]["loss"], rel=1e-5, abs=0)

    export_checkpoint(tmp_path / "ckpt", tmp_path / "hf")
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    sharded = run_on_ranks(_logits, 2, {**no_pp, "checkpoint_dir": str(tmp_path / "ckpt")}, tokens,
                           timeout=TIMEOUT)[0]
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    with torch.no_grad():
        assert torch.equal(hf(input_ids=tokens).logits, sharded)


# ---------------------------------------------------------------- refused before any rank starts


def _config(tmp_path, **overrides) -> str:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**LLAMA, **overrides}))
    return str(path)


@pytest.mark.parametrize("argv,message", [
    (["--model", "nano", "--nproc", "4", "--pp", "2", "--pp-schedule", "Interleaved1F1B"],
     "the nano GPT has 2 blocks, too few for 4 pipeline stages"),
    (["--nproc", "3", "--pp", "2"], "--pp 2 x --replicate 1 x --tp 1 must divide the 3 ranks"),
    (["--nproc", "4", "--pp", "2", "--grad-accum", "2"], "--pp with --grad-accum is not supported"),
    (["--nproc", "4", "--pp", "2", "--pp-microbatches", "3"], "--pp-microbatches 3 must divide --batch-size 16"),
    (["--pp-schedule", "GPipe"], "--pp-schedule configure pipeline parallelism: add --pp N"),
])
def test_flags_that_do_not_compose_are_refused_before_launch(no_launch, argv, message):
    with pytest.raises(SystemExit, match=message.replace("(", r"\(").replace("+", r"\+")):
        cli.main(["train", *argv])


def test_models_that_cannot_be_split_are_refused_before_launch(no_launch, tmp_path):
    with pytest.raises(SystemExit, match="ties its input embeddings and lm_head"):
        cli.main(["train", "--nproc", "4", "--pp", "2", "--hf-config", _config(tmp_path, tie_word_embeddings=True)])
    with pytest.raises(SystemExit, match="not model_type 'phi3'"):
        cli.main(["train", "--nproc", "4", "--pp", "2", "--hf-config", _config(tmp_path, model_type="phi3", pad_token_id=0)])
    with pytest.raises(SystemExit, match="4 decoder layers, too few for 8 pipeline stages"):
        cli.main(["train", "--nproc", "4", "--pp", "4", "--pp-schedule", "LoopedBFS", "--hf-config", _config(tmp_path)])
