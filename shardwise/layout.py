"""FlatLayout: where each all-gather input lies in a group's all-gather row.

A group's row is a list of *segments*, one per all-gather input: a plain param's padded
shard (see param.py), or each tensor a subclass's ``fsdp_pre_all_gather`` returned (see
tensor_extension.py). One unshard copies them back to back into our rank's row of the
all-gather output and gathers all rows in one collective (see group.py). Each segment
has its *row dtype*: what lands in the row (a plain param's ``param_dtype`` when mixed
precision casts it, else its own dtype; an extension input's own dtype). Usually all
agree and the row has that dtype. A frozen low-precision base next to trainable fp32
adapters (LoRA), or float8 / NF4 inputs next to plain params, mix dtypes in one group;
torch's FSDP2 then all-gathers the group as bytes. So do we::

    one dtype      row (P,) of that dtype; segments in their own order
    mixed dtypes   row (P bytes,) uint8; segments ordered widest itemsize first, so every
                   segment's byte offset is a multiple of its itemsize and its gathered
                   (N*width,) segment can be viewed as its dtype (itemsizes are powers of two)

Widths and offsets are in row units. Offsets in the unsharded buffer follow the same
order and widths, times N.
"""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(frozen=True)
class FlatLayout:
    """Positions of a group's all-gather inputs in its row (all per segment, in segment order)."""

    dtypes: tuple[torch.dtype, ...]  # each segment's row dtype
    storage_dtype: torch.dtype  # the row's dtype: the common one, or uint8 when mixed
    order: tuple[int, ...]  # segment indices in row order
    offsets: tuple[int, ...]  # start of each segment in the row (row units)
    widths: tuple[int, ...]  # length of each segment (row units)
    numels: tuple[int, ...]  # elements of each segment
    total: int  # length of the row (row units)
    row_widths: tuple[int, ...]  # widths in row order (what copy-in and copy-out split the row by)
    row_dtypes: tuple[torch.dtype, ...]  # dtypes in row order

    @staticmethod
    def build(numels: list[int], dtypes: list[torch.dtype]) -> "FlatLayout":
        mixed = len(set(dtypes)) > 1
        n = len(dtypes)
        if mixed:
            order = tuple(sorted(range(n), key=lambda i: -_itemsize(dtypes[i])))
            widths = tuple(numel * _itemsize(d) for numel, d in zip(numels, dtypes))
        else:
            order, widths = tuple(range(n)), tuple(numels)
        offsets = [0] * n
        offset = 0
        for i in order:
            offsets[i] = offset
            offset += widths[i]
        storage = torch.uint8 if mixed else dtypes[0]
        in_order = tuple(widths[i] for i in order), tuple(dtypes[i] for i in order)
        return FlatLayout(tuple(dtypes), storage, order, tuple(offsets), widths, tuple(numels), offset, *in_order)

    @property
    def mixed(self) -> bool:
        return self.storage_dtype == torch.uint8 and any(d != torch.uint8 for d in self.dtypes)

    def as_param(self, gathered_segment: torch.Tensor, i: int) -> torch.Tensor:
        """Segment ``i``'s gathered (N*width,) rows (row units) viewed as its dtype."""
        if gathered_segment.dtype == torch.uint8 and self.dtypes[i] != torch.uint8:
            return gathered_segment.view(self.dtypes[i])
        return gathered_segment

    def as_row(self, output: torch.Tensor) -> torch.Tensor:
        """A segment's output tensor (its dtype) viewed in row units (bytes when mixed)."""
        if self.storage_dtype == torch.uint8 and output.dtype != torch.uint8:
            return output.view(torch.uint8)
        return output


def check_trainable_uniform(names: list[str], dtypes: list[torch.dtype], requires_grad: list[bool]) -> None:
    """torch's rule: the params that train share one dtype (gradients reduce together)."""
    trainable = {d for d, rg in zip(dtypes, requires_grad) if rg}
    if len(trainable) > 1:
        listed = ", ".join(f"{n}: {d}" for n, d, rg in zip(names, dtypes, requires_grad) if rg)
        raise NotImplementedError(
            f"fully_shard needs one dtype per group for the trainable parameters (FSDP expects uniform "
            f"original parameter dtype), got {listed}; call fully_shard separately on the submodules "
            "whose parameters differ in dtype, or cast the module first"
        )


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()
