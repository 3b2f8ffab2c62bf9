"""CUDA: shardwise on a GPU, against torch's FSDP2 on the same seed and data.

Skipped (with the reason) where no CUDA device is present, which is every CI run: these
are the checks a lent GPU runs. World size 1 runs on NCCL in this process; the two-rank
cases share the one GPU over gloo, which accepts CUDA tensors (NCCL refuses two ranks on
one device). Each parity case compares every step's loss and, at the end, every
parameter with ``torch.equal`` (bit-equal: same kernels, same order).
"""

from __future__ import annotations

import copy
import os
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import CPUOffloadPolicy as TorchOffload
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMP
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.utils.checkpoint import checkpoint

import shardwise
from shardwise import faults
from shardwise.faults import poller
from shardwise.faults.ledger import Ledger, ledger_for
from shardwise.faults.records import Collective
from shardwise.testing import CommCounter, run_on_ranks
from _models import Transformer, allreduce_mean_grads, chunk_of, lm_loss

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; this machine has none")

DIMS = dict(vocab_size=64, dim=32, n_layers=3, n_heads=4, max_seq_len=16, ffn_hidden=64)
STEPS = 4


@pytest.fixture
def nccl_rank():
    """A one-rank NCCL default group on cuda:0, in this process."""
    if dist.is_initialized():
        pytest.fail("a default process group is already initialised by an earlier test")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=torch.device("cuda", 0))
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


CONFIGS = {
    "fp32": {},
    "bf16": {"mp": (torch.bfloat16, torch.float32)},
    "no-reshard": {"reshard_after_forward": False},
    "activation-checkpointing": {"ac": True},
    "offload": {"offload": True},
}


def _checkpointed(block: nn.Module) -> None:
    forward = block.forward
    block.forward = lambda x: checkpoint(forward, x, use_reentrant=False)


def _sharded(base: nn.Module, impl: str, config: dict) -> nn.Module:
    model = copy.deepcopy(base)
    fully_shard = shardwise.fully_shard if impl == "shardwise" else torch_fully_shard
    kwargs = {"reshard_after_forward": config.get("reshard_after_forward", True)}
    if "mesh" in config:
        kwargs["mesh"] = config["mesh"]
    if "mp" in config:
        policy = shardwise.MixedPrecisionPolicy if impl == "shardwise" else TorchMP
        kwargs["mp_policy"] = policy(param_dtype=config["mp"][0], reduce_dtype=config["mp"][1])
    if config.get("offload"):
        kwargs["offload_policy"] = (shardwise.CPUOffloadPolicy if impl == "shardwise" else TorchOffload)()
    else:
        model.cuda()
    for layer in model.layers:
        if config.get("ac"):
            _checkpointed(layer)
        fully_shard(layer, **kwargs)
    return fully_shard(model, **kwargs)


def _train(model: nn.Module, batches: list[torch.Tensor]) -> list[torch.Tensor]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for tokens in batches:
        loss = lm_loss(model, tokens)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return losses


