"""``shardwise train --hf-config`` on every Transformers causal-LM family, blocks found through the model's metadata.

- The blocks are the ``nn.ModuleList`` of the classes ``_no_split_modules`` names, wherever the
  family keeps it (``transformer.h``, ``gpt_neox.layers``, ``model.decoder.layers``,
  ``model.layers``); without that metadata, the usual attribute paths.
- Each family (tied embeddings; GPT-2's ``Conv1D`` weights) trains 2 steps on 2 ranks with
  losses bit-equal to ``--impl torch``, and ``shardwise export`` gives a directory
  ``AutoModelForCausalLM.from_pretrained`` loads with logits ``torch.equal`` to the trained
  sharded model's and to a Transformers model holding the trained full weights.
- A model with no recognisable blocks is refused in the CLI, before launch, naming the classes found.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from torch import nn

from shardwise import cli
from shardwise.testing import run_on_ranks
from shardwise.testing.hf_families import FAMILIES, tiny_config, write_config
from shardwise.train.config import TrainConfig
from shardwise.train.hf_blocks import NoBlocksError, find_blocks
from shardwise.train.models import model_spec
from test_train_hf import BASE, TIMEOUT, _env, train_keeping_model

BLOCKS = {"gpt2": "transformer.h", "falcon": "transformer.h", "bloom": "transformer.h", "gpt_neox": "gpt_neox.layers",
          "opt": "model.decoder.layers"}  # every other family: model.layers


def _meta_model(family: str) -> nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = tiny_config(family, tie_word_embeddings=True)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(AutoConfig.for_model(config.pop("model_type"), **config))


def test_blocks_are_the_module_list_of_the_classes_no_split_modules_names():
    for family in FAMILIES:
        model = _meta_model(family)
        blocks = find_blocks(model)
        assert blocks is model.get_submodule(BLOCKS.get(family, "model.layers")), family
        assert len(blocks) == 2 and all(type(b).__name__ in model._no_split_modules for b in blocks), family
        assert model.lm_head.weight is model.get_input_embeddings().weight, family  # tied


def _family_on_rank(fields: dict, tokens: torch.Tensor) -> dict:
    """Both implementations' losses; of shardwise's run, the trained sharded model's logits and full weights."""
    cfg, env = TrainConfig(**fields), _env(fields)
    theirs = train_keeping_model(dataclasses.replace(cfg, impl="torch", checkpoint_dir=None), env)[0].losses
    result, model = train_keeping_model(cfg, env)
    full = {n: p.full_tensor() for n, p in model.named_parameters()}  # before a forward leaves the root unsharded
    model.eval()  # dropout (GPT-2's, Falcon's...) off, as in the exported model
    with torch.no_grad():
        logits = model_spec(cfg).logits(model, tokens)
    return dict(ours=result.losses, theirs=theirs, logits=logits, full=full)


FAST = ("gpt2",)  # Conv1D weights, tied embeddings, blocks at transformer.h: `./dev test` runs it; CI all of them


@pytest.mark.parametrize("family", [f if f in FAST else pytest.param(f, marks=pytest.mark.launches) for f in FAMILIES])
def test_family_matches_torch_and_exports_to_transformers(tmp_path, family):
    from transformers import AutoModelForCausalLM

    config = write_config(tmp_path, family, tie_word_embeddings=family != "llama")  # llama: untied, as test_train_hf's
    fields = {**BASE, "steps": 2, "hf_config": str(config), "checkpoint_dir": str(tmp_path / "ckpt")}
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    ranks = run_on_ranks(_family_on_rank, 2, fields, tokens, timeout=3 * TIMEOUT)
    for rank in ranks:
        assert rank["ours"] == rank["theirs"] and len(rank["ours"]) == 2  # bit-equal, every step
    assert ranks[0]["ours"] != ranks[1]["ours"]  # the ranks' batches differ

    assert cli.main(["export", str(tmp_path / "ckpt"), str(tmp_path / "out")]) == 0
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    trained = AutoModelForCausalLM.from_config(exported.config).eval()
    trained.load_state_dict(ranks[0]["full"], strict=False)  # a tied head is the embedding: one of its names
    missing = {n for n, _ in trained.named_parameters(remove_duplicate=False)} - ranks[0]["full"].keys()
    assert missing <= {"lm_head.weight"} and bool(missing) == (family != "llama"), missing
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the ranks: the MoE's grouped_mm sums in another order on more threads
    try:
        with torch.no_grad():
            logits = exported(input_ids=tokens).logits
            assert torch.equal(logits, trained(input_ids=tokens).logits)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(logits, ranks[0]["logits"]) and torch.equal(ranks[0]["logits"], ranks[1]["logits"])


