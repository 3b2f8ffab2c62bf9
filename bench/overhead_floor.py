"""``python -m bench.overhead_floor``: what the mechanisms FSDP2's API prescribes cost per unit.

:mod:`bench.overhead` measures each wrapper's per-unit overhead on a stack of K blocks.
This measures the part of it that no implementation of the API can avoid, on the same
stack at world size 1 (one process, no collective), each mechanism added to a plain
model on its own, per unit (one block: two Linears, four parameters)::

    module hooks        a forward pre-hook and a forward hook per unit (the API's
                        "unshard before, reshard after"), dynamo-disabled as a wrapper's are
    post-backward       a hook on each unit's input tensor: it runs once the input's
                        gradient is complete, so once the unit's gradients are (shardwise
                        runs it in the previous unit's output hook). FSDP2's, an identity
                        autograd.Function on the inputs, is printed below the floor: a
                        Function's apply and backward node cost more
    pre-backward        a hook on each unit's output tensor (FSDP2's kind)
    DTensor gradients   each backward's gradient of the unit's four parameters made a
                        DTensor and set as ``.grad`` (the API makes sharded gradients
                        DTensors; autograd sets a plain model's for free)
    DTensor optimizer   SGD over the unit's four parameters as DTensors with DTensor
                        gradients sharing their spec objects, as FSDP2's and shardwise's do
                        (the API makes sharded parameters and gradients DTensors) against
                        the same SGD over plain tensors

Each figure is the training thread's CPU time (robust to a loaded machine), the 20th
percentile of ``steps`` steps taken in turns with every other variant (the fastest of
``rounds`` rounds), over the
plain model's, divided by K. Their sum is the
floor under shardwise's (and torch FSDP2's) per-unit overhead on CPU, where SGD runs one
tensor at a time (on a GPU it runs ``foreach``: one DTensor dispatch per step, not per
parameter)::

    python -m bench.overhead_floor                # K=48, 200 steps
    python -m bench.overhead_floor --quick        # smoke test
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from bench.launch import _loopback_interface, _loopback_store
from bench.overhead import WIDTH, BATCH, build_stack
from shardwise.backward_hooks import register_tensor_hook

__all__ = ["MECHANISMS", "measure", "main"]

MECHANISMS = ("module hooks", "post-backward", "pre-backward", "DTensor gradients", "DTensor optimizer")
FUNCTION_TRIGGER = "post-backward as an autograd.Function (FSDP2's)"


class _Trigger(torch.autograd.Function):
    """Identity on a unit's inputs; its backward is where a wrapper learns the unit is done."""

    @staticmethod
    def forward(ctx, *inputs):
        return inputs

    @staticmethod
    def backward(ctx, *grads):
        return grads


def _hooked_stack(k: int, trigger: str | None, output_hook: bool) -> nn.Module:
    """The plain stack with a pre- and post-forward hook per unit, plus the chosen mechanisms
    (``trigger``: None, "hook" for a hook on the input tensor, "function" for FSDP2's). A
    hook is registered as shardwise registers its own (no handle)."""
    model = build_stack(k)

    @torch._dynamo.disable
    def pre(module, args, kwargs):
        if trigger == "function" and torch.is_grad_enabled():
            args = _Trigger.apply(*args)
        elif trigger == "hook" and args[0].grad_fn is not None:
            register_tensor_hook(args[0], _ignore)
        return args, kwargs

    @torch._dynamo.disable
    def post(module, args, kwargs, output):
        if output_hook and output.grad_fn is not None:
            register_tensor_hook(output, _ignore)
        return output

    for unit in (*model, model):
        unit.register_forward_pre_hook(pre, with_kwargs=True)
        unit.register_forward_hook(post, with_kwargs=True)
    return model


_Arm = tuple[Callable[[], None], Callable[[], None]]  # (untimed setup before each step, the timed step)


def _nothing() -> None:
    pass


def _ignore(grad: torch.Tensor) -> None:
    pass


