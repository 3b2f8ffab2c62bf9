"""The step report (``shardwise.report`` / ``shardwise train --report`` / ``shardwise report``).

- Truthful attribution: a custom all-gather on one block blocks every wait for a known
  ``DELAY_S`` longer; on real gloo ranks the report must charge that group's all-gather
  with the injected time (within 10%) and name it as the top cause, with its knob.
- The files: summary.json, a Chrome trace with every rank, the four PNGs and index.html;
  ``shardwise report DIR`` prints the table and the causes.
- Off costs nothing: with no report active, a training step reads no clock and records
  nothing in :mod:`shardwise.tracing`.
- The definitions (exposed, busy, overlap, per-phase waits) on hand-made spans, the knob
  each kind of wait points to, and the plain-JSON fallback without matplotlib.
"""

from __future__ import annotations

import html
import json
import logging
import sys
import time

import pytest
import torch
import torch.nn as nn

import shardwise
import shardwise.tracing
from _models import Transformer, apply_fully_shard, lm_loss, rank_generator, token_batch
from shardwise import cli, collectives
from shardwise.step_report import analysis
from shardwise.step_report.export import PLOT_HINT
from shardwise.step_report.steps import MemoryColumns, StepInput, summarize_step
from shardwise.testing import run_on_ranks
from shardwise.tracing import CommSpan

DELAY_S = 0.1
STEPS = 4
TIMEOUT = 90
DIMS = dict(vocab_size=32, dim=16, n_layers=2, n_heads=2, max_seq_len=8, ffn_hidden=32)
PNGS = ("timeline.png", "exposed.png", "memory.png", "loss.png")


# ---------------------------------------------------------------- helpers (run on the ranks)


class _DelayedWork:
    def __init__(self, work, comm: "DelayedAllGather"):
        self.work, self.comm = work, comm

    def wait(self) -> bool:
        start = time.monotonic()
        time.sleep(DELAY_S)  # the injected slowness: every wait blocks DELAY_S longer
        slept = time.monotonic()
        self.work.wait()
        self.comm.record(slept - start, time.monotonic() - start)
        return True


class DelayedAllGather(collectives.AllGather):
    """The default all-gather, whose wait blocks ``DELAY_S`` longer than the data takes."""

    def __init__(self) -> None:
        self.waits = 0
        self.injected_s = 0.0  # what the sleeps really took (a loaded machine oversleeps)
        self.blocked_s = 0.0  # the whole of each wait, as the caller saw it

    def record(self, injected_s: float, blocked_s: float) -> None:
        self.waits += 1
        self.injected_s += injected_s
        self.blocked_s += blocked_s

    def __call__(self, output_tensor, input_tensor, group, async_op: bool = False):
        return _DelayedWork(collectives.all_gather(output_tensor, input_tensor, group, async_op=True), self)


class _NoClock:
    """Stands in for the ``time`` module inside shardwise.tracing: any clock read fails."""

    def monotonic_ns(self) -> int:
        raise AssertionError("shardwise.tracing read the clock with no report or trace active")


def _train_with_report(out_dir: str):
    torch.manual_seed(0)
    model = apply_fully_shard(Transformer(**DIMS), shardwise.fully_shard)
    comm = DelayedAllGather()
    model.layers[1].set_custom_all_gather(comm)
    optim = torch.optim.SGD(model.parameters(), lr=1e-2)
    gen = rank_generator()
    after_warmup = (0, 0.0, 0.0)
    with shardwise.report(out_dir, meta={"model": "test transformer"}) as r:
        for step in range(STEPS):
            loss = lm_loss(model, token_batch(gen, DIMS["vocab_size"]))
            loss.backward()
            optim.step()
            optim.zero_grad()
            r.step(loss)
            if step == 0:
                after_warmup = (comm.waits, comm.injected_s, comm.blocked_s)
    assert shardwise.tracing._ACTIVE is None, "the report left its recorder active"
    n = STEPS - 1
    per_step = [(now - then) / n for now, then in zip((comm.waits, comm.injected_s, comm.blocked_s), after_warmup)]

    # Off: a whole step with no clock read in tracing (no recording work on the hot path).
    clock = shardwise.tracing.time
    shardwise.tracing.time = _NoClock()
    try:
        lm_loss(model, token_batch(gen, DIMS["vocab_size"])).backward()
        optim.step()
    finally:
        shardwise.tracing.time = clock
    return r.summary, per_step


