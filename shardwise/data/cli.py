"""``shardwise data prepare SRC OUT --tokenizer DIR|bytes``: the flags and the command's report."""

from __future__ import annotations

import argparse
import logging

__all__ = ["add_data_args", "run_data"]


def add_data_args(data: argparse.ArgumentParser) -> None:
    """``shardwise data``'s subcommands (``prepare``) on its parser."""
    from shardwise.data.prepare import PrepareOptions

    d = PrepareOptions(tokenizer="bytes")
    verbs = data.add_subparsers(dest="data_command", required=True, metavar="VERB")
    p = verbs.add_parser(
        "prepare", help="tokenize JSONL, Parquet, text or a saved dataset into memory-mapped shards",
        description="Tokenize SRC once, in parallel, into token shards in OUT with a manifest; "
        "`shardwise train --data OUT` memory-maps them. Interrupted, the same command resumes.",
    )
    p.add_argument("src", metavar="SRC",
                   help="a .jsonl/.json, .parquet or text file, a directory of them, or a save_to_disk directory")
    p.add_argument("out", metavar="OUT", help="the directory to write (shards, document index, manifest.json)")
    p.add_argument("--tokenizer", required=True, metavar="DIR|bytes",
                   help="a Transformers tokenizer directory (its eos_token ends each document), or 'bytes' "
                        "(UTF-8 bytes, the GPT presets' vocabulary)")
    p.add_argument("--text-field", default=d.text_field, metavar="NAME",
                   help="the column holding each document's text (default %(default)s)")
    p.add_argument("--held-out", type=float, default=d.held_out, metavar="F",
                   help="share of the documents (the last ones) kept for --eval-every (default %(default)s)")
    p.add_argument("--shard-bytes", type=int, default=d.shard_bytes, metavar="N",
                   help="about N bytes of source text per shard (default %(default)s)")
    p.add_argument("--workers", type=int, default=d.workers, metavar="N",
                   help="tokenizing processes (default: one per CPU core)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")


def run_data(args: argparse.Namespace) -> int:
    """Run ``shardwise data <verb>``; exit code 0, or ``SystemExit`` with the error's message."""
    from shardwise.data.prepare import PrepareOptions, prepare

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        opts = PrepareOptions(args.tokenizer, args.text_field, args.held_out, args.shard_bytes, args.workers)
        manifest = prepare(args.src, args.out, opts, show_progress=not args.quiet)
    except (ValueError, OSError, RuntimeError) as e:
        raise SystemExit(f"shardwise data prepare: {e}") from None
    counts = manifest.counts()
    print(f"prepared {args.out}: {counts['train']['tokens']} training tokens ({counts['train']['documents']} documents), "
          f"{counts['held_out']['tokens']} held out ({counts['held_out']['documents']}), {len(manifest.shards)} "
          f"{manifest.dtype} shard(s), vocabulary {manifest.vocab_size}")
    return 0
