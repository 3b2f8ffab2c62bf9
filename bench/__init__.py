"""Benchmarks of shardwise side by side with torch's FSDP2 and DDP, on gloo CPU ranks.

Run ``python -m bench --quick`` (about a minute and a half) or ``python -m bench`` (the
full grid); see ``bench/README.md``. One module per concept:

- :mod:`~bench.cases` — what to compare (:class:`~bench.cases.Case`) and how (:class:`~bench.cases.Settings`).
- :mod:`~bench.contenders` — building both implementations of a case from the same weights.
- :mod:`~bench.workload` — the batches and the timed training step.
- :mod:`~bench.rank` — one case on one rank: interleaved timing, counted, memory and profiled steps.
- :mod:`~bench.launch` — spawning the gloo ranks and streaming their results back.
- :mod:`~bench.baseline` — the compute-only baseline (one process, no wrapper).
- :mod:`~bench.wire` — bytes per step: ring-counted, theoretical minimum, socket ``wchar``.
- :mod:`~bench.memory` — peak live tensor bytes via a dispatch mode.
- :mod:`~bench.stats` — medians, percentiles, worst rank.
- :mod:`~bench.profiling` — the top costs of one cProfile'd step.
- :mod:`~bench.report` — the JSON document and the table; :mod:`~bench.cli` — the command.
- :mod:`~bench.compile` — ``python -m bench.compile``: torch.compile graph counts and the compiling step.
- :mod:`~bench.overhead` — ``python -m bench.overhead``: each wrapper's host cost per unit on a launch-bound stack.
"""
