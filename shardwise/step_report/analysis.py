"""From every rank's step records to the answer: the summary and the causes of exposed time.

:func:`summarize` averages over the measured steps (the first step is warm-up — lazy
init, first allocations — and is left out whenever there is more than one) and then over
ranks. The **straggler** of a step is the rank with the most compute: the others wait for
it inside their collectives, so its lead shows up as their exposed time; the **skew** is
its compute minus the least compute of any rank in that step.

:func:`causes` ranks ``(group, collective, phase)`` by exposed ms per step (mean over
ranks) and says for each which knob addresses it, from what was measured: an all-gather
waited with almost no lead (issued under 25% of its duration before its wait) was not
prefetched; one with a lead was prefetched but took longer than the compute before it.
"""

from __future__ import annotations

import dataclasses
import statistics
from typing import Any

from shardwise.step_report.steps import StepRecord

__all__ = ["summarize", "causes", "explain", "choose_timeline_step"]

PREFETCH_LEAD = 0.25
"""An all-gather issued less than this fraction of its duration before its wait counts as not prefetched."""


def _measured(records: list[StepRecord]) -> list[StepRecord]:
    return records[1:] if len(records) > 1 else records


def _mean(values: list[float]) -> float:
    return statistics.fmean(values) if values else 0.0


def _rank_summary(records: list[StepRecord]) -> dict[str, Any]:
    steps = _measured(records)
    kinds = sorted({k for r in steps for k in r.comm_ms})
    wire_kinds = sorted({k for r in steps for k in r.wire_bytes})
    overlaps = [r.overlap for r in steps if r.overlap is not None]
    peak = max(steps, key=lambda r: r.peak_bytes)
    return {
        "rank": steps[0].rank,
        "wall_ms": _mean([r.wall_ms for r in steps]),
        "compute_ms": _mean([r.compute_ms for r in steps]),
        "exposed_ms": _mean([r.exposed_ms for r in steps]),
        "busy_ms": _mean([r.busy_ms for r in steps]),
        "overlap": _mean(overlaps) if overlaps else None,
        "comm_ms": {k: _mean([r.comm_ms.get(k, 0.0) for r in steps]) for k in kinds},
        "wire_bytes_per_step": {k: _mean([r.wire_bytes.get(k, 0) for r in steps]) for k in wire_kinds},
        "peak_bytes": peak.peak_bytes,
        "peak_step": peak.step,
        "peak_at_ms": peak.peak_at_ms,
        "peak_at_fraction": peak.peak_at_ms / peak.wall_ms if peak.wall_ms else 0.0,
        "peak_event": peak.peak_event,
    }


