"""``--fault-tolerance torchft``: replica groups that survive each other's failures (torchft's HSDP).

The job is ``R`` *replica groups*, each one torchrun job that shards the model over its own
ranks with ``fully_shard``; torchft's lighthouse (one small server for the whole job) tells
the groups, step by step, which of them are alive. Every step:

1. :meth:`Replicas.begin_step` asks torchft's ``Manager`` for a quorum of live groups (in a
   thread that overlaps forward with ``--async-quorum``) and reconfigures the process group
   that spans them;
2. each group's reduce-scattered gradient shard is averaged across the live groups by the
   all-reduce hook (``set_all_reduce_hook``: after the group's own reduction, before
   ``.grad`` is written) through ``Manager.allreduce``; a peer that dies mid-step makes the
   hook's collective fail, which the Manager records instead of raising;
3. :class:`CommitGate` steps the optimizer only when ``Manager.should_commit()`` says every
   rank of this group finished the step with a healthy quorum: a step whose quorum failed is
   discarded (parameters untouched, the data position rewound) and run again, never applied
   twice. The vote waits :data:`VOTE_TIMEOUTS` collective timeouts for the group's last rank:
   a peer group's failure reaches the group's ranks up to one collective timeout apart.

A group that joins late or restarts after a crash *heals*: torchft fetches a live peer's
state over HTTP and :class:`HealState` loads it (model shards, AdamW, LR schedule, data
position, RNG) with no checkpoint read. The step count travels inside torchft's own state.
torchft heals rank by rank (group rank ``r`` from rank ``r`` of a live group) and at step 0
(its ``init_sync``) picks the source group by ``r``: ranks of one group may heal from
different groups. Every group must therefore run the same flags (same ``--seed``), and a
heal must never enter a collective of the group (only some of its ranks heal).

Staging (why asynchronous quorum works). The peer serves its state from torchft's quorum
thread while its training thread is already in the next forward. Calling
``model.state_dict()`` there is the bug: FSDP's state-dict hook reshards every group (torch
FSDP2 registers the sharded parameters again; shardwise's contract does the same), under the
forward that is using the gathered ones. So the training thread *stages* the state at each
step boundary instead (:meth:`HealState.stage`, the way torchtitan caches its model and
optimizer state dicts for torchft): plain references to the sharded parameters' local
tensors and AdamW's state tensors, which only ``optimizer.step()`` changes in place, plus a
host copy of the small trainer state. The quorum thread only reads tensors. torchft's
``should_commit`` blocks checkpoint reads (its HTTP transport's write lock) before the
optimizer step, so a transfer never sees a half-updated step.

Gradient exactness. The group averages over its ``N`` ranks, then the hook averages over the
``R`` live groups: ``(sum / N) / R``. For powers of two the divisions are exact, so a run
without failures is bit-identical to the same ranks in one job with ``--replicate R``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import time
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from shardwise.checkpoint.faults import maybe_kill
from shardwise.checkpoint.trainer_state import rng_state, set_rng_state

if TYPE_CHECKING:
    from shardwise.train.config import TrainConfig
    from shardwise.train.data import BatchSampler
    from shardwise.train.distributed import DistEnv

__all__ = ["FAULT_TOLERANCE", "VOTE_TIMEOUTS", "ReplicaGroup", "replica_group", "require_torchft", "HealState", "CommitGate", "Replicas", "attach"]

logger = logging.getLogger(__name__)

FAULT_TOLERANCE = ("none", "torchft")
"""Values of ``--fault-tolerance``."""

_LOOPBACK = ("localhost", "127.0.0.1", "::1")

VOTE_TIMEOUTS = 2
"""The commit vote (``should_commit``, which waits for every rank of the group) waits this many
``--ft-timeout-s``; a quorum, a collective across groups and a heal wait one.

