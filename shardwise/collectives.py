"""The collectives of one group, as plain functions of tensors and process groups.

Data flow of one group (N ranks in the shard group, P = sum of padded shard numels)::

    unshard:  padded shards --copy_in--> our (P,) slot of gathered (N*P,) --all_gather (in place)-->
              gathered --copy_out--> per-param (N*pn,) segments
    reduce:   unsharded grads --pack_for_reduce--> (N, Pg) --reduce_scatter--> (Pg,) our shard
              [HSDP: --all_reduce over the replicate group-->]

Every function records itself in :mod:`shardwise.comm_stats`. World size 1 never calls a
collective: the caller copies instead. Averaging is a SUM plus explicit scaling
(``ReducePlan``): gloo has neither AVG nor PREMUL_SUM, and fp16 needs its sum split into a
pre- and post-divide to avoid overflow.
"""

from __future__ import annotations

import abc
import math
import os
from typing import NamedTuple, Sequence

import torch
import torch.distributed as dist

from shardwise import comm_stats


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _gather_fn():
    """``torch.distributed``'s all-gather into one tensor, looked up now (never bound at import).

    Tools and tests patch ``dist``'s collectives to count or check calls (torch's own FSDP2
    tests patch ``dist.all_gather_single``, older ones ``dist.all_gather_into_tensor``), so
    every call goes through the module attribute. torch 2.13's ``all_gather_into_tensor`` is
    an alias that calls c10d's ``all_gather_single`` directly, past a patch on ``dist``: the
    alias is called only when it, and not ``all_gather_single``, was replaced on ``dist``, or
    on an older torch that has it alone.
    """
    return _looked_up("all_gather_single", "all_gather_into_tensor")


def _reduce_scatter_fn():
    """``torch.distributed``'s reduce-scatter of one tensor, looked up now (as :func:`_gather_fn`)."""
    return _looked_up("reduce_scatter_single", "reduce_scatter_tensor")


def _looked_up(name: str, alias: str):
    """``dist.<name>``, or ``dist.<alias>`` when only the alias was patched (or ``name`` is absent)."""
    current = getattr(dist, name, None)
    if current is None:
        return getattr(dist, alias)
    aliased = getattr(dist, alias)
    if current is getattr(dist.distributed_c10d, name) and aliased is not getattr(dist.distributed_c10d, alias):
        return aliased
    return current


def all_gather(output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup, async_op: bool):
    """All-gather ``input`` (P,) from every rank into ``output`` (N*P,), rank-major."""
    comm_stats.record("all_gather", _nbytes(output), dist.get_world_size(group), output.dtype)
    return _gather_fn()(output, input, group=group, async_op=async_op)


def work_is_completed(work) -> bool:
    """Whether a collective's work handle says it completed; False while in flight and for a
    handle that cannot say (a custom comm's work without ``is_completed``)."""
    check = getattr(work, "is_completed", None)
    return bool(check()) if callable(check) else False


def copy_in(slot: torch.Tensor, inputs: list[torch.Tensor], widths: list[int], dtypes: list[torch.dtype]) -> None:
    """Lay the all-gather ``inputs`` back to back into ``slot`` (P,), each into ``widths[i]``
    of the slot's units as ``dtypes[i]``: our input of an in-place all-gather (FSDP2's copy-in).

    A slot of one dtype casts each input element-wise on the way (``param_dtype``); a byte
    slot (a group of mixed dtypes, see layout.py) takes each input's bytes, cast to its
    row dtype first where mixed precision asks. Either way inputs move to the slot's device.
    """
    flats = [_in_row_units(slot, t.reshape(-1), d) for t, d in zip(inputs, dtypes)]
    if len(flats) == 1:
        slot.copy_(flats[0], non_blocking=True)
    elif all(f.dtype == slot.dtype and f.device == slot.device for f in flats):
        torch.cat(flats, out=slot)
    else:
        torch._foreach_copy_(list(slot.split(widths)), flats, non_blocking=True)


