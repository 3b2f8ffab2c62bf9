"""Transformers causal LMs for ``shardwise train``: ``--hf-config PATH`` and ``--hf-model DIR``.

``--hf-config`` builds a model from a local ``config.json`` (no download) with random
weights; ``--hf-model`` loads one from a local directory of safetensors weights, with its
tokenizer when the directory has one. Either way the model is built on the meta device,
sharded, and only then given memory: each parameter's full tensor exists one at a time,
initialised (``PreTrainedModel._init_weights``) or read from safetensors, and each rank
keeps only its shard of it (see :mod:`~shardwise.train.build`).

Data. With a tokenizer the corpus text is tokenised by it. Without one the corpus stays
bytes and byte ``b`` is token id ``b``: ids 0..255 of the model's vocabulary are used and
the rest never appear (a model of fewer than 256 ids is refused rather than clipped, which
would merge bytes into one id). A vocabulary of ids that no data uses costs a little
memory and nothing in quality for a from-scratch run; fine-tuning a pretrained model on
bytes would be meaningless, so ``--hf-model`` without a tokenizer logs a warning.

Blocks. Any causal LM Transformers builds: its blocks (the FSDP units) are the ModuleList of
the classes its ``_no_split_modules`` names, GPT-2's ``transformer.h`` as Llama's
``model.layers`` (:mod:`~shardwise.train.hf_blocks`).

Tensor parallelism is planned for the Llama family (:data:`TP_FAMILIES`), whose blocks
name their projections alike: ``q/k/v_proj`` and ``gate/up_proj`` column-wise, ``o_proj``
and ``down_proj`` row-wise (Megatron's split of heads and hidden units).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from shardwise.train.hf_blocks import find_blocks
from shardwise.train.pipeline import pruned, stage_blocks

__all__ = ["TP_FAMILIES", "PP_FAMILIES", "HFSpec", "HFStage", "config_path", "read_config_dict"]

logger = logging.getLogger(__name__)

TP_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
"""``model_type``s whose blocks have a tensor-parallel plan (:meth:`HFSpec.tp_plan`)."""

PP_FAMILIES = TP_FAMILIES
"""``model_type``s that ``--pp`` splits into stages (:meth:`HFSpec.stage_module`): their base
model's forward takes ``inputs_embeds`` as it is and runs ``embed_tokens``, ``layers``, ``norm``."""

DEFAULT_SEQ_LEN = 256
"""Sequence length when ``--seq-len`` is not given (capped by ``max_position_embeddings``)."""

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def config_path(path: str) -> Path:
    """The ``config.json`` that ``path`` names (the file, or a directory holding it); raises if absent."""
    p = Path(path)
    file = p / "config.json" if p.is_dir() else p
    if not file.is_file():
        raise FileNotFoundError(f"no Transformers config at {str(file)!r}; give a config.json or a directory holding one")
    return file


def read_config_dict(path: str) -> dict[str, Any]:
    """The JSON of :func:`config_path`, checked to name a ``model_type``."""
    file = config_path(path)
    d = json.loads(file.read_text())
    if "model_type" not in d:
        raise ValueError(f"{file} has no 'model_type'; Transformers cannot tell which model it describes")
    return d


def _load_config(d: dict[str, Any]):
    from transformers import AutoConfig

    d = dict(d)
    config = AutoConfig.for_model(d.pop("model_type"), **d)
    config.use_cache = False  # training: no KV cache built in every forward
    return config