Why more than one: when a peer group's link is cut, the group's ranks learn it up to one
collective timeout apart. A rank whose all-reduce across groups lost its data at the cut waits
out the timeout, while a group peer whose all-reduce got through before the cut goes on, waits
for it in the group's next reduce-scatter, and only then meets the silent link in its own next
all-reduce: a second full timeout. When that was the step's last all-reduce, the first rank
votes (its later all-reduces are skipped: torchft stops after an error) one timeout plus the
end of the step before the last. A vote that waited only one timeout expired first and raised
``TimeoutError`` out of the step, killing a survivor instead of discarding the step. Two
timeouts leave the end of the step (the backward after the last hook) up to a timeout: a
timeout shorter than a step is unworkable anyway (the quorum waits one too).
"""

_JOIN_POLL_S = 0.05
"""Seconds between a fresh job's quorum tries while it waits for all replica groups."""

ENV_GROUP_ID, ENV_GROUPS, ENV_LIGHTHOUSE = "REPLICA_GROUP_ID", "NUM_REPLICA_GROUPS", "TORCHFT_LIGHTHOUSE"
"""torchft's (and torchtitan's) environment variables; the flags win over them."""


@dataclasses.dataclass(frozen=True)
class ReplicaGroup:
    """Which replica group this torchrun job is, of how many, and where the lighthouse listens."""

    group_id: int  # 0 <= group_id < groups
    groups: int  # R: the replica groups the job was started with (the data is split R ways)
    lighthouse: str  # e.g. http://localhost:29510


def replica_group(cfg: "TrainConfig", environ: dict[str, str] | None = None) -> ReplicaGroup:
    """The flags of ``cfg``, else torchft's environment variables; ``ValueError`` names what is missing."""
    environ = os.environ if environ is None else environ

    def pick(value: Any, var: str, flag: str) -> str:
        if value is not None:
            return str(value)
        if environ.get(var):
            return environ[var]
        raise ValueError(f"--fault-tolerance torchft needs {flag} (or the environment variable {var})")

    groups = int(pick(cfg.replica_groups, ENV_GROUPS, "--replica-groups R"))
    group_id = int(pick(cfg.replica_group_id, ENV_GROUP_ID, "--replica-group-id I"))
    lighthouse = pick(cfg.lighthouse, ENV_LIGHTHOUSE, "--lighthouse http://HOST:PORT")
    if groups < 1 or not 0 <= group_id < groups:
        raise ValueError(f"--replica-group-id must be in [0, --replica-groups={groups}), got {group_id}")
    return ReplicaGroup(group_id, groups, lighthouse)


def require_torchft(cfg: "TrainConfig") -> ReplicaGroup:
    """Preflight of ``--fault-tolerance torchft``: torchft importable, the replica group named."""
    try:
        import torchft  # noqa: F401
    except ImportError:
        raise ImportError("--fault-tolerance torchft needs the torchft package: pip install torchft") from None
    return replica_group(cfg)


def _local(t: Any) -> Any:
    """The local tensor of a DTensor (a view: in-place updates show through), else ``t``."""
    return t.to_local() if isinstance(t, DTensor) else t


