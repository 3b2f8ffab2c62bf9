"""Run by tests/test_clean_exit.py under torchrun: one short ``shardwise train`` run, then a
report of the Python threads still alive on this rank once the job has torn down, before
the interpreter finalises (none may be: a thread inside a native call then aborts the
process when the call returns)."""

import json
import os
import sys
import threading

from shardwise.train import loop
from shardwise.train.config import TrainConfig

if __name__ == "__main__":
    loop.run(TrainConfig(model="nano", steps=2, batch_size=2, seq_len=16, data_bytes=20_000))
    alive = [t.name for t in threading.enumerate() if t is not threading.main_thread() and t.is_alive()]
    print("CLEAN-EXIT " + json.dumps({"rank": int(os.environ["RANK"]), "threads": alive}), flush=True)
    sys.exit(0)
