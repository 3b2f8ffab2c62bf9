"""``shardwise train`` on Transformers models, with every parallelism knob, TensorBoard, and the export.

- Done-when: a small Llama built from a config trains on 4 gloo ranks with
  ``--replicate 2 --ac full --grad-accum 2 --clip-norm 1 --tensorboard --checkpoint-dir``,
  resumes bit-identically (every step's loss and grad norm ``==`` the uninterrupted run's),
  its TensorBoard events open in TensorBoard's own reader, and ``shardwise export`` gives a
  directory ``AutoModelForCausalLM.from_pretrained`` loads with logits equal to the trained
  sharded model's.
- ``--tp 2`` (a GPT preset and a Llama) and ``--compile``: every step equal to ``--impl torch``
  on the same seed, and TP within fp32 tolerance of the same model without TP.
- ``--float8`` (a GPT preset in fp32, a Llama in bf16): every step's loss and the final local
  shards equal ``--impl torch``'s; the blocks' weights are all-gathered in float8 (bytes by
  dtype), and after each optimizer step one all-reduce precomputes every weight's scale; the
  float8 model is materialised with the plain model's weights.
- ``--grad-accum`` reduces once per step; set-up peak memory stays near one rank's share.
- Bad input fails in the CLI before any rank is launched.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from shardwise import cli
from shardwise.testing import run_on_ranks
from shardwise.testing.memory import PeakMemory
from shardwise.train import distributed
from shardwise.train.build import materialize, sharded_on_meta
from shardwise.train.config import TrainConfig, TrainResult
from shardwise.train.float8 import convert_to_float8
from shardwise.train.export import export_checkpoint, load_gpt
from shardwise.train import loop
from shardwise.train.loop import restore_model, train
from shardwise.train.metrics import read_metrics
from shardwise.train.models import model_spec
from shardwise.train.summary import summary_lines

TIMEOUT = 180
LLAMA = {"model_type": "llama", "vocab_size": 256, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
         "tie_word_embeddings": False}
BASE = dict(steps=4, batch_size=4, seq_len=16, data_bytes=20_000, lr=3e-3)


@pytest.fixture
def llama_config(tmp_path) -> str:
    path = tmp_path / "llama" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(LLAMA))
    return str(path)


def _env(fields: dict) -> distributed.DistEnv:
    return distributed.setup("cpu", num_threads=1, replicate=fields.get("replicate", 1), tp=fields.get("tp", 1))


def _train_on_rank(fields: dict) -> TrainResult:
    return train(TrainConfig(**fields), _env(fields))


def train_keeping_model(cfg: TrainConfig, env: distributed.DistEnv) -> tuple[TrainResult, nn.Module]:
    """:func:`train`, and the trained (sharded) model, kept as the loop builds it."""
    built, build = [], loop.build_model
    with mock.patch.object(loop, "build_model", lambda *args: built.append(build(*args)) or built[0]):
        result = train(cfg, env)
    return result, built[0]


def _logits_on_rank(fields: dict, tokens: torch.Tensor) -> torch.Tensor:
    """The trained sharded model's logits (restored from its newest checkpoint)."""
    cfg = TrainConfig(**fields)
    env = _env(fields)
    model = restore_model(cfg, env)
    with torch.no_grad():
        return model_spec(cfg).logits(model, tokens)


def _curve(path: Path, key: str) -> dict[int, float]:
    return {step: record[key] for step, record in read_metrics(path).items()}


