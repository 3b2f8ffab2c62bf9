"""``shardwise data prepare``: every source kind and tokenizer, the shards and manifest, bad input, resume.

Corpora are a few hundred tiny documents written by the tests; the tokenizer is a small BPE
trained here with the ``tokenizers`` library (no network). The token stream of a prepared
directory is checked against the tokenizer run by hand: each document's ids and an EOS.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from shardwise import cli
from shardwise.data import shards
from shardwise.data.encoders import Encoder
from shardwise.data.manifest import read_manifest, sha256_file, shard_paths
from shardwise.data.permutation import permute
from shardwise.data.prepare import PrepareOptions, plan_rows, prepare
from shardwise.data.sources import SourceError
from shardwise.data.windows import TokenStream, WindowSampler

datasets = pytest.importorskip("datasets")

DOCS = [f"document {i}: " + "lorem ipsum dolor " * (i % 7) + "é" * (i % 3) for i in range(120)]


def write_jsonl(path: Path, docs=DOCS, field: str = "text") -> Path:
    path.write_text("".join(json.dumps({field: d, "id": i}) + "\n" for i, d in enumerate(docs)))
    return path


def make_tokenizer(root: Path, eos: bool = True) -> Path:
    """A byte-level BPE of ~300 ids trained on DOCS, saved as a Transformers tokenizer directory."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(DOCS, trainer)
    out = root / ("tokenizer" if eos else "tokenizer-no-eos")
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", **({"eos_token": "</s>"} if eos else {})
                            ).save_pretrained(out)
    return out


def expected_stream(encoder: Encoder, docs: list[str]) -> np.ndarray:
    """Each document tokenized on its own, then its EOS."""
    return np.concatenate([np.append(encoder.encode([d])[0][:-1], encoder.eos_id) for d in docs])


def all_tokens(out: Path) -> np.ndarray:
    """Training then held-out tokens of a prepared directory, in order."""
    parts = [TokenStream.open(out, split) for split in ("train", "held_out")]
    return np.concatenate([s.read(0, len(s)) for s in parts])


def opts(tokenizer: str, **kw) -> PrepareOptions:
    return PrepareOptions(tokenizer, **{"workers": 1, "shard_bytes": 600, "held_out": 0.05, **kw})


# ---- sources and tokenizers


def test_jsonl_with_a_local_tokenizer_in_worker_processes(tmp_path):
    tokenizer = make_tokenizer(tmp_path)
    out = tmp_path / "out"
    manifest = prepare(write_jsonl(tmp_path / "c.jsonl"), out, opts(str(tokenizer), workers=2), show_progress=False)
    encoder = Encoder(str(tokenizer))
    np.testing.assert_array_equal(all_tokens(out), expected_stream(encoder, DOCS))
    assert manifest.dtype == "uint16" and manifest.vocab_size == len(encoder.tokenizer) == 300
    assert manifest.tokenizer["eos_id"] == encoder.tokenizer.convert_tokens_to_ids("</s>")
    assert manifest.counts()["held_out"]["documents"] == 6 and len(manifest.shards) > 4
    for shard in manifest.shards:  # checksums, and the document index: each document ends with EOS
        bin_path, idx_path, _ = shard_paths(out, shard.index)
        assert sha256_file(bin_path) == shard.sha256
        tokens, starts = np.fromfile(bin_path, dtype=np.uint16), np.load(idx_path)
        assert len(starts) == shard.documents and starts[0] == 0
        assert (tokens[starts[1:] - 1] == manifest.tokenizer["eos_id"]).all() and tokens[-1] == manifest.tokenizer["eos_id"]
    assert not (out / ".datasets-cache").exists()


@pytest.mark.parametrize("kind", ["parquet", "text", "save_to_disk", "directory"])
def test_parquet_text_files_saved_dataset_and_directories_as_bytes(tmp_path, kind):
    src = tmp_path / "src"
    if kind == "parquet":
        datasets.Dataset.from_dict({"body": DOCS}).to_parquet(str(src.with_suffix(".parquet")))
        src, field, docs = src.with_suffix(".parquet"), "body", DOCS
    elif kind == "text":  # each file is one document
        src.mkdir()
        for i, d in enumerate(DOCS[:20]):
            (src / f"{i:03d}.txt").write_text(d)
        field, docs = "text", DOCS[:20]
    elif kind == "save_to_disk":
        datasets.DatasetDict({"train": datasets.Dataset.from_dict({"content": DOCS})}).save_to_disk(str(src))
        field, docs = "content", DOCS
    else:  # two JSONL files, read in sorted order
        src.mkdir()
        write_jsonl(src / "a.jsonl", DOCS[:50])
        write_jsonl(src / "b.jsonl", DOCS[50:])
        field, docs = "text", DOCS
    manifest = prepare(src, tmp_path / "out", opts("bytes", text_field=field), show_progress=False)
    np.testing.assert_array_equal(all_tokens(tmp_path / "out"), expected_stream(Encoder("bytes"), docs))
    assert manifest.tokenizer["name"] == "bytes" and manifest.vocab_size == 256 and manifest.tokenizer["eos_id"] == 0