# ---------------------------------------------------------------- tests


def test_injected_delay_is_attributed_to_its_group(tmp_path, capsys):
    ranks = run_on_ranks(_train_with_report, 2, str(tmp_path), timeout=TIMEOUT)
    summary = ranks[0][0]
    assert ranks[1][0] is None and summary["meta"]["world_size"] == 2 and summary["meta"]["steps"] == STEPS
    waits, injected_s, blocked_s = (sum(r[1][i] for r in ranks) / 2 for i in range(3))  # per step, mean over ranks
    assert waits == 2  # forward and backward all-gather of layers.1 (reshard_after_forward=True)

    injected_ms = injected_s * 1e3
    gathers = [w for w in summary["waits"] if w["kind"] == "all_gather"]
    delayed = sum(w["ms_per_step"] for w in gathers if w["fqn"] == "layers.1")
    assert abs(delayed - injected_ms) <= 0.1 * injected_ms, f"layers.1 all-gather exposed {delayed:.1f} ms/step, injected {injected_ms:.1f}"
    assert delayed == pytest.approx(blocked_s * 1e3, rel=0.02)  # exactly the waits' time, as the comm measured it
    expected_ms = DELAY_S * 1e3 * waits
    others = sum(w["ms_per_step"] for w in gathers if w["fqn"] != "layers.1")
    assert others < 0.5 * delayed, f"other groups' all-gathers {others:.1f} ms/step vs layers.1 {delayed:.1f}"
    top = summary["causes"][0]
    assert (top["fqn"], top["kind"]) == ("layers.1", "all_gather"), summary["causes"]
    assert top["knob"] in ("set_modules_to_forward_prefetch", "set_modules_to_backward_prefetch")
    for rank in summary["ranks"]:
        assert rank["exposed_ms"] >= 0.9 * expected_ms and rank["compute_ms"] > 0
        assert rank["wall_ms"] == pytest.approx(rank["compute_ms"] + rank["exposed_ms"])
        assert 0.0 <= rank["overlap"] <= 1.0 and rank["peak_bytes"] > 0
        assert rank["wire_bytes_per_step"]["all_gather"] > 0

    trace = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    assert {e["pid"] for e in trace} == {0, 1}
    assert any(e["cat"] == "exposed" and "layers.1" in e["name"] for e in trace if e["ph"] == "X")
    page = (tmp_path / "index.html").read_text()
    for png in PNGS:
        assert (tmp_path / png).stat().st_size > 1000 and f'src="{png}"' in page

    assert cli.main(["report", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "exposed ms" in out and "straggler: rank" in out and "peak memory:" in out
    first = next(line for line in out.splitlines() if line.startswith("1. "))
    assert first.startswith("1. layers.1's") and "all-gather waits" in first, out


def _span(kind, issue, done, wait=None, fqn="a", state="forward"):
    span = CommSpan(kind, fqn, state, issue, done)
    if wait is not None:
        span.wait_start_ns, span.wait_end_ns, span.wait_state = wait[0], wait[1], state
    return span


def test_step_definitions_on_known_spans():
    ms = 1_000_000
    comms = [
        _span("all_gather", 0, 10 * ms, wait=(8 * ms, 10 * ms)),  # blocked 2 ms
        _span("all_gather", 5 * ms, 15 * ms, wait=(20 * ms, 20 * ms), fqn="b"),  # done before its wait: 0
        _span("reduce_scatter", 30 * ms, 50 * ms, wait=(45 * ms, 50 * ms), state="post_backward"),  # 5 ms
        _span("reduce_scatter", 90 * ms, 120 * ms),  # in flight past the step's end: clipped, not waited
    ]
    memory = MemoryColumns([0, 40 * ms, 100 * ms], [10, 30, 20])  # at unshard (a), reshard (b), step end
    rec = summarize_step(StepInput(3, 0, 0, 0, 100 * ms, comms, memory, ["unshard", "reshard"], ["a", "b"], {"all_gather": 8}, 1.5))
    assert rec.wall_ms == 100 and rec.exposed_ms == 7 and rec.compute_ms == 93
    assert rec.comm_ms == {"all_gather": 15, "reduce_scatter": 30}  # union per kind, clipped to the step
    assert rec.busy_ms == 45 and rec.overlap == pytest.approx(1 - 7 / 45)
    waits = {(w.fqn, w.kind, w.phase): (w.ms, w.count) for w in rec.waits}
    assert waits == {("a", "all_gather", "forward"): (2, 1), ("b", "all_gather", "forward"): (0, 1),
                     ("a", "reduce_scatter", "backward"): (5, 1)}  # fmt: skip
    assert (rec.peak_bytes, rec.peak_at_ms, rec.peak_event) == (30, 40, "reshard (b)")


@pytest.mark.parametrize("fqn,kind,phase,lead,knob", [
    ("", "all_gather", "forward", 0.0, "unshard(async_op=True)"),
    ("layers.3", "all_gather", "forward", 0.01, "set_modules_to_forward_prefetch"),
    ("layers.3", "all_gather", "backward", 0.0, "set_modules_to_backward_prefetch"),
    ("layers.3", "reduce_scatter", "backward", 4.0, "MixedPrecisionPolicy(reduce_dtype)"),
    ("layers.3", "all_reduce", "backward", 4.0, "set_requires_all_reduce"),
])  # fmt: skip
def test_each_cause_names_its_knob_and_cost(fqn, kind, phase, lead, knob):
    row = {"fqn": fqn, "kind": kind, "phase": phase, "ms_per_step": 12.0, "lead_ms": lead, "duration_ms": 10.0}
    (cause,) = analysis.causes([row])
    assert cause["knob"] == knob and "12.0 ms per step" in cause["text"] and knob.split("(")[0] in cause["text"]
    assert cause["text"].startswith("the root's" if not fqn else f"{fqn}'s")


def test_single_process_report_without_matplotlib(tmp_path, monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    monkeypatch.delitem(sys.modules, "shardwise.step_report.plots", raising=False)
    model = nn.Linear(4, 2)
    with pytest.raises(RuntimeError, match="outside the `with shardwise.report"):
        shardwise.report(tmp_path).step()
    with caplog.at_level(logging.WARNING), shardwise.report(tmp_path) as r:
        for _ in range(3):
            model(torch.randn(8, 4)).sum().backward()
            r.step(1.0)
    assert r.summary["meta"]["world_size"] == 1 and r.summary["causes"] == [] and r.summary["loss"] == [1.0] * 3
    assert PLOT_HINT in caplog.text and html.escape(PLOT_HINT) in (tmp_path / "index.html").read_text()
    assert not any((tmp_path / png).exists() for png in PNGS) and (tmp_path / "summary.json").is_file()
    with pytest.raises(SystemExit, match="summary.json not found"):
        cli.main(["report", str(tmp_path / "missing")])


def test_train_flags_reach_the_config():
    args = cli.build_parser().parse_args(["train", "--report", "runs/r", "--reshard-after-forward", "false"])
    cfg = cli._train_config(args)
    assert cfg.report == "runs/r" and cfg.reshard_after_forward is False
    assert cli._train_config(cli.build_parser().parse_args(["train"])).report is None
