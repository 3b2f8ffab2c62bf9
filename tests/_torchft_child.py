"""One rank of ``shardwise train`` for tests/test_torchft.py: under torchrun (a replica group), or
in a warm pool rank (:func:`reference`, a one-job run to compare with).

    python -m torch.distributed.run ... tests/_torchft_child.py OUT DUMP_STEPS <shardwise train flags>

Runs :func:`shardwise.train.loop.train` as ``shardwise train`` would, and records what the
test compares: ``OUT/dp<R>.jsonl`` (one line per committed step, written as it goes: this
rank's loss, the replica groups in the quorum, whether it healed, the wall clock) and, after
each step in ``DUMP_STEPS`` (comma-separated), ``OUT/dp<R>-step<S>.pt``: this rank's local
parameter shards and AdamW state, by parameter name. ``R`` is the rank's slice of the global
batch (``replica_group * group_size + rank``), the same name in a one-job ``--replicate`` run.

``$TEST_GO_FILE``: wait for this file before starting (a replacement group launched before the
kill it replaces, so that the test does not wait for its imports). ``$TEST_READY_FILE``: touched
once the job is set up (torchft's Manager made: its next step asks the lighthouse for a quorum).
``$TEST_ALONE_STEP_S``: seconds to wait after each step run with fewer replica groups than the
job started with; with ``$TEST_PEER_READY_FILE`` a survivor first waits (up to
``PEER_READY_TIMEOUT_S``) for the restarted group to touch that file. Either way the survivor
does not run out of steps before the restarted group joins, and it need not run many steps
alone while that group starts (2-15 s here).
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Callable

import torch

from shardwise.cli import _train_config, build_parser
from shardwise.train import distributed, loop


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def local_state(job) -> dict:
    params = dict(job.model.named_parameters())
    by_param = {id(p): name for name, p in params.items()}
    optim = {by_param[id(p)]: {k: _local(v).clone() for k, v in s.items()} for p, s in job.optimizer.state.items()}
    return {"model": {n: _local(p.detach()).clone() for n, p in params.items()}, "optimizer": optim}


def run(argv: list[str], dump_steps: set[int], write: Callable[[dict], None],
        save: Callable[[int, dict], None]) -> distributed.DistEnv:
    """``shardwise train <argv>`` on this rank, each committed step written and the dumps saved."""
    cfg = _train_config(build_parser().parse_args(["train", *argv]))
    env = distributed.setup(cfg.device, num_threads=1, replicate=cfg.replicate)  # the same kernels everywhere
    jobs = []
    setup_run = loop._setup_run

    def capture(*args, **kwargs):
        job, start = setup_run(*args, **kwargs)
        jobs.append(job)
        ready = os.environ.get("TEST_READY_FILE")
        if ready:
            Path(ready).touch()
        return job, start

    def on_step(step: int, loss: float, _tokens_per_s: float) -> None:
        ft = jobs[0].replicas
        record = {"step": step, "loss": loss, "t": time.time()}
        if ft is not None:
            record.update(groups=ft.participants, healed=ft.healed_this_step, quorum_s=ft.quorum_s,
                          heal_bytes=ft.heal.last_heal_bytes if ft.healed_this_step else 0)
        write(record)
        if step in dump_steps:
            save(step, local_state(jobs[0]))
        if ft is not None and record["groups"] < ft.group.groups:  # a survivor alone: give the replacement time
            _wait_for(os.environ.get("TEST_PEER_READY_FILE"), PEER_READY_TIMEOUT_S)
            time.sleep(float(os.environ.get("TEST_ALONE_STEP_S", "0")))

    loop._setup_run = capture
    try:
        loop.train(cfg, env, on_step=on_step)
    finally:
        loop._setup_run = setup_run
    return env


def reference(argv: list[str], dump_steps: list[int]) -> tuple[int, dict[int, float], dict[int, dict]]:
    """A pool rank's run (one job, no fault tolerance): ``(its rank = its data slice, losses and dumps by step)``."""
    losses, dumps = {}, {}
    env = run(argv, set(dump_steps), lambda r: losses.__setitem__(r["step"], r["loss"]), dumps.__setitem__)
    return env.rank, losses, dumps


PEER_READY_TIMEOUT_S = 120.0


def _wait_for(path: str | None, timeout: float = math.inf) -> None:
    """Until the file ``path`` exists (no wait without a path), at most ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while path and not Path(path).exists() and time.monotonic() < deadline:
        time.sleep(0.02)


def main() -> None:
    out, dump_steps, argv = Path(sys.argv[1]), {int(s) for s in sys.argv[2].split(",") if s}, sys.argv[3:]
    _wait_for(os.environ.get("TEST_GO_FILE"))
    rank = int(os.environ["RANK"])
    group = int(argv[argv.index("--replica-group-id") + 1]) if "--replica-group-id" in argv else 0
    dp = group * int(os.environ["WORLD_SIZE"]) + rank
    log = (out / f"dp{dp}.jsonl").open("a", buffering=1)
    env = run(argv, dump_steps, lambda record: log.write(json.dumps(record) + "\n"),
              lambda step, state: torch.save(state, out / f"dp{dp}-step{step}.pt"))
    distributed.teardown(env)


if __name__ == "__main__":
    main()
