"""FlatLayout: where each parameter's padded shard lies in a group's all-gather row.

Every param owns its padded shard (see param.py); one unshard copies them back to back
into our rank's row of the all-gather output and gathers all rows in one collective
(see group.py). Usually all params share one dtype and the row has it. A frozen
low-precision base next to trainable fp32 adapters (LoRA) mixes dtypes in one group;
torch's FSDP2 allows that (it checks dtype uniformity over *trainable* params only) and
all-gathers such a group as bytes. So do we::

    one dtype      row (P,) of that dtype; params in their own order
    mixed dtypes   row (P bytes,) uint8; params ordered widest itemsize first, so every
                   param's byte offset is a multiple of its itemsize and its gathered
                   segment can be viewed as its dtype (all itemsizes are powers of two)

The row is in "gather units": ``storage_dtype`` (the common dtype, or bytes), or
``param_dtype`` when mixed precision casts it (then elementwise: one unit per element).
Offsets in the unsharded buffer follow the same order and widths, times N.
"""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(frozen=True)
class FlatLayout:
    """Positions of a group's params in its all-gather row (all per param, in param order)."""

    dtypes: tuple[torch.dtype, ...]  # each param's sharded dtype
    storage_dtype: torch.dtype  # the row's dtype when nothing casts: the common one, or uint8 when mixed
    order: tuple[int, ...]  # param indices in row order
    offsets: tuple[int, ...]  # start of each padded shard in the row (storage units)
    widths: tuple[int, ...]  # length of each padded shard (storage units)
    padded_numels: tuple[int, ...]  # elements of each padded shard
    total: int  # length of the row (storage units)

    @staticmethod
    def build(padded_numels: list[int], dtypes: list[torch.dtype]) -> "FlatLayout":
        mixed = len(set(dtypes)) > 1
        n = len(dtypes)
        if mixed:
            order = tuple(sorted(range(n), key=lambda i: -_itemsize(dtypes[i])))
            widths = tuple(pn * _itemsize(d) for pn, d in zip(padded_numels, dtypes))
        else:
            order, widths = tuple(range(n)), tuple(padded_numels)
        offsets = [0] * n
        offset = 0
        for i in order:
            offsets[i] = offset
            offset += widths[i]
        storage = torch.uint8 if mixed else dtypes[0]
        return FlatLayout(tuple(dtypes), storage, order, tuple(offsets), widths, tuple(padded_numels), offset)

    @property
    def mixed(self) -> bool:
        return self.storage_dtype == torch.uint8 and any(d != torch.uint8 for d in self.dtypes)

    def gather_widths(self, gather_dtype: torch.dtype) -> tuple[int, ...]:
        """Each param's length in one rank's all-gather row, in ``gather_dtype`` units."""
        return self.widths if gather_dtype == self.storage_dtype else self.padded_numels

    def as_param(self, gathered_segment: torch.Tensor, i: int) -> torch.Tensor:
        """Param ``i``'s unsharded segment (gather units) viewed as the dtype it computes in."""
        if gathered_segment.dtype == torch.uint8 and self.dtypes[i] != torch.uint8:
            return gathered_segment.view(self.dtypes[i])
        return gathered_segment

    def check_trainable_uniform(self, names: list[str], requires_grad: list[bool]) -> None:
        """torch's rule: the params that train share one dtype (gradients reduce together)."""
        trainable = {d for d, rg in zip(self.dtypes, requires_grad) if rg}
        if len(trainable) > 1:
            listed = ", ".join(f"{n}: {d}" for n, d, rg in zip(names, self.dtypes, requires_grad) if rg)
            raise NotImplementedError(
                f"fully_shard needs one dtype per group for the trainable parameters (FSDP expects uniform "
                f"original parameter dtype), got {listed}; call fully_shard separately on the submodules "
                "whose parameters differ in dtype, or cast the module first"
            )


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()
