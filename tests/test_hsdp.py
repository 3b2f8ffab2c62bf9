"""HSDP: fully_shard on a 2-D (replicate, shard) mesh, against a reference and torch.

Parameters are sharded over the ``shard`` dim and replicated over ``replicate``
(``(Replicate(), Shard(0))`` DTensors); each synced backward reduce-scatters every group's
gradients over ``shard`` and all-reduces the shard over ``replicate``. Every rank trains on
its own data, so the reference is a plain replica whose gradients are averaged over all
ranks. After every step :func:`_nd_helpers.check_step` compares losses, ``full_tensor()`` of
every parameter and gradient with the reference, and placements plus ``to_local()`` with
torch's ``fully_shard`` on the same mesh.

Counts: on gloo shardwise implements the reduce-scatter as an all-to-all plus a local sum
(``shardwise.collectives.reduce_scatter``), torch calls gloo's reduce-scatter; both are the
group's one reduce collective, so :func:`_nd_helpers.tally` counts an all-to-all as a
reduce-scatter.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import CPUOffloadPolicy as TorchCPUOffloadPolicy
from torch.distributed.fsdp import FSDPModule as TorchFSDPModule
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import Replicate, Shard

import shardwise
from _models import Transformer
from _nd_helpers import TIMEOUT, generator, make_mesh, tally, tally_by_kind, token_batches, train
from shardwise.testing import run_on_ranks

STEPS = 3
MICROBATCHES = 3
DIMS = dict(vocab_size=17, dim=8, n_layers=2, n_heads=2, max_seq_len=8, ffn_hidden=12)
GROUPS = DIMS["n_layers"] + 1  # one per block, plus the root

# ---------------------------------------------------------------- on the ranks


def _shard(model, fully_shard_fn, mesh, **kwargs):
    for layer in model.layers:
        fully_shard_fn(layer, mesh=mesh, **kwargs)
    return fully_shard_fn(model, mesh=mesh, **kwargs)


def _microbatch_knob(mode: str):
    """Called before micro-batch i of n: only the last one syncs (or all-reduces)."""

    def before(model, i, n):
        if mode == "no_sync":
            model.set_requires_gradient_sync(i == n - 1)
        elif mode == "no_all_reduce":
            model.set_requires_all_reduce(i == n - 1)

    return before


def _hsdp(shape: tuple[int, int], config: dict) -> dict:
    mesh = make_mesh(shape, ("replicate", "shard"))
    torch.manual_seed(0)
    base = Transformer(**DIMS)
    ref = copy.deepcopy(base)
    kwargs = {"reshard_after_forward": config.get("raf")} if "raf" in config else {}
    theirs_kwargs = dict(kwargs)
    if config.get("offload"):
        kwargs["offload_policy"] = shardwise.CPUOffloadPolicy(pin_memory=False)
        theirs_kwargs["offload_policy"] = TorchCPUOffloadPolicy(pin_memory=False)
    theirs = _shard(copy.deepcopy(base), torch_fully_shard, mesh, **theirs_kwargs)
    ours = _shard(base, shardwise.fully_shard, mesh, **kwargs)
    for name, p in ours.named_parameters():
        assert p.placements == (Replicate(), Shard(0)), f"{name}: {p.placements}"
        assert p.device_mesh.mesh_dim_names == ("replicate", "shard"), f"{name}: {p.device_mesh}"
    ref_scale, after_backward = _reduction_knobs(ours, theirs, config)
    gen = generator(dist.get_rank())
    micro = MICROBATCHES if config.get("mode") else 1
    batches = [token_batches(gen, DIMS["vocab_size"], micro) for _ in range(STEPS)]
    counts: dict = {}
    before = _microbatch_knob(config["mode"]) if config.get("mode") else None
    losses = train(
        ours, ref, theirs, batches, before=before, ref_scale=ref_scale, after_backward=after_backward, counts=counts
    )
    if config.get("offload"):
        for name, p in ours.named_parameters():
            assert p.device.type == "cpu" and p.grad.device.type == "cpu", name
    return {
        "losses": losses,
        "ours": [tally(events) for events in counts["ours"]],
        "torch": [tally(events) for events in counts["torch"]],
        "ours_groups": [_group_sizes(events) for events in counts["ours"]],
        "torch_groups": [_group_sizes(events) for events in counts["torch"]],
    }


def _group_sizes(events: list) -> dict[str, list[int]]:
    """kind -> sorted group sizes (all-gathers over the shard dim or a post-forward block,
    reduce-scatters over the shard dim, all-reduces over the replicate dim)."""
    sizes: dict[str, list[int]] = {}
    for kind, events_of_kind in tally_by_kind(events).items():
        sizes[kind] = sorted(e.group_size for e in events_of_kind)
    return sizes


def _reduction_knobs(ours, theirs, config: dict):
    """Set force-sum / a divide factor on every FSDP module (or on the root only, as torch's
    setters are not recursive); return the reference's grad scale and a hook rescaling the
    reference's root-owned grads in the root-only case."""
    if not (config.get("force_sum") or config.get("factor")):
        return 1.0, None
    root_only = config.get("root_only", False)
    targets = [(ours, theirs)] if root_only else [(o, t) for o, t in zip(_fsdp_modules(ours), _fsdp_modules(theirs))]
    for mine, torchs in targets:
        if config.get("force_sum"):  # SUM-only collectives; the gradient is still the mean
            mine.set_force_sum_reduction_for_comms(True)
            torchs.set_force_sum_reduction_for_comms(True)
        if config.get("factor"):
            # sum over all replicate x shard ranks / factor (not over the shard ranks only).
            # torch turns a custom factor into PREMUL_SUM, which gloo lacks, unless told to
            # use SUM collectives: the same numbers.
            mine.set_gradient_divide_factor(config["factor"])
            torchs.set_gradient_divide_factor(config["factor"])
            torchs.set_force_sum_reduction_for_comms(True)
    scale = dist.get_world_size() / config["factor"] if config.get("factor") else 1.0
    if not root_only:
        return scale, None
    block_params = {id(p) for layer in ours.layers for p in layer.parameters()}
    root_names = [n for n, p in ours.named_parameters() if id(p) not in block_params]

    def scale_root_grads(_ours, ref, _theirs):
        with torch.no_grad():
            for name in root_names:
                ref.get_parameter(name).grad.mul_(scale)

    return 1.0, scale_root_grads


