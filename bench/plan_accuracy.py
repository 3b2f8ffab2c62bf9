"""Planner accuracy: shardwise.plan's predictions against real gloo runs of the same wrapping.

For each case (GPT preset or a small Transformers Llama, world size, reshard policy,
precision) every rank builds the model, applies ``shardwise.auto_shard`` with the plan
``shardwise.plan`` made for it, trains warm-up steps, then measures one step's collectives
(``shardwise.comm_stats``) and its peak live tensor bytes (:class:`bench.memory.PeakMemory`,
seeded like the benchmark with params, grads, optimizer state and the batch):

- with the run's batch: against the predicted peak *with* activations (target: within 20%);
- with a one-token batch, where activations are negligible: against the predicted peak
  *without* activations (target: within 10%);
- bytes on the wire and collective counts: equal.

    python -m bench.plan_accuracy                 # the full table (tiny/small/medium, llama; 2 and 4 ranks)
    python -m bench.plan_accuracy --quick         # tiny only
"""

from __future__ import annotations

import argparse
import dataclasses

import torch
import torch.nn.functional as F

import shardwise
from shardwise.testing.memory import PeakMemory, tensors_of
from shardwise import comm_stats
from shardwise.testing import run_on_ranks
from shardwise.train.model import GPT, GPTConfig

__all__ = ["AccuracyCase", "measure_case", "main"]

WARMUP = 2


@dataclasses.dataclass(frozen=True)
class AccuracyCase:
    model: str  # tiny | small | medium | llama
    world_size: int
    reshard: bool | int
    dtype: str  # fp32 | bf16
    batch_size: int = 2
    seq_len: int | None = None  # None: the preset's
    mesh_shape: tuple[int, int] | None = None  # HSDP (replicate, shard); None: 1-D over world_size
    checkpointing: bool = False  # activation checkpointing of every block (applied by auto_shard)

    @property
    def label(self) -> str:
        mesh = f" mesh {self.mesh_shape[0]}x{self.mesh_shape[1]}" if self.mesh_shape else ""
        ac = " AC" if self.checkpointing else ""
        return f"{self.model} ws{self.world_size}{mesh} rs={self.reshard} {self.dtype}{ac}"


def build_model(name: str) -> tuple[torch.nn.Module, int, int]:
    """(model, vocab size, default seq len), the same on every rank (seed 0)."""
    torch.manual_seed(0)
    if name == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=352, num_hidden_layers=4,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
        return LlamaForCausalLM(cfg), 256, 128
    cfg = GPTConfig.preset(name)
    return GPT(cfg), cfg.vocab_size, cfg.seq_len


def _step(model, opt, x, y):
    out = model(x)
    logits = out if isinstance(out, torch.Tensor) else out.logits
    loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _batch(vocab: int, b: int, t: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (b, t + 1), generator=gen)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def measure_case(case: AccuracyCase, batch: tuple[int, int] | None = None) -> dict:
    """On every rank: plan, auto_shard, train; rank 0's predictions and measurements."""
    import torch.distributed as dist

    model, vocab, seq = build_model(case.model)
    b, t = batch or (case.batch_size, case.seq_len or seq)
    mp = shardwise.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if case.dtype == "bf16" else None
    plan = shardwise.plan(model, mesh_shape=case.mesh_shape or (dist.get_world_size(),), device="cpu", mp_policy=mp,
                          batch=(b, t), reshard_after_forward=case.reshard, foreach=True,
                          activation_checkpointing=case.checkpointing)
    shardwise.auto_shard(model, plan)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    x, y = _batch(vocab, b, t, dist.get_rank())
    for _ in range(WARMUP):
        _step(model, opt, x, y)
    comm_stats.reset()
    _step(model, opt, x, y)
    stats = comm_stats.snapshot()
    with PeakMemory(tensors_of(model, opt) + [x, y]) as mem:
        _step(model, opt, x, y)
    peaks = [None] * dist.get_world_size()
    dist.all_gather_object(peaks, mem.peak_bytes)
    return {
        "predicted": plan.peak_bytes, "predicted_no_act": plan.peak_bytes_without_activations,
        "measured": max(peaks), "peak_at": plan.peak_at,
        "wire_predicted": plan.comm_wire_bytes, "wire_measured": dict(stats.wire_bytes),
        "counts_predicted": plan.comm_counts, "counts_measured": dict(stats.counts),
    }


def run(case: AccuracyCase) -> dict:
    full = run_on_ranks(measure_case, case.world_size, case, timeout=600)[0]
    tiny = run_on_ranks(measure_case, case.world_size, case, (1, 1), timeout=600)[0]
    return {"case": case, "full": full, "no_act": tiny}


def cases(quick: bool) -> list[AccuracyCase]:
    models = ["tiny"] if quick else ["tiny", "small", "medium", "llama"]
    out = []
    for m in models:
        for ws in (2, 4):
            for rs in (True, False, 2 if ws == 4 else None):
                if rs is None:
                    continue
                for dt in ("fp32", "bf16"):
                    out.append(AccuracyCase(m, ws, rs, dt))
    return out


def _pct(pred: int, meas: int) -> str:
    return f"{100 * (pred - meas) / meas:+.1f}%"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--models", nargs="*")
    parser.add_argument("--hsdp", action="store_true", help="only the HSDP cases (4 ranks as 2 x 2)")
    parser.add_argument("--ac", action="store_true", help="only activation-checkpointing cases (2 ranks)")
    args = parser.parse_args(argv)
    todo = cases(args.quick)
    if args.models:
        todo = [c for c in todo if c.model in args.models]
    if args.hsdp:
        todo = [AccuracyCase(m, 4, rs, dt, mesh_shape=(2, 2)) for m in (args.models or ["tiny"])
                for rs in (True, False) for dt in ("fp32", "bf16")]
    if args.ac:
        todo = [AccuracyCase(m, 2, rs, dt, checkpointing=True) for m in (args.models or ["tiny"])
                for rs in (True, False) for dt in ("fp32", "bf16")]
    print("| case | no-act pred / meas (MiB) | err | with-act pred / meas (MiB) | err | wire exact | counts exact |")
    print("|---|---|---|---|---|---|---|")
    for case in todo:
        r = run(case)
        f, n = r["full"], r["no_act"]
        mib = 2**20
        print(f"| {case.label} | {n['predicted_no_act'] / mib:.2f} / {n['measured'] / mib:.2f} | "
              f"{_pct(n['predicted_no_act'], n['measured'])} | {f['predicted'] / mib:.2f} / {f['measured'] / mib:.2f} | "
              f"{_pct(f['predicted'], f['measured'])} | {f['wire_predicted'] == f['wire_measured']} | "
              f"{f['counts_predicted'] == f['counts_measured']} |", flush=True)


if __name__ == "__main__":
    main()