def test_a_vocabulary_past_uint16_is_stored_as_uint32(tmp_path):
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(70_000)} | {"</s>": 70_000, "<unk>": 70_001}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    from tokenizers import pre_tokenizers

    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", unk_token="<unk>").save_pretrained(tmp_path / "big")
    src = write_jsonl(tmp_path / "c.jsonl", ["w1 w69999 w5", "w65536 w2"])
    manifest = prepare(src, tmp_path / "out", opts(str(tmp_path / "big"), held_out=0), show_progress=False)
    assert manifest.dtype == "uint32"
    np.testing.assert_array_equal(all_tokens(tmp_path / "out"), [1, 69999, 5, 70_000, 65536, 2, 70_000])


# ---- bad input


def test_each_bad_input_is_a_clear_error_naming_the_file_field_or_tokenizer(tmp_path):
    good = write_jsonl(tmp_path / "good.jsonl")
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"text": "fine"}\nthis is not json\n')
    with pytest.raises(SourceError, match=f"{broken}: not readable as json"):
        prepare(broken, tmp_path / "o1", opts("bytes"), show_progress=False)
    junk = tmp_path / "junk.parquet"
    junk.write_bytes(b"not a parquet file at all")
    with pytest.raises(SourceError, match=f"{junk}: not readable as parquet"):
        prepare(junk, tmp_path / "o2", opts("bytes"), show_progress=False)
    with pytest.raises(SourceError, match=r"no text field 'body' \(columns: text, id\); pass --text-field"):
        prepare(good, tmp_path / "o3", opts("bytes", text_field="body"), show_progress=False)
    with pytest.raises(SourceError, match="nowhere.jsonl: no such file"):
        prepare(tmp_path / "nowhere.jsonl", tmp_path / "o4", opts("bytes"), show_progress=False)
    with pytest.raises(FileNotFoundError, match="--tokenizer .*missing: not a directory"):
        prepare(good, tmp_path / "o5", opts(str(tmp_path / "missing")), show_progress=False)
    with pytest.raises(ValueError, match="has no eos_token"):
        prepare(good, tmp_path / "o6", opts(str(make_tokenizer(tmp_path, eos=False))), show_progress=False)
    numbers = write_jsonl(tmp_path / "numbers.jsonl", [1, 2, 3])
    with pytest.raises(ValueError, match="row 0 of the source: field 'text' is int, not text"):
        prepare(numbers, tmp_path / "o7", opts("bytes", held_out=0), show_progress=False)
    with pytest.raises(SystemExit, match="shardwise data prepare: .*no text field 'body'"):
        cli.main(["data", "prepare", str(good), str(tmp_path / "o8"), "--tokenizer", "bytes", "--text-field", "body", "-q"])


# ---- interruption and resume

def _interrupt(out: Path, src: Path, workers: int, monkeypatch) -> None:
    """Stop a prepare in the middle of shard 3: Ctrl-C in the one process, or SIGKILL of a pool worker."""
    if workers == 1:
        def ctrl_c(point: str, step: int, rank: int) -> None:
            if point == "prepare_mid_shard" and step == 3:
                raise KeyboardInterrupt

        monkeypatch.setattr(shards, "maybe_kill", ctrl_c)
        with pytest.raises(KeyboardInterrupt):
            prepare(src, out, opts("bytes", workers=1), show_progress=False)
        assert (out / ".shard-00003.bin.tmp").exists()  # half written, under a name nothing reads
    else:
        monkeypatch.setenv("SHARDWISE_FAULT", "prepare_mid_shard@3")
        with pytest.raises(RuntimeError, match="a tokenizing worker died .* run the same command again"):
            prepare(src, out, opts("bytes", workers=2), show_progress=False)
    monkeypatch.undo()


@pytest.mark.parametrize("workers", [1, 2])
def test_an_interrupted_prepare_leaves_no_shard_looking_complete_and_the_rerun_finishes_it(tmp_path, workers,
                                                                                          monkeypatch):
    src, out = write_jsonl(tmp_path / "c.jsonl"), tmp_path / "out"
    _interrupt(out, src, workers, monkeypatch)
    assert not (out / "manifest.json").exists()
    with pytest.raises(FileNotFoundError, match="did not finish; run the same command again"):
        read_manifest(out)
    receipts = {int(p.name[6:11]): json.loads(p.read_text())["shard"] for p in out.glob("shard-*.json")}
    assert receipts and 3 not in receipts and not shard_paths(out, 3)[0].exists()
    for index, shard in receipts.items():  # every visible receipt describes a whole, correct shard
        assert sha256_file(shard_paths(out, index)[0]) == shard["sha256"]
    kept = {i: shard_paths(out, i)[0].stat().st_mtime_ns for i in receipts}
    first = min(receipts)
    shard_paths(out, first)[0].write_bytes(b"\0\0")  # damage one finished shard: it must be rewritten
    prepare(src, out, opts("bytes", workers=workers), show_progress=False)
    np.testing.assert_array_equal(all_tokens(out), expected_stream(Encoder("bytes"), DOCS))
    for i, mtime in kept.items():
        assert (shard_paths(out, i)[0].stat().st_mtime_ns == mtime) == (i != first), i
    assert not list(out.glob(".*tmp"))


