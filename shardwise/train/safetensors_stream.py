"""Write safetensors files one tensor at a time, from shapes known in advance.

``safetensors.torch.save_file`` needs every tensor of a file in memory at once. An export
knows every tensor's name, dtype and shape before reading any of them (from the
checkpoint's metadata), so the header — the offsets of every tensor in the file — can be
written first and the tensors after it, each read, written and dropped in turn. The
format (https://github.com/huggingface/safetensors)::

    u64 little-endian N | N bytes of JSON header, space-padded to 8 | the tensors' bytes, back to back
    header: {"__metadata__": {...}, name: {"dtype": "F32", "shape": [...], "data_offsets": [begin, end]}, ...}

:func:`plan_files` groups tensors into files of at most ``max_bytes`` (a tensor larger
than that gets a file of its own) and names them as Transformers does
(``model.safetensors``, or ``model-0000i-of-0000n.safetensors`` plus an index).
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from typing import Callable, Iterable, NamedTuple

import torch

__all__ = ["TensorInfo", "DTYPES", "plan_files", "write_file", "write_index"]

DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL",
}
"""torch dtypes safetensors names."""


class TensorInfo(NamedTuple):
    """A tensor to write, known before its data is read."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def plan_files(infos: Iterable[TensorInfo], max_bytes: int) -> dict[str, list[TensorInfo]]:
    """``{file name: tensors}`` in order, each file at most ``max_bytes`` of data (unless one tensor is larger)."""
    groups: list[list[TensorInfo]] = [[]]
    size = 0
    for info in infos:
        if groups[-1] and size + info.nbytes > max_bytes:
            groups.append([])
            size = 0
        groups[-1].append(info)
        size += info.nbytes
    if len(groups) == 1:
        return {"model.safetensors": groups[0]}
    n = len(groups)
    return {f"model-{i + 1:05d}-of-{n:05d}.safetensors": g for i, g in enumerate(groups)}


def _header(infos: list[TensorInfo]) -> bytes:
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for info in infos:
        if info.dtype not in DTYPES:
            raise ValueError(f"{info.name}: dtype {info.dtype} has no safetensors name")
        header[info.name] = {"dtype": DTYPES[info.dtype], "shape": list(info.shape),
                             "data_offsets": [offset, offset + info.nbytes]}
        offset += info.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    return raw + b" " * (-len(raw) % 8)


def write_file(path: Path, infos: list[TensorInfo], read: Callable[[TensorInfo], torch.Tensor]) -> int:
    """Write ``infos`` to ``path``, calling ``read`` for one tensor at a time; returns the data bytes."""
    header = _header(infos)
    written = 0
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header)))
        f.write(header)
        for info in infos:
            tensor = read(info)
            if tensor.dtype != info.dtype or tuple(tensor.shape) != info.shape:
                raise ValueError(f"{info.name}: read {tensor.dtype} {tuple(tensor.shape)}, "
                                 f"expected {info.dtype} {info.shape}")
            data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8)  # little-endian on x86/ARM
            f.write(memoryview(data.numpy()))  # no copy of the bytes
            written += info.nbytes
            del tensor, data
    return written


def write_index(out_dir: Path, files: dict[str, list[TensorInfo]]) -> None:
    """``model.safetensors.index.json`` for a model of several files (nothing for one)."""
    if len(files) < 2:
        return
    index = {"metadata": {"total_size": sum(i.nbytes for infos in files.values() for i in infos)},
             "weight_map": {i.name: name for name, infos in files.items() for i in infos}}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
