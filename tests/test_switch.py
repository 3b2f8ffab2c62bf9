"""The switch (shardwise.switch, shardwise.as_torch_fsdp): unmodified code that calls torch's
FSDP2 names runs on shardwise.

- In one process: every switched name holds shardwise's object while on and exactly torch's
  object (by identity) after uninstall; a failure while building the table or midway through
  applying it leaves torch untouched; uninstall refuses to restore over a name rebound since;
  modules that bound torch's names before the switch are named in a warning.
- Through a launcher: ``torch.distributed.run -m shardwise.as_torch_fsdp script.py`` gives
  every rank shardwise's objects under torch's names, in a script that imports them at its top
  (the launch is in ``./dev test --all``; ``./dev test`` runs the script runner on 2 warm ranks).
- Through a framework: Hugging Face Accelerate's FSDP2 plugin (fsdp_version=2, transformer-layer
  auto wrap) trains a Transformers Llama via the switch bit-identically to torch's FSDP2, every
  step: loss, every gradient and every parameter (fp32; and bf16 with tied embeddings,
  activation checkpointing, gradient accumulation and Accelerate's gradient clipping).
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import json
import os
import subprocess
import sys
import types
import warnings

import pytest
import torch
import torch.distributed as dist

import shardwise
from shardwise import switch
from shardwise.testing import run_on_ranks

TIMEOUT = 120
STEPS = 3
HOMES = tuple(switch.HOMES)  # the real ones (one test adds a broken one)


@pytest.fixture(autouse=True)
def _switch_off_after():
    """A failing test must not leave the switch on for the rest of the session."""
    yield
    if switch.installed():
        for b in switch.installed():
            setattr(b.home, b.name, b.shardwise_obj)
        switch.uninstall_as_torch_fsdp()


def _install_quietly() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # test modules hold torch's objects as oracles on purpose
        shardwise.install_as_torch_fsdp()


def _snapshot() -> dict[str, dict[str, object]]:
    """Every attribute of every home, by identity."""
    return {name: dict(vars(sys.modules[name])) for name in HOMES}


def _assert_same(before: dict, after: dict) -> None:
    assert before.keys() == after.keys()
    for home in before:
        changed = [k for k in before[home].keys() | after[home].keys() if before[home].get(k) is not after[home].get(k)]
        assert not changed, f"{home}: {changed} differ from before the switch"


# ---------------------------------------------------------------- one process


def test_switch_puts_shardwise_under_torch_names_and_restores_torch_exactly():
    switch.plan()  # imports every home
    before = _snapshot()
    _install_quietly()
    import torch.distributed._composable.fsdp as composable_fsdp
    import torch.distributed._composable.replicate_with_fsdp as replicate_with_fsdp
    import torch.distributed.fsdp as fsdp
    from torch.distributed.fsdp import FSDPModule, fully_shard  # a lookup after the switch

    assert fully_shard is shardwise.fully_shard and FSDPModule is shardwise.FSDPModule
    for name in ("MixedPrecisionPolicy", "OffloadPolicy", "CPUOffloadPolicy", "UnshardHandle", "share_comm_ctx"):
        assert getattr(fsdp, name) is getattr(shardwise, name), name
    assert composable_fsdp.fully_shard is shardwise.fully_shard  # Transformers' import path
    assert replicate_with_fsdp.replicate is shardwise.replicate
    assert {(b.home.__name__, b.name) for b in switch.installed()} >= {
        ("torch.distributed.fsdp", n) for n in switch.HOMES["torch.distributed.fsdp"]
    }
    shardwise.uninstall_as_torch_fsdp()
    assert not switch.installed()
    _assert_same(before, _snapshot())
    shardwise.uninstall_as_torch_fsdp()  # off already: a no-op


def test_install_is_idempotent_and_with_undoes_only_its_own_install():
    import torch.distributed.fsdp as fsdp

    torch_fully_shard = fsdp.fully_shard
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with shardwise.install_as_torch_fsdp():
            with shardwise.install_as_torch_fsdp():  # already on: changes nothing
                assert fsdp.fully_shard is shardwise.fully_shard
            assert switch.installed() and fsdp.fully_shard is shardwise.fully_shard
    assert not switch.installed() and fsdp.fully_shard is torch_fully_shard


class _FailsToSet(types.ModuleType):
    """A module whose ``replicate`` cannot be set: a failure midway through the table."""

    def __setattr__(self, name: str, value: object) -> None:
        if name == "replicate":
            raise RuntimeError("cannot set replicate")
        super().__setattr__(name, value)


def test_failure_midway_leaves_torch_untouched():
    bindings = switch.plan()
    home = sys.modules["torch.distributed._composable.replicate_with_fsdp"]
    index = next(i for i, b in enumerate(bindings) if b.home is home and b.name == "replicate")
    assert 0 < index, "the failing name must come after others were set"
    before = _snapshot()
    home.__class__ = _FailsToSet
    try:
        with pytest.raises(RuntimeError, match="cannot set replicate"):
            _install_quietly()
    finally:
        home.__class__ = types.ModuleType
    assert not switch.installed()
    _assert_same(before, _snapshot())


def test_failure_midway_through_uninstall_leaves_the_switch_whole():
    _install_quietly()
    home = sys.modules["torch.distributed._composable.replicate_with_fsdp"]
    home.__class__ = _FailsToSet
    try:
        with pytest.raises(RuntimeError, match="cannot set replicate"):
            shardwise.uninstall_as_torch_fsdp()
    finally:
        home.__class__ = types.ModuleType
    assert all(getattr(b.home, b.name) is b.shardwise_obj for b in switch.installed())
    shardwise.uninstall_as_torch_fsdp()
    assert not switch.installed()


def test_failure_building_the_table_changes_nothing(monkeypatch):
    switch.plan()
    before = _snapshot()
    monkeypatch.setitem(switch.HOMES, "torch.distributed.no_such_home", ("fully_shard",))
    with pytest.raises(ImportError):
        _install_quietly()
    assert not switch.installed()
    _assert_same(before, _snapshot())


def test_uninstall_refuses_to_restore_over_a_name_rebound_since():
    import torch.distributed.fsdp as fsdp

    _install_quietly()
    fsdp.fully_shard = intruder = object()
    with pytest.raises(RuntimeError, match=r"torch\.distributed\.fsdp\.fully_shard no longer hold"):
        shardwise.uninstall_as_torch_fsdp()
    assert switch.installed() and fsdp.fully_shard is intruder  # nothing was restored
    assert fsdp.FSDPModule is shardwise.FSDPModule
    fsdp.fully_shard = shardwise.fully_shard
    shardwise.uninstall_as_torch_fsdp()
    assert not switch.installed()


def test_install_names_modules_that_bound_torch_names_first(monkeypatch):
    from torch.distributed.fsdp import FSDPModule as torch_fsdp_module
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    early = types.ModuleType("early_framework")
    early.fully_shard, early.FSDPModule = torch_fully_shard, torch_fsdp_module
    monkeypatch.setitem(sys.modules, "early_framework", early)
    with pytest.warns(UserWarning, match=r"early_framework \(FSDPModule, fully_shard\).*Install the switch before"):
        shardwise.install_as_torch_fsdp()
    assert early.fully_shard is torch_fully_shard  # modules are never rewritten behind their back
    shardwise.uninstall_as_torch_fsdp()


def _signature(fn) -> list:
    """Parameter names, kinds and defaults; a policy default compares by class name and fields
    (torch's ``MixedPrecisionPolicy()`` and shardwise's are different classes)."""

    def default(v):
        return (type(v).__name__, dataclasses.asdict(v)) if dataclasses.is_dataclass(v) else v

    return [(p.name, p.kind, default(p.default)) for p in inspect.signature(fn).parameters.values()]


def _torch_callables() -> dict[str, tuple]:
    """(torch's, shardwise's) for every switched function and every FSDPModule method."""
    pairs = {b.name: (b.torch_obj, b.shardwise_obj) for b in switch.plan() if inspect.isfunction(b.torch_obj)}
    torch_module = sys.modules["torch.distributed.fsdp"].FSDPModule
    for name, fn in vars(torch_module).items():
        if inspect.isfunction(fn) and name != "_get_fsdp_state":  # torch-internal: returns torch's FSDPState
            pairs[f"FSDPModule.{name}"] = (fn, getattr(shardwise.FSDPModule, name, None))
    return pairs


@pytest.mark.parametrize("name", sorted(_torch_callables()))
def test_switched_callables_take_torchs_arguments(name):
    theirs, ours = _torch_callables()[name]
    assert ours is not None, f"shardwise lacks {name}"
    assert _signature(ours) == _signature(theirs)


def test_switched_policies_have_torchs_fields():
    for b in switch.plan():
        if dataclasses.is_dataclass(b.torch_obj):
            fields = [(f.name, f.default) for f in dataclasses.fields(b.torch_obj)]
            assert [(f.name, f.default) for f in dataclasses.fields(b.shardwise_obj)] == fields, b


def test_launcher_usage_errors():
    from shardwise import as_torch_fsdp

    with pytest.raises(SystemExit, match="usage"):
        as_torch_fsdp.main([])
    with pytest.raises(SystemExit, match="no such script"):
        as_torch_fsdp.main(["no/such/script.py"])
    assert not switch.installed()


def test_launcher_runs_a_module_as_main_with_its_args_and_the_switch_on(tmp_path, monkeypatch):
    from shardwise import as_torch_fsdp

    (tmp_path / "user_entry.py").write_text(
        "import json, sys\n"
        "from torch.distributed.fsdp import fully_shard\n"
        "with open(sys.argv[1], 'w') as f:\n"
        "    json.dump([__name__, sys.argv[2:], fully_shard.__module__], f)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    out = tmp_path / "seen.json"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        as_torch_fsdp.main(["-m", "user_entry", str(out), "--steps", "2"])
    assert json.loads(out.read_text()) == ["__main__", ["--steps", "2"], "shardwise.fully_shard"]
    assert switch.installed()  # on until the process exits (the fixture turns it off here)


# ---------------------------------------------------------------- a launched script, 2 ranks

SCRIPT = '''\
"""A training script that has never heard of shardwise."""
import json, os, sys
import torch, torch.distributed as dist, torch.nn as nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

launched = not dist.is_initialized()  # a warm test rank is inside its world already
if launched:
    dist.init_process_group("gloo")
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
fully_shard(model[0], mp_policy=MixedPrecisionPolicy())
fully_shard(model)
model(torch.randn(3, 4)).sum().backward()
with open(os.path.join(sys.argv[1], f"rank{dist.get_rank()}.json"), "w") as f:
    json.dump({
        "name": __name__, "argv": sys.argv[1:],
        "fully_shard": fully_shard.__module__, "FSDPModule": FSDPModule.__module__,
        "model_class": type(model).__module__, "is_fsdp_module": isinstance(model[0], FSDPModule),
        "grad": type(model[0].weight.grad).__name__,
    }, f)
if launched:
    dist.destroy_process_group()
'''
SEEN = {
    "name": "__main__", "fully_shard": "shardwise.fully_shard", "FSDPModule": "shardwise.module",
    "model_class": "shardwise.fully_shard", "is_fsdp_module": True, "grad": "DTensor",
}  # fmt: skip


def _script_in_this_rank(script: str, out_dir: str) -> dict:
    """``python -m shardwise.as_torch_fsdp SCRIPT OUT_DIR --lr 3e-4`` in this warm rank; the
    rank's argv, path and torch's names are restored after."""
    from shardwise import as_torch_fsdp

    argv, path = list(sys.argv), list(sys.path)
    try:
        as_torch_fsdp.main([script, out_dir, "--lr", "3e-4"])
    finally:
        sys.argv[:], sys.path[:] = argv, path
        shardwise.uninstall_as_torch_fsdp()
    return json.loads(open(os.path.join(out_dir, f"rank{dist.get_rank()}.json")).read())


def test_an_unedited_script_gets_shardwise_in_every_rank(tmp_path):
    """The script runner of ``shardwise.as_torch_fsdp`` on 2 ranks (the warm ones: the launch
    through torchrun is the next test, in ``./dev test --all``)."""
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    for rank, seen in enumerate(run_on_ranks(_script_in_this_rank, 2, str(script), str(tmp_path), timeout=TIMEOUT)):
        assert seen == {**SEEN, "argv": [str(tmp_path), "--lr", "3e-4"]}, f"rank {rank}"


@pytest.mark.launches
def test_torchrun_launched_script_gets_shardwise_in_every_rank(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           "-m", "shardwise.as_torch_fsdp", str(script), str(tmp_path), "--lr", "3e-4"]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    for rank in range(2):
        seen = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert seen == {**SEEN, "argv": [str(tmp_path), "--lr", "3e-4"]}, f"rank {rank}"


# ---------------------------------------------------------------- Accelerate + Transformers, 2 ranks


def _tiny_llama(tied: bool) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=16, tie_word_embeddings=tied,
    )  # fmt: skip
    torch.manual_seed(0)  # the same initialisation for both runs and on every rank
    return LlamaForCausalLM(config)


@contextlib.contextmanager
def _accelerate_env():
    """What ``accelerate launch`` would have set for these ranks (Accelerate reads its rank from
    the environment on CPU); the warm rank process gets its own environment back after."""
    rank, world = dist.get_rank(), dist.get_world_size()
    env = dict(RANK=rank, WORLD_SIZE=world, LOCAL_RANK=rank, LOCAL_WORLD_SIZE=world,
               MASTER_ADDR="127.0.0.1", OMP_NUM_THREADS=1)  # fmt: skip
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update({k: str(v) for k, v in env.items()})
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@dataclasses.dataclass(frozen=True)
class Case:
    """One Accelerate configuration; ``accum`` micro-batches per optimizer step."""

    mixed_precision: str = "no"
    tied: bool = False
    ac: bool = False
    accum: int = 1
    clip: float | None = None


def _accelerator(case: Case):
    from accelerate import Accelerator
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=["LlamaDecoderLayer"], activation_checkpointing=case.ac,
    )  # fmt: skip
    accelerator = Accelerator(
        cpu=True, fsdp_plugin=plugin, mixed_precision=case.mixed_precision, gradient_accumulation_steps=case.accum
    )
    # Accelerate enables FSDP only on accelerator devices: AcceleratorState switches
    # distributed_type to FSDP for MULTI_GPU / MULTI_XPU / MULTI_NPU / ... but never for
    # MULTI_CPU (accelerate/state.py). Its FSDP2 code path itself is device-agnostic, so on
    # CPU the test sets what AcceleratorState would have set on a GPU machine.
    accelerator.state.distributed_type = DistributedType.FSDP
    accelerator.state.fsdp_plugin = plugin
    if case.mixed_precision != "no":
        plugin.set_mixed_precision(case.mixed_precision)
    return accelerator


def _train_with_accelerate(case: Case, batches: list) -> tuple:
    """Accelerate's FSDP2 path as a user's script runs it; per optimizer step the micro-batch
    losses, the (clipped) gradients and the parameters."""
    from accelerate.state import AcceleratorState, GradientState

    accelerator = _accelerator(case)
    try:
        model = _tiny_llama(case.tied)
        optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model, optim = accelerator.prepare(model, optim)
        steps, losses = [], []
        for ids in batches:
            with accelerator.accumulate(model):
                loss = model(input_ids=ids, labels=ids).loss
                accelerator.backward(loss)
                losses.append(loss.detach().clone())
                if not accelerator.sync_gradients:
                    continue
                if case.clip is not None:
                    accelerator.clip_grad_norm_(model.parameters(), case.clip)
                grads = [p.grad.to_local().clone() for p in model.parameters()]
                optim.step()
                optim.zero_grad()
                steps.append((torch.stack(losses), grads, [p.to_local().detach().clone() for p in model.parameters()]))
                losses = []
        return model, steps
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()


def _accelerate_parity(case: Case) -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
    from torch.distributed.fsdp import FSDPModule as TorchFSDPModule

    gen = torch.Generator().manual_seed(dist.get_rank())  # each rank its own data
    batches = [torch.randint(0, 64, (2, 8), generator=gen) for _ in range(STEPS * case.accum)]
    with _accelerate_env():
        theirs, torch_steps = _train_with_accelerate(case, batches)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # Transformers bound torch's names at import: expected here
            with shardwise.install_as_torch_fsdp():
                ours, our_steps = _train_with_accelerate(case, batches)
    assert not switch.installed()
    layers = ours.model.layers
    assert isinstance(theirs, TorchFSDPModule) and not isinstance(theirs, shardwise.FSDPModule)
    assert isinstance(ours, shardwise.FSDPModule) and all(isinstance(m, shardwise.FSDPModule) for m in layers)
    assert all(isinstance(m, CheckpointWrapper) for m in layers) == case.ac
    assert (ours.lm_head.weight is ours.model.embed_tokens.weight) == case.tied
    assert len(torch_steps) == len(our_steps) == STEPS
    for step, ((l0, g0, p0), (l1, g1, p1)) in enumerate(zip(torch_steps, our_steps)):
        where = f"rank {dist.get_rank()} step {step}"
        assert torch.equal(l0, l1), f"{where}: losses {l0.tolist()} (torch) != {l1.tolist()} (shardwise)"
        assert len(g0) == len(g1) and all(torch.equal(a, b) for a, b in zip(g0, g1)), f"{where}: grads differ"
        assert len(p0) == len(p1) and all(torch.equal(a, b) for a, b in zip(p0, p1)), f"{where}: params differ"


@pytest.mark.parametrize(
    "case",
    [Case(), Case(mixed_precision="bf16", tied=True, ac=True, accum=2, clip=0.5)],
    ids=["fp32", "bf16-tied-ac-accum2-clip"],
)
def test_accelerate_fsdp2_llama_via_switch_matches_torch_bitwise(case):
    run_on_ranks(_accelerate_parity, 2, case, timeout=TIMEOUT)