def _in_row_units(slot: torch.Tensor, flat: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``flat`` as bytes of ``dtype`` when ``slot`` holds bytes of several dtypes, else as it is."""
    if slot.dtype == torch.uint8 and flat.dtype != torch.uint8:
        return (flat if flat.dtype == dtype else flat.to(dtype)).view(torch.uint8)
    return flat


def copy_out(gathered: torch.Tensor, num_shards: int, split_sizes: list[int], outs: list[torch.Tensor]) -> None:
    """Scatter the rank-major ``gathered`` (N*P,) into per-param (N*pn,) segments ``outs``.

    Column block i of ``gathered.view(N, P)`` holds every rank's padded shard of param i,
    which is exactly param i's unsharded rows (plus padding) once laid out row-major.
    """
    rows = gathered.view(num_shards, -1)  # (N, P)
    targets = [out.view(num_shards, -1) for out in outs]  # (N, pn_i)
    if len(targets) == 1:
        targets[0].copy_(rows)
        return
    torch.split_with_sizes_copy(rows, split_sizes, dim=1, out=targets)


def pack_for_reduce(chunked_grads: list[torch.Tensor], num_shards: int, dtype: torch.dtype) -> torch.Tensor:
    """Lay gradients out rank-major: row r of the (N, Pg) result is rank r's padded shards.

    Each gradient is split like ``torch.chunk`` along dim 0 and padded to ``ceil(D0/N)``
    rows, matching the shard layout of param.py; the copy casts to ``dtype`` on the way.
    """
    first = chunked_grads[0]
    if first.dtype == dtype and type(first) is torch.Tensor:
        return torch._chunk_cat(chunked_grads, dim=0, num_chunks=num_shards)  # (N, Pg)
    # Another dtype, or a subclass's gradient (a wrapper such as TwoTensor has no storage of
    # its own to reduce or free): into a plain buffer, as torch's FSDP2 packs every gradient.
    width = sum(_padded_chunk_numel(g, num_shards) for g in chunked_grads)
    packed = torch.empty(num_shards, width, dtype=dtype, device=chunked_grads[0].device)
    return torch._chunk_cat(chunked_grads, dim=0, num_chunks=num_shards, out=packed)


SMALL_GRAD_NUMEL = 32_768
"""Mean gradient size (elements) below which :func:`pack_dividing` concatenates in one call
and divides the whole buffer after (two passes, no Python per gradient) instead of
dividing each gradient into place (one pass, one call per gradient). Measured per
transformer block on this CPU: GPT-tiny (12 grads, 16k elements each on average) 0.06 vs
0.12 ms; GPT-medium (262k each) 1.3 vs 0.95 ms."""


def pack_dividing(
    grads: list[torch.Tensor], dtype: torch.dtype, divisor: float, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Shard size 1: concatenate the gradients into one (1, P) buffer, each divided by
    ``divisor`` on the way (cast to ``dtype`` too); into ``out`` when given.

    One pass over the gradients instead of a copy and a separate division of the whole
    buffer, as DDP divides while copying into its buckets; many small gradients of
    ``dtype`` are concatenated in one call and divided after (:data:`SMALL_GRAD_NUMEL`).
    Either way each element is ``g / divisor`` rounded once, so ``sum(g / N)`` equals
    ``sum(g) / N`` bit for bit when N is a power of two; otherwise within an ulp.
    """
    if out is None:
        out = torch.empty(sum(g.numel() for g in grads), dtype=dtype, device=grads[0].device)
    total = out.numel()  # the caller sized ``out`` to the gradients: no second sum over them
    packed = out.view(1, -1)
    flat = packed.view(-1)
    if total < SMALL_GRAD_NUMEL * len(grads) and all(g.dtype == dtype for g in grads):
        torch.cat([g.reshape(-1) for g in grads], out=flat)  # (P,)
        return packed.div_(divisor) if divisor != 1.0 else packed  # g / 1 is g, bit for bit
    offset = 0
    for grad in grads:
        numel = grad.numel()
        out = flat[offset : offset + numel].view(grad.shape)
        if divisor == 1.0:
            out.copy_(grad)
        elif grad.dtype == dtype:
            torch.div(grad, divisor, out=out)
        else:  # divide in the reduce dtype, not the gradient's (bf16 -> fp32 keeps fp32 precision)
            out.copy_(grad).div_(divisor)
        offset += numel
    return packed


def _padded_chunk_numel(t: torch.Tensor, num_shards: int) -> int:
    rows = -(-t.size(0) // num_shards) if t.size(0) else 0
    return rows * (t.numel() // t.size(0) if t.size(0) else 0)


def free_storage(buffer: torch.Tensor) -> None:
    """Release a finished collective's scratch buffer now.

    gloo's worker thread keeps its reference to a work's tensors for a moment after the
    work completes, so dropping ours frees the bytes at a time that depends on thread
    scheduling, and the next buffer may be allocated first: a peak that varies from step
    to step. Resizing the storage to 0 frees it at once (the work no longer reads it).
    """
    buffer.untyped_storage().resize_(0)


def reduce_scatter(output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup, async_op: bool):
    """SUM-reduce-scatter ``input`` (N*Pg,) into our ``output`` (Pg,).

    The backend's reduce-scatter, as torch's FSDP2 issues it. Opt-in on gloo: an all-to-all
    of the N chunks followed by a local sum (see :func:`use_all_to_all_reduce`), which may
    reorder ``input``'s rows.
    """
    n = dist.get_world_size(group)
    if not use_all_to_all_reduce(group):
        comm_stats.record("reduce_scatter", _nbytes(input), n, input.dtype)
        return _reduce_scatter_fn()(output, input, op=dist.ReduceOp.SUM, group=group, async_op=async_op)
    comm_stats.record("all_to_all", _nbytes(input), n, input.dtype)
    handle = _all_to_all_reduce(output, input.view(n, -1), dist.get_rank(group), group)
    if async_op:
        return handle
    handle.wait()
    return None


def _all_to_all_reduce(output: torch.Tensor, rows: torch.Tensor, rank: int, group) -> "_SumOnWait":
    """Start the all-to-all that sends row j of ``rows`` (N, Pg) to rank j, except our own.

    Our own row never travels: it is summed locally, so only the N-1 other ranks' rows are
    received. With 2 ranks the one received row lands in ``output`` itself, so the live
    buffers are the input and the output: the memory of a native reduce-scatter. With more
    ranks, ``output`` starts as our row and a (N-1, Pg) buffer receives the rest.
    all_to_all sends contiguous per-rank segments in rank order, so the rows after ours
    shift up by one (clobbering ``rows``) to close the gap our row leaves.
    """
    n = rows.size(0)
    splits = [rows.size(1)] * n
    splits[rank] = 0
    if n == 2:
        received, own = output.view(1, -1), rows[rank]
    else:
        received, own = rows.new_empty(n - 1, rows.size(1)), None
        output.copy_(rows[rank])
    if rank == 0:
        send = rows[1:]
    else:
        for j in range(rank, n - 1):
            rows[j].copy_(rows[j + 1])
        send = rows[: n - 1]
    work = dist.all_to_all_single(received.view(-1), send.reshape(-1), splits, splits, group=group, async_op=True)
    return _SumOnWait(work, output, [own] if own is not None else list(received.unbind(0)))


class _SumOnWait:
    """Work handle of an all-to-all reduce: waiting also adds the other addends into the output."""

    def __init__(self, work, output: torch.Tensor, addends: list[torch.Tensor]):
        self._work, self._output, self._addends = work, output, addends

    def is_completed(self) -> bool:
        """Whether the chunks have arrived (the sum happens in wait)."""
        return self._work is None or self._work.is_completed()

    def wait(self, timeout=None) -> bool:
        """Wait (at most ``timeout``, a timedelta: c10d raises on expiry), then sum."""
        if self._work is not None:
            self._work.wait() if timeout is None else self._work.wait(timeout)
            for addend in self._addends:  # (Pg,) each; 2 ranks: our own row, else the received ones
                self._output.add_(addend)
            if len(self._addends) > 1:  # the (N-1, Pg) receive buffer
                free_storage(self._addends[0])
            self._work = self._addends = None
        return True


def all_to_all_receive_buffer(group: dist.ProcessGroup) -> bool:
    """Whether :func:`reduce_scatter` over ``group`` allocates a receive buffer besides its
    output (the all-to-all reduce over more than 2 ranks)."""
    return use_all_to_all_reduce(group) and dist.get_world_size(group) > 2


def use_all_to_all_reduce(group: dist.ProcessGroup) -> bool:
    """Whether to reduce-scatter as all-to-all + local sum: only on gloo, and only when
    ``SHARDWISE_GLOO_REDUCE_SCATTER=all_to_all`` asks for it.

    gloo's reduce-scatter behaves like an all-reduce followed by a slice: it writes about
    twice the ring ideal to its sockets. An all-to-all moves each rank's (N-1)/N chunks once
    and the sum happens locally — half the bytes on the sockets (``/proc/self/io``), and in
    a micro-benchmark here 1.5x (2 ranks, 4 MB) to 2.3x (4 ranks, 16 MB) faster. The result
    is exact; for 2 ranks it is bit-identical (a + b), for more
    ranks the summation order (ours first, then rank order) may differ from gloo's ring.

    It is not the default because a drop-in's collectives by kind are torch's: under
    ``CommDebugMode`` (or any counter of ``torch.ops.c10d`` ops) users' tests count
    ``_reduce_scatter_base_`` per group and backward, and an all-to-all is not one.
    """
    chosen = os.environ.get("SHARDWISE_GLOO_REDUCE_SCATTER", "native")
    return chosen == "all_to_all" and dist.get_backend(group) == "gloo"


def all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup, async_op: bool):
    """SUM-all-reduce ``tensor`` in place."""
    comm_stats.record("all_reduce", _nbytes(tensor), dist.get_world_size(group), tensor.dtype)
    return dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group, async_op=async_op)


class Comm(abc.ABC):
    """A pluggable collective: how to allocate its buffer, and how to run it."""

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The buffer the collective writes into (override for special memory)."""
        return torch.empty(*size, dtype=dtype, device=device)


class AllGather(Comm):
    """Interface of ``FSDPModule.set_custom_all_gather``: ``comm(output, input, group, async_op)``."""

    @abc.abstractmethod
    def __call__(self, output_tensor, input_tensor, group, async_op: bool = False): ...


class ReduceScatter(Comm):
    """Interface of ``FSDPModule.set_custom_reduce_scatter``: ``comm(output, input, group, op, async_op)``.

    shardwise always passes ``op=ReduceOp.SUM`` and applies the averaging itself.
    """

    @abc.abstractmethod
    def __call__(self, output_tensor, input_tensor, group, op, async_op: bool = False): ...


class DefaultAllGather(AllGather):
    def __call__(self, output_tensor, input_tensor, group, async_op: bool = False):
        return all_gather(output_tensor, input_tensor, group, async_op)


class DefaultReduceScatter(ReduceScatter):
    def __call__(self, output_tensor, input_tensor, group, op, async_op: bool = False):
        return reduce_scatter(output_tensor, input_tensor, group, async_op)


class ReducePlan(NamedTuple):
    """Scale by ``1/pre_divide`` before a SUM collective and by ``1/post_divide`` after it;
    or multiply by ``pre_multiply`` before it (torch's ``PREMUL_SUM``).

    ``post_divide`` is one of two things, and the all-reduce hook runs between them as it
    does in torch: with ``divides_as_collective`` it stands in for torch's AVG collective
    (gloo-independent SUM plus a division), so the hook sees the divided gradient, as
    torch's sees the AVG's output; otherwise it is torch's own post-division (fp16, forced
    SUMs), after the hook."""

    pre_divide: float
    post_divide: float
    pre_multiply: float = 1.0
    divides_as_collective: bool = False


def plan_reduction(
    dtype: torch.dtype, world: int, divide_factor: float | None, shard_size: int, force_sum: bool = False
) -> ReducePlan:
    """How to turn a SUM over ``world`` ranks into the gradient the user expects.

    Default: the mean (divide by ``world``). ``divide_factor``: divide by it instead. fp16
    splits the divisor into a power of two before the sum and the rest after, so the
    partial sums stay in range. Collectives are always SUMs (gloo has no AVG/PREMUL_SUM),
    which is also what ``set_force_sum_reduction_for_comms`` asks for.

    With ``shard_size`` 1 (replicate) the reduced buffer is the whole gradient, so a
    post-divide would be a second pass over it: the division happens before the sum
    instead, fused into packing (:func:`pack_dividing`), as DDP divides into its buckets.
    At world size 1 nothing is communicated: the packed gradients are divided once, after
    packing, out of place (torch's one ``aten.div.Tensor``), and not at all without a factor.

    A ``divide_factor`` other than the shard size, in fp32/bf16 and without
    ``force_sum``, is torch's ``PREMUL_SUM(1/f)``: every rank multiplies its gradient by
    ``1/f`` before the SUM (bit-equal to torch; ``x * (1/f)`` and ``x / f`` round apart).
    """
    if world == 1:  # nothing is communicated: one division of the packed gradients, as torch
        return ReducePlan(1.0, 1.0 if divide_factor is None else float(divide_factor))
    premul = divide_factor is not None and divide_factor != shard_size and shard_size > 1
    if premul and not force_sum and dtype in (torch.float32, torch.bfloat16):
        return ReducePlan(1.0, 1.0, 1.0 / divide_factor)
    factor = float(world if divide_factor is None else divide_factor)
    if dtype == torch.float16 and factor > 1:
        pre = float(2 ** math.ceil(math.log2(math.sqrt(factor))))
        pre = min(pre, factor)
        return ReducePlan(pre, factor / pre)
    if force_sum:  # torch: SUM collectives, the all-reduce hook, then one post-division
        return ReducePlan(1.0, factor)
    if shard_size == 1:
        return ReducePlan(factor, 1.0)
    return ReducePlan(1.0, factor, divides_as_collective=True)