class HFSpec:
    """A Transformers causal LM as a run sees it (the :class:`~shardwise.train.models.ModelSpec` of HF models)."""

    config: Any  # transformers.PretrainedConfig
    source: Path  # the config file, or the model directory of --hf-model
    weights_dir: Path | None  # --hf-model: where the safetensors are; None: random init
    tokenizer: Any  # a transformers tokenizer, or None (bytes are the tokens)
    seq_len: int

    def __init__(self, hf_config: str | None, hf_model: str | None, seq_len: int | None) -> None:
        path = hf_model if hf_model is not None else hf_config
        self.config = _load_config(read_config_dict(path))
        self.source = Path(path)
        self.weights_dir = Path(hf_model) if hf_model is not None else None
        self.tokenizer = self._load_tokenizer()
        max_len = getattr(self.config, "max_position_embeddings", None) or DEFAULT_SEQ_LEN
        self.seq_len = seq_len if seq_len is not None else min(DEFAULT_SEQ_LEN, max_len)

    def __repr__(self) -> str:
        return f"HFSpec({self.config.model_type}, {str(self.source)!r}, seq_len={self.seq_len})"

    def _load_tokenizer(self):
        if self.weights_dir is None or not any((self.weights_dir / f).exists() for f in _TOKENIZER_FILES):
            if self.weights_dir is not None:
                logger.warning("%s has no tokenizer: training on bytes as ids 0..255", self.weights_dir)
            return None
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(self.weights_dir))

    # ---- what the run needs of a model
    @property
    def vocab_size(self) -> int:
        return int(self.config.vocab_size)

    @property
    def n_layers(self) -> int:
        return int(self.config.num_hidden_layers)

    @property
    def dim(self) -> int:
        return int(self.config.hidden_size)

    def describe(self, n_params: int) -> str:
        return (f"{self.config.model_type} from {self.source} ({n_params / 1e6:.2f}M params, "
                f"{self.n_layers} layers, dim {self.dim})")

    def build(self) -> nn.Module:
        """The model, under whatever device context the caller set (meta for training)."""
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_config(self.config, dtype=torch.float32)

    def blocks(self, model: nn.Module) -> nn.ModuleList:
        """The FSDP units: the ModuleList of the classes ``_no_split_modules`` names (:mod:`~shardwise.train.hf_blocks`)."""
        return find_blocks(model)

    def logits(self, model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
        return model(input_ids=tokens).logits  # (B, T, vocab)

    def check_pp(self, n_stages: int) -> None:
        c = self.config
        if c.model_type not in PP_FAMILIES:
            raise ValueError(f"--pp: shardwise train splits {PP_FAMILIES} into pipeline stages, not "
                             f"model_type {c.model_type!r}; drop --pp")
        if getattr(c, "tie_word_embeddings", False):
            raise ValueError("--pp: the config ties its input embeddings and lm_head (tie_word_embeddings), "
                             "which would sit on the first and the last stage; untie them or drop --pp")
        if self.n_layers < n_stages:
            raise ValueError(f"--pp: the model has {self.n_layers} decoder layers, too few for {n_stages} "
                             "pipeline stages; use a smaller --pp or a single-stage --pp-schedule")

    def stage_module(self, model: nn.Module, keep: range, first: bool, last: bool) -> nn.Module:
        """A pipeline stage: :class:`HFStage` over a pruned copy of the base model (its layers of
        ``keep``, the embeddings when ``first``, the final norm when ``last``) and ``lm_head``."""
        prefix = model.base_model_prefix
        base = getattr(model, prefix)
        base = pruned(base, {"embed_tokens": base.embed_tokens if first else None,
                             "layers": stage_blocks(base.layers, keep),
                             "norm": base.norm if last else nn.Identity()})
        return HFStage(prefix, base, model.lm_head if last else None, first)

    def init_module(self, model: nn.Module, name: str, module: nn.Module) -> None:
        """Transformers' own initialisation of one module's direct parameters and buffers."""
        model._init_weights(module)

    def check_tp(self, tp: int) -> None:
        c = self.config
        if c.model_type not in TP_FAMILIES:
            raise ValueError(f"--tp: no tensor-parallel plan for model_type {c.model_type!r}; "
                             f"shardwise train plans {TP_FAMILIES}")
        sizes = {"num_attention_heads": c.num_attention_heads, "intermediate_size": c.intermediate_size,
                 "num_key_value_heads": getattr(c, "num_key_value_heads", None) or c.num_attention_heads}
        for field, n in sizes.items():
            if n % tp:
                raise ValueError(f"--tp {tp} must divide the config's {field}={n}")

    def tp_plan(self) -> dict[str, Any]:
        """Megatron's split inside one block: heads and MLP hidden units over the TP ranks."""
        col, row = ColwiseParallel, RowwiseParallel
        return {"self_attn.q_proj": col(), "self_attn.k_proj": col(), "self_attn.v_proj": col(),
                "self_attn.o_proj": row(), "mlp.gate_proj": col(), "mlp.up_proj": col(), "mlp.down_proj": row()}

    def flops_per_token(self, n_params: int) -> float:
        """6N for the matmuls of forward and backward, plus attention's 12 * layers * dim * seq_len."""
        embedding = self.vocab_size * self.dim
        return 6 * (n_params - embedding) + 12 * self.n_layers * self.dim * self.seq_len

    def card(self) -> dict[str, Any]:
        """JSON-able facts an export needs: the config (and where the tokenizer came from)."""
        return {"kind": "hf", "config": self.config.to_dict(),
                "tokenizer_dir": None if self.tokenizer is None else str(self.weights_dir)}

    # ---- data and weights
    def tokens(self, corpus: torch.Tensor) -> torch.Tensor:
        """The corpus (bytes) as this model's token ids: tokenised, or the bytes themselves."""
        if self.tokenizer is None:
            if self.vocab_size < 256:
                raise ValueError(f"vocab_size={self.vocab_size} < 256: bytes cannot be its tokens; "
                                 "use --hf-model DIR with a tokenizer, or a config with >= 256 ids")
            return corpus
        text = bytes(corpus.tolist()).decode("utf-8", errors="replace")
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return torch.tensor(ids, dtype=torch.int32)

    def weights(self) -> SafetensorsWeights | None:
        return None if self.weights_dir is None else SafetensorsWeights(self.weights_dir)


class HFStage(nn.Module):
    """One pipeline stage of a Transformers causal LM, under the model's own parameter names
    (``model.layers.3...``, ``lm_head.weight``).

    The first stage maps token ids to hidden states through the (pruned) base model, a later
    one maps hidden states to hidden states (``inputs_embeds``: the base model's embedding is
    not run), and the last also applies ``lm_head``: logits ``(B, T, vocab)``.
    """

    def __init__(self, prefix: str, base: nn.Module, lm_head: nn.Module | None, first: bool) -> None:
        super().__init__()
        self.prefix, self.first = prefix, first
        self.add_module(prefix, base)
        self.lm_head = lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        base = getattr(self, self.prefix)
        inputs = {"input_ids": x} if self.first else {"inputs_embeds": x}
        hidden = base(**inputs, use_cache=False).last_hidden_state
        return hidden if self.lm_head is None else self.lm_head(hidden)


class SafetensorsWeights:
    """Full tensors by parameter name from a directory of ``*.safetensors`` files, one at a time."""

    files: dict[str, Path]  # parameter name -> the file holding it

    def __init__(self, directory: Path) -> None:
        from safetensors import safe_open

        self.files = {}
        for file in sorted(directory.glob("*.safetensors")):
            with safe_open(str(file), framework="pt") as f:
                self.files.update((k, file) for k in f.keys())
        if not self.files:
            raise FileNotFoundError(f"--hf-model {directory}: no *.safetensors weights there")

    def __call__(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        if name not in self.files:
            raise KeyError(f"weight {name!r} is not in the safetensors of this model directory")
        with safe_open(str(self.files[name]), framework="pt") as f:
            return f.get_tensor(name)

    def __contains__(self, name: str) -> bool:
        return name in self.files


