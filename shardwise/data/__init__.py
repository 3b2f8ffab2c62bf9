"""Tokenized corpora for training: ``shardwise data prepare`` writes them, ``shardwise train --data DIR`` reads them.

- :mod:`~shardwise.data.sources` — the source text (JSONL, Parquet, text, ``save_to_disk``) through ``datasets``.
- :mod:`~shardwise.data.encoders` — the tokenizer (``bytes`` or a Transformers directory) and its identity.
- :mod:`~shardwise.data.shards` — one shard written so that it appears whole; the resume check.
- :mod:`~shardwise.data.prepare` — the plan, the worker pool and progress bar, the manifest last.
- :mod:`~shardwise.data.manifest` — the directory's layout and ``manifest.json``.
- :mod:`~shardwise.data.permutation` — a seeded permutation evaluated pointwise (the global window order).
- :mod:`~shardwise.data.windows` — memory-mapped token streams and the resumable window sampler.

Nothing here imports :mod:`shardwise.train`; the trainer imports this package.
"""

from shardwise.data.manifest import Manifest, is_prepared, read_manifest
from shardwise.data.prepare import PrepareOptions, prepare
from shardwise.data.windows import TokenStream, WindowSampler

__all__ = ["Manifest", "PrepareOptions", "TokenStream", "WindowSampler", "is_prepared", "prepare", "read_manifest"]
