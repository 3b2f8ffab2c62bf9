"""Tests of the benchmark harness (``python -m bench``): its arithmetic, and one tiny run end to end.

The end-to-end test runs the ``--quick`` machinery on the tiny model only (2 ranks, fp32,
2 timed steps, fully_shard with resharding and replicate vs DDP, profiled) in a subprocess and checks the JSON it writes: every field present, numbers sane. It never
compares timings: the machine is shared.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import sys
from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))  # `bench` is a top-level package of the repo, not installed

from bench.cases import Case, Settings  # noqa: E402
from bench.cli import build_parser, main, plan  # noqa: E402
from bench.compile import format_table as compile_table  # noqa: E402
from bench.compile import main as compile_main  # noqa: E402
from bench import launch as bench_launch  # noqa: E402
from bench.memory import _ORIGINAL_RESIZE, PeakMemory  # noqa: E402
from bench.report import above_floor_ratio  # noqa: E402
from bench.stats import percentile, spread, worst_rank  # noqa: E402
from bench.wire import count_events, read_wchar, theoretical_min  # noqa: E402
from shardwise.testing import CommEvent, run_on_ranks  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def _ranks_fork_from_the_warm_server():
    """The bench's launches fork their ranks from the pools' fork server (torch and shardwise
    imported once) instead of spawning interpreters that each import them again."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(bench_launch, "START_METHOD", "forkserver")
        yield

# ---------------------------------------------------------------- arithmetic


def test_theoretical_min_uses_param_dtype_for_gathers_and_reduce_dtype_for_reductions():
    psi, n = 1000, 4
    fp32 = theoretical_min("fsdp", psi, n, True, 4, 4)
    assert fp32.total_bytes == pytest.approx(3 * psi * 4 * 3 / 4)
    bf16 = theoretical_min("fsdp", psi, n, True, 2, 4)
    assert bf16.gather_bytes == pytest.approx(2 * psi * 2 * 3 / 4)
    assert bf16.reduce_bytes == pytest.approx(psi * 4 * 3 / 4)
    assert theoretical_min("fsdp", psi, n, False, 4, 4).total_bytes == pytest.approx(2 * psi * 4 * 3 / 4)
    assert theoretical_min("replicate", psi, n, None, 4, 4).total_bytes == pytest.approx(2 * psi * 4 * 3 / 4)


def test_count_events_applies_ring_factors():
    events = [
        CommEvent("all_gather", "op", 800, 4),
        CommEvent("reduce_scatter", "op", 800, 4),
        CommEvent("all_reduce", "op", 800, 4),
        CommEvent("all_to_all", "op", 800, 4),
        CommEvent("barrier", "op", 0, 4),
    ]
    counted = count_events(events)
    assert counted.wire_bytes == {"all_gather": 600, "reduce_scatter": 600, "all_reduce": 1200, "all_to_all": 600}
    assert counted.counts["barrier"] == 1 and counted.total_wire_bytes == 3000


def test_above_floor_ratio():
    assert above_floor_ratio(2.0, 3.0) == pytest.approx(0.5)  # 1.0 above compute against 2.0
    assert above_floor_ratio(3.0, 4.0, floor=2.0) == pytest.approx(0.5)  # 4 ranks on 2 cores
    assert above_floor_ratio(1.5, 1.0) is None  # torch at the floor: nothing to compare with


def test_spread_and_worst_rank():
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([0.0, 10.0], 10) == pytest.approx(1.0)
    assert spread([1.0, 2.0, 3.0, 4.0, 5.0]).median == 3.0
    worst = worst_rank([[1.0, 1.0, 1.0], [2.0, 2.0, 9.0]])
    assert worst.median == 2.0 and worst.p90 > 2.0


def test_peak_memory_counts_frees_and_storage_resizes():
    keep = torch.zeros(1000)  # 4000 B seeded
    with PeakMemory([keep]) as memory:
        a = torch.ones(2000)  # 12000 live
        b = a * 2  # 20000
        del a, b  # 4000
        buf = torch.empty(5000)  # 24000
        buf.untyped_storage().resize_(0)  # 4000: freed the way FSDP frees unsharded params
        small = torch.ones(100)  # 4400
        buf.untyped_storage().resize_(20_000)  # 24400
        del small  # 24000
    assert memory.start_bytes == 4000
    assert memory.peak_bytes == 24_400 and memory.live_bytes == 24_000
    assert torch.UntypedStorage.resize_ is _ORIGINAL_RESIZE  # the wrapper is gone with the mode