def _like_param(value: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """A received local tensor as ``param`` holds it: a DTensor on its mesh (scalars stay plain)."""
    if not isinstance(param, DTensor) or value.dim() == 0:
        return value
    local = value.to(param.to_local().device)
    return DTensor.from_local(local, param.device_mesh, param.placements, run_check=False,
                              shape=param.shape, stride=param.stride())


def _nbytes(tree: Any) -> int:
    if isinstance(tree, torch.Tensor):
        return tree.numel() * tree.element_size()
    if isinstance(tree, dict):
        return sum(_nbytes(v) for v in tree.values())
    if isinstance(tree, (list, tuple)):
        return sum(_nbytes(v) for v in tree)
    return 0


class HealState:
    """What a healing group receives: staged by the training thread, read by torchft's threads.

    :meth:`stage` runs on the training thread between steps and holds references (no copies)
    to each parameter's local shard and to AdamW's state tensors, plus a host snapshot of the
    LR schedule, the data position and the RNG streams taken at that same boundary.
    :meth:`state_dict` (torchft's quorum thread) returns the staged dict and calls nothing on
    the model. :meth:`load_state_dict` (the training thread, inside ``start_quorum`` or
    ``should_commit``) copies into the live objects.
    """

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    sampler: "BatchSampler"
    params: dict[str, torch.Tensor]  # fqn -> the sharded parameter (a DTensor), in state-dict order
    staged: dict[str, Any] | None  # what a peer is served: None until the first stage()
    healed: int  # how many times this process loaded a peer's state
    last_heal_bytes: int  # tensor bytes of the last state loaded

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                 scheduler: torch.optim.lr_scheduler.LRScheduler, sampler: "BatchSampler") -> None:
        self.model, self.optimizer, self.scheduler, self.sampler = model, optimizer, scheduler, sampler
        self.params = dict(model.named_parameters())
        self.staged = None
        self.healed = 0
        self.last_heal_bytes = 0

    def stage(self) -> None:
        """Refresh what peers are served; call on the training thread at a step boundary."""
        optim = self.optimizer.state_dict()  # references to the state tensors; host copies of the rest
        self.staged = {
            "model": {fqn: _local(p.detach()) for fqn, p in self.params.items()},
            "optimizer": {
                "state": {i: {k: _local(v) for k, v in s.items()} for i, s in optim["state"].items()},
                "param_groups": optim["param_groups"],
            },
            "scheduler": self.scheduler.state_dict(),
            "sampler": self.sampler.state_dict(),
            "rng": rng_state(),
        }

    def state_dict(self) -> dict[str, Any]:
        """torchft's ``state_dict`` callback (quorum thread): the staged state, untouched."""
        if self.staged is None:
            raise RuntimeError("fault_tolerance: a peer asked for this group's state before it was staged")
        return self.staged

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """torchft's ``load_state_dict`` callback (training thread): become the peer."""
        model = state["model"]
        if list(model) != list(self.params):
            raise ValueError(f"fault_tolerance: the peer's model has parameters {list(model)[:3]}..., this group's "
                             f"{list(self.params)[:3]}...: every replica group must train the same model")
        for fqn, value in model.items():
            local = _local(self.params[fqn])
            if local.shape != value.shape:
                raise ValueError(f"fault_tolerance: {fqn} is {tuple(value.shape)} on the peer, {tuple(local.shape)} "
                                 "here: every replica group must have the same number of ranks")
            local.copy_(value)
        by_index = list(self.params.values())
        optim_state = {i: {k: _like_param(v, by_index[i]) for k, v in s.items()}
                       for i, s in state["optimizer"]["state"].items()}
        self.optimizer.load_state_dict({"state": optim_state, "param_groups": state["optimizer"]["param_groups"]})
        self.scheduler.load_state_dict(state["scheduler"])
        self.sampler.load_state_dict(state["sampler"])
        set_rng_state(state["rng"])
        self.healed += 1
        self.last_heal_bytes = _nbytes(state)
        self.stage()  # serve what we now hold, should a later peer heal from us


class CommitGate:
    """The optimizer as the step loop sees it: ``step()`` applies only a committed step.

    ``zero_grad`` is the wrapped optimizer's (the quorum starts in :meth:`Replicas.begin_step`,
    before the batch is drawn, not in ``zero_grad`` as ``torchft.Optimizer`` does: a synchronous
    heal must land before the data position is read).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, should_commit: Callable[[], bool]) -> None:
        self.optimizer = optimizer
        self._should_commit = should_commit
        self.committed = False  # the last step()'s decision

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        self.committed = self._should_commit()
        if self.committed:
            self.optimizer.step()

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state)


def _process_group(device: torch.device, timeout: timedelta):
    """torchft's reconfigurable process group across the replica groups: gloo on CPU, NCCL on GPUs."""
    from torchft.process_group import ProcessGroupGloo, ProcessGroupNCCL

    return ProcessGroupNCCL(timeout=timeout) if device.type == "cuda" else ProcessGroupGloo(timeout=timeout)


