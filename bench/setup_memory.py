"""Per-rank peak memory while ``shardwise train`` sets up a Transformers model, against the model's size.

``python -m bench.setup_memory [--ranks 4] [--layers 12] [--hidden 768] [--vocab 32000]`` builds a
Llama from a config on N gloo CPU ranks the way the job does (meta device, ``fully_shard`` per
block, then :func:`~shardwise.train.build.materialize`) and measures the peak live tensor bytes
of materialising with :class:`~shardwise.testing.memory.PeakMemory`. It prints each rank's
peak against the full model, one rank's share (full / N) and the largest single parameter
(the one full tensor set-up holds at a time); building the whole model first and sharding it
after would peak at the full size or more.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from shardwise.testing import run_on_ranks
from shardwise.testing.memory import PeakMemory
from shardwise.train import distributed
from shardwise.train.build import materialize, sharded_on_meta
from shardwise.train.config import TrainConfig
from shardwise.train.models import model_spec


def _peak_on_rank(cfg: TrainConfig) -> dict[str, int]:
    env = distributed.setup("cpu", num_threads=1)
    spec = model_spec(cfg)
    # a one-block model first fills DTensor's sharding-propagation caches (their fake-tensor
    # path and PeakMemory's dispatch mode do not nest); the measured model then runs cached
    small = TrainConfig(hf_config=_one_block(cfg.hf_config), seq_len=cfg.seq_len)
    materialize(sharded_on_meta(small, env, model_spec(small)), model_spec(small), env.device, 0)
    model = sharded_on_meta(cfg, env, spec)
    with PeakMemory() as memory:
        materialize(model, spec, env.device, cfg.seed)
    params = list(model.parameters())
    return {"peak": memory.peak_bytes, "full": sum(p.numel() * p.element_size() for p in params),
            "largest": max(p.numel() * p.element_size() for p in params)}


def _one_block(config_path: str) -> str:
    config = json.loads(Path(config_path).read_text())
    path = Path(config_path).with_name("one_block.json")
    path.write_text(json.dumps({**config, "num_hidden_layers": 1}))
    return str(path)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--vocab", type=int, default=32000)
    args = p.parse_args()
    config = {"model_type": "llama", "vocab_size": args.vocab, "hidden_size": args.hidden,
              "intermediate_size": args.hidden * 8 // 3 // 64 * 64, "num_hidden_layers": args.layers,
              "num_attention_heads": args.hidden // 64, "num_key_value_heads": args.hidden // 256 or 1,
              "max_position_embeddings": 256, "tie_word_embeddings": False}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "config.json"
        path.write_text(json.dumps(config))
        rows = run_on_ranks(_peak_on_rank, args.ranks, TrainConfig(hf_config=str(path), seq_len=64), timeout=1800)
    full, largest = rows[0]["full"], rows[0]["largest"]
    mb = 1e6
    print(f"Llama {config['num_hidden_layers']} layers, hidden {args.hidden}, vocab {args.vocab}: "
          f"{full / 4 / 1e6:.0f}M params, {full / mb:.0f} MB fp32; {args.ranks} ranks -> share {full / args.ranks / mb:.0f} MB, "
          f"largest parameter {largest / mb:.0f} MB")
    for rank, row in enumerate(rows):
        print(f"rank {rank}: set-up peak {row['peak'] / mb:.0f} MB = {row['peak'] / full:.2f} x the full model "
              f"(share + largest = {(full / args.ranks + largest) / mb:.0f} MB)")


if __name__ == "__main__":
    main()
