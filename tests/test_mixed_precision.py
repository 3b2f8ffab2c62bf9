"""Mixed precision: parity with torch's FSDP2 under the same policy, reduction numerics,
bytes on the wire, gradient accumulation, GradScaler, and bad policies.

Parity cases train shardwise and torch's ``fully_shard`` side by side on 2 gloo ranks, each
rank on its own data, with the *same* ``MixedPrecisionPolicy`` (torch's own class for torch,
shardwise's for shardwise), and compare the loss, every sharded parameter and every sharded
gradient after every step (:func:`_mp_helpers.compare_with_torch`) **bit for bit**: on 2
ranks shardwise's gloo reduction (an all-to-all plus a local sum) adds ``a + b`` exactly as
gloo's reduce-scatter does, and everything else is the same arithmetic in the same order.
On more ranks the summation order differs from gloo's ring (shardwise sums locally with
``torch.sum``), so the bf16/fp16 sums may round differently: those numerics are checked at
4 and 8 ranks against a reference computed by hand instead — each rank's local gradient of
a plain replica in the compute dtype, all-gathered, then averaged (or summed and divided by
the factor) in fp32 — within a few ulps of the reduce dtype (see ``_reduction_numerics``).
The GradScaler case runs on 4 ranks and is compared with torch within fp16 tolerance.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMP
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor

import shardwise
from _models import Transformer, apply_fully_shard, lm_loss, rank_generator, token_batch
from _mp_helpers import (
    SEQ,
    VOCAB,
    Agreement,
    MPNet,
    compare_with_torch,
    lm_loss_fp32,
    record_output_dtypes,
    shard_mpnet,
)
from shardwise import CPUOffloadPolicy, MixedPrecisionPolicy
from shardwise.testing import CommCounter, run_on_ranks

TIMEOUT = 90
STEPS = 10
LR = 0.1
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32

# (param_dtype, reduce_dtype, output_dtype, cast_forward_inputs)
MP_CASES = {
    "bf16_reduce_fp32": (BF16, FP32, None, True),
    "bf16_reduce_bf16_out_fp32": (BF16, BF16, FP32, True),
    "fp16_reduce_fp32_out_fp32": (FP16, FP32, FP32, True),
    "fp16_reduce_fp16": (FP16, FP16, None, True),
    "bf16_no_input_cast": (BF16, None, None, False),
    "fp32_compute_reduce_bf16": (None, BF16, None, True),
}


# ---------------------------------------------------------------- helpers (run on the ranks)


def _policies(case: tuple) -> tuple[MixedPrecisionPolicy, TorchMP]:
    param_dtype, reduce_dtype, output_dtype, cast = case
    kwargs = dict(
        param_dtype=param_dtype, reduce_dtype=reduce_dtype, output_dtype=output_dtype, cast_forward_inputs=cast
    )
    return MixedPrecisionPolicy(**kwargs), TorchMP(**kwargs)


def _mp_parity(case: tuple) -> dict:
    param_dtype, reduce_dtype, output_dtype, cast = case
    compute = param_dtype or FP32
    ours_mp, torch_mp = _policies(case)
    torch.manual_seed(0)
    base = MPNet()
    theirs = shard_mpnet(copy.deepcopy(base), torch_fully_shard, mp_policy=torch_mp)
    ours = shard_mpnet(base, shardwise.fully_shard, mp_policy=ours_mp)
    outputs = record_output_dtypes(ours)
    params = list(ours.parameters())
    ids = [id(p) for p in params]
    opts = [torch.optim.SGD(m.parameters(), lr=LR, foreach=True) for m in (ours, theirs)]
    gen = rank_generator()
    agreement = Agreement()
    for step in range(STEPS):
        tokens = token_batch(gen, VOCAB, seq_len=SEQ)
        before = [p.to_local().clone() for p in params]
        losses = []
        for model, opt in zip((ours, theirs), opts):
            opt.zero_grad()
            loss = lm_loss_fp32(model, tokens)
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        where = f"step {step}, rank {dist.get_rank()}"
        compare_with_torch(where, ours, theirs, *losses, agreement, exact=True, rtol=0, atol=0)
        # The optimizer holds and updates the sharded fp32 params; their grads are fp32 too.
        assert [id(p) for p in ours.parameters()] == ids, f"{where}: parameter objects changed"
        assert [id(p) for p in opts[0].param_groups[0]["params"]] == ids
        changed = 0
        for (name, p), old in zip(ours.named_parameters(), before):
            assert isinstance(p, DTensor) and p.dtype == p.to_local().dtype == FP32, f"{where}: {name} {p.dtype}"
            assert p._spec.tensor_meta.dtype == FP32, f"{where}: {name} spec {p._spec.tensor_meta.dtype}"
            assert isinstance(p.grad, DTensor) and p.grad.dtype == FP32 and p.grad.to_local().dtype == FP32, (
                f"{where}: {name}.grad {p.grad.dtype if p.grad is not None else None}"
            )
            changed += not torch.equal(p.to_local(), old)
        assert changed > 0, f"{where}: the optimizer step changed no parameter"
    # What the modules saw in forward: unsharded params in param_dtype; floating inputs
    # cast to param_dtype (including the fp32 intermediate fed to the grouped pair's second
    # member), integer inputs untouched; outputs in output_dtype.
    input_dtype = compute if cast else FP32
    assert set(ours.seen) == {(torch.int64, compute, torch.int64)}, ours.seen  # (tokens, embedding, marker)
    assert set(ours.mid.seen) == {(compute, compute)}, ours.mid.seen
    assert set(ours.head.seen) == {(input_dtype, torch.int64, compute)}, ours.head.seen
    expected_out = output_dtype or compute
    for name, dtypes in outputs.items():
        assert dtypes and set(dtypes) == {expected_out}, f"outputs of {name!r}: {set(dtypes)}, expected {expected_out}"
    return agreement.as_dict()


class TwoLinears(nn.Module):
    """Weights (17, 257) and (64, 297) plus biases: uneven over 4 and 8 ranks (8 ranks leave
    ``small`` with zero rows on the last two)."""

    def __init__(self):
        super().__init__()
        self.small = nn.Linear(257, 17)
        self.big = nn.Linear(297, 64)

    def forward(self, x_small: torch.Tensor, x_big: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.small(x_small), self.big(x_big)


def _numerics_batch(regime: str) -> tuple[torch.Tensor, ...]:
    """(x_small, x_big, upstream grad of small, upstream grad of big), different per rank.

    ``signed``: N(0, 1) everywhere. ``large``: all positive, with each rank's fp16 gradients in
    [2.0e4, 3.1e4]: their sum over 4 or more ranks overflows fp16 (65504) unless the sum is
    pre-divided, while the mean is representable.
    """
    gen = rank_generator(7)
    shapes = [(2, 257), (2, 297), (2, 17), (2, 64)]
    if regime == "signed":
        return tuple(torch.randn(s, generator=gen) for s in shapes)
    xs = [0.8 + 0.2 * torch.rand(s, generator=gen) for s in shapes[:2]]
    cs = [1.6e4 * (0.8 + 0.15 * torch.rand(s, generator=gen)) for s in shapes[2:]]
    return (*xs, *cs)


def _numerics_loss(model: nn.Module, batch: tuple[torch.Tensor, ...], dtype: torch.dtype) -> torch.Tensor:
    x_small, x_big, c_small, c_big = batch
    out_small, out_big = model(x_small.to(dtype), x_big.to(dtype))
    return (out_small.float() * c_small).sum() + (out_big.float() * c_big).sum()


def _reduction_numerics(compute: torch.dtype, reduce: torch.dtype, factor: float | None, regime: str) -> dict:
    """Our reduced grads vs all-gathered local grads of a replica, averaged (or / factor) in fp32."""
    world = dist.get_world_size()
    torch.manual_seed(0)
    base = TwoLinears()
    replica = copy.deepcopy(base).to(compute)  # computes the same local grads in the compute dtype
    mp = MixedPrecisionPolicy(param_dtype=None if compute == FP32 else compute, reduce_dtype=reduce)
    shardwise.fully_shard(base.small, mp_policy=mp)
    shardwise.fully_shard(base, mp_policy=mp)
    if factor is not None:  # per module, like torch's (it does not recurse into submodules)
        for module in (base.small, base):
            module.set_gradient_divide_factor(factor)
    batch = _numerics_batch(regime)
    _numerics_loss(base, batch, compute).backward()
    _numerics_loss(replica, batch, compute).backward()
    local = torch.cat([p.grad.reshape(-1) for p in replica.parameters()])  # compute dtype
    gathered = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(gathered, local)
    grads = torch.stack(gathered).float()  # (N, numel): every rank's local grads, in fp32
    divisor = float(world if factor is None else factor)
    if compute == BF16 and factor is not None:
        expected = (grads * (1.0 / divisor)).sum(0)  # the reference: upcast, scale by 1/f, sum
    else:
        expected = grads.sum(0) / divisor
    magnitude = grads.abs().sum(0) / divisor
    # Rounding in the reduce dtype: at most one per addition of the N-term sum and one per
    # pre/post division, each within eps of the sum of magnitudes.
    bound = (world + 2) * torch.finfo(reduce).eps * magnitude
    ours = torch.cat([p.grad.full_tensor().reshape(-1) for p in base.parameters()])
    for p in base.parameters():
        assert isinstance(p.grad, DTensor) and p.grad.dtype == FP32, f"grad {p.grad.dtype}"
    assert torch.isfinite(ours).all(), f"non-finite reduced grads: {(~torch.isfinite(ours)).sum()} elements"
    error = (ours.double() - expected.double()).abs()
    worst = int((error - bound.double()).argmax())
    assert (error <= bound).all(), (
        f"rank {dist.get_rank()}: reduced grad off by {error[worst]:.3e} at {worst} (allowed {bound[worst]:.3e}; "
        f"ours {ours[worst]:.6e}, expected {expected[worst]:.6e})"
    )
    relative = float((error / magnitude.double().clamp_min(1e-30)).max())
    return {"max_rel_error": relative, "sum_exceeds_fp16": bool(grads.sum(0).abs().max() > torch.finfo(FP16).max)}


def _count_and_bytes(tally, *kinds: str) -> tuple[int, int]:
    return sum(tally.count(k) for k in kinds), sum(tally.payload_bytes(k) for k in kinds)


# On gloo shardwise reduce-scatters as an all-to-all plus a local sum (the same payload as
# gloo's reduce-scatter input): both count as the gradient reduction.
REDUCTION = ("reduce_scatter", "all_to_all")


def _step_tallies(model: nn.Module, opt, steps: int) -> list[dict]:
    gen = rank_generator()
    tallies = []
    for _ in range(steps):
        tokens = token_batch(gen, VOCAB, seq_len=SEQ)
        opt.zero_grad()
        with CommCounter() as comm:
            lm_loss(model, tokens).backward()
        opt.step()  # outside the counter: DTensor sharding propagation fails under a dispatch mode
        tally = comm.snapshot()
        tallies.append(
            {
                "all_gather": _count_and_bytes(tally, "all_gather"),
                "reduction": _count_and_bytes(tally, *REDUCTION),
                "all_reduce": _count_and_bytes(tally, "all_reduce"),
            }
        )
    return tallies


def _bytes_per_step() -> dict:
    """Per config: our and torch's (count, bytes) of each collective kind, for 2 steps."""
    result = {}
    configs = {"fp32": (None, None), "bf16_reduce_fp32": (BF16, FP32), "bf16_reduce_bf16": (BF16, None)}
    for name, (param_dtype, reduce_dtype) in configs.items():
        torch.manual_seed(0)
        base = Transformer(vocab_size=VOCAB, dim=16, n_layers=2, n_heads=2, max_seq_len=SEQ, ffn_hidden=32)
        kwargs = dict(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
        theirs = apply_fully_shard(copy.deepcopy(base), torch_fully_shard, mp_policy=TorchMP(**kwargs))
        ours = apply_fully_shard(base, shardwise.fully_shard, mp_policy=MixedPrecisionPolicy(**kwargs))
        result[name] = {
            impl: _step_tallies(model, torch.optim.SGD(model.parameters(), lr=LR), 2)
            for impl, model in (("ours", ours), ("torch", theirs))
        }
    return result


def _accumulate_without_sync(param_dtype, reduce_dtype, microbatches: int, steps: int) -> dict:
    """Sync off for all microbatches but the last, vs torch. Unsynced grads accumulate in
    reduce_dtype when it differs from the compute dtype (fp32 for bf16 compute: more precise;
    bf16 for fp32 compute: less), exactly like torch."""
    ours_mp, torch_mp = _policies((param_dtype, reduce_dtype, None, True))
    torch.manual_seed(0)
    base = MPNet()
    theirs = shard_mpnet(copy.deepcopy(base), torch_fully_shard, mp_policy=torch_mp)
    ours = shard_mpnet(base, shardwise.fully_shard, mp_policy=ours_mp)
    opts = [torch.optim.SGD(m.parameters(), lr=LR, foreach=True) for m in (ours, theirs)]
    gen = rank_generator()
    agreement = Agreement()
    counts = []
    for step in range(steps):
        for opt in opts:
            opt.zero_grad()
        for micro in range(microbatches):
            tokens = token_batch(gen, VOCAB, seq_len=SEQ)
            last = micro == microbatches - 1
            losses, reduce_scatters = [], []
            for model in (ours, theirs):
                model.set_requires_gradient_sync(last)
                with CommCounter() as comm:
                    loss = lm_loss_fp32(model, tokens)
                    loss.backward()
                losses.append(loss.detach())
                reduce_scatters.append(_count_and_bytes(comm.snapshot(), *REDUCTION)[0])
            where = f"step {step}, microbatch {micro}, rank {dist.get_rank()}"
            counts.append((where, last, *reduce_scatters))
            # grads are None on both while sync is off, and equal once reduced
            compare_with_torch(where, ours, theirs, *losses, agreement, exact=True, rtol=0, atol=0)
        for opt in opts:
            opt.step()
        compare_with_torch(f"after step {step}", ours, theirs, *losses, agreement, exact=True, rtol=0, atol=0)
    # No reduction while sync is off (the count once sync is back on is checked, like torch's,
    # by test_grouped_pair_gathers_and_reduces_once_per_step_like_torch).
    for where, last, mine, theirs_count in counts:
        if not last:
            assert (mine, theirs_count) == (0, 0), f"{where}: reductions with sync off: ours {mine}, torch {theirs_count}"
        else:
            assert mine > 0 and theirs_count > 0, f"{where}: no reduction with sync on: {mine}, torch {theirs_count}"
    return agreement.as_dict()


def _collectives_per_step() -> dict:
    """(count, bytes) of each collective kind in forward and in backward, ours and torch's,
    for the bf16 MPNet (two blocks, the grouped pair, the root: 4 groups)."""
    ours_mp, torch_mp = _policies((BF16, FP32, None, True))
    torch.manual_seed(0)
    base = MPNet()
    models = {
        "torch": shard_mpnet(copy.deepcopy(base), torch_fully_shard, mp_policy=torch_mp),
        "ours": shard_mpnet(base, shardwise.fully_shard, mp_policy=ours_mp),
    }
    tokens = token_batch(rank_generator(), VOCAB, seq_len=SEQ)
    result = {}
    for name, model in models.items():
        with CommCounter() as comm:
            loss = lm_loss_fp32(model, tokens)
            forward = comm.snapshot()
            loss.backward()
        backward = comm.snapshot() - forward
        result[name] = {
            "forward all_gather": _count_and_bytes(forward, "all_gather"),
            "backward all_gather": _count_and_bytes(backward, "all_gather"),
            "backward reduction": _count_and_bytes(backward, *REDUCTION),
        }
    return result


def _grad_scaler(steps: int, inject_step: int) -> dict:
    """fp16 with torch.amp.GradScaler("cpu"); at ``inject_step`` rank 0's upstream gradient of
    output 7 overflows fp16, so only the rank owning row 7 of the weight sees inf in its shard."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    base = nn.Linear(16, 8)
    theirs = torch_fully_shard(copy.deepcopy(base), mp_policy=TorchMP(param_dtype=FP16))
    ours = shardwise.fully_shard(base, mp_policy=MixedPrecisionPolicy(param_dtype=FP16))
    models = (ours, theirs)
    opts = [torch.optim.SGD(m.parameters(), lr=LR) for m in models]
    scalers = [torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=2) for _ in models]
    gen = rank_generator(3)
    record = {"scale": [], "nonfinite_local": [], "stepped": []}
    agreement = Agreement()
    for step in range(steps):
        x, c = torch.randn(2, 16, generator=gen), torch.randn(2, 8, generator=gen)
        if step == inject_step and rank == 0:
            c[:, 7] = 1e6  # times the loss scale: far past fp16's max in backward
        losses = []
        for i, (model, opt, scaler) in enumerate(zip(models, opts, scalers)):
            opt.zero_grad()
            before = [p.to_local().clone() for p in model.parameters()]
            loss = (model(x).float() * c).sum()
            scaler.scale(loss).backward()
            if i == 0:
                finite = all(torch.isfinite(p.grad.to_local()).all() for p in model.parameters())
                record["nonfinite_local"].append(not finite)
            scaler.step(opt)
            scaler.update()
            losses.append(loss.detach())
            if i == 0:
                changed = [not torch.equal(p.to_local(), b) for p, b in zip(model.parameters(), before)]
                record["stepped"].append(any(changed))
                record["scale"].append(scaler.get_scale())
        for p, q in zip(ours.parameters(), theirs.parameters()):  # same overflowing elements as torch's
            mine, their = p.grad.to_local(), q.grad.to_local()
            assert torch.equal(~torch.isfinite(mine), ~torch.isfinite(their)), f"step {step}, rank {rank}"
            mine[~torch.isfinite(mine)] = 0  # (inf vs nan may differ) compare the finite rest below
            their[~torch.isfinite(their)] = 0
        # fp16 sums over 4 ranks: shardwise's gloo reduction (all-to-all + local sum) adds in a
        # different order than gloo's reduce-scatter, so fp16 rounding may differ.
        where = f"step {step}, rank {rank}"
        compare_with_torch(where, ours, theirs, *losses, agreement, exact=False, rtol=4e-3, atol=2e-3)
        assert scalers[0].get_scale() == scalers[1].get_scale()
    # every rank's view of the scale, gathered
    views = [None] * world
    dist.all_gather_object(views, record["scale"])
    record["scales_on_all_ranks"] = views
    record["agreement"] = agreement.as_dict()
    return record


# ---------------------------------------------------------------- tests: parity with torch


@pytest.mark.parametrize("case", list(MP_CASES))
def test_mixed_precision_parity_with_torch(case):
    # 2 ranks: shardwise's gloo reduction (all-to-all + local sum) adds a + b exactly like
    # gloo's reduce-scatter, so every case is bit-equal to torch (see the module docstring).
    agreements = run_on_ranks(_mp_parity, 2, MP_CASES[case], timeout=TIMEOUT)
    assert all(a["loss"] and a["params"] and a["grads"] for a in agreements), agreements


# ---------------------------------------------------------------- tests: reduction numerics

# name: (compute dtype, reduce dtype, gradient divide factor, data regime)
NUMERICS = {
    "fp32_mean": (FP32, FP32, None, "signed"),
    "fp32_divide_3": (FP32, FP32, 3.0, "signed"),
    "fp16_mean_near_overflow": (FP16, FP16, None, "large"),
    "fp16_divide_3": (FP16, FP16, 3.0, "signed"),
    "bf16_upcast_fp32_divide_3": (BF16, FP32, 3.0, "signed"),
    "bf16_mean_in_bf16": (BF16, BF16, None, "signed"),
}


@pytest.mark.parametrize("world_size", [4, 8])
@pytest.mark.parametrize("case", list(NUMERICS))
def test_reduction_numerics_against_hand_computed_reference(case, world_size):
    results = run_on_ranks(_reduction_numerics, world_size, *NUMERICS[case], timeout=TIMEOUT)
    if NUMERICS[case][3] == "large":  # the case really stresses fp16's range
        assert all(r["sum_exceeds_fp16"] for r in results), results


# ---------------------------------------------------------------- tests: bytes on the wire


def test_all_gather_bytes_halve_in_bf16_and_reduce_scatter_bytes_follow_reduce_dtype():
    per_rank = run_on_ranks(_bytes_per_step, 2, timeout=TIMEOUT)
    for rank, result in enumerate(per_rank):
        for name, impls in result.items():
            assert impls["ours"] == impls["torch"], f"rank {rank}, {name}: ours {impls['ours']}, torch {impls['torch']}"
        fp32, bf16_fp32, bf16 = (result[k]["ours"] for k in ("fp32", "bf16_reduce_fp32", "bf16_reduce_bf16"))
        for step in range(2):
            ag = fp32[step]["all_gather"]
            rs = fp32[step]["reduction"]
            assert ag[0] == 5 and rs[0] == 3, f"step {step}: {fp32[step]}"  # 3 gathers forward, 2 in backward
            assert bf16_fp32[step]["all_gather"] == (ag[0], ag[1] // 2), bf16_fp32[step]
            assert bf16[step]["all_gather"] == (ag[0], ag[1] // 2), bf16[step]
            assert ag[1] % 2 == 0
            assert bf16_fp32[step]["reduction"] == rs, bf16_fp32[step]
            assert bf16[step]["reduction"] == (rs[0], rs[1] // 2), bf16[step]
            assert fp32[step]["all_reduce"] == (0, 0)


# ---------------------------------------------------------------- tests: accumulation, GradScaler


@pytest.mark.parametrize(
    "param_dtype,reduce_dtype", [(BF16, FP32), (None, BF16)], ids=["bf16_reduce_fp32", "fp32_reduce_bf16"]
)
def test_gradient_accumulation_without_sync_matches_torch(param_dtype, reduce_dtype):
    agreements = run_on_ranks(_accumulate_without_sync, 2, param_dtype, reduce_dtype, 3, 2, timeout=TIMEOUT)
    assert all(all(v for k, v in a.items() if not k.startswith("max")) for a in agreements), agreements


def test_grouped_pair_gathers_and_reduces_once_per_step_like_torch():
    # fully_shard([mid, head]) is one group: one all-gather in forward, one in backward, one
    # reduction for both members' grads. 4 groups; the root is not resharded after forward.
    for rank, result in enumerate(run_on_ranks(_collectives_per_step, 2, timeout=TIMEOUT)):
        assert result["torch"]["forward all_gather"][0] == 4 and result["torch"]["backward reduction"][0] == 4
        assert result["ours"] == result["torch"], f"rank {rank}: ours {result['ours']}, torch {result['torch']}"


def test_grad_scaler_skips_the_step_on_every_rank_when_one_shard_overflows():
    steps, inject = 5, 2
    records = run_on_ranks(_grad_scaler, 4, steps, inject, timeout=TIMEOUT)
    owner = 3  # rows 6..7 of the (8, 16) weight and elements 6..7 of the bias live on rank 3 of 4
    for rank, record in enumerate(records):
        expected_nonfinite = [step == inject and rank == owner for step in range(steps)]
        assert record["nonfinite_local"] == expected_nonfinite, (rank, record)
        assert record["stepped"] == [step != inject for step in range(steps)], (
            f"rank {rank} stepped {record['stepped']}: every rank must skip step {inject} and only it"
        )
        # growth_interval=2: x2 after two clean steps, x0.5 on the overflow, x2 after two more
        assert record["scale"] == [256.0, 512.0, 256.0, 256.0, 512.0], (rank, record["scale"])
        assert all(view == record["scale"] for view in record["scales_on_all_ranks"]), record["scales_on_all_ranks"]


# ---------------------------------------------------------------- tests: bad policies (no ranks needed)


@pytest.mark.parametrize("field", ["param_dtype", "reduce_dtype", "output_dtype"])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.bool, torch.complex64])
def test_non_floating_policy_dtype_is_a_value_error(field, dtype):
    with pytest.raises(ValueError, match=rf"{field}.*floating.*{dtype}"):
        MixedPrecisionPolicy(**{field: dtype})


def test_policy_field_of_wrong_type_is_a_type_error():
    with pytest.raises(TypeError, match="param_dtype"):
        MixedPrecisionPolicy(param_dtype="bfloat16")
    with pytest.raises(TypeError, match="cast_forward_inputs"):
        MixedPrecisionPolicy(cast_forward_inputs=1)
    with pytest.raises(TypeError, match="pin_memory"):
        CPUOffloadPolicy(pin_memory="yes")


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(mp_policy=CPUOffloadPolicy()),
        dict(mp_policy=BF16),
        dict(offload_policy=MixedPrecisionPolicy()),
        dict(offload_policy="cpu"),
    ],
    ids=["offload_as_mp", "dtype_as_mp", "mp_as_offload", "string_as_offload"],
)
def test_policy_object_of_wrong_type_is_a_type_error_before_any_collective(kwargs):
    # No process group exists in this process: the check must come first.
    module = nn.Linear(4, 4)
    (argument,) = kwargs
    with pytest.raises(TypeError, match=argument):
        shardwise.fully_shard(module, **kwargs)
    assert not isinstance(module, shardwise.FSDPModule)
    assert not isinstance(module.weight, DTensor)