def _fsdp_modules(model) -> list:
    return [m for m in model.modules() if isinstance(m, (shardwise.FSDPModule, TorchFSDPModule))]


def _unnamed_2d_mesh() -> dict:
    mesh = make_mesh((2, 2), None)
    errors = {}
    for name, fully_shard_fn in (("ours", shardwise.fully_shard), ("torch", torch_fully_shard)):
        try:
            fully_shard_fn(Transformer(**DIMS), mesh=mesh)
            errors[name] = None
        except Exception as err:  # recorded for both: ours must be a ValueError, both AssertionErrors
            errors[name] = (type(err).__name__, str(err), isinstance(err, ValueError), isinstance(err, AssertionError))
    return errors


# ---------------------------------------------------------------- checks


def _check_counts(results: list[dict], expected: dict[str, int]) -> None:
    for rank, result in enumerate(results):
        for step, (mine, theirs) in enumerate(zip(result["ours"], result["torch"])):
            where = f"rank {rank}, step {step}"
            assert mine == expected, f"{where}: ours {mine}, expected {expected}"
            assert mine == theirs, f"{where}: ours {mine}, torch {theirs}"
        assert result["ours_groups"] == result["torch_groups"], f"rank {rank}: group sizes {result['ours_groups']}"
    assert len({tuple(r["losses"]) for r in results}) == len(results), "ranks saw the same data"


@pytest.mark.parametrize("reshard_after_forward", [True, False])
def test_hsdp_parity_and_counts(reshard_after_forward):
    results = run_on_ranks(_hsdp, 4, (2, 2), {"raf": reshard_after_forward}, timeout=TIMEOUT)
    backward_gathers = GROUPS if reshard_after_forward else 0
    expected = {"all_gather": GROUPS + backward_gathers, "reduce_scatter": GROUPS, "all_reduce": GROUPS}
    _check_counts(results, expected)
    for r in results:  # gathers and reduce-scatters over the 2 shard ranks, all-reduces over 2 replicas
        assert r["ours_groups"][0] == {kind: [2] * n for kind, n in expected.items()}, r["ours_groups"][0]