def test_case_validation():
    with pytest.raises(ValueError, match="reshard"):
        Case("fsdp", "tiny", 2, None)
    with pytest.raises(ValueError, match="fp32"):
        Case("replicate", "tiny", 2, None, "bf16")
    with pytest.raises(ValueError, match="torch_replicate Case is fp32"):
        Case("torch_replicate", "tiny", 2, True)
    with pytest.raises(ValueError, match="world_size"):
        Case("fsdp", "tiny", 1, True)
    with pytest.raises(ValueError, match="steps"):
        Settings(steps=0)
    with pytest.raises(ValueError, match="optimizer"):
        Settings(optimizer="fused")


def test_quick_plan_is_the_documented_grid():
    cases, settings = plan(build_parser().parse_args(["--quick"]))
    assert [c.label for c in cases] == [
        "tiny ws2 rs=T fp32", "tiny ws2 rs=F fp32", "small ws2 rs=T fp32", "small ws2 rs=F fp32", "tiny ws2 replicate",
        "tiny ws2 vs torch replicate",
    ]  # fmt: skip
    assert settings.steps <= 3 and settings.optimizer == "foreach"
    _, settings = plan(build_parser().parse_args(["--quick", "--optimizer", "loop"]))
    assert settings.optimizer == "loop"
    cases, _ = plan(build_parser().parse_args(["--models", "small", "--world-sizes", "4", "--reshard", "false", "--replicate-models", "none"]))
    assert [c.label for c in cases] == ["small ws4 rs=F fp32", "small ws4 rs=F bf16"]
    cases, _ = plan(build_parser().parse_args(["--models", "none", "--replicate-models", "tiny", "--replicate-peers", "torch"]))
    assert [(c.kind, c.label) for c in cases] == [("torch_replicate", "tiny ws2 vs torch replicate"), ("torch_replicate", "tiny ws4 vs torch replicate")]
    cases, _ = plan(build_parser().parse_args(["--models", "none", "--replicate-models", "tiny", "--world-sizes", "2", "--replicate-peers", "ddp-matched"]))
    assert [(c.kind, c.label) for c in cases] == [("ddp_matched", "tiny ws2 vs DDP matched buckets")]
    cases, _ = plan(build_parser().parse_args(["--report-overhead", "--world-sizes", "2", "--reshard", "true"]))
    assert [(c.kind, c.label) for c in cases] == [("report", "small ws2 rs=T fp32 report")]



def test_compile_table_puts_counts_side_by_side_with_the_first_step_ratio():
    def row(graphs, breaks, first_s):
        return dict(graphs=graphs, breaks=breaks, first_s=first_s, second_s=0.1)

    rows = [("whole", "torch", row(1, 0, 4.0)), ("whole", "shardwise", row(1, 0, 3.0))]
    lines = compile_table(rows, "aot_eager").splitlines()
    assert lines[0] == "backend=aot_eager"
    assert lines[-2].split() == ["whole", "torch", "1", "0", "4.00", "0.100"]
    assert lines[-1].split() == ["whole", "shardwise", "1", "0", "3.00", "0.100", "0.75"]
    with pytest.raises(SystemExit, match="unknown recipes"):
        compile_main(["--recipes", "whole,nope"])


# ---------------------------------------------------------------- end to end

_SPREAD_KEYS = {"median", "p10", "p90"}
_IMPL_KEYS = {
    "name", "step_s", "per_rank_median_s", "tokens_per_s", "x_compute", "wire_bytes", "wire_over_min", "comm_counts",
    "payload_bytes_by_kind", "wire_bytes_by_kind", "self_reported_wire_bytes", "socket_bytes", "peak_bytes",
    "start_bytes", "losses_rank0", "step_s_per_rank", "profile_rank0", "thread_cpu_s",
}  # fmt: skip
_RESULT_KEYS = {
    "case", "n_params", "seq_len", "tokens_per_step", "theory_min_bytes", "compute_only", "ratio", "above_compute",
    "max_loss_diff", "impls",
}  # fmt: skip
_NAMES = {
    "fsdp": ("shardwise.fully_shard", "torch.fully_shard"),
    "replicate": ("shardwise.replicate", "torch.DDP"),
    "torch_replicate": ("shardwise.replicate", "torch.replicate"),
}


