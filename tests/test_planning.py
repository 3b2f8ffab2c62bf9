"""shardwise.plan / auto_shard / Plan: unit discovery, the plan as data, the budget search,
and predictions against real gloo runs of the planned wrapping.

The accuracy test runs ``bench.plan_accuracy.measure_case`` on 2 ranks (tiny GPT): it plans,
applies the plan with ``auto_shard``, trains warm-up steps, then measures one step's
collectives (``shardwise.comm_stats``) and peak live tensor bytes (``PeakMemory``). Bytes on
the wire and collective counts must equal the prediction exactly; the peak within 10%
without activations (a one-token batch) and within 20% with the run's batch.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # bench/ lives at the repo root

import shardwise  # noqa: E402
from bench.plan_accuracy import AccuracyCase, measure_case  # noqa: E402
from shardwise.planning.api import parse_bytes  # noqa: E402
from shardwise.planning.structure import find_block_fqns  # noqa: E402
from shardwise.testing import run_on_ranks  # noqa: E402
from shardwise.train.model import GPT, GPTConfig  # noqa: E402

TIMEOUT = 120


def _meta_gpt(name: str = "tiny") -> GPT:
    with torch.device("meta"):
        return GPT(GPTConfig.preset(name))


# ---------------------------------------------------------------- structure


class _Nested(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = nn.Sequential(*(nn.Sequential(nn.Linear(8, 8), nn.ReLU()) for _ in range(3)))
        self.mixed = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 4)])  # not identical: no units
        self.head = nn.Linear(8, 2)


def test_blocks_found_by_structure_not_by_name():
    assert find_block_fqns(_meta_gpt()) == [f"layers.{i}" for i in range(5)]
    assert find_block_fqns(_Nested()) == ["encoder.0", "encoder.1", "encoder.2"]


def test_transformers_llama_from_config_on_meta():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                   num_attention_heads=4, num_key_value_heads=2)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    plan = shardwise.plan(model, world_size=1024, batch=(1, 16), memory_budget="1GiB")
    assert [u.fqn for u in plan.units] == ["", "model.layers.0", "model.layers.1", "model.layers.2"]
    assert plan.fits and plan.peak_bytes > plan.peak_bytes_without_activations > 0


# ---------------------------------------------------------------- the plan as data


def test_plan_without_process_group_round_trips_and_prints(tmp_path):
    plan = shardwise.plan(_meta_gpt(), world_size=1024, device="cuda", batch=(2, 64))
    assert plan.world_size == 1024 and plan.units[0].reshard_after_forward is False
    assert all(u.reshard_after_forward is True for u in plan.units[1:])
    assert plan.comm_counts == {"all_gather": 11, "reduce_scatter": 6}
    path = tmp_path / "plan.json"
    plan.save(path)
    again = shardwise.Plan.load(path)
    assert again == plan
    text = str(plan)
    assert "layers.0 .. 4 (5)" in text and "predicted peak per rank" in text and "reduce_scatter" in text
    with pytest.raises(ValueError, match="no fields"):
        shardwise.Plan.from_dict({**plan.to_dict(), "bogus": 1})


def test_parse_bytes():
    assert parse_bytes("80GiB") == 80 * 2**30 and parse_bytes("1.5 GB") == 1_500_000_000 and parse_bytes(7) == 7
    with pytest.raises(ValueError, match="80GiB"):
        parse_bytes("lots")


# ---------------------------------------------------------------- the budget search


def test_budget_picks_cheapest_plan_that_fits():
    model = _meta_gpt("small")
    lean = shardwise.plan(model, world_size=8, device="cpu", batch=(1, 256), reshard_after_forward=True)
    kept = shardwise.plan(model, world_size=8, device="cpu", batch=(1, 256), reshard_after_forward=False)
    budget = (lean.peak_bytes + kept.peak_bytes) // 2
    plan = shardwise.plan(model, world_size=8, device="cpu", batch=(1, 256), memory_budget=budget)
    assert plan.fits and plan.peak_bytes <= budget
    assert kept.total_wire_bytes < plan.total_wire_bytes < lean.total_wire_bytes
    assert any(u.reshard_after_forward is False for u in plan.units[1:])


def test_budget_miss_says_by_how_much_and_what_would_fit():
    plan = shardwise.plan(_meta_gpt("small"), world_size=2, device="cpu", batch=(4, 256), memory_budget="4MiB",
                          activation_checkpointing=False)
    assert plan.fits is False and plan.peak_bytes > 4 * 2**20
    remedies = " ".join(plan.advice)
    for remedy in ("ranks", "bf16", "activation checkpointing", "CPU offload"):
        assert remedy in remedies
    assert "misses by" in str(plan)


def test_auto_shard_rejects_a_plan_for_another_model():
    plan = shardwise.plan(_meta_gpt(), world_size=2)
    plan.units[1].fqn = "blocks.0"
    with pytest.raises(ValueError, match="blocks.0"):
        shardwise.auto_shard(_meta_gpt(), plan)


def test_cli_plan(capsys):
    from shardwise import cli

    code = cli.main(["plan", "--model", "tiny", "--world-size", "4", "--device", "cpu", "--memory", "1GiB"])
    out = capsys.readouterr().out
    assert code == 0 and "fits" in out and "layers.0" in out


# ---------------------------------------------------------------- accuracy against real runs


@pytest.mark.parametrize("case", [AccuracyCase("tiny", 2, True, "fp32"), AccuracyCase("tiny", 2, False, "bf16")],
                         ids=lambda c: c.label)
def test_predictions_match_a_real_run(case):
    full = run_on_ranks(measure_case, 2, case, timeout=TIMEOUT)[0]
    no_act = run_on_ranks(measure_case, 2, case, (1, 1), timeout=TIMEOUT)[0]
    assert full["wire_predicted"] == full["wire_measured"]
    assert full["counts_predicted"] == full["counts_measured"]
    assert abs(no_act["predicted_no_act"] - no_act["measured"]) <= 0.10 * no_act["measured"]
    assert abs(full["predicted"] - full["measured"]) <= 0.20 * full["measured"]


def _train_auto() -> tuple[int, int, float]:
    from shardwise.train import distributed
    from shardwise.train.loop import TrainConfig, train

    cfg = TrainConfig(steps=3, batch_size=2, seq_len=64, auto=True, device="cpu", data_bytes=50_000)
    result = train(cfg, distributed.setup("cpu", num_threads=1))
    return result.predicted_peak_bytes, result.measured_peak_bytes, result.final_loss


def test_train_auto_reports_predicted_against_measured_peak():
    predicted, measured, loss = run_on_ranks(_train_auto, 2, timeout=TIMEOUT)[0]
    assert predicted and measured and loss == loss
    assert abs(predicted - measured) <= 0.20 * measured
