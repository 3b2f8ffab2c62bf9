"""Small configs of Transformers' causal-LM families, for tests and stress launches (no network).

Each is a ``config.json`` dict of about 30-70 K parameters: hidden size 32, 2 layers, 4
heads, a 256-id vocabulary (the bytes), 64 positions. The common fields go to every family
(Transformers maps ``hidden_size`` and the like onto GPT-2's or Bloom's own names); a few
families need more (:data:`EXTRA`)::

    write_config(tmp_path, "gpt2")     # tmp_path/gpt2/config.json
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["COMMON", "EXTRA", "FAMILIES", "tiny_config", "write_config"]

COMMON: dict[str, Any] = {
    "vocab_size": 256, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
    "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
}

EXTRA: dict[str, dict[str, Any]] = {
    "gpt2": {"n_inner": 64},
    "opt": {"ffn_dim": 64, "word_embed_proj_dim": 32},
    "falcon": {"new_decoder_architecture": True},  # grouped KV heads (Falcon-40B/180B); False: multi-query
    "gemma": {"head_dim": 8},
    "gemma2": {"head_dim": 8},
    "qwen3": {"head_dim": 8},
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
    "qwen3_moe": {"head_dim": 8, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32},
}

FAMILIES = ("gpt2", "gpt_neox", "opt", "falcon", "bloom", "phi", "phi3", "gemma", "gemma2", "qwen2", "qwen3",
            "mistral", "mixtral", "qwen3_moe", "llama")
"""The ``model_type``\\ s ``shardwise train`` is tested on."""


def tiny_config(family: str, **overrides: Any) -> dict[str, Any]:
    """The small ``config.json`` dict of ``family`` (a ``model_type``), with ``overrides``."""
    return {"model_type": family, **COMMON, **EXTRA.get(family, {}), **overrides}


def write_config(directory: Path, family: str, **overrides: Any) -> Path:
    """:func:`tiny_config` as ``directory/<family>/config.json``; returns that directory."""
    out = Path(directory) / family
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(tiny_config(family, **overrides)))
    return out