@pytest.fixture(scope="module")
def quick_tiny_run(tmp_path_factory) -> tuple[dict, str]:
    out = tmp_path_factory.mktemp("bench")
    argv = [
        "--models", "tiny", "--world-sizes", "2", "--dtypes", "fp32", "--reshard", "true",
        "--replicate-models", "tiny", "--warmup", "1", "--steps", "2", "--profile", "--out", str(out),
    ]  # fmt: skip
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert main(argv) == 0
    files = list(out.glob("*.json"))
    assert len(files) == 1, files
    return json.loads(files[0].read_text()), printed.getvalue()


def test_run_writes_every_field(quick_tiny_run):
    doc, stdout = quick_tiny_run
    assert set(doc) == {"meta", "results"}
    assert doc["meta"]["settings"]["steps"] == 2 and doc["meta"]["threads_per_rank"] == 1
    assert len(doc["meta"]["source"]["shardwise_sources_sha256"]) == 64 and doc["meta"]["cases_planned"] == 3
    labels = [r["case"]["label"] for r in doc["results"]]
    assert labels == ["tiny ws2 rs=T fp32", "tiny ws2 replicate", "tiny ws2 vs torch replicate"]
    for res in doc["results"]:
        assert set(res) == _RESULT_KEYS
        assert set(res["compute_only"]) == {"step_s", "peak_bytes", "step_s_rank0"}
        assert set(res["compute_only"]["step_s"]) == _SPREAD_KEYS
        assert set(res["impls"]) == {"shardwise", "torch"}
        for role, name in zip(("shardwise", "torch"), _NAMES[res["case"]["kind"]]):
            imp = res["impls"][role]
            assert set(imp) == _IMPL_KEYS, set(imp) ^ _IMPL_KEYS
            assert imp["name"] == name
            assert set(imp["step_s"]) == _SPREAD_KEYS
            prof = imp["profile_rank0"]
            assert prof is not None and prof["top"] and prof["own"]
            assert prof["python_calls"] > prof["own_python_calls"] > 0
        assert res["case"]["label"] in stdout  # the printed table has a row per case


def test_run_numbers_are_sane(quick_tiny_run):
    doc, _ = quick_tiny_run
    for res in doc["results"]:
        minimum = res["theory_min_bytes"]["total"]
        assert res["tokens_per_step"] == 1 * 128 * 2 and res["n_params"] > 1_000_000
        assert res["ratio"] > 0 and math.isfinite(res["ratio"])
        above = res["above_compute"]
        assert above["cpu_share_floor"] == max(1.0, 2 / os.cpu_count())
        xs, xt = (res["impls"][r]["x_compute"] for r in ("shardwise", "torch"))
        if xt > 1:  # torch slower than compute alone: the ratio is defined
            assert above["vs_compute_only"] == pytest.approx((xs - 1) / (xt - 1))
        assert res["max_loss_diff"] < 1e-3, "both implementations should train the same model on the same data"
        compute = res["compute_only"]
        assert len(compute["step_s_rank0"]) == 2 and compute["step_s"]["median"] > 0
        assert compute["peak_bytes"] > 0
        for imp in res["impls"].values():
            s = imp["step_s"]
            assert 0 < s["p10"] <= s["median"] <= s["p90"]
            assert len(imp["step_s_per_rank"]) == 2 and all(len(t) == 2 for t in imp["step_s_per_rank"])
            assert imp["tokens_per_s"] > 0 and imp["x_compute"] > 0
            assert 0.99 * minimum <= imp["wire_bytes"] <= 2 * minimum, (imp["name"], imp["wire_bytes"], minimum)
            assert imp["peak_bytes"] > imp["start_bytes"] > 0
            assert len(imp["losses_rank0"]) == 1 + 2 + 2  # warmup, timed, counted, memory
            if read_wchar() is not None:
                assert imp["socket_bytes"] >= 0.5 * minimum
            if imp["name"].startswith("shardwise"):
                assert imp["self_reported_wire_bytes"] == imp["wire_bytes"]


def test_replicate_peers_issue_the_same_collectives(quick_tiny_run):
    """shardwise.replicate against torch's replicate, applied the same way: one all-reduce
    per group on both sides, the same count and payload in the counted step."""
    doc, _ = quick_tiny_run
    (res,) = [r for r in doc["results"] if r["case"]["kind"] == "torch_replicate"]
    sw, th = res["impls"]["shardwise"], res["impls"]["torch"]
    assert sw["comm_counts"] == th["comm_counts"] and sw["comm_counts"]["all_reduce"] == 6  # 5 blocks + root
    assert sw["payload_bytes_by_kind"] == th["payload_bytes_by_kind"]


