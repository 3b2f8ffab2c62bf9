"""The tokenizer of ``shardwise data prepare --tokenizer DIR|bytes``, and its identity.

``bytes``: one token per UTF-8 byte (vocabulary 256, the GPT presets'), the NUL byte as EOS.
``DIR``: a Transformers tokenizer directory (``tokenizer.json``, ``tokenizer_config.json``...),
loaded with ``AutoTokenizer.from_pretrained(DIR)``, local files only; its ``eos_token`` ends
every document, so it must have one.

The identity (:meth:`Encoder.identity`) goes into the manifest: the name, the vocabulary size
(``len(tokenizer)``, added tokens included), the EOS id and a sha256 of the vocabulary
(token -> id, sorted). Training compares it with the model's: a model whose ``vocab_size``
is smaller, or whose own tokenizer has another vocabulary, is refused before launch.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["BYTES", "Encoder", "vocab_sha256"]

BYTES = "bytes"
"""``--tokenizer bytes``: UTF-8 bytes are the ids."""

BYTES_EOS = 0
"""The EOS of the byte tokenizer: NUL, which text does not contain."""


def vocab_sha256(tokenizer: Any) -> str:
    """sha256 of a Transformers tokenizer's vocabulary (``get_vocab()``, sorted), or of the 256 bytes."""
    vocab = {str(i): i for i in range(256)} if tokenizer is None else tokenizer.get_vocab()
    return hashlib.sha256(json.dumps(sorted(vocab.items())).encode()).hexdigest()


class Encoder:
    """Text -> ids with an EOS after each document; picklable (a worker loads the tokenizer itself).

    ``name`` is :data:`BYTES` or a tokenizer directory; the tokenizer is loaded on first use,
    so a pool's workers each load their own copy.
    """

    name: str  # BYTES, or the absolute path of a tokenizer directory
    _tokenizer: Any  # the loaded Transformers tokenizer; None until first use (and for bytes)

    def __init__(self, name: str) -> None:
        if name != BYTES:
            path = Path(name)
            if not path.is_dir():
                raise FileNotFoundError(f"--tokenizer {name}: not a directory; pass a Transformers tokenizer "
                                        f"directory (tokenizer.json ...) or '{BYTES}'")
            name = str(path.resolve())
        self.name = name
        self._tokenizer = None

    def __repr__(self) -> str:
        return f"Encoder({self.name})"

    def __getstate__(self) -> dict:
        return {"name": self.name, "_tokenizer": None}

    @property
    def tokenizer(self) -> Any:
        """The Transformers tokenizer (``None`` for bytes), loaded once."""
        if self._tokenizer is None and self.name != BYTES:
            self._tokenizer = _load_tokenizer(self.name)
        return self._tokenizer

    @property
    def vocab_size(self) -> int:
        return 256 if self.name == BYTES else len(self.tokenizer)

    @property
    def eos_id(self) -> int:
        return BYTES_EOS if self.name == BYTES else int(self.tokenizer.eos_token_id)

    def identity(self) -> dict[str, Any]:
        """What the manifest records of the tokenizer (see the module docstring)."""
        return {"name": self.name, "vocab_size": self.vocab_size, "eos_id": self.eos_id,
                "vocab_sha256": vocab_sha256(self.tokenizer)}

    def encode(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """``(ids, lengths)``: every text's ids followed by the EOS id, concatenated (int64), and each
        document's length (EOS included)."""
        if self.name == BYTES:
            raw = [text.encode("utf-8") for text in texts]
            ids = np.frombuffer(b"\0".join(raw) + b"\0", dtype=np.uint8).astype(np.int64)  # NUL is the EOS
            return ids, np.fromiter((len(r) + 1 for r in raw), dtype=np.int64, count=len(raw))
        rows = self.tokenizer(texts, add_special_tokens=False)["input_ids"]
        lengths = np.fromiter((len(r) + 1 for r in rows), dtype=np.int64, count=len(rows))
        eos = [self.eos_id]
        ids = np.fromiter(itertools.chain.from_iterable(r + eos for r in rows), dtype=np.int64, count=int(lengths.sum()))
        return ids, lengths


def _load_tokenizer(directory: str) -> Any:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # the pool's processes are the parallelism
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"--tokenizer {directory}: Transformers cannot load a tokenizer from it ({e})") from None
    if tokenizer.eos_token_id is None:
        raise ValueError(f"--tokenizer {directory}: the tokenizer has no eos_token to put between documents; "
                         "set \"eos_token\" in its tokenizer_config.json")
    return tokenizer
