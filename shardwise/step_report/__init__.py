"""Where a training step's time and memory go: ``shardwise.report(DIR)`` and ``shardwise report DIR``.

One module per concept, imports flowing down this list:

- :mod:`~shardwise.step_report.session` — :func:`report` / :class:`Report`, the context around a loop.
- :mod:`~shardwise.step_report.export` — summary.json, trace.json, index.html (rank 0).
- :mod:`~shardwise.step_report.plots` — the PNGs (matplotlib, optional).
- :mod:`~shardwise.step_report.text` — the summary as a table and sentences; ``cli`` prints it.
- :mod:`~shardwise.step_report.analysis` — across ranks and steps: means, straggler, causes and knobs.
- :mod:`~shardwise.step_report.recorder` — a :class:`~shardwise.tracing.Trace` cut into steps.
- :mod:`~shardwise.step_report.steps` — one step on one rank: the definitions of exposed, overlap, compute.
- :mod:`~shardwise.step_report.memory` — the memory sampler.
"""

from shardwise.step_report.session import Report, report

__all__ = ["Report", "report"]
