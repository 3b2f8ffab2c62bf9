"""Run by tests/test_clean_exit.py under torchrun: one short ``shardwise train`` run, then a
report of what is still alive on this rank once the job has torn down (before the
interpreter finalises): Python threads other than the main one, and whether the default
process group's object still exists (its gloo worker threads with it)."""

import json
import sys
import threading
import weakref

import torch.distributed as dist

from shardwise.train import loop
from shardwise.train.config import TrainConfig

_GROUPS: list[weakref.ref] = []


def _setup_and_note_the_group(*args, **kwargs):
    env = _setup(*args, **kwargs)
    _GROUPS.append(weakref.ref(dist.group.WORLD))
    return env


_setup = loop.setup
loop.setup = _setup_and_note_the_group

if __name__ == "__main__":
    loop.run(TrainConfig(model="nano", steps=2, batch_size=2, seq_len=16, data_bytes=20_000))
    alive = [t.name for t in threading.enumerate() if t is not threading.main_thread() and t.is_alive()]
    print("CLEAN-EXIT " + json.dumps({"rank": int(__import__("os").environ["RANK"]), "threads": alive,
                                      "group_alive": any(ref() is not None for ref in _GROUPS)}), flush=True)
    sys.exit(0)