def _mean_over_ranks(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key in ("wall_ms", "compute_ms", "exposed_ms", "busy_ms"):
        out[key] = _mean([r[key] for r in ranks])
    overlaps = [r["overlap"] for r in ranks if r["overlap"] is not None]
    out["overlap"] = _mean(overlaps) if overlaps else None
    for key in ("comm_ms", "wire_bytes_per_step"):
        kinds = sorted({k for r in ranks for k in r[key]})
        out[key] = {k: _mean([r[key].get(k, 0.0) for r in ranks]) for k in kinds}
    out["peak_bytes"] = max(r["peak_bytes"] for r in ranks)
    return out


def _straggler(by_rank: list[list[StepRecord]]) -> dict[str, Any]:
    steps = min(len(_measured(r)) for r in by_rank)
    slowest: list[int] = []
    skews: list[float] = []
    for i in range(steps):
        compute = [_measured(r)[i].compute_ms for r in by_rank]
        slowest.append(max(range(len(compute)), key=compute.__getitem__))
        skews.append(max(compute) - min(compute))
    if not slowest:
        return {"rank": None, "times_slowest": 0, "steps": 0, "skew_ms_mean": 0.0, "skew_ms_max": 0.0}
    rank = max(set(slowest), key=slowest.count)
    return {"rank": rank, "times_slowest": slowest.count(rank), "steps": steps,
            "skew_ms_mean": _mean(skews), "skew_ms_max": max(skews)}  # fmt: skip


def _waits(by_rank: list[list[StepRecord]]) -> list[dict[str, Any]]:
    """Exposed time per (group, kind, phase): ms per step, mean over ranks (and the worst rank)."""
    per_rank: dict[tuple[str, str, str], list[list[float]]] = {}
    n = len(by_rank)
    for rank, records in enumerate(by_rank):
        steps = _measured(records)
        for r in steps:
            for w in r.waits:
                acc = per_rank.setdefault((w.fqn, w.kind, w.phase), [[0.0, 0, 0.0, 0.0] for _ in range(n)])[rank]
                acc[0] += w.ms / len(steps)
                acc[1] += w.count
                acc[2] += w.lead_ms
                acc[3] += w.duration_ms
    rows = []
    for (fqn, kind, phase), accs in per_rank.items():
        count = sum(a[1] for a in accs) or 1
        rows.append({
            "fqn": fqn, "kind": kind, "phase": phase,
            "ms_per_step": _mean([a[0] for a in accs]), "worst_rank_ms_per_step": max(a[0] for a in accs),
            "lead_ms": sum(a[2] for a in accs) / count, "duration_ms": sum(a[3] for a in accs) / count,
        })  # fmt: skip
    return sorted(rows, key=lambda w: -w["ms_per_step"])


def choose_timeline_step(by_rank: list[list[StepRecord]], kept: set[int]) -> int | None:
    """The kept measured step whose slowest rank's wall time is the median among kept steps."""
    walls = {}
    for records in by_rank:
        for r in _measured(records):
            if r.step in kept:
                walls[r.step] = max(walls.get(r.step, 0.0), r.wall_ms)
    if not walls:
        return min(kept) if kept else None
    ordered = sorted(walls, key=walls.get)
    return ordered[len(ordered) // 2]


def explain(w: dict[str, Any]) -> tuple[str, str]:
    """``(sentence, knob)`` for one row of :func:`summarize`'s ``waits``."""
    name = "the root" if not w["fqn"] else w["fqn"]
    ms = f"{w['ms_per_step']:.1f} ms per step"
    lead, dur = w["lead_ms"], w["duration_ms"]
    prefetched = lead >= PREFETCH_LEAD * dur and lead > 0.05
    if w["kind"] == "all_gather" and w["phase"] == "forward":
        if not w["fqn"]:
            return (f"{name}'s forward all-gather waits {ms}: it opens the step and nothing runs before it; "
                    "issue it early with model.unshard(async_op=True) before fetching the next batch",
                    "unshard(async_op=True)")  # fmt: skip
        if not prefetched:
            return (f"{name}'s forward all-gather waits {ms}: its prefetch is not overlapped "
                    f"(issued {lead:.1f} ms before it is needed, takes {dur:.1f} ms); see set_modules_to_forward_prefetch",
                    "set_modules_to_forward_prefetch")  # fmt: skip
        return (f"{name}'s forward all-gather waits {ms}: prefetched {lead:.1f} ms ahead but it takes {dur:.1f} ms; "
                "prefetch it earlier (set_modules_to_forward_prefetch) or keep it gathered (reshard_after_forward=False)",
                "set_modules_to_forward_prefetch")  # fmt: skip
    if w["kind"] == "all_gather":
        how = "is not prefetched" if not prefetched else f"is prefetched {lead:.1f} ms ahead but takes {dur:.1f} ms"
        return (f"{name}'s backward all-gather waits {ms}: it {how}; see set_modules_to_backward_prefetch, "
                "or reshard_after_forward=False to keep the parameters from forward (more memory)",
                "set_modules_to_backward_prefetch")  # fmt: skip
    if w["kind"] == "reduce_scatter":
        return (f"{name}'s reduce-scatter waits {ms}: it takes {dur:.1f} ms and is waited {lead:.1f} ms after issue; "
                "halve its bytes with MixedPrecisionPolicy(reduce_dtype=torch.bfloat16), or skip it on "
                "accumulation microbatches with set_requires_gradient_sync(False)",
                "MixedPrecisionPolicy(reduce_dtype)")  # fmt: skip
    return (f"{name}'s all-reduce waits {ms} (takes {dur:.1f} ms); reduce in bf16 (reduce_dtype) or defer it "
            "on accumulation microbatches with set_requires_all_reduce(False)",
            "set_requires_all_reduce")  # fmt: skip


def causes(waits: list[dict[str, Any]], top: int = 3) -> list[dict[str, Any]]:
    """The ``top`` largest exposed waits, each with its sentence and knob."""
    out = []
    for w in waits[:top]:
        if w["ms_per_step"] <= 0:
            break
        text, knob = explain(w)
        out.append({**w, "text": text, "knob": knob})
    return out


def summarize(by_rank: list[list[StepRecord]], meta: dict[str, Any], kept: set[int]) -> dict[str, Any]:
    """The report's ``summary.json`` content (rank 0, after every rank's records are gathered)."""
    if not by_rank or not all(by_rank):
        raise ValueError("shardwise.report: no step was recorded; call r.step() once per training step")
    ranks = [_rank_summary(r) for r in by_rank]
    waits = _waits(by_rank)
    n_steps = min(len(r) for r in by_rank)
    losses = [[r[i].loss for r in by_rank] for i in range(n_steps)]
    return {
        "meta": {**meta, "world_size": len(by_rank), "steps": n_steps, "measured_steps": len(_measured(by_rank[0])),
                 "warmup_excluded": n_steps > 1},  # fmt: skip
        "ranks": ranks,
        "mean": _mean_over_ranks(ranks),
        "straggler": _straggler(by_rank),
        "waits": waits,
        "causes": causes(waits),
        "loss": [_mean([v for v in step if v is not None]) if any(v is not None for v in step) else None for step in losses],
        "per_step": [[{k: v for k, v in dataclasses.asdict(r).items() if k != "waits"} for r in records] for records in by_rank],
        "timeline_step": choose_timeline_step(by_rank, kept),
    }
