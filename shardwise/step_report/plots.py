"""The report's PNGs, drawn with matplotlib's object API (no pyplot, no global backend change).

- ``loss.png``: the loss after each step, mean over ranks.
- ``timeline.png``: one chosen step (the median-time kept step), every rank on one time
  axis. Per rank three lanes: the training thread (computing, or blocked in a wait on an
  all-gather or a reduction), the all-gathers in flight and the reductions in flight.
- ``memory.png``: each rank's sampled memory over that step, with its peak marked.
- ``exposed.png``: exposed communication per group, split by what was waited on.

Importing this module needs matplotlib (``pip install 'shardwise[plot]'``).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.patches import Patch

__all__ = ["draw_all", "loss_plot", "timeline_plot", "memory_plot", "exposed_plot"]

COLORS = {
    "compute": "#9ccc65", "wait_all_gather": "#e53935", "wait_reduce": "#8e24aa",
    "all_gather": ("#1e88e5", "#64b5f6"), "reduce": ("#fb8c00", "#ffcc80"),
}  # fmt: skip
_REDUCE_KINDS = ("reduce_scatter", "all_reduce")


def _save(fig: Figure, path: Path) -> str:
    FigureCanvasAgg(fig)
    fig.savefig(path, dpi=110)
    return path.name


def _name(fqn: str) -> str:
    return fqn or "root"


def _natural(fqn: str) -> list:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", fqn)]


def loss_plot(summary: dict[str, Any], path: Path) -> str:
    fig = Figure(figsize=(7, 3.6), layout="constrained")
    ax = fig.add_subplot()
    points = [(i, v) for i, v in enumerate(summary["loss"]) if v is not None]
    if points:
        ax.plot(*zip(*points), marker="o" if len(points) < 40 else None, color="#1e88e5")
    else:
        ax.text(0.5, 0.5, "no loss passed to r.step(loss)", ha="center", va="center", transform=ax.transAxes)
    ax.set(title="Loss (mean over ranks)", xlabel="step", ylabel="loss")
    ax.grid(alpha=0.3)
    return _save(fig, path)


def _steps_of(raw: list[dict[str, Any]], step: int) -> list[dict[str, Any]]:
    return sorted((s for s in raw if s["step"] == step), key=lambda s: s["rank"])


def _thread_lane(ax, s: dict[str, Any], y: float, t0: float) -> None:
    ax.broken_barh([(s["start_ms"] - t0, s["end_ms"] - s["start_ms"])], (y - 0.4, 0.8), color=COLORS["compute"])
    for c in s["comms"]:
        if c["wait_start"] is None or c["wait_end"] <= c["wait_start"]:
            continue
        color = COLORS["wait_all_gather"] if c["kind"] == "all_gather" else COLORS["wait_reduce"]
        ax.broken_barh([(c["wait_start"] - t0, c["wait_end"] - c["wait_start"])], (y - 0.4, 0.8), color=color)


def _comm_lane(ax, s: dict[str, Any], y: float, t0: float, kinds: tuple[str, ...], colors: tuple[str, str]) -> None:
    comms = sorted((c for c in s["comms"] if c["kind"] in kinds), key=lambda c: c["issue"])
    for i, c in enumerate(comms):  # alternate shades so back-to-back collectives stay distinct
        ax.broken_barh([(c["issue"] - t0, max(c["done"] - c["issue"], 0.01))], (y - 0.35, 0.7), color=colors[i % 2])


def timeline_plot(summary: dict[str, Any], raw: list[dict[str, Any]], path: Path) -> str:
    step = summary["timeline_step"]
    steps = _steps_of(raw, step) if step is not None else []
    lanes = 3 * max(1, len(steps))
    fig = Figure(figsize=(12, 1.6 + 0.32 * lanes), layout="constrained")
    ax = fig.add_subplot()
    t0 = min((s["start_ms"] for s in steps), default=0.0)
    labels = []
    for i, s in enumerate(steps):
        base = 3 * i
        _thread_lane(ax, s, base, t0)
        _comm_lane(ax, s, base + 1, t0, ("all_gather",), COLORS["all_gather"])
        _comm_lane(ax, s, base + 2, t0, _REDUCE_KINDS, COLORS["reduce"])
        if i:
            ax.axhline(base - 0.5, color="#666", linewidth=0.8)
        r = s["rank"]
        labels += [f"rank {r} thread", f"rank {r} all-gathers", f"rank {r} reductions"]
    ax.set_yticks(range(len(labels)), labels)
    ax.invert_yaxis()
    ax.set(xlabel="time from the step's start (ms)", title=f"Step {step}: compute, collectives in flight and waits, per rank")
    ax.grid(axis="x", alpha=0.3)
    legend = [Patch(color=COLORS["compute"], label="computing"),
              Patch(color=COLORS["wait_all_gather"], label="blocked: all-gather wait"),
              Patch(color=COLORS["wait_reduce"], label="blocked: reduction wait"),
              Patch(color=COLORS["all_gather"][0], label="all-gather in flight"),
              Patch(color=COLORS["reduce"][0], label="reduce-scatter / all-reduce in flight")]  # fmt: skip
    fig.legend(handles=legend, loc="outside lower center", ncols=5, fontsize="small", frameon=False)
    return _save(fig, path)


def memory_plot(summary: dict[str, Any], raw: list[dict[str, Any]], path: Path) -> str:
    step = summary["timeline_step"]
    fig = Figure(figsize=(10, 4), layout="constrained")
    ax = fig.add_subplot()
    for s in _steps_of(raw, step) if step is not None else []:
        t = [m[0] - s["start_ms"] for m in s["memory"]]
        mb = [m[1] / 1e6 for m in s["memory"]]
        peak = max(range(len(mb)), key=mb.__getitem__)
        label = f"rank {s['rank']}: peak {mb[peak]:.1f} MB at {t[peak]:.0f} ms ({s['memory'][peak][2]})"
        line, = ax.step(t, mb, where="post", label=label)
        ax.plot(t[peak], mb[peak], "o", color=line.get_color())
    ax.set(title=f"Memory over step {step} ({summary['meta'].get('memory', 'bytes')}, sampled at lifecycle events)",
           xlabel="time from the step's start (ms)", ylabel="memory (MB)")  # fmt: skip
    ax.legend(fontsize="small")
    ax.grid(alpha=0.3)
    return _save(fig, path)


def exposed_plot(summary: dict[str, Any], path: Path) -> str:
    parts = {"forward all-gather": {}, "backward all-gather": {}, "reduction": {}}
    for w in summary["waits"]:
        part = "reduction" if w["kind"] in _REDUCE_KINDS else f"{'forward' if w['phase'] == 'forward' else 'backward'} all-gather"
        parts[part][w["fqn"]] = parts[part].get(w["fqn"], 0.0) + w["ms_per_step"]
    groups = sorted({f for p in parts.values() for f in p}, key=_natural)
    fig = Figure(figsize=(9, 1.5 + 0.3 * max(1, len(groups))), layout="constrained")
    ax = fig.add_subplot()
    left = [0.0] * len(groups)
    colors = {"forward all-gather": "#e53935", "backward all-gather": "#ef9a9a", "reduction": "#8e24aa"}
    for part, values in parts.items():
        widths = [values.get(g, 0.0) for g in groups]
        ax.barh(range(len(groups)), widths, left=left, color=colors[part], label=part)
        left = [a + b for a, b in zip(left, widths)]
    ax.set_yticks(range(len(groups)), [_name(g) for g in groups])
    ax.invert_yaxis()
    ax.set(title="Exposed communication per group (mean over ranks)", xlabel="blocked time per step (ms)")
    fig.legend(loc="outside lower center", ncols=3, fontsize="small", frameon=False)
    ax.grid(axis="x", alpha=0.3)
    return _save(fig, path)


def draw_all(out_dir: Path, summary: dict[str, Any], raw: list[dict[str, Any]]) -> list[str]:
    """Write the four PNGs into ``out_dir``; their file names, in page order."""
    return [
        timeline_plot(summary, raw, out_dir / "timeline.png"),
        exposed_plot(summary, out_dir / "exposed.png"),
        memory_plot(summary, raw, out_dir / "memory.png"),
        loss_plot(summary, out_dir / "loss.png"),
    ]
