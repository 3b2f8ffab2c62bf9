"""The files of a report directory, written on rank 0 from every rank's records.

::

    DIR/summary.json     the numbers (:func:`shardwise.step_report.analysis.summarize`)
    DIR/trace.json       Chrome trace-event JSON of the kept steps: one process per rank with
                         tracks for the training thread (steps, waits, lifecycle events), the
                         all-gathers and the reductions in flight, and a memory counter
                         (open in https://ui.perfetto.dev or chrome://tracing)
    DIR/*.png            loss.png, timeline.png, memory.png, exposed.png (needs matplotlib)
    DIR/index.html       the plots and the summary table on one page
"""

from __future__ import annotations

import html
import json
import logging
from pathlib import Path
from typing import Any

from shardwise.step_report import analysis
from shardwise.step_report.steps import records_from_json
from shardwise.step_report.text import header_lines, straggler_line, summary_rows

__all__ = ["write_report", "chrome_trace", "index_html", "PLOT_HINT"]

logger = logging.getLogger(__name__)

PLOT_HINT = "the report's plots need matplotlib: pip install 'shardwise[plot]'"

_TRACKS = {"all_gather": 1, "reduce_scatter": 2, "all_reduce": 2}
_TRACK_NAMES = {0: "training thread (steps, waits)", 1: "all-gathers in flight", 2: "reductions in flight"}


def write_report(out_dir: Path, gathered: list[dict[str, Any]], meta: dict[str, Any], plots: bool = True) -> dict[str, Any]:
    """Write every file of the report into ``out_dir``; returns the summary."""
    by_rank = [records_from_json(p["records"]) for p in gathered]
    raw = [step for p in gathered for step in p["raw"]]
    kept = set.intersection(*({s["step"] for s in p["raw"]} for p in gathered)) if gathered else set()
    summary = analysis.summarize(by_rank, meta, kept)
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    (out_dir / "trace.json").write_text(json.dumps(chrome_trace(raw)))
    images: list[str] = []
    note = ""
    if plots:
        try:
            from shardwise.step_report import plots as plotting
        except ImportError:
            logger.warning("shardwise.report: %s; wrote summary.json and trace.json only", PLOT_HINT)
            note = PLOT_HINT
        else:
            images = plotting.draw_all(out_dir, summary, raw)
    (out_dir / "index.html").write_text(index_html(summary, images, note))
    return summary


def _x(name: str, cat: str, start_ms: float, end_ms: float, pid: int, tid: int, args=None) -> dict[str, Any]:
    event = {"name": name, "cat": cat, "ph": "X", "ts": start_ms * 1e3, "dur": max(0.0, end_ms - start_ms) * 1e3,
             "pid": pid, "tid": tid}  # fmt: skip
    if args:
        event["args"] = args
    return event


def chrome_trace(raw: list[dict[str, Any]]) -> dict[str, Any]:
    """Chrome trace-event JSON (``ts`` in µs from the report's origin) of the kept raw steps."""
    out: list[dict[str, Any]] = []
    for rank in sorted({s["rank"] for s in raw}):
        out.append({"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"rank {rank}"}})
        out += [{"name": "thread_name", "ph": "M", "pid": rank, "tid": t, "args": {"name": n}} for t, n in _TRACK_NAMES.items()]
    for s in raw:
        pid = s["rank"]
        out.append(_x(f"step {s['step']}", "step", s["start_ms"], s["end_ms"], pid, 0))
        for c in s["comms"]:
            name = f"{c['kind']} ({c['fqn'] or 'root'})"
            out.append(_x(name, "collective", c["issue"], c["done"], pid, _TRACKS.get(c["kind"], 2)))
            if c["wait_start"] is not None and c["wait_end"] > c["wait_start"]:
                out.append(_x(f"wait {name}", "exposed", c["wait_start"], c["wait_end"], pid, 0, {"phase": c["wait_state"]}))
        for kind, fqn, state, t in s["events"]:
            out.append({"name": f"{kind} ({fqn or 'root'})", "cat": state, "ph": "i", "s": "t", "ts": t * 1e3, "pid": pid, "tid": 0})
        for t, nbytes, _ in s["memory"]:
            out.append({"name": "memory", "ph": "C", "ts": t * 1e3, "pid": pid, "args": {"MB": nbytes / 1e6}})
    return {"traceEvents": out, "displayTimeUnit": "ms"}


def _table_html(summary: dict[str, Any]) -> str:
    header, *rows = summary_rows(summary)
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def index_html(summary: dict[str, Any], images: list[str], note: str = "") -> str:
    """One page: header facts, the summary table, the top causes, the plots."""
    facts = "".join(f"<li>{html.escape(line)}</li>" for line in [*header_lines(summary), straggler_line(summary)])
    causes = "".join(f"<li>{html.escape(c['text'])}</li>" for c in summary["causes"]) or "<li>no exposed communication</li>"
    figures = "".join(f'<figure><img src="{html.escape(name)}" alt="{html.escape(name)}"></figure>' for name in images)
    warn = f"<p class=note>{html.escape(note)}</p>" if note else ""
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>shardwise step report</title>
<style>body{{font-family:sans-serif;max-width:1200px;margin:2em auto}}table{{border-collapse:collapse}}
td,th{{border:1px solid #ccc;padding:3px 8px;text-align:right}}img{{max-width:100%}}.note{{color:#a00}}</style>
</head><body><h1>shardwise step report</h1><ul>{facts}</ul>{_table_html(summary)}
<h2>Top causes of exposed communication</h2><ol>{causes}</ol>{warn}{figures}
<p>Data: <a href="summary.json">summary.json</a>, <a href="trace.json">trace.json</a>
(open in <a href="https://ui.perfetto.dev">Perfetto</a>).</p></body></html>
"""