def _interleaved_cpu_us(arms: dict[str, _Arm], steps: int) -> dict[str, float]:
    """Each arm's 20th percentile of its step's thread CPU time, in µs, the arms taking
    turns one step each (after a few untimed steps): a machine's passing load lands on
    all of them alike, instead of on whichever ran its steps in that second."""
    times: dict[str, list[float]] = {name: [] for name in arms}
    for i in range(steps + 5):
        for name, (before, step) in arms.items():
            before()
            start = time.thread_time()
            step()
            if i >= 5:
                times[name].append(time.thread_time() - start)
    return {name: sorted(t)[len(t) // 5] * 1e6 for name, t in times.items()}


def _train_step(model: nn.Module) -> _Arm:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(BATCH, WIDTH), torch.randn(BATCH, WIDTH)

    def step() -> None:
        (model(x) - y).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return _nothing, step


def _optimizer_step(params: list[torch.Tensor]) -> _Arm:
    """SGD's step (and zero_grad) alone, gradients set before each (a DTensor param's with
    the param's own spec object)."""
    optimizer = torch.optim.SGD(params, lr=0.01)
    grads = [torch.ones_like(p._local_tensor if isinstance(p, DTensor) else p) for p in params]

    def set_grads() -> None:
        for p, g in zip(params, grads):
            p.grad = _grad_like(p, g.clone())

    def step() -> None:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return set_grads, step


def _grad_like(param: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """``local`` as ``param``'s gradient: a DTensor param's wraps it with the param's spec."""
    if isinstance(param, DTensor):
        return DTensor.__new__(DTensor, local, param._spec, requires_grad=False)
    return local


def _grad_wrapping(params: list[nn.Parameter]) -> _Arm:
    """Making each parameter's gradient a DTensor with its spec and setting ``.grad``, as
    a backward's last step does (the cheapest way known: DTensor's own ``__new__``)."""
    locals_ = [torch.ones_like(p._local_tensor) for p in params]

    def clear() -> None:
        for p in params:
            p.grad = None

    def step() -> None:
        for p, local in zip(params, locals_):
            p.grad = _grad_like(p, local)

    return clear, step


def _dtensor_params(model: nn.Module, mesh: DeviceMesh) -> list[nn.Parameter]:
    return [nn.Parameter(distribute_tensor(p.detach(), mesh, [Shard(0)])) for p in model.parameters()]


def _measure_once(k: int, steps: int, mesh: DeviceMesh) -> dict[str, float]:
    """One round: the step (or optimizer step) CPU µs of every variant, interleaved."""
    model = build_stack(k)
    return _interleaved_cpu_us({
        "plain": _train_step(build_stack(k)),
        "hooks": _train_step(_hooked_stack(k, trigger=None, output_hook=False)),
        "post": _train_step(_hooked_stack(k, trigger="hook", output_hook=False)),
        "post function": _train_step(_hooked_stack(k, trigger="function", output_hook=False)),
        "pre": _train_step(_hooked_stack(k, trigger=None, output_hook=True)),
        "opt plain": _optimizer_step(list(model.parameters())),
        "opt dtensor": _optimizer_step(_dtensor_params(model, mesh)),
        "grad dtensor": _grad_wrapping(_dtensor_params(model, mesh)),
    }, steps)


def measure(k: int, steps: int, mesh: DeviceMesh, rounds: int = 3) -> dict[str, float]:
    """Per-unit µs of each mechanism over the plain stack (see the module docstring).

    The variants take turns step by step within a round; each keeps its fastest round,
    as a machine's passing load only ever adds time."""
    runs = [_measure_once(k, steps, mesh) for _ in range(rounds)]
    best = {name: min(run[name] for run in runs) for name in runs[0]}
    return {
        "plain step": best["plain"],
        "module hooks": (best["hooks"] - best["plain"]) / k,
        "post-backward": (best["post"] - best["hooks"]) / k,
        FUNCTION_TRIGGER: (best["post function"] - best["hooks"]) / k,
        "pre-backward": (best["pre"] - best["hooks"]) / k,
        "DTensor gradients": best["grad dtensor"] / k,
        "DTensor optimizer": (best["opt dtensor"] - best["opt plain"]) / k,
    }


def format_table(k: int, result: dict[str, float]) -> str:
    lines = [f"world_size=1 K={k}: plain step {result['plain step']:.0f} µs (thread CPU)", f"{'mechanism':<20} {'µs/unit':>8}"]
    lines += [f"{name:<20} {result[name]:>8.1f}" for name in MECHANISMS]
    lines.append(f"{'floor (sum)':<20} {sum(result[name] for name in MECHANISMS):>8.1f}")
    lines.append(f"not in the floor: {FUNCTION_TRIGGER} {result[FUNCTION_TRIGGER]:.1f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.overhead_floor", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke test: K=4, 10 steps")
    parser.add_argument("--k", type=int, default=None, help="units (default 48)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per measurement (default 200)")
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 3)")
    args = parser.parse_args(argv)
    k = args.k or (4 if args.quick else 48)
    steps = args.steps or (10 if args.quick else 200)
    rounds = args.rounds or (1 if args.quick else 3)
    torch.set_num_threads(1)
    os.environ["GLOO_SOCKET_IFNAME"] = _loopback_interface()
    store = _loopback_store()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        print(format_table(k, measure(k, steps, init_device_mesh("cpu", (1,)), rounds)), flush=True)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
