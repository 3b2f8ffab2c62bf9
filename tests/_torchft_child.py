"""One rank of ``shardwise train`` for tests/test_torchft.py, launched by torchrun.

    python -m torch.distributed.run ... tests/_torchft_child.py OUT DUMP_STEPS <shardwise train flags>

Runs :func:`shardwise.train.loop.train` as ``shardwise train`` would, and writes what the
test compares: ``OUT/dp<R>.jsonl`` (one line per committed step: this rank's loss, the
replica groups in the quorum, whether it healed, the wall clock) and, after each step in
``DUMP_STEPS`` (comma-separated), ``OUT/dp<R>-step<S>.pt``: this rank's local parameter
shards and AdamW state, by parameter name. ``R`` is the rank's slice of the global batch
(``replica_group * group_size + rank``), the same name in a one-job ``--replicate`` run.

``$TEST_GO_FILE``: wait for this file before starting (a replacement group launched before the
kill it replaces, so that the test does not wait for its imports). ``$TEST_ALONE_STEP_S``: seconds to wait after each step run with fewer replica groups than
the job started with, so that a survivor does not finish before the restarted group is up.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

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


def _wait_for_go() -> None:
    """``$TEST_GO_FILE``: a replacement started ahead of time (its imports paid) waits here for it."""
    go = os.environ.get("TEST_GO_FILE")
    while go and not Path(go).exists():
        time.sleep(0.02)


def main() -> None:
    out, dump_steps, argv = Path(sys.argv[1]), {int(s) for s in sys.argv[2].split(",") if s}, sys.argv[3:]
    _wait_for_go()
    cfg = _train_config(build_parser().parse_args(["train", *argv]))
    env = distributed.setup(cfg.device, replicate=cfg.replicate)
    dp = (cfg.replica_group_id or 0) * env.world_size + env.rank
    jobs = []
    setup_run = loop._setup_run

    def capture(*args, **kwargs):
        job, start = setup_run(*args, **kwargs)
        jobs.append(job)
        return job, start

    loop._setup_run = capture
    log = (out / f"dp{dp}.jsonl").open("a", buffering=1)

    def on_step(step: int, loss: float, _tokens_per_s: float) -> None:
        job = jobs[0]
        ft = job.replicas
        record = {"step": step, "loss": loss, "t": time.time()}
        if ft is not None:
            record.update(groups=ft.participants, healed=ft.healed_this_step, quorum_s=ft.quorum_s,
                          heal_bytes=ft.heal.last_heal_bytes if ft.healed_this_step else 0)
        log.write(json.dumps(record) + "\n")
        if step in dump_steps:
            torch.save(local_state(job), out / f"dp{dp}-step{step}.pt")
        if ft is not None and record["groups"] < ft.group.groups:  # a survivor alone: give the replacement time
            time.sleep(float(os.environ.get("TEST_ALONE_STEP_S", "0")))

    loop.train(cfg, env, on_step=on_step)
    distributed.teardown(env)


if __name__ == "__main__":
    main()
