"""Implicit forward prefetch: on CPU, gather the next module while this one computes.

On CUDA the host runs ahead of the device, so the all-gather a module's pre-forward
issues is queued long before the device needs it and overlaps the previous module's
kernels by itself. On CPU compute is synchronous: the all-gather of module i+1 is issued
only when module i has finished computing, and the rank waits for it. So, where no
explicit :meth:`~shardwise.FSDPModule.set_modules_to_forward_prefetch` list is set, the
pre-forward of each module on a CPU device also starts the all-gathers of the
:data:`DEPTH` modules that entered forward after it in the root's *previous* forward.
Two ahead measured 1.5% (10M GPT) to 8% (1M GPT) faster per step than one ahead on 2
ranks here: one module's forward is often shorter than a gather's latency. It costs one
more module's unsharded params during forward, which stays under the start of backward's
peak (all activations plus two gathered modules) in the benchmarks.

The invariants, kept by :class:`ForwardPrefetcher`:

* Only inside the root's forward: a submodule run on its own (or a loss head run after
  the root's forward) neither records order nor prefetches, so it issues exactly the
  collectives it would without prefetching.
* Same collectives as without prefetching when the order repeats: a prefetch is the
  all-gather that module's own pre-forward would issue, only earlier.
* Nothing stays gathered by mistake: at the root's post-forward, a module that was
  prefetched but did not run (the order changed) is resharded, so an optimizer step
  before its next forward cannot leave it computing with stale parameters.
"""

from __future__ import annotations

from typing import Protocol, Sequence


class _Gatherable(Protocol):
    @property
    def gathered_or_gathering(self) -> bool: ...

    def reshard(self) -> None: ...


class PrefetchTarget(Protocol):
    """What the prefetcher needs of a ``state.ModuleState`` (declared here, below
    state.py, so imports flow one way)."""

    groups: Sequence[_Gatherable]  # one per mesh; empty when the state has no params
    gathers: bool  # some group's unshard is a collective (shard size > 1): worth starting early

    def prefetch(self, in_backward: bool = False) -> None: ...

DEPTH = 2
"""How many modules ahead the implicit forward prefetch gathers."""


class ForwardPrefetcher:
    """The root's forward order, recorded each forward and followed in the next."""

    active: bool  # inside the root's forward
    _order: list[PrefetchTarget]  # states with params, in the order this forward entered them
    _next: dict[int, PrefetchTarget]  # id(state) -> who entered after it in the last forward
    _prefetched: list[PrefetchTarget]  # what this forward prefetched implicitly

    def __init__(self) -> None:
        self.active = False
        self._order = []
        self._next = {}
        self._prefetched = []

    def start(self) -> None:
        """The root's pre-forward: the previous forward's order becomes the one to follow."""
        if self._order:
            self._next = {id(a): b for a, b in zip(self._order, self._order[1:])}
        self._order = []
        self._prefetched = []
        self.active = True

    def enter(self, state: PrefetchTarget) -> None:
        """``state`` entered forward (its first member, once per pass); only states whose
        unshard communicates are followed (at shard size 1 there is nothing to overlap)."""
        if self.active and state.gathers:
            self._order.append(state)

    def prefetch_after(self, state: PrefetchTarget) -> None:
        """Start the all-gathers of the :data:`DEPTH` states that followed ``state`` last time."""
        if not self.active:
            return
        for _ in range(DEPTH):
            state = self._next.get(id(state))
            if state is None:
                return
            if not _gathered_or_gathering(state):
                self._prefetched.append(state)
                state.prefetch()

    def finish(self) -> None:
        """The root's post-forward: reshard what was prefetched but did not run."""
        ran = {id(s) for s in self._order}
        for state in self._prefetched:
            if id(state) not in ran:
                for group in state.groups:
                    group.reshard()
        self._prefetched = []
        self.active = False

    def abort(self) -> None:
        """An exception ended the iteration: forget this forward (the groups are resharded)."""
        self.active = False
        self._order = []
        self._prefetched = []


def _gathered_or_gathering(state: PrefetchTarget) -> bool:
    """Every group of ``state`` is gathered or gathering (its groups gather together)."""
    for group in state.groups:
        if not group.gathered_or_gathering:
            return False
    return True
