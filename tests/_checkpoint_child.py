"""One-rank ``shardwise train`` runs killed mid-save, for the crash tests of test_checkpoint.py.

``python tests/_checkpoint_child.py '<TrainConfig fields as JSON>' DIR POINT [POINT ...]``
imports torch once, then forks one run per kill point, each with its own process group,
checkpoint directory ``DIR/POINT`` and ``SHARDWISE_FAULT=POINT@2``, so that it is killed
(SIGKILL) at that point of the save of step 2. Prints ``{point: wait status}`` as JSON.
"""

import dataclasses
import json
import os
import sys

import torch.distributed as dist

from shardwise.train import distributed
from shardwise.train.config import TrainConfig
from shardwise.train.loop import train


def _run(cfg: TrainConfig) -> None:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    train(cfg, distributed.setup("cpu", num_threads=1))


def main(fields: str, root: str, points: list[str]) -> dict[str, int]:
    statuses = {}
    for point in points:  # one at a time: the runs share two cores with the test
        cfg = dataclasses.replace(TrainConfig(**json.loads(fields)), checkpoint_dir=os.path.join(root, point))
        pid = os.fork()
        if pid == 0:
            os.environ["SHARDWISE_FAULT"] = f"{point}@2"
            try:
                _run(cfg)
            finally:
                os._exit(0)  # not killed: the test reports the missing SIGKILL
        statuses[point] = os.waitpid(pid, 0)[1]
    return statuses


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], sys.argv[2], sys.argv[3:])))
