"""From raw per-rank measurements to the report: one JSON document and a short table.

:func:`summarise_case` reduces a case's ranks to the numbers a reader compares (each
defined in the JSON next to the value):

- step time: max over ranks of each rank's median / p10 / p90 (:mod:`bench.stats`);
- tokens/s: ``batch_size * seq_len * world_size`` / median step time;
- ``x_compute``: median step time / the median of the case's compute-only baseline
  (rank 0, interleaved with the contenders: :mod:`bench.baseline`);
- bytes per rank per step: counted ring bytes, theoretical minimum, socket ``wchar``
  (max over ranks), and shardwise's own ``comm_stats`` tally as a cross-check;
- peak live tensor bytes (max over ranks);
- ``ratio``: shardwise median / torch median (< 1: shardwise is faster);
- ``above_compute``: shardwise's time above the compute-only baseline over torch's
  (``(x_compute_sw - 1) / (x_compute_torch - 1)``: what each wrapper adds to the model's own
  work), and the same above the CPU-sharing floor ``ranks / cores`` when there are more
  ranks than cores (4 ranks on 2 cores cannot go under twice the compute-only time);
- ``max_loss_diff``: the largest per-step loss difference between the two on rank 0,
  which shows both trained the same model on the same data.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from bench.cases import Case, Settings
from bench.contenders import DTYPE_BYTES
from bench.rank import CaseMeasurement, ImplMeasurement
from bench.stats import Spread, spread, worst_rank
from bench.wire import theoretical_min
from shardwise.train.model import GPTConfig, count_params

__all__ = ["ROLES", "above_floor_ratio", "summarise_case", "write_json", "format_table", "format_profiles"]

ROLES = ("shardwise", "torch")

_COLUMNS = (  # header, width, alignment
    ("case", 29, "<"), ("impl", 21, "<"), ("step ms", 8, ">"), ("p10-p90 ms", 15, ">"), ("tok/s", 8, ">"),
    ("x compute", 9, ">"), ("sw/torch", 8, ">"), ("above s/t", 9, ">"), ("wire MB", 8, ">"), ("min MB", 7, ">"),
    ("socket MB", 9, ">"), ("peak MB", 8, ">"),
)  # fmt: skip


def summarise_case(case: Case, ranks: list[CaseMeasurement], settings: Settings) -> dict[str, Any]:
    """The JSON record of one case from every rank's measurements (index = rank)."""
    cfg = GPTConfig.preset(case.model)
    n_params = count_params(cfg)
    tokens = settings.batch_size * cfg.seq_len * case.world_size
    theory = theoretical_min(case.kind, n_params, case.world_size, case.reshard, DTYPE_BYTES[case.dtype], DTYPE_BYTES["fp32"])
    baseline = ranks[0].compute_only
    compute = spread(baseline.step_s)
    impls = {role: _summarise_impl([getattr(r, role) for r in ranks], tokens, compute.median, theory.total_bytes) for role in ROLES}
    sw, th = ranks[0].shardwise, ranks[0].torch
    return {
        "case": {"label": case.label, "kind": case.kind, "model": case.model, "world_size": case.world_size,
                 "reshard_after_forward": case.reshard, "dtype": case.dtype},
        "n_params": n_params,
        "seq_len": cfg.seq_len,
        "tokens_per_step": tokens,
        "theory_min_bytes": {"gather": theory.gather_bytes, "reduce": theory.reduce_bytes, "total": theory.total_bytes},
        "compute_only": {"step_s": compute._asdict(), "peak_bytes": baseline.peak_bytes, "step_s_rank0": baseline.step_s},
        "ratio": impls["shardwise"]["step_s"]["median"] / impls["torch"]["step_s"]["median"],
        "above_compute": _above_compute(impls, case.world_size),
        "max_loss_diff": max(abs(a - b) for a, b in zip(sw.losses, th.losses)),
        "impls": impls,
    }  # fmt: skip


def above_floor_ratio(shardwise_x: float, torch_x: float, floor: float = 1.0) -> float | None:
    """Shardwise's step time above ``floor`` over torch's, both in units of the compute-only
    time (``x_compute``); None when torch is not above the floor (nothing to compare)."""
    torch_above = torch_x - floor
    return (shardwise_x - floor) / torch_above if torch_above > 0 else None


def _above_compute(impls: dict[str, dict[str, Any]], world_size: int) -> dict[str, float | None]:
    sw, th = impls["shardwise"]["x_compute"], impls["torch"]["x_compute"]
    floor = max(1.0, world_size / (os.cpu_count() or 1))  # ranks sharing each core
    return {
        "vs_compute_only": above_floor_ratio(sw, th),
        "cpu_share_floor": floor,
        "vs_cpu_share": above_floor_ratio(sw, th, floor),
    }