def _store_address() -> tuple[str, int]:
    """The replica group's own c10d store (torchrun's ``MASTER_ADDR:MASTER_PORT``): torchft keeps its keys
    there, and the other groups meet there when this group is the quorum's primary. ``torchrun
    --standalone`` names it ``localhost``, which another machine cannot reach: it is advertised by
    this host's name instead, as torchft advertises its manager and heal server."""
    try:
        addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    except KeyError:
        raise RuntimeError("--fault-tolerance torchft runs each replica group under torchrun (MASTER_ADDR and "
                           "MASTER_PORT name the group's store); launch it with `shardwise train` or torchrun") from None
    return (socket.gethostname() if addr in _LOOPBACK else addr), port


class Replicas:
    """One replica group's side of torchft: the Manager, the gradient hook, the step protocol.

    The loop calls :meth:`begin_step` before drawing a batch, trains with :attr:`gate` as its
    optimizer, then :meth:`end_step` (which rewinds the data position when the step was
    discarded) and, on a commit, :meth:`stage`. :attr:`step` is the job's committed step
    count (torchft's, which a heal brings along).
    """

    manager: Any  # torchft.Manager
    group: ReplicaGroup
    heal: HealState
    gate: CommitGate
    async_quorum: bool
    rank: int  # this rank in its replica group
    joined: bool  # the start barrier is behind us (a fresh job waits for all R groups once)
    join_timeout_s: float
    quorum_s: float  # seconds the last begin_step spent (the quorum, and a synchronous heal)
    _position: dict[str, Any] | None  # data position and RNG before this step's batch
    _heals_at_start: int  # heal.healed when the step began
    _heals_at_draw: int  # heal.healed when its batch was drawn (a synchronous heal comes in between)

    def __init__(self, cfg: "TrainConfig", env: "DistEnv", group: ReplicaGroup, heal: HealState, model: nn.Module,
                 start_step: int = 0) -> None:
        from torchft import Manager

        timeout = timedelta(seconds=cfg.ft_timeout_s)
        store_addr, store_port = _store_address()
        self.group, self.heal, self.async_quorum, self.rank = group, heal, cfg.async_quorum, env.rank
        heal.stage()  # before the Manager exists: a peer may ask for our state from its first quorum on
        self.manager = Manager(
            pg=_process_group(env.device, timeout), load_state_dict=heal.load_state_dict, state_dict=heal.state_dict,
            min_replica_size=1, use_async_quorum=cfg.async_quorum, timeout=timeout, quorum_timeout=timeout,
            connect_timeout=timeout, rank=env.rank, world_size=env.world_size, store_addr=store_addr,
            store_port=store_port, lighthouse_addr=group.lighthouse, replica_id=f"shardwise_{group.group_id}",
        )
        if start_step:  # --resume: the job's step continues from the checkpoint
            self.manager.load_state_dict({"step": start_step, "batches_committed": start_step * group.groups})
        self.gate = CommitGate(heal.optimizer, lambda: self.manager.should_commit(timeout=VOTE_TIMEOUTS * timeout))
        self.joined = start_step > 0
        self.join_timeout_s = cfg.ft_timeout_s
        self.quorum_s = 0.0
        self._position = None
        self._heals_at_start = self._heals_at_draw = 0
        _set_all_reduce_hooks(model, self._all_reduce)
        logger.info("replica group %d of %d, lighthouse %s, %s quorum", group.group_id, group.groups,
                    group.lighthouse, "asynchronous" if cfg.async_quorum else "synchronous")

    @property
    def step(self) -> int:
        """Steps the job has committed (this group's, or the peer's it healed from)."""
        return self.manager.current_step()

    @property
    def participants(self) -> int:
        """Replica groups in this step's quorum."""
        return self.manager.num_participants()

    def begin_step(self) -> None:
        """Join this step's quorum (a synchronous heal lands here), then remember the data position."""
        start = time.perf_counter()
        self._heals_at_start = self.heal.healed
        if self.joined:
            self.manager.start_quorum()
        else:
            self._join()
        self.quorum_s = time.perf_counter() - start
        self._heals_at_draw = self.heal.healed
        self._position = {"sampler": self.heal.sampler.state_dict(), "rng": rng_state()}

    def _join(self) -> None:
        """A fresh job's first quorum waits until all ``R`` groups are in it (or a peer has already
        committed steps: then this group is a replacement and heals), so that a run without
        failures starts as ``--replicate R`` would. The lighthouse alone would start with
        whichever groups were heartbeating first. With ``--async-quorum`` too: the step-0 heal
        (torchft's ``init_sync``) is then fetched during the first forward, and the healing
        groups add zeros to the first step's average (torchft's rule for a healing group).

        Every rank of the group must make the same number of quorum calls (the group's manager
        waits for all of them), so the wait is bounded by a count of tries, never by each
        rank's clock: the quorum's answer and the count are the same on every rank.
        """
        for attempt in range(max(1, int(self.join_timeout_s / _JOIN_POLL_S))):
            if attempt:
                time.sleep(_JOIN_POLL_S)
            self.manager.start_quorum()
            if self.participants >= self.group.groups or self.step > 0:  # participants waits for the quorum
                break
        else:
            logger.warning("only %d of %d replica groups joined within about %.0f s; training with them",
                           self.participants, self.group.groups, self.join_timeout_s)
        self.joined = True

    @property
    def healed_this_step(self) -> bool:
        """Whether this group took a peer's state during the last step (at its start or its commit)."""
        return self.heal.healed != self._heals_at_start

    def end_step(self) -> bool:
        """After the gated optimizer step: whether it committed. A discarded step rewinds the data
        position (the step is run again on the same batch); one during which this group healed
        (asynchronous quorum: the peer's state lands in ``should_commit``) advances it past the
        batch the peer drew for the step being committed, so every group reads the same stream."""
        if self.heal.healed != self._heals_at_draw:
            if self.gate.committed:
                self.heal.sampler.next_batch()  # the peer's position is before this step's batch
            return self.gate.committed
        if not self.gate.committed and self._position is not None:
            self.heal.sampler.load_state_dict(self._position["sampler"])
            set_rng_state(self._position["rng"])
        return self.gate.committed

    def _all_reduce(self, grad: torch.Tensor) -> None:
        """The all-reduce hook: this group's reduced gradient shard averaged over the live groups.
        torchft records a failed collective (a dead peer) and ``should_commit`` then says no."""
        maybe_kill("ft_all_reduce", self.step + 1, self.rank)
        self.manager.allreduce(grad).wait()

    def shutdown(self) -> None:
        self.manager.shutdown(wait=False)


def _set_all_reduce_hooks(model: nn.Module, hook: Callable[[torch.Tensor], None]) -> None:
    """``set_all_reduce_hook`` on every FSDP module (shardwise's or torch's: both have the method)."""
    n = 0
    for module in model.modules():
        setter = getattr(module, "set_all_reduce_hook", None)
        if setter is not None:
            setter(hook)
            n += 1
    if n == 0:
        raise RuntimeError("fault_tolerance: the model has no fully_shard-ed module to hook the all-reduce into")


def attach(cfg: "TrainConfig", env: "DistEnv", model: nn.Module, optimizer: torch.optim.Optimizer,
           scheduler: torch.optim.lr_scheduler.LRScheduler, sampler: "BatchSampler", start_step: int) -> Replicas:
    """This rank's :class:`Replicas` for ``--fault-tolerance torchft``."""
    return Replicas(cfg, env, replica_group(cfg), HealState(model, optimizer, scheduler, sampler), model, start_step)
