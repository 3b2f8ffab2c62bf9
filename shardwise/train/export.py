"""``shardwise export CHECKPOINT_DIR OUT_DIR``: a training checkpoint as a directory Transformers loads.

One process, no process group. The checkpoint is DCP's format: a metadata file listing
every tensor's global shape and dtype, and each rank's shards in its own files. The export
reads the metadata, plans the safetensors files from it, then reads one tensor at a time
(``dcp.load`` of a one-key state dict reads just that tensor's shards from every file and
assembles the full tensor) and streams it into its file
(:mod:`~shardwise.train.safetensors_stream`). Peak memory is one full tensor.

What it writes, from the manifest's model card (:mod:`~shardwise.train.checkpointing`)::

    OUT_DIR/config.json                  the Transformers config (a GPT preset: its GPTConfig)
    OUT_DIR/model.safetensors            or model-0000i-of-0000n.safetensors + model.safetensors.index.json
    OUT_DIR/tokenizer.json ...           the run's tokenizer, when it had one

then ``AutoModelForCausalLM.from_pretrained(OUT_DIR)`` (a Transformers model) or
:func:`load_gpt` (a GPT preset: a plain state dict plus its config) gives the trained model.
Only the model is exported; the optimizer's state stays in the checkpoint.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from shardwise.checkpoint.directory import MANIFEST, POINTER, CheckpointDir
from shardwise.train.checkpointing import CARD_KEY, TOKENIZER_DIR
from shardwise.train.model import GPT, GPTConfig
from shardwise.train.safetensors_stream import TensorInfo, plan_files, write_file, write_index

__all__ = ["ExportResult", "DEFAULT_MAX_SHARD_BYTES", "export_checkpoint", "load_gpt", "GPT_MARKER"]

DEFAULT_MAX_SHARD_BYTES = 5 * 10**9
"""Start a new safetensors file past this many bytes (Transformers' ``max_shard_size`` default)."""

GPT_MARKER = "shardwise_gpt"
"""Key of an exported GPT preset's ``config.json`` (its value: the preset's name)."""

_MODEL_PREFIX = "model."  # DCP keys of the model's state (the trainer state is {"model": ..., "optim": ...})


class ExportResult(NamedTuple):
    source: Path  # the step-N checkpoint exported
    step: int
    n_tensors: int
    n_bytes: int
    n_files: int


def _resolve(checkpoint: str | Path) -> tuple[Path, dict]:
    """The committed checkpoint ``checkpoint`` names (a ``--checkpoint-dir`` or one step in it) and its manifest."""
    root = Path(checkpoint)
    if (root / POINTER).exists() or not (root / MANIFEST).exists():
        path = CheckpointDir(root).latest()
        if path is None:
            raise FileNotFoundError(f"{root} holds no committed checkpoint (no {POINTER!r} pointer nor {MANIFEST})")
    else:
        path = root
    manifest = CheckpointDir.verify(path)
    if CARD_KEY not in manifest.get("meta", {}):
        raise ValueError(f"checkpoint {path} records no model card (saved by an older shardwise); cannot tell "
                         "which model it holds")
    return path, manifest


def _model_tensors(path: Path) -> list[TensorInfo]:
    metadata = dcp.FileSystemReader(str(path)).read_metadata()
    infos = []
    for key, md in metadata.state_dict_metadata.items():
        if key.startswith(_MODEL_PREFIX) and isinstance(md, TensorStorageMetadata):
            infos.append(TensorInfo(key[len(_MODEL_PREFIX):], md.properties.dtype, tuple(md.size)))
    if not infos:
        raise ValueError(f"checkpoint {path} holds no model tensors")
    return infos


def _reader(path: Path):
    def read(info: TensorInfo) -> torch.Tensor:
        tensor = torch.empty(info.shape, dtype=info.dtype)
        dcp.load({_MODEL_PREFIX + info.name: tensor}, storage_reader=dcp.FileSystemReader(str(path)), no_dist=True)
        return tensor

    return read


def _config_json(card: dict) -> dict:
    if card["kind"] == "gpt":
        return {GPT_MARKER: card["preset"], **card["config"]}
    config = dict(card["config"])
    config["use_cache"] = True  # trained without a KV cache; inference wants one
    return config


def export_checkpoint(checkpoint: str | Path, out_dir: str | Path, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> ExportResult:
    """Write the model of ``checkpoint`` (the newest in a ``--checkpoint-dir``, or a ``step-N``) to ``out_dir``."""
    path, manifest = _resolve(checkpoint)
    card = manifest["meta"][CARD_KEY]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    infos = _model_tensors(path)
    files = plan_files(infos, max_shard_bytes)
    read = _reader(path)
    n_bytes = sum(write_file(out / name, group, read) for name, group in files.items())
    write_index(out, files)
    (out / "config.json").write_text(json.dumps(_config_json(card), indent=2, sort_keys=True))
    tokenizer = path.parent / TOKENIZER_DIR
    if tokenizer.is_dir():
        for file in tokenizer.iterdir():
            shutil.copy2(file, out / file.name)
    return ExportResult(path, int(manifest["step"]), len(infos), n_bytes, len(files))


def load_gpt(out_dir: str | Path) -> GPT:
    """The GPT preset an export wrote to ``out_dir`` (config and weights), on the CPU."""
    from safetensors.torch import load_file

    out = Path(out_dir)
    config = json.loads((out / "config.json").read_text())
    if GPT_MARKER not in config:
        raise ValueError(f"{out} is not an exported GPT preset (no {GPT_MARKER!r} in its config.json); "
                         "load it with transformers.AutoModelForCausalLM.from_pretrained")
    config.pop(GPT_MARKER)
    model = GPT(GPTConfig(**config))
    state = {}
    for file in sorted(out.glob("*.safetensors")):
        state.update(load_file(str(file)))
    model.load_state_dict(state)
    return model