def test_rerunning_a_finished_directory_keeps_it_and_another_source_is_refused(tmp_path):
    src, out = write_jsonl(tmp_path / "c.jsonl"), tmp_path / "out"
    first = prepare(src, out, opts("bytes"), show_progress=False)
    assert prepare(src, out, opts("bytes"), show_progress=False) == first
    with pytest.raises(FileExistsError, match="already holds a prepared corpus of another source"):
        prepare(write_jsonl(tmp_path / "d.jsonl", DOCS[:30]), out, opts("bytes"), show_progress=False)


# ---- the plan, the permutation and the window order


def test_plan_holds_out_the_last_documents_and_covers_every_row_once():
    plan = plan_rows(100, 10_000, 0.05, 1000)
    assert [p for p in plan if p[0] == "held_out"] == [("held_out", 95, 100)]
    rows = [r for _, a, b in plan for r in range(a, b)]
    assert rows == list(range(100)) and all(b - a == 10 for s, a, b in plan if s == "train" and b < 95)
    with pytest.raises(ValueError, match="1 document"):
        plan_rows(1, 10, 0.5, 10)


@pytest.mark.parametrize("n", [1, 2, 7, 1000, 4099])
def test_permutation_is_a_bijection_per_epoch_and_epochs_differ(n):
    idx = np.arange(n)
    for epoch in (0, 1):
        assert sorted(permute(idx, n, seed=3, epoch=epoch)) == list(range(n))
    if n > 7:
        assert (permute(idx, n, 3, 0) != permute(idx, n, 3, 1)).any()
        assert (permute(idx, n, 3, 0) != idx).mean() > 0.9


def test_windows_are_one_global_order_whatever_the_world_size(tmp_path):
    out = tmp_path / "out"
    prepare(write_jsonl(tmp_path / "c.jsonl"), out, opts("bytes"), show_progress=False)
    stream = TokenStream.open(out)
    assert all(isinstance(s, np.memmap) for s in stream.shards)

    def steps(world: int, batch: int, n_steps: int, state: dict | None = None) -> list[np.ndarray]:
        samplers = [WindowSampler(stream, batch, 16, seed=1, rank=r, world_size=world) for r in range(world)]
        if state is not None:
            for s in samplers:
                s.load_state_dict(state)
        out = []
        for _ in range(n_steps):
            out.append(np.concatenate([s.next_batch()[0].numpy() for s in samplers]))  # the global batch
        return out, samplers[0].state_dict()

    ref, _ = steps(2, 4, 60)  # past an epoch: the stream holds fewer than 480 windows
    assert ref[0].shape == (8, 16)
    head, state = steps(2, 4, 25)
    tail, _ = steps(4, 2, 35, state)  # 4 ranks resume what 2 saved
    for a, b in zip(ref, head + tail):
        np.testing.assert_array_equal(a, b)
    x, y = WindowSampler(stream, 3, 16, seed=1).next_batch()
    np.testing.assert_array_equal(x[:, 1:], y[:, :-1])
    with pytest.raises(ValueError, match="resume with the same --data, --seq-len and --seed"):
        WindowSampler(stream, 4, 32, seed=1).load_state_dict(state)


def _private_rss_bytes() -> int:
    """This process's resident anonymous memory (``RssAnon``): what it holds itself, page cache excluded."""
    line = next(l for l in Path("/proc/self/status").read_text().splitlines() if l.startswith("RssAnon:"))
    return int(line.split()[1]) * 1024


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads Linux's /proc")
def test_sampling_holds_no_copy_of_the_corpus(tmp_path):
    """Mapped pages of the shards that windows touched count in RSS as shared page cache (a fault
    may map a whole large folio of the file); the process's own memory does not grow with the corpus."""
    src = tmp_path / "big.jsonl"
    lines = "".join(json.dumps({"text": " ".join(f"w{(i * 7919 + j) % 5003}" for j in range(400))}) + "\n"
                    for i in range(1000))
    src.write_text(lines * 9)  # ~20 MB of text: ~40 MB of uint16 tokens
    out = tmp_path / "out"
    prepare(src, out, opts("bytes", shard_bytes=8 << 20, held_out=0.0), show_progress=False)
    before = _private_rss_bytes()
    stream = TokenStream.open(out)
    sampler = WindowSampler(stream, 8, 128, seed=0)
    for _ in range(50):
        sampler.next_batch()
    corpus = sum(s.nbytes for s in stream.shards)
    assert isinstance(stream.shards[0], np.memmap)
    assert corpus > 35e6 and _private_rss_bytes() - before < 0.05 * corpus, (corpus, _private_rss_bytes() - before)