def _summarise_impl(ranks: list[ImplMeasurement], tokens: int, compute_s: float, min_bytes: float) -> dict[str, Any]:
    step = worst_rank([r.step_s for r in ranks])
    wire = max(r.comm.total_wire_bytes for r in ranks)
    socket = [sum(r.socket_bytes) / len(r.socket_bytes) for r in ranks if r.socket_bytes]
    self_reported = [r.self_reported_wire_bytes for r in ranks if r.self_reported_wire_bytes is not None]
    return {
        "name": ranks[0].name,
        "step_s": step._asdict(),
        "per_rank_median_s": [spread(r.step_s).median for r in ranks],
        "thread_cpu_s": worst_rank([r.thread_cpu_s for r in ranks])._asdict(),  # CPU time of the training thread
        "tokens_per_s": tokens / step.median,
        "x_compute": step.median / compute_s,
        "wire_bytes": wire,
        "wire_over_min": wire / min_bytes,
        "comm_counts": ranks[0].comm.counts,
        "payload_bytes_by_kind": ranks[0].comm.payload_bytes,
        "wire_bytes_by_kind": ranks[0].comm.wire_bytes,
        "self_reported_wire_bytes": max(self_reported) if self_reported else None,
        "socket_bytes": max(socket) if socket else None,
        "peak_bytes": max(r.peak_bytes for r in ranks),
        "start_bytes": max(r.start_bytes for r in ranks),
        "losses_rank0": ranks[0].losses,
        "step_s_per_rank": [r.step_s for r in ranks],
        "profile_rank0": _profile_json(ranks[0]),
    }


def _profile_json(m: ImplMeasurement) -> dict[str, Any] | None:
    if m.profile is None:
        return None
    return {
        "total_s": m.profile.total_s,
        "python_calls": m.profile.calls,
        "own_python_calls": m.profile.own_calls,
        "top": [e._asdict() for e in m.profile.top],
        "own": [e._asdict() for e in m.profile.own],
    }


def write_json(doc: dict[str, Any], out_dir: Path, stamp: str) -> Path:
    """Write ``doc`` to ``out_dir/<stamp>.json`` (creating the directory); return the path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{stamp}.json"
    path.write_text(json.dumps(doc, indent=1) + "\n")
    return path


def format_table(results: list[dict[str, Any]]) -> str:
    """Three aligned rows per case (shardwise, torch, compute-only); sizes in decimal MB per rank per step."""
    lines = [_row([h for h, _, _ in _COLUMNS]), _row(["-" * w for _, w, _ in _COLUMNS])]
    for res in results:
        lines.extend(_row(_cells(res, role)) for role in ROLES)
        lines.append(_row(_compute_only_cells(res)))
    return "\n".join(lines)


def _cells(res: dict[str, Any], role: str) -> list[str]:
    imp = res["impls"][role]
    s = Spread(**imp["step_s"])
    first = role == ROLES[0]
    return [
        res["case"]["label"] if first else "",
        imp["name"],
        f"{s.median * 1e3:.1f}",
        f"{s.p10 * 1e3:.1f}-{s.p90 * 1e3:.1f}",
        f"{imp['tokens_per_s']:,.0f}",
        f"{imp['x_compute']:.2f}",
        f"{res['ratio']:.3f}" if first else "",
        _ratio(above_floor_ratio(imp["x_compute"], res["impls"][ROLES[1]]["x_compute"])) if first else "",
        _mb(imp["wire_bytes"]),
        _mb(res["theory_min_bytes"]["total"]),
        _mb(imp["socket_bytes"]),
        _mb(imp["peak_bytes"]),
    ]


def _compute_only_cells(res: dict[str, Any]) -> list[str]:
    base = res["compute_only"]
    s = Spread(**base["step_s"])
    return ["", "compute-only (1 rank)", f"{s.median * 1e3:.1f}", f"{s.p10 * 1e3:.1f}-{s.p90 * 1e3:.1f}", "", "1.00", "", "", "", "", "", _mb(base["peak_bytes"])]


def _ratio(r: float | None) -> str:
    return "n/a" if r is None else f"{r:.2f}"


def _mb(n: float | None) -> str:
    return "n/a" if n is None else f"{n / 1e6:.2f}"


def _row(cells: list[str]) -> str:
    return "  ".join(f"{c:{align}{w}}" for c, (_, w, align) in zip(cells, _COLUMNS)).rstrip()


def format_profiles(results: list[dict[str, Any]], limit: int = 8) -> str:
    """Per case and implementation: its own package's top functions by cumtime, then the top overall by tottime."""
    lines = []
    for res in results:
        for role in ROLES:
            prof = res["impls"][role]["profile_rank0"]
            if prof is None:
                continue
            calls = f", {prof['python_calls']:,} Python calls ({prof['own_python_calls']:,} in its package)" if "python_calls" in prof else ""
            lines.append(f"{res['case']['label']} - {res['impls'][role]['name']}: one step, {prof['total_s'] * 1e3:.0f} ms under cProfile{calls}")
            lines.append(f"  {'own ms':>8}  {'cum ms':>8}  {'calls':>6}  function")
            for title, entries in (("own package, by cumtime", prof["own"]), ("everything, by own time", prof["top"])):
                lines.append(f"  -- {title}")
                lines.extend(_profile_line(e) for e in entries[:limit])
    return "\n".join(lines)


def _profile_line(e: dict[str, Any]) -> str:
    return f"  {e['tottime_s'] * 1e3:8.1f}  {e['cumtime_s'] * 1e3:8.1f}  {e['ncalls']:6d}  {e['function']}"