def _scalars(directory: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing import event_accumulator

    acc = event_accumulator.EventAccumulator(str(directory))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


# ---------------------------------------------------------------- done when


def test_llama_hsdp_trains_resumes_bit_identically_and_exports_to_transformers(tmp_path, llama_config):
    from transformers import AutoModelForCausalLM

    knobs = dict(hf_config=llama_config, replicate=2, ac="full", grad_accum=2, clip_norm=1.0, eval_every=2, **BASE)
    ref, resumed, tb = tmp_path / "ref.jsonl", tmp_path / "resumed.jsonl", tmp_path / "tb"
    run_on_ranks(_train_on_rank, 4, {**knobs, "metrics": str(ref)}, timeout=TIMEOUT)
    ckpt = dict(checkpoint_dir=str(tmp_path / "ckpt"), tensorboard=str(tb), metrics=str(resumed))
    first = run_on_ranks(_train_on_rank, 4, {**knobs, **ckpt, "stop_after": 2}, timeout=TIMEOUT)
    second = run_on_ranks(_train_on_rank, 4, {**knobs, **ckpt, "resume": True}, timeout=TIMEOUT)
    assert second[0].resumed_from == 2 and first[0].steps == second[0].steps == 2
    for key in ("loss", "grad_norm", "lr"):  # bit-identical: == on floats, every step
        assert _curve(resumed, key) == _curve(ref, key) and len(_curve(ref, key)) == 4, key
    assert all(g > 1.0 for g in _curve(ref, "grad_norm").values())  # the clip was active

    scalars = _scalars(tb)  # TensorBoard's own reader; the resumed run appended steps 3-4
    for tag in ("train/loss", "train/lr", "train/grad_norm", "train/tokens_per_s", "train/step_s",
                "train/peak_memory_gb", "train/wire_mb"):
        assert [s for s, _ in scalars[tag]] == [1, 2, 3, 4], tag
    assert [v for _, v in scalars["train/loss"]] == pytest.approx(list(_curve(ref, "loss").values()))
    assert all(v > 0 for _, v in scalars["train/wire_mb"])
    assert [s for s, _ in scalars["eval/loss"]] == [2, 4]

    result = export_checkpoint(tmp_path / "ckpt", tmp_path / "hf", max_shard_bytes=60_000)
    assert result.step == 4 and result.n_files > 1  # several shards and an index
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    sharded = run_on_ranks(_logits_on_rank, 4, {**knobs, **ckpt, "tensorboard": None}, tokens, timeout=TIMEOUT)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    with torch.no_grad():
        exported = hf(input_ids=tokens).logits
    assert torch.equal(exported, sharded[0]) and torch.equal(sharded[0], sharded[3])


def test_gpt_preset_with_tp_resumes_bit_identically_and_exports_a_state_dict_and_config(tmp_path):
    ref, resumed = tmp_path / "ref.jsonl", tmp_path / "resumed.jsonl"
    fields = dict(model="nano", tp=2, **BASE)
    run_on_ranks(_train_on_rank, 2, {**fields, "metrics": str(ref)}, timeout=TIMEOUT)
    fields.update(checkpoint_dir=str(tmp_path / "ckpt"), metrics=str(resumed))
    run_on_ranks(_train_on_rank, 2, {**fields, "stop_after": 2}, timeout=TIMEOUT)
    run_on_ranks(_train_on_rank, 2, {**fields, "resume": True}, timeout=TIMEOUT)
    assert _curve(resumed, "loss") == _curve(ref, "loss") and len(_curve(ref, "loss")) == 4
    assert cli.main(["export", str(tmp_path / "ckpt"), str(tmp_path / "out")]) == 0
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    sharded = run_on_ranks(_logits_on_rank, 2, fields, tokens, timeout=TIMEOUT)
    with torch.no_grad():  # TP sums row-wise partial products in another order than one matmul
        torch.testing.assert_close(load_gpt(tmp_path / "out")(tokens), sharded[0], rtol=1e-5, atol=1e-5)


def _pretrained_dir(root: Path) -> Path:
    """A local Transformers model directory: random Llama weights (safetensors) and a small BPE tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

    out = root / "pretrained"
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["def foo(x):\n    return x + 1\n" * 50, "import os\nclass A: pass\n" * 50], trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>").save_pretrained(out)
    config = AutoConfig.for_model(**{**LLAMA, "vocab_size": 320})
    torch.manual_seed(5)
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    return out


def _loaded_on_rank(fields: dict) -> dict[str, torch.Tensor]:
    from shardwise.train.build import build_sharded

    cfg = TrainConfig(**fields)
    model = build_sharded(cfg, _env(fields), model_spec(cfg))
    return {name: p.full_tensor() for name, p in model.named_parameters()}


def test_hf_model_dir_loads_its_weights_trains_on_its_tokenizer_and_exports_it(tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    src = _pretrained_dir(tmp_path)
    fields = dict(hf_model=str(src), **{**BASE, "steps": 1}, checkpoint_dir=str(tmp_path / "ckpt"))
    loaded = run_on_ranks(_loaded_on_rank, 2, fields, timeout=TIMEOUT)[0]
    saved = load_file(src / "model.safetensors")
    assert loaded.keys() == saved.keys() and all(torch.equal(loaded[k], saved[k]) for k in saved)
    run_on_ranks(_train_on_rank, 2, fields, timeout=TIMEOUT)
    export_checkpoint(tmp_path / "ckpt", tmp_path / "out")
    text = "def foo(x): return x"
    assert AutoTokenizer.from_pretrained(tmp_path / "out")(text)["input_ids"] == \
        AutoTokenizer.from_pretrained(src)(text)["input_ids"]


# ---------------------------------------------------------------- parity with torch's FSDP2


def _losses(fields: dict, world: int) -> list[list[float]]:
    return [r.losses for r in run_on_ranks(_train_on_rank, world, fields, timeout=TIMEOUT)]


@pytest.mark.parametrize("model,replicate", [("gpt", 1), ("llama", 1), ("gpt", 2)])
def test_tp2_matches_torch_and_the_model_without_tp(model, replicate, llama_config):
    """(dp 2, tp 2) meshes, and (dp_replicate 2, dp_shard 1, tp 2): HSDP with TP inside."""
    fields = {**BASE, "steps": 3, "clip_norm": 1.0, **({"model": "nano"} if model == "gpt" else {"hf_config": llama_config})}
    ours = _losses({**fields, "tp": 2, "replicate": replicate}, 4)
    torch_fsdp = _losses({**fields, "tp": 2, "replicate": replicate, "impl": "torch"}, 4)
    assert ours == torch_fsdp  # bit-equal, every step on every rank
    assert ours[0] == ours[1] and ours[0] != ours[2]  # a TP pair shares its batch; dp ranks differ
    without_tp = _losses({**fields, "batch_size": BASE["batch_size"]}, 2)
    assert ours[0] == pytest.approx(without_tp[0], rel=1e-5) and ours[2] == pytest.approx(without_tp[1], rel=1e-5)


def test_compile_matches_torch_and_eager(tmp_path):
    fields = {**BASE, "steps": 3, "model": "nano", "compile": True, "compile_backend": "aot_eager"}
    ours = _losses({**fields, "report": str(tmp_path / "report")}, 2)  # composes with the step report
    assert (tmp_path / "report" / "summary.json").is_file()
    assert ours == _losses({**fields, "impl": "torch"}, 2)
    eager = _losses({**fields, "compile": False}, 2)
    for rank in range(2):
        assert ours[rank] == pytest.approx(eager[rank], rel=1e-5)


def test_offload_int_reshard_selective_ac_bf16_match_torch():
    fields = {**BASE, "steps": 3, "model": "nano", "cpu_offload": True, "reshard_after_forward": 2,
              "ac": "selective", "mixed_precision": "bf16"}
    assert _losses(fields, 4) == _losses({**fields, "impl": "torch"}, 4)


class _AmaxReduces(TorchDispatchMode):
    """Counts functional all-reduces: torchao's amax reductions, one per weight in each float8
    pre-all-gather without a precomputed scale (a precompute's own all-reduce runs inside
    DTensor's dispatch, which this mode does not see)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func is torch.ops._c10d_functional.all_reduce.default
        return func(*args, **(kwargs or {}))


FLOAT8_WEIGHT = "WeightWithDynamicFloat8CastTensor"


def _float8_on_rank(fields: dict) -> dict:
    """The run's losses, amax all-reduces and all-gather bytes by dtype; the trained model's local
    shards (with their type); each float8 weight's precomputed scale against the scale of its full
    tensor's amax; and the bytes one all-gather of every block moves with float8 weights."""
    from torchao.float8.float8_utils import tensor_to_scale

    cfg, env = TrainConfig(**fields), _env(fields)
    with _AmaxReduces() as reduces:
        result, model = train_keeping_model(cfg, env)
    shards = {n: (type(p.to_local()).__name__, p.to_local()) for n, p in model.named_parameters()}
    scales = [(p._local_tensor._precomputed_scale, tensor_to_scale(p.full_tensor(), torch.float8_e4m3fn))
              for n, p in model.named_parameters() if shards[n][0] == FLOAT8_WEIGHT]
    bf16 = cfg.mixed_precision == "bf16"
    block_bytes = env.dp_size * sum(  # all-gather output: every dp rank's shard
        p.to_local().numel() * (1 if type(p.to_local()).__name__ == FLOAT8_WEIGHT else 2 if bf16 else 4)
        for p in model_spec(cfg).blocks(model).parameters())
    return dict(losses=result.losses, reduces=reduces.count, gathered=result.comm and result.comm.bytes_by_dtype(
        "all_gather"), shards=shards, scales=scales, block_bytes=block_bytes)


def _assert_float8_run_equals(mine: dict, ref: dict, steps: int) -> set[str]:
    """A rank's float8 run against torch's, bit for bit; the names of its float8 weights."""
    assert mine["losses"] == ref["losses"]  # bit-equal, every step
    assert mine["shards"].keys() == ref["shards"].keys()
    for name, (kind, local) in mine["shards"].items():
        assert kind == ref["shards"][name][0] and torch.equal(local, ref["shards"][name][1]), name
    float8 = {n for n, (kind, _) in mine["shards"].items() if kind == FLOAT8_WEIGHT}
    matrices = {n for n, (_, local) in mine["shards"].items() if local.dim() == 2}
    assert float8 == {n for n in matrices if "layers." in n}, float8  # the blocks' linears: not the head
    # blocks gathered in forward and again in backward; float8 weights as 1 byte, norms (and
    # biases) in the parameter dtype: a group of mixed dtypes moves bytes (uint8)
    assert mine["gathered"][torch.uint8] == 2 * steps * mine["block_bytes"], mine["gathered"]
    return float8


@pytest.mark.parametrize("model,precision", [("gpt", "none"), ("llama", "bf16")])
def test_float8_matches_torch_gathers_float8_and_precomputes_scales(llama_config, model, precision):
    steps = 2  # step 1 casts with each weight's own amax; step 2 with the scales precomputed after step 1
    fields = {**BASE, "steps": steps, "float8": True, "mixed_precision": precision,
              **({"model": "nano"} if model == "gpt" else {"hf_config": llama_config})}
    ours = run_on_ranks(_float8_on_rank, 2, fields, timeout=TIMEOUT)
    theirs = run_on_ranks(_float8_on_rank, 2, {**fields, "impl": "torch"}, timeout=TIMEOUT)
    assert ours[0]["losses"] != ours[1]["losses"]  # the ranks' batches differ
    for mine, ref in zip(ours, theirs):
        float8 = _assert_float8_run_equals(mine, ref, steps)
        # the scales precomputed after the last step are those of the weights' amax now...
        assert len(mine["scales"]) == len(float8)
        assert all(got is not None and torch.equal(got, want) for got, want in mine["scales"]), mine["scales"]
        # ...and the gathers of every step but the first reuse them: only step 1 (forward and
        # backward) reduces each weight's amax, where without the precompute every step would
        assert mine["reduces"] == 2 * len(float8) == ref["reduces"], mine["reduces"]


def test_float8_with_tp_matches_torch(llama_config):
    """(dp 2, tp 2): torchao's float8 TP styles split the Llama's float8 linears, FSDP shards them over dp."""
    fields = {**BASE, "steps": 2, "float8": True, "tp": 2, "hf_config": llama_config}
    ours = run_on_ranks(_float8_on_rank, 4, fields, timeout=TIMEOUT)
    theirs = run_on_ranks(_float8_on_rank, 4, {**fields, "impl": "torch"}, timeout=TIMEOUT)
    assert ours[0]["losses"] == ours[1]["losses"] != ours[2]["losses"]  # a TP pair shares its batch
    for mine, ref in zip(ours, theirs):
        _assert_float8_run_equals(mine, ref, 2)


def test_float8_model_is_materialised_with_the_weights_of_the_plain_one(llama_config):
    """The shards of a float8 weight (a DTensor around torchao's subclass) get the same values
    from the seed, through the subclass's own ``copy_``, as the plain model's."""
    fields = {**BASE, "hf_config": llama_config}
    plain = run_on_ranks(_loaded_on_rank, 2, fields, timeout=TIMEOUT)[0]
    float8 = run_on_ranks(_loaded_on_rank, 2, {**fields, "float8": True}, timeout=TIMEOUT)[0]
    assert plain.keys() == float8.keys() and all(torch.equal(plain[k], float8[k]) for k in plain)


def test_float8_converts_only_linears_float8_can_multiply():
    from torchao.float8.float8_linear import Float8Linear

    with torch.device("meta"):
        blocks = nn.ModuleList([nn.Sequential(nn.Linear(32, 64), nn.Linear(64, 24), nn.LayerNorm(24))])
    assert convert_to_float8(blocks) == 1
    assert [type(m) for m in blocks[0]] == [Float8Linear, nn.Linear, nn.LayerNorm]


def _grad_accum_on_rank(fields: dict) -> tuple[list[float], int]:
    result = _train_on_rank(fields)
    return result.losses, result.comm.counts.get("reduce_scatter", 0)


def test_grad_accum_reduces_once_per_step_and_equals_the_whole_batch():
    fields = {**BASE, "steps": 3, "model": "nano"}
    whole = run_on_ranks(_grad_accum_on_rank, 2, fields, timeout=TIMEOUT)
    split = run_on_ranks(_grad_accum_on_rank, 2, {**fields, "grad_accum": 2}, timeout=TIMEOUT)
    assert split[0][1] == whole[0][1] > 0  # reduce-scatters: the same count, not twice as many
    assert split[0][0] == pytest.approx(whole[0][0], rel=1e-5)


# ---------------------------------------------------------------- set-up memory


def _setup_peak_on_rank(fields: dict) -> tuple[int, int]:
    cfg = TrainConfig(**fields)
    env = _env(fields)
    spec = model_spec(cfg)
    # a first model fills DTensor's sharding-propagation caches (its fake-tensor path and
    # PeakMemory's dispatch mode do not nest); the measured one runs on the cached path
    materialize(sharded_on_meta(cfg, env, spec), spec, env.device, cfg.seed)
    model = sharded_on_meta(cfg, env, spec)  # no memory yet: every parameter is on the meta device
    with PeakMemory() as memory:
        materialize(model, spec, env.device, cfg.seed)
    full = sum(p.numel() * p.element_size() for p in model.parameters())  # DTensors: global sizes
    return memory.peak_bytes, full


def test_setup_peak_stays_near_one_ranks_share(tmp_path):
    config = {**LLAMA, "hidden_size": 64, "intermediate_size": 256, "num_hidden_layers": 4}
    (tmp_path / "config.json").write_text(json.dumps(config))
    peaks = run_on_ranks(_setup_peak_on_rank, 4, {"hf_config": str(tmp_path), **BASE}, timeout=TIMEOUT)
    for peak, full in peaks:
        largest = 256 * 64 * 4  # an MLP weight or the embedding: the one full tensor held at a time,
        assert peak <= full / 4 + 1.25 * largest + 4096, (peak, full)  # with its shard's copy
        assert peak < full / 2


# ---------------------------------------------------------------- bad input, before any rank starts


@pytest.mark.parametrize("argv,message", [
    (["--nproc", "3", "--replicate", "2"], "must divide the 3 ranks"),
    (["--nproc", "4", "--tp", "2", "--replicate", "4"], "must divide the 4 ranks"),
    (["--hf-config", "/nonexistent/config.json"], "no Transformers config at"),
    (["--batch-size", "6", "--grad-accum", "4"], "--grad-accum 4 must divide --batch-size 6"),
    (["--nproc", "4", "--reshard-after-forward", "3"], "--reshard-after-forward 3 must divide the 4 ranks"),
    (["--reshard-after-forward", "maybe"], None),
    (["--model", "nano", "--tp", "3", "--nproc", "3"], "--tp 3 must divide the nano GPT's n_heads=2"),
    (["--nproc", "4", "--float8", "--reshard-after-forward", "2"], "--float8 with --reshard-after-forward 2: a float8"),
])
def test_bad_input_fails_before_launch(no_launch, argv, message):
    with pytest.raises(SystemExit) as e:
        cli.main(["train", *argv])
    if message is not None:
        assert message in str(e.value)


def test_float8_without_torchao_or_on_an_older_gpu_fails_before_launch(no_launch, monkeypatch):
    with monkeypatch.context() as m:
        m.setitem(sys.modules, "torchao.float8", None)  # as if torchao were not installed
        with pytest.raises(SystemExit, match="--float8 needs torchao"):
            cli.main(["train", "--float8"])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))  # an A100
    with pytest.raises(SystemExit, match="compute capability >= 8.9 .* this one is 8.0"):
        cli.main(["train", "--float8"])