def _all_reduces_of_the_matched_pair() -> dict[str, int]:
    """Each contender's all-reduces in its second step."""
    from torch.distributed.device_mesh import init_device_mesh

    from bench.contenders import build_pair
    from bench.workload import make_batches, train_step
    from shardwise.testing import CommCounter
    from shardwise.train.model import GPTConfig

    pair = build_pair(Case("ddp_matched", "tiny", 2), init_device_mesh("cpu", (2,)), 0, "foreach")
    batches = make_batches(GPTConfig.preset("tiny"), 1, 2, 0, torch.distributed.get_rank())
    counts = {}
    for c in pair:
        train_step(c.model, c.optimizer, batches[0])  # DDP rebuilds its buckets after the first step
        with CommCounter() as counter:
            train_step(c.model, c.optimizer, batches[1])
        counts[c.name] = counter.counts["all_reduce"]  # DDP also broadcasts its buffers each forward, by default
    return counts


def test_matched_ddp_issues_one_all_reduce_per_replicate_call():
    """The ``ddp-matched`` peer isolates the replicate API's collective count: DDP bucketed
    to as many all-reduces as shardwise.replicate issues (5 blocks + root on tiny)."""
    counts = run_on_ranks(_all_reduces_of_the_matched_pair, 2, timeout=120)[0]
    assert counts == {"shardwise.replicate": 6, "torch.DDP matched": 6}


# ---------------------------------------------------------------- bench.overhead


def _overhead_quick_at_two_ranks() -> dict:
    """One rank's ``measure_k`` of ``--quick`` at world size 2, in the warm pool (a launch
    of its own would spend most of its time starting processes and importing torch)."""
    from bench.overhead import OverheadSpec, measure_k
    from torch.distributed.device_mesh import init_device_mesh

    spec = OverheadSpec(2, (2,), warmup=1, steps=3, rounds=1, faults="on", device="cpu", profile=True)
    return measure_k(2, spec, init_device_mesh("cpu", (2,)))


def test_overhead_quick_runs_every_contender_and_they_train_the_same_losses():
    """``python -m bench.overhead --quick`` (world size 1 through the CLI's launch, world
    size 2 on the pool's ranks): a table per (faults, world size, K), every contender
    timed in every round, and every contender's losses equal to the plain model's (all
    ranks share one batch, so a wrapper that loses or doubles a gradient shows). No timing
    is asserted: the machine is shared."""
    from bench.overhead import CONTENDERS, format_tables, run, summarise
    from shardwise.testing import run_on_ranks

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        summaries = run(["--quick", "--profile", "--faults", "on", "--world-sizes", "1"])
    assert printed.getvalue().count("faults=") == 1 and all(name in printed.getvalue() for name in CONTENDERS)
    summaries.append(summarise(2, 2, "on", run_on_ranks(_overhead_quick_at_two_ranks, 2, timeout=120)))
    assert [(s["faults"], s["world_size"], s["k"]) for s in summaries] == [("on", 1, 2), ("on", 2, 2)]
    for s in summaries:
        assert set(s["rows"]) == set(CONTENDERS)
        for name, row in s["rows"].items():
            assert set(row) == {"step_s", "cpu_s", "unit_us", "cpu_unit_us"}
            assert len(row["step_s"]) == 1 and row["step_s"][0] > 0 and row["cpu_s"][0] > 0
            assert s["max_loss_diff_vs_plain"][name] <= 1e-6, (name, s["max_loss_diff_vs_plain"])
        assert s["rows"]["plain"]["unit_us"] == [0.0]
        assert set(s["calls"]) == set(CONTENDERS) and s["calls"]["plain"]["calls"] > 0
        assert s["calls"]["shardwise.fully_shard"]["own_calls"] > 0
    table = format_tables(summaries)
    assert table.count("faults=") == 2 and all(name in table for name in CONTENDERS)
    assert format_tables(summaries[:1]).splitlines()[1] == "faults=on world_size=1 K=2"


# ---------------------------------------------------------------- bench.overhead_floor


def _floor_measured() -> dict:
    from bench.overhead_floor import measure
    from torch.distributed.device_mesh import init_device_mesh

    return measure(2, 3, init_device_mesh("cpu", (1,)), rounds=1)