# ---------------------------------------------------------------- a model with no blocks


def _register_flat_lm(no_split: list[str] | None, module_list: bool) -> str:
    """A Transformers causal LM type whose layers sit in an ``nn.Sequential`` (or a ModuleList); its model_type."""
    from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

    model_type = f"shardwise_flat_{'list' if module_list else 'seq'}_{'meta' if no_split else 'none'}"

    class FlatConfig(PretrainedConfig):
        pass

    class FlatLM(PreTrainedModel):
        config_class = FlatConfig
        _no_split_modules = no_split

        def __init__(self, config):
            super().__init__(config)
            layers = [nn.Linear(8, 8) for _ in range(2)]
            self.layers = nn.ModuleList(layers) if module_list else nn.Sequential(*layers)
            self.post_init()

    FlatConfig.model_type = model_type
    try:
        AutoConfig.register(model_type, FlatConfig)
        AutoModelForCausalLM.register(FlatConfig, FlatLM)
    except ValueError:  # registered by an earlier test of this session
        pass
    return model_type


def test_a_model_with_no_module_list_of_blocks_is_refused_before_launch_naming_its_classes(no_launch, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": _register_flat_lm(["FlatBlock"], False)}))
    with pytest.raises(SystemExit) as e:
        cli.main(["train", "--hf-config", str(tmp_path)])
    message = str(e.value)
    assert "FlatLM has no nn.ModuleList of blocks to shard" in message
    assert "_no_split_modules names ['FlatBlock']" in message and "['FlatLM', 'Sequential', 'Linear']" in message


def test_without_metadata_the_usual_attribute_paths_are_tried():
    from transformers import AutoConfig, AutoModelForCausalLM

    for module_list in (True, False):
        config = AutoConfig.for_model(_register_flat_lm(None, module_list))
        model = AutoModelForCausalLM.from_config(config)
        if module_list:
            assert find_blocks(model) is model.layers
        else:
            with pytest.raises(NoBlocksError, match="_no_split_modules names no classes, its ModuleLists hold none"):
                find_blocks(model)


# ---------------------------------------------------------------- tied weights from a model directory


class _OnlyHead(dict):
    """Weights by name, as a safetensors directory that saved a tied matrix under the head's name only."""

    def __call__(self, name: str) -> torch.Tensor:
        return self[name]


def test_a_tied_weight_loads_under_whichever_of_its_names_the_directory_holds(tmp_path, single_rank):
    from shardwise.train.build import materialize, sharded_on_meta

    cfg = TrainConfig(hf_config=str(write_config(tmp_path, "qwen2", tie_word_embeddings=True)))
    spec = model_spec(cfg)
    model = sharded_on_meta(cfg, single_rank, spec)  # fully_shard keeps the tie (to_empty alone would not)
    weights = _OnlyHead({n: torch.randn(p.shape) for n, p in model.named_parameters()})
    weights["lm_head.weight"] = weights.pop("model.embed_tokens.weight")  # the first name is not in the directory
    materialize(model, spec, torch.device("cpu"), seed=0, weights=weights)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert torch.equal(model.lm_head.weight.full_tensor(), weights["lm_head.weight"])
