"""The summary as text: the table and lines that ``shardwise report DIR`` prints and
``index.html`` shows (plain functions of the ``summary.json`` dict)."""

from __future__ import annotations

from typing import Any

__all__ = ["header_lines", "summary_rows", "format_table", "straggler_line", "memory_line", "cause_lines", "format_summary"]

_KIND_SHORT = {"all_gather": "AG", "reduce_scatter": "RS", "all_reduce": "AR"}


def header_lines(summary: dict[str, Any]) -> list[str]:
    """What ran: the caller's facts, ranks, steps, and what memory means."""
    meta = summary["meta"]
    facts = {k: v for k, v in meta.items() if k not in ("world_size", "steps", "measured_steps", "warmup_excluded", "memory", "device")}
    lines = [", ".join(f"{k} {v}" for k, v in facts.items())] if facts else []
    warm = " (step 0 is warm-up and left out)" if meta.get("warmup_excluded") else ""
    lines.append(f"{meta['world_size']} ranks on {meta.get('device', '?')}, {meta['steps']} steps{warm}; "
                 f"per-step means; memory = {meta.get('memory', '?')}")  # fmt: skip
    return lines


def _row(r: dict[str, Any], kinds: list[str], label: str) -> list[str]:
    overlap = "n/a" if r["overlap"] is None else f"{100 * r['overlap']:.0f}%"
    sent = sum(r["wire_bytes_per_step"].values()) / 1e6
    return [label, f"{r['wall_ms']:.1f}", f"{r['compute_ms']:.1f}", f"{r['exposed_ms']:.1f}", overlap,
            *(f"{r['comm_ms'].get(k, 0.0):.1f}" for k in kinds), f"{r['peak_bytes'] / 1e6:.1f}", f"{sent:.2f}"]  # fmt: skip


def summary_rows(summary: dict[str, Any]) -> list[list[str]]:
    """Header then one row per rank and a mean row."""
    kinds = sorted({k for r in summary["ranks"] for k in r["comm_ms"]})
    header = ["rank", "step ms", "compute ms", "exposed ms", "overlap",
              *(f"{_KIND_SHORT.get(k, k)} ms" for k in kinds), "peak MB", "sent MB"]  # fmt: skip
    rows = [_row(r, kinds, str(r["rank"])) for r in summary["ranks"]]
    return [header, *rows, _row(summary["mean"], kinds, "mean")]


def format_table(rows: list[list[str]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in rows)


def straggler_line(summary: dict[str, Any]) -> str:
    s = summary["straggler"]
    if s["rank"] is None or summary["meta"]["world_size"] < 2:
        return "straggler: n/a (one rank)"
    return (f"straggler: rank {s['rank']} (most compute in {s['times_slowest']}/{s['steps']} steps); "
            f"compute skew between ranks {s['skew_ms_mean']:.1f} ms/step mean, {s['skew_ms_max']:.1f} ms max")  # fmt: skip


def memory_line(summary: dict[str, Any]) -> str:
    r = max(summary["ranks"], key=lambda r: r["peak_bytes"])
    return (f"peak memory: {r['peak_bytes'] / 1e6:.1f} MB on rank {r['rank']}, step {r['peak_step']}, "
            f"{r['peak_at_ms']:.1f} ms in ({100 * r['peak_at_fraction']:.0f}% of the step), at {r['peak_event']}")


def cause_lines(summary: dict[str, Any]) -> list[str]:
    causes = summary["causes"]
    if not causes:
        return ["no exposed communication was measured"]
    return [f"{i}. {c['text']}" for i, c in enumerate(causes, 1)]


def format_summary(summary: dict[str, Any]) -> str:
    """Everything ``shardwise report DIR`` prints."""
    lines = [*header_lines(summary), "", format_table(summary_rows(summary)), "",
             straggler_line(summary), memory_line(summary), "",
             "top causes of exposed communication (ms per step, mean over ranks):", *cause_lines(summary)]  # fmt: skip
    return "\n".join(lines)