def test_tp_without_a_plan_fails_before_launch(no_launch, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_embd": 32, "n_layer": 2, "n_head": 2}))
    with pytest.raises(SystemExit, match="no tensor-parallel plan for model_type 'gpt2'"):
        cli.main(["train", "--hf-config", str(tmp_path), "--tp", "2"])


def test_resume_of_another_models_checkpoint_fails_before_launch(no_launch, tmp_path, llama_config):
    ckpt = tmp_path / "ckpt"
    run_on_ranks(_train_on_rank, 2, {**BASE, "steps": 1, "model": "nano", "checkpoint_dir": str(ckpt)}, timeout=TIMEOUT)
    with pytest.raises(SystemExit, match="is of another model .*dim=32 there, 128 here"):
        cli.main(["train", "--model", "tiny", "--checkpoint-dir", str(ckpt), "--resume"])
    with pytest.raises(SystemExit, match="a gpt model, this run a hf model"):
        cli.main(["train", "--hf-config", llama_config, "--checkpoint-dir", str(ckpt), "--resume"])
    shutil.rmtree(ckpt)


def test_summary_prints_tokens_per_s_always_and_mfu_when_the_peak_is_known():
    common = dict(steps=10, world_size=2, n_params=1000, tokens_per_step=1000, losses=[1.0], first_loss=2.0,
                  final_loss=1.0, wall_s=1.0, setup_s=0.1, comm=None, flops_per_token=6000.0)
    cpu = "\n".join(summary_lines(TrainResult(**common)))
    assert "10,000 tokens/s" in cpu and "MFU n/a (device peak unknown)" in cpu
    gpu = "\n".join(summary_lines(TrainResult(**common, peak_flops=1e9)))
    assert "MFU 3.0%" in gpu  # 10,000 tokens/s x 6,000 FLOPs / (2 ranks x 1 GFLOP/s)