def _batches(seed: int = 0) -> list[torch.Tensor]:
    """One batch, ``STEPS`` times: its loss falls step after step (random tokens don't)."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, DIMS["vocab_size"], (4, 17), generator=gen).cuda()] * STEPS


@pytest.mark.parametrize("config", list(CONFIGS))
def test_world_size_one_matches_torch(nccl_rank, config):
    torch.manual_seed(0)
    base = Transformer(**DIMS)
    ours, theirs = (_sharded(base, impl, CONFIGS[config]) for impl in ("shardwise", "torch"))
    batches = _batches()
    our_losses, their_losses = _train(ours, batches), _train(theirs, batches)
    assert torch.equal(torch.stack(our_losses), torch.stack(their_losses)), (our_losses, their_losses)
    assert our_losses[-1] < our_losses[0], "did not train"
    for (name, p), q in zip(ours.named_parameters(), theirs.parameters()):
        assert torch.equal(p.full_tensor(), q.full_tensor()), name
        if CONFIGS[config].get("offload"):
            assert p.device.type == "cpu" and p.to_local().is_pinned(), f"{name} is not in pinned host memory"
        else:
            assert p.device.type == "cuda", name


def test_world_size_one_issues_no_collectives(nccl_rank):
    torch.manual_seed(0)
    model = _sharded(Transformer(**DIMS), "shardwise", {})
    with CommCounter() as comm:
        _train(model, _batches())
    assert comm.snapshot().count() == 0, comm.snapshot()


def _hooked_grads(impl: str, stream: torch.cuda.Stream) -> tuple[list, list[torch.Tensor]]:
    """One backward with an all-reduce hook on ``stream`` that scales the reduced grads by 2
    after a long kernel: the streams the hook saw, and the grads (wrong if unordered)."""
    torch.manual_seed(0)
    model = _sharded(Transformer(**DIMS), impl, {})
    seen = []

    def hook(reduced: torch.Tensor) -> None:
        seen.append(torch.cuda.current_stream())
        torch.cuda._sleep(1_000_000)  # the .grad write must wait for the scaling below
        reduced.mul_(2)

    for block in [*model.layers, model]:
        block.set_all_reduce_hook(hook, stream=stream)
    lm_loss(model, _batches()[0]).backward()
    return seen, [p.grad.full_tensor() for p in model.parameters()]


def test_all_reduce_hook_runs_on_its_stream_like_torch(nccl_rank):
    stream = torch.cuda.Stream()
    (our_streams, ours), (their_streams, theirs) = (_hooked_grads(impl, stream) for impl in ("shardwise", "torch"))
    assert our_streams and all(s == stream for s in our_streams), our_streams
    assert len(our_streams) == len(their_streams) and all(s == stream for s in their_streams), their_streams
    for a, b in zip(ours, theirs):
        assert torch.equal(a, b)


# ---------------------------------------------------------------- two ranks on one GPU (gloo)


def _two_ranks_on_one_gpu(config: dict) -> list[float]:
    torch.cuda.set_device(0)
    mesh = dist.device_mesh.init_device_mesh("cuda", (dist.get_world_size(),))
    torch.manual_seed(0)
    base = Transformer(**DIMS)
    ref = copy.deepcopy(base).cuda()
    ours = _sharded(base, "shardwise", dict(config, mesh=mesh))
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    opt = torch.optim.AdamW(ours.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(100 + dist.get_rank())
    tokens = torch.randint(0, DIMS["vocab_size"], (4, 17), generator=gen).cuda()
    losses = []
    for _ in range(STEPS):
        loss, ref_loss = lm_loss(ours, tokens), lm_loss(ref, tokens)
        loss.backward()
        ref_loss.backward()
        allreduce_mean_grads(ref)
        opt.step(), ref_opt.step(), opt.zero_grad(), ref_opt.zero_grad()
        torch.testing.assert_close(loss, ref_loss)
        losses.append(loss.item())
    for name, p in ours.named_parameters():  # each rank its chunk (DTensor's own gather over gloo-on-CUDA crashes torch 2.11)
        expected = chunk_of(ref.get_parameter(name).detach(), dist.get_rank(), dist.get_world_size())
        torch.testing.assert_close(p.to_local(), expected, msg=name)
    return losses


@pytest.mark.parametrize("config", ["fp32", "no-reshard"])
def test_two_ranks_on_one_gpu_match_the_replica(config):
    histories = run_on_ranks(_two_ranks_on_one_gpu, 2, {k: v for k, v in CONFIGS[config].items()}, timeout=300)
    assert all(h[-1] < h[0] for h in histories), histories


# ---------------------------------------------------------------- the watchdog on real NCCL works


def _sleep_on_stream(seconds: float) -> None:
    """Keep the current stream busy for about ``seconds`` (an NCCL collective queued after it stays in flight)."""
    torch.cuda._sleep(int(seconds * 1.4e9))  # spin cycles; H100 clocks run near 1.4-2 GHz


def test_poller_follows_real_nccl_works_and_never_blames_a_slow_one(nccl_rank):
    faults.configure(watchdog_s=0.5, heartbeat_s=0.05)
    try:
        ledger = Ledger(nccl_rank, generation=1000)  # a one-rank group has no ledger of its own
        position = ledger.record(Collective("all-reduce", "slow", "backward", 1024, torch.float32))
        mine = poller.poller_for(ledger.rank, 0.05)
        _sleep_on_stream(2.0)
        work = dist.all_reduce(torch.ones(1024, device="cuda"), async_op=True)
        work.wait()  # NCCL: orders the stream, returns at once
        mine.watch(work, nccl_rank, ledger, position, deadline=0.5)
        assert not work.is_completed()
        time.sleep(0.5)
        assert mine.in_flight() == 1 and ledger.beacon.status().waiting == position
        torch.cuda.synchronize()
        time.sleep(0.3)
        assert mine.in_flight() == 0 and ledger.beacon.status().waiting is None
        poller.raise_if_failed(ledger.rank)  # past the deadline, but no peer says hang
    finally:
        faults.configure(watchdog_s=60.0, heartbeat_s=None)


def _nccl_peer_stops() -> tuple[str | None, float]:
    """Rank 0 waits on a real NCCL collective; rank 1 stops reporting (frozen host)."""
    os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "0"  # our abort, not torch's teardown, in this test
    torch.cuda.set_device(0)
    faults.configure(order_check="off", watchdog_s=1.0, heartbeat_s=0.1)
    own = [dist.new_group([r], backend="nccl") for r in range(2)][dist.get_rank()]
    ledger = ledger_for(dist.new_group(backend="gloo"))
    dist.barrier()
    if dist.get_rank() == 1:
        ledger.beacon.stop(join_timeout=5.0)
        time.sleep(6.0)
        return None, 0.0
    dist.all_reduce(torch.ones(1, device="cuda"), group=own)  # the communicator starts (seconds) here, not below
    torch.cuda.synchronize()
    _sleep_on_stream(5.0)
    work = dist.all_reduce(torch.ones(1024, device="cuda"), group=own, async_op=True)
    position = ledger.record(Collective("reduce-scatter", "layers.2", "backward", 1024, torch.float32))
    start = time.monotonic()
    poller.poller_for(ledger.rank, 0.1).watch(work, own, ledger, position, deadline=1.0)
    while time.monotonic() - start < 8.0:
        try:
            poller.raise_if_failed(ledger.rank)
        except faults.CollectiveTimeoutError as err:
            return str(err), time.monotonic() - start
        time.sleep(0.05)
    return None, time.monotonic() - start


def test_poller_names_a_stopped_peer_over_nccl():
    message, seconds = run_on_ranks(_nccl_peer_stops, 2, timeout=120)[0]
    assert message is not None, f"no error within {seconds:.1f} s"
    assert "rank 1 has not reported" in message and "backward reduce-scatter of layers.2" in message, message
    assert 1.0 <= seconds < 4.0, seconds
