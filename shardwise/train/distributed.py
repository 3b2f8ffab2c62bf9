"""Process-group set-up for a training run: which rank am I, on which device, with which backend.

torchrun (``torch.distributed.run``) starts one process per rank and hands each the
``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR`` and
``MASTER_PORT`` environment variables; :func:`setup` turns those into a default process
group (NCCL on GPUs, gloo on CPU) and the meshes of the run::

    env = setup("auto")                     # under torchrun, or with a process group already initialised
    env = setup("auto", replicate=2, tp=2)  # 8 ranks: a (2, 2, 2) mesh (dp_replicate, dp_shard, tp)
    env = setup("auto", pp=2, tp=2)         # 8 ranks: a (2, 2, 2) mesh (pp, dp, tp)

The world mesh has only the dims that are used, in the order ``pp, dp_replicate, dp_shard,
tp`` (tensor parallelism innermost, so a TP group is adjacent ranks: one host's fast links;
pipeline stages outermost, torchtitan's order). ``env.mesh`` is what ``fully_shard`` gets:
``dp`` (1-D FSDP) or ``(dp_replicate, dp_shard)`` (HSDP); ``env.tp_mesh`` and
``env.pp_mesh`` are the ``tp`` and ``pp`` dims or ``None``. Ranks of one TP group, and of
one pipeline, train on the same batch, so data is sliced by ``env.dp_rank`` of ``env.dp_size``.
    ...train...
    teardown(env)

With a process group already initialised (a test that calls
``init_process_group("gloo", store=HashStore(), rank=0, world_size=1)``), :func:`setup`
adopts it and :func:`teardown` leaves it alone.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import os
import sys
import threading

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from shardwise.faults import monitor

__all__ = ["DistEnv", "mesh_dims", "setup", "teardown", "leave", "release_process_groups", "is_under_launcher",
           "cpu_threads_per_rank"]

logger = logging.getLogger(__name__)

_LAUNCHER_VARS = ("RANK", "LOCAL_RANK")


@dataclasses.dataclass(frozen=True)
class DistEnv:
    """Where this process sits in the run."""

    rank: int
    """Global rank of this process, ``0 <= rank < world_size``."""
    world_size: int
    """Number of ranks; every one holds a ``1/world_size`` shard of each parameter."""
    device: torch.device
    """Device holding this rank's shards and activations (``cuda:<local_rank>`` or ``cpu``)."""
    mesh: DeviceMesh
    """The data-parallel mesh passed to ``fully_shard(mesh=...)``: ``dp``, or ``(dp_replicate, dp_shard)``."""
    owns_process_group: bool
    """True when :func:`setup` created the default process group (so :func:`teardown` destroys it)."""
    tp_mesh: DeviceMesh | None = None
    """The tensor-parallel dim of the world mesh, or ``None`` without ``--tp``."""
    pp_mesh: DeviceMesh | None = None
    """The pipeline-parallel dim of the world mesh, or ``None`` without ``--pp``."""
    replica_group: int = 0
    """``--fault-tolerance torchft``: which replica group (one torchrun job) this process belongs to."""
    replica_groups: int = 1
    """``--fault-tolerance torchft``: replica groups the job was started with; the data is split over all of them."""

    @property
    def tp_size(self) -> int:
        return 1 if self.tp_mesh is None else self.tp_mesh.size()

    @property
    def pp_size(self) -> int:
        return 1 if self.pp_mesh is None else self.pp_mesh.size()

    @property
    def dp_size(self) -> int:
        """Data-parallel ranks of the whole job (every replica group's): each draws its own slice of the global batch."""
        return self.world_size // (self.tp_size * self.pp_size) * self.replica_groups

    @property
    def dp_rank(self) -> int:
        """Which slice of the global batch this rank trains on (the same for a whole TP group and
        a whole pipeline: ``pp`` is the mesh's outermost dim, ``tp`` its innermost)."""
        per_group = self.world_size // (self.tp_size * self.pp_size)
        return self.replica_group * per_group + self.rank % (self.world_size // self.pp_size) // self.tp_size

    @property
    def is_main(self) -> bool:
        """Rank 0 reports progress and the summary."""
        return self.rank == 0


def is_under_launcher() -> bool:
    """Whether torchrun (or another ``env://`` launcher) started this process as a rank."""
    return any(var in os.environ for var in _LAUNCHER_VARS)


def _available_cpus() -> int:
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def cpu_threads_per_rank(local_world_size: int) -> int:
    """An even share of this machine's CPU cores for one of ``local_world_size`` ranks (at least 1)."""
    return max(1, _available_cpus() // max(1, local_world_size))


def _pick_device(device: str, local_rank: int, local_world_size: int) -> torch.device:
    """``auto`` means one GPU per local rank when there are enough for all of them, else the CPU.

    The decision depends only on the machine, never on the rank, so all ranks agree on
    the backend (a mix of NCCL and gloo ranks would hang in the first collective).
    """
    if device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {device!r}")
    enough_gpus = torch.cuda.is_available() and torch.cuda.device_count() >= local_world_size
    if device == "cuda" and not enough_gpus:
        raise RuntimeError(
            f"--device cuda needs a GPU for each of the {local_world_size} local ranks "
            f"(cuda available={torch.cuda.is_available()}, count={torch.cuda.device_count()})"
        )
    if device == "cpu" or not enough_gpus:
        return torch.device("cpu")
    return torch.device("cuda", local_rank)


def _init_default_group(backend: str, device_id: torch.device | None) -> None:
    """``init_process_group`` from torchrun's environment, on a store private to this restart attempt.

    torchrun (2.13) hands every attempt of a restarted job the same agent-hosted TCPStore,
    and the keys of the previous attempt are still there: a rank of attempt 2 can read a
    peer's attempt-1 gloo address and fail with "Connection refused" (pytorch/pytorch#135712).
    Prefixing the store with ``TORCHELASTIC_RESTART_COUNT`` gives each attempt clean keys.
    """
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        dist.init_process_group(backend=backend, device_id=device_id)
        return
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size, is_master=False)
    dist.init_process_group(backend=backend, store=dist.PrefixStore(f"shardwise/attempt_{attempt}", store),
                            rank=rank, world_size=world_size, device_id=device_id)


def mesh_dims(world_size: int, replicate: int = 1, tp: int = 1, pp: int = 1) -> dict[str, int]:
    """``{dim name: size}`` of the world mesh for ``pp`` x ``replicate`` x ``tp`` over ``world_size`` ranks.

    Raises:
        ValueError: ``pp * replicate * tp`` does not divide ``world_size``.
    """
    if pp < 1 or replicate < 1 or tp < 1 or world_size % (pp * replicate * tp):
        raise ValueError(
            f"--pp {pp} x --replicate {replicate} x --tp {tp} must divide the {world_size} ranks "
            f"(the mesh is pp x replicate x shard x tp); choose sizes whose product divides {world_size}"
        )
    shard = world_size // (pp * replicate * tp)
    dims = {"pp": pp} if pp > 1 else {}
    if replicate == 1:
        dims["dp"] = shard
    else:
        dims.update(dp_replicate=replicate, dp_shard=shard)
    return {**dims, "tp": tp} if tp > 1 else dims


_NOT_DP = ("pp", "tp")


def _build_meshes(device_type: str, world_size: int, replicate: int, tp: int, pp: int) -> dict[str, DeviceMesh | None]:
    """``{"dp": the data-parallel mesh, "tp": ..., "pp": ...}`` (``None`` for a dim not used)."""
    dims = mesh_dims(world_size, replicate, tp, pp)
    world = init_device_mesh(device_type, tuple(dims.values()), mesh_dim_names=tuple(dims))
    if len(dims) == 1:
        return {"dp": world, "tp": None, "pp": None}
    dp_names = tuple(n for n in dims if n not in _NOT_DP)
    return {"dp": world[dp_names if len(dp_names) > 1 else dp_names[0]],
            **{name: world[name] if name in dims else None for name in _NOT_DP}}


def setup(device: str = "auto", num_threads: int | None = None, replicate: int = 1, tp: int = 1, pp: int = 1) -> DistEnv:
    """Initialise (or adopt) the default process group and build this rank's :class:`DistEnv`.

    Args:
        device: ``"auto"`` (GPU per local rank when available, else CPU), ``"cpu"`` or ``"cuda"``.
        num_threads: CPU threads for this rank's ops; ``None`` gives each rank on this machine
            an even share of the cores, since several ranks each using every core mostly contend.
        replicate: HSDP replicas (``--replicate``); 1 is plain FSDP.
        tp: tensor-parallel degree (``--tp``); 1 is none.
        pp: pipeline-parallel degree (``--pp``); 1 is none.
    """
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", 1)))
    torch.set_num_threads(num_threads or cpu_threads_per_rank(local_world_size))
    dev = _pick_device(device, local_rank, local_world_size)
    on_gpu = dev.type == "cuda"
    if on_gpu:
        torch.cuda.set_device(dev)
    owns = not dist.is_initialized()
    if owns:
        if not is_under_launcher():
            raise RuntimeError("no process group: run under torchrun (or `shardwise train`, which launches it)")
        _init_default_group("nccl" if on_gpu else "gloo", dev if on_gpu else None)
    meshes = _build_meshes(dev.type, dist.get_world_size(), replicate, tp, pp)
    env = DistEnv(dist.get_rank(), dist.get_world_size(), dev, meshes["dp"], owns, meshes["tp"], meshes["pp"])
    logger.info(
        "rank %d/%d on %s (backend %s, %d threads)",
        env.rank, env.world_size, dev, dist.get_backend(), torch.get_num_threads(),
    )
    return env


def teardown(env: DistEnv, wait_for_peers: bool = True) -> list[threading.Thread]:
    """Destroy the default process group if :func:`setup` created it; idempotent. Returns
    shardwise's threads still alive after it (empty on an orderly end): see :func:`leave`.

    Args:
        env: what :func:`setup` returned.
        wait_for_peers: barrier first (the normal exit); pass ``False`` when leaving on an
            error, since the other ranks may never reach the barrier.

    The order is the invariant: no thread may be inside a native call when the interpreter
    finalises. A thread that returns from one into a finalising interpreter is ended by a
    forced unwind as it takes the GIL, and a C++ frame on its stack (a ``noexcept``
    destructor: pybind11's GIL release, a tensor's release) turns that into
    ``std::terminate``: "terminate called without an active exception", SIGABRT, after a
    run that trained every step. So, in order:

    1. an exit barrier, an all-reduce through the fault monitor: a peer that died, stopped
       or lost its link before the end of the job is named within the watchdog's deadline
       (without it, a rank that finished early closed its gloo connections while rank 0
       still wrote the summary: 1 run in ~5 aborted);
    2. shardwise's threads stop and are joined (beacons, pollers, the watchdog's waiter:
       :func:`shardwise.faults.monitor.shutdown`), before any c10d object goes;
    3. a plain barrier keeps every rank until all have stopped theirs (no beacon may be in
       a store call when the store's host exits);
    4. the process groups are destroyed, and :func:`release_process_groups` frees the
       dropped sharded model now (its states hold the groups and its tensors in reference
       cycles), not in the interpreter's last collection.

    ``setup`` has no barrier of its own: the rendezvous in ``init_process_group`` and
    ``init_device_mesh`` is torch's (bounded by the process group's timeout).
    """
    if not (env.owns_process_group and dist.is_initialized()):
        return []
    if wait_for_peers:
        monitor.all_reduce(torch.zeros(1, device=env.device), dist.group.WORLD, dist.ReduceOp.SUM,
                           "shardwise train's exit barrier").cpu()  # .cpu(): NCCL waits here
    stuck = monitor.shutdown()
    if wait_for_peers and not stuck:
        dist.barrier()
    dist.destroy_process_group()
    release_process_groups()
    for thread in stuck:  # a waiter in a failed collective returns once its group is gone
        thread.join(STUCK_JOIN_S)
    return [t for t in stuck if t.is_alive()]


STUCK_JOIN_S = 5.0
"""How long :func:`teardown` waits, after destroying the groups, for a thread that was inside a collective."""


def release_process_groups() -> None:
    """Collect the garbage that still holds destroyed process groups and tensors (a dropped
    sharded model: module -> state -> its modules) while the interpreter is fully alive."""
    gc.collect()


def leave(stuck: list[threading.Thread], code: int) -> None:
    """End the process now, without interpreter finalisation, if shardwise threads are
    ``stuck`` inside native calls (see :func:`teardown`): streams flushed, logging shut
    down, ``os._exit(code)``. Nothing happens when ``stuck`` is empty."""
    if not stuck:
        return
    logger.error("shardwise: %d thread(s) still inside native calls at the end of the job (%s): "
                 "leaving without interpreter teardown, exit code %d", len(stuck),
                 ", ".join(t.name for t in stuck), code)
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)