def test_overhead_floor_mechanisms_are_identities_and_all_measured():
    """The hooked stacks of ``python -m bench.overhead_floor`` compute the plain stack's
    gradients (the trigger and hooks only observe), and every mechanism gets a figure."""
    from bench.overhead import build_stack
    from bench.overhead_floor import FUNCTION_TRIGGER, MECHANISMS, _hooked_stack, format_table
    from shardwise.testing import run_on_ranks

    x = torch.randn(3, 32)
    plain = build_stack(2)
    plain(x).sum().backward()
    for trigger in ("hook", "function"):
        hooked = _hooked_stack(2, trigger=trigger, output_hook=True)
        hooked(x).sum().backward()
        for a, b in zip(plain.parameters(), hooked.parameters()):
            assert torch.equal(a.grad, b.grad)
    (result,) = run_on_ranks(_floor_measured, 1, timeout=120)
    assert set(result) == {"plain step", *MECHANISMS, FUNCTION_TRIGGER} and result["plain step"] > 0
    lines = format_table(2, result).splitlines()
    assert lines[-2].startswith("floor (sum)") and lines[-1].startswith("not in the floor")


# ---------------------------------------------------------------- bench.instructions


def test_instructions_arithmetic_and_table():
    """``python -m bench.instructions`` reads cachegrind's total and divides the timed steps'
    share of it by steps and K; the table puts each contender over the plain model."""
    from bench.instructions import format_table, instructions_in, per_unit

    output = "==12== Collected : 5\n==12==\n==12== I   refs:      12,539,472,334\n"
    assert instructions_in(output) == 12_539_472_334
    with pytest.raises(RuntimeError, match="I refs"):
        instructions_in("valgrind: no such tool")
    assert per_unit(1_000, 1_000 + 60 * 48 * 500, 60, 48) == 500.0
    lines = format_table({"plain": 400_000.0, "shardwise.fully_shard": 612_500.0}).splitlines()
    assert lines[1].split() == ["plain", "400.0"]
    assert lines[2].split() == ["shardwise.fully_shard", "612.5", "212.5"]


def test_instructions_child_trains_each_contender_and_rejects_unknown_ones():
    """The child valgrind counts runs the stack in-process at world size 1 (an in-memory
    store: no port), with and without the optimizer step: the command line once (a fresh
    interpreter, as valgrind starts it), the other variant forked from the warm fork server
    (a second interpreter would only import torch again)."""
    import multiprocessing
    import subprocess

    from bench.instructions import main

    child = ["--child", "shardwise.fully_shard", "--k", "2", "--warmup", "1", "--steps", "1"]
    command = subprocess.Popen([sys.executable, "-m", "bench.instructions", *child, "--no-optimizer"], cwd=REPO_ROOT,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    forked = multiprocessing.get_context("forkserver").Process(target=main, args=(child,))
    try:
        forked.start()
        forked.join(120)
        _, err = command.communicate(timeout=120)
    finally:
        command.kill()
        command.wait()
        if forked.pid is not None:
            forked.kill()
    assert command.returncode == 0, err[-2000:]
    assert forked.exitcode == 0
    with pytest.raises(SystemExit, match="unknown contender"):
        main(["--contenders", "plain,nope"])


def test_data_pipeline_prepares_both_corpora_and_times_the_loader(tmp_path):
    pytest.importorskip("datasets")
    from bench.data_pipeline import main as data_main, write_corpus

    assert 45_000 <= write_corpus(tmp_path / "c.jsonl", 0.05) <= 50_000  # cut at a line end
    assert all(json.loads(line)["text"] for line in (tmp_path / "c.jsonl").read_text().splitlines())
    out = tmp_path / "r.json"
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        data_main(["--small-mb", "0.05", "--big-mb", "0.1", "--workers", "1", "--no-train", "--seq-len", "32",
                   "--workdir", str(tmp_path / "w"), "--json", str(out)])
    sizes = json.loads(out.read_text())["sizes"]
    assert sizes["big"]["prepare"]["tokens"] > 1.9 * sizes["small"]["prepare"]["tokens"] > 0
    assert all(row["prepare"]["tokens_per_cpu_s"] > 0 and row["loader_ms"] > 0 for row in sizes.values())
    assert "tok/CPU-s" in printed.getvalue() and not (tmp_path / "w").exists()
