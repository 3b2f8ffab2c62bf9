"""A c10d store object is used by one thread only.

torch 2.13's ``TCPStore`` counts each client's requests in a map it updates before taking
the client's lock, so two threads calling one client at once race on that map (a heap
corruption abort, seen once in a full run). shardwise's background threads (the beacon,
the NCCL poller) therefore talk to the store through a client of their own
(``store.clone()``). These tests record which thread calls which store object.
"""

from __future__ import annotations

import threading
import time

import torch.distributed as dist

from shardwise.faults.beacon import Beacon, own_client


class RecordingStore(dist.Store):
    """A HashStore that records the threads that called this object."""

    def __init__(self, inner: dist.Store | None = None, clones: list | None = None):
        super().__init__()
        self.inner = inner or dist.HashStore()
        self.threads: set[int] = set()
        self.clones = clones if clones is not None else []

    def _note(self) -> None:
        self.threads.add(threading.get_ident())

    def set(self, key, value):
        self._note()
        self.inner.set(key, value)

    def get(self, key):
        self._note()
        return self.inner.get(key)

    def check(self, keys):
        self._note()
        return self.inner.check(keys)

    def multi_get(self, keys):
        self._note()
        return self.inner.multi_get(keys)

    def add(self, key, value):
        self._note()
        return self.inner.add(key, value)

    def clone(self):  # not a request to the server: TCPStore's clone only reads the address
        twin = RecordingStore(self.inner, self.clones)  # same keys, another client
        self.clones.append(twin)
        return twin


def test_own_client_is_one_clone_per_thread_and_store():
    store = RecordingStore()
    mine = own_client(store)
    assert mine is own_client(store) and mine is not store and mine.inner is store.inner
    found = []
    thread = threading.Thread(target=lambda: found.append(own_client(store)))
    thread.start()
    thread.join()
    assert found[0] is not mine and found[0] is not store


def test_beacon_thread_never_calls_the_training_threads_store():
    store = RecordingStore()
    beacon = Beacon(store, rank=0, interval=0.02)
    try:
        deadline = time.monotonic() + 10
        while not any(c.threads for c in store.clones) and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.1)  # a few more beats
        statuses = beacon.read([0])  # the training thread reads through its own store
    finally:
        beacon.stop(join_timeout=5)
    main = threading.get_ident()
    assert store.threads == {main}, f"the training thread's store was called from {store.threads - {main}}"
    beat_threads = set().union(*(c.threads for c in store.clones))
    assert beat_threads and main not in beat_threads, beat_threads
    assert statuses[0] is not None and statuses[0].rank == 0  # what the thread published is there