def test_hsdp_reshard_after_forward_int():
    """(2, 4) mesh on 8 ranks: ``reshard_after_forward=2`` keeps a shard over blocks of 2 of
    the 4 shard ranks after forward, so backward all-gathers over 2 ranks only (with 4 = the
    shard size, an int equal to it would just mean True)."""
    results = run_on_ranks(_hsdp, 8, (2, 4), {"raf": 2}, timeout=TIMEOUT)
    expected = {"all_gather": 2 * GROUPS, "reduce_scatter": GROUPS, "all_reduce": GROUPS}
    _check_counts(results, expected)
    for r in results:  # forward over the 4 shard ranks, backward over blocks of 2; all-reduce over 2
        groups = {"all_gather": [2] * GROUPS + [4] * GROUPS, "reduce_scatter": [4] * GROUPS, "all_reduce": [2] * GROUPS}
        assert r["ours_groups"][0] == groups, r["ours_groups"][0]


@pytest.mark.parametrize("mode", ["no_sync", "no_all_reduce"])
def test_hsdp_microbatches(mode):
    """3 micro-batches; only the last syncs gradients / all-reduces them.

    Default reshard (root keeps its params, blocks re-gather in backward): per micro-batch
    N+1 forward and N backward all-gathers. ``no_sync``: one reduce-scatter and one
    all-reduce per group, in the last backward. ``no_all_reduce``: reduce-scatters in every
    backward ((N+1)·M), the all-reduce only in the last (N+1)."""
    results = run_on_ranks(_hsdp, 4, (2, 2), {"mode": mode}, timeout=TIMEOUT)
    rs = GROUPS if mode == "no_sync" else GROUPS * MICROBATCHES
    expected = {"all_gather": MICROBATCHES * (2 * GROUPS - 1), "reduce_scatter": rs, "all_reduce": GROUPS}
    _check_counts(results, expected)


def test_hsdp_cpu_offload():
    results = run_on_ranks(_hsdp, 4, (2, 2), {"offload": True}, timeout=TIMEOUT)
    expected = {"all_gather": 2 * GROUPS - 1, "reduce_scatter": GROUPS, "all_reduce": GROUPS}
    _check_counts(results, expected)


@pytest.mark.parametrize(
    "config",
    [{"force_sum": True}, {"factor": 3.0}, {"factor": 2.0}, {"factor": 3.0, "root_only": True}],
    ids=["force_sum_is_still_the_mean", "divide_factor_3", "divide_factor_2_not_the_shard_size", "root_only"],
)
def test_hsdp_reduction_scaling(config):
    """The gradient is sum-over-all-4-ranks / factor (the mean for force-sum: SUM collectives
    plus a separate division), whatever the split between the reduce-scatter and the
    all-reduce: the reference's grads are scaled and compared numerically every step.

    The knobs are set on every FSDP module; ``root_only`` sets them on the root only, which
    in torch changes the root's group alone (its setters are not recursive)."""
    results = run_on_ranks(_hsdp, 4, (2, 2), config, timeout=TIMEOUT)
    expected = {"all_gather": 2 * GROUPS - 1, "reduce_scatter": GROUPS, "all_reduce": GROUPS}
    _check_counts(results, expected)


def test_hsdp_mesh_without_dim_names_raises():
    for rank, errors in enumerate(run_on_ranks(_unnamed_2d_mesh, 4, timeout=TIMEOUT)):
        assert errors["ours"] is not None and errors["ours"][2], f"rank {rank}: {errors['ours']}"
        assert "name" in errors["ours"][1], errors["ours"][1]
        # torch rejects it too, with an AssertionError ("init the 2D mesh for HSDP with mesh_dim_names"): ours is one
        assert errors["torch"] is not None and errors["torch"][3], f"rank {rank}: torch said {errors['torch']}"
        assert errors["ours"][3] and "mesh_dim_names specified" in errors["ours"][1], errors["ours"]
