"""What torch.compile sees of shardwise: the compiled blocks' math, never the hooks.

shardwise's hooks drive collectives, swap parameters on the module, read autograd's
graph-task id and register autograd hooks: Python that Dynamo cannot (and should not)
turn into a graph. Dynamo meets them in two ways:

- ``block.compile(...)`` compiles ``nn.Module._call_impl``, so the eval-frame callback is
  active while the forward hooks run, and every Python frame they call is a candidate for
  compilation: with ``fullgraph=True`` the first unsupported call (``_current_graph_task_id``,
  ``Work.wait``, ``Tensor.set_``) raised ``torch._dynamo.exc.Unsupported``;
- ``torch.compile(model)`` over sharded blocks inlines each block's ``_call_impl``, hooks
  included: without ``fullgraph`` every unsupported call inside them split the step's
  graphs (23 graphs and 38 breaks over two steps of a 2-block transformer; torch: 1 and 0).

The fix, as torch FSDP2 does it for its own hooks: each hook is registered already wrapped
in ``torch.compiler.disable`` (:func:`run_eagerly`). A disabled function is called from a
compiled frame without being traced (Dynamo skips its frame and everything it calls), so
the hooks run as in eager mode and the compiled region is exactly the module's
``forward``: one graph per distinct block, no graph break, the same as torch. The wrapper
must be the registered callable itself: a shardwise function that *calls* a disabled one
would be traced up to that call, a graph break that ``fullgraph=True`` refuses.

A method registered with ``register_fsdp_forward_method`` is the other entry point: the
hooks must run eagerly around it, yet its body is the user's math and should compile.
:func:`bind_untraced` makes the wrapper a frame Dynamo skips (no graph break where it is
entered) while every frame it calls is compiled as usual. It runs the disabled hooks
directly, so they cost no break either; they would cost one each if the wrapper were
traced (measured over two steps: 4 breaks against torch's 2 for ``torch.compile(m.logits)``
over sharded blocks, 2 against 0 for a compiled model calling a block's method).

``torch.compile(block)`` returns an ``OptimizedModule`` whose ``forward`` is an instance
attribute (the compiled ``_orig_mod.__call__``); :func:`implements_forward` lets
``fully_shard`` accept it as torch does: the hooks go on the wrapper and run outside the
compiled frame, the parameters are ``_orig_mod``'s (their FQNs carry ``_orig_mod.``, as
in torch).
"""

from __future__ import annotations

import functools
import types
from typing import Any, Callable, TypeVar

import torch
import torch.nn as nn
from torch._C._dynamo.eval_frame import get_eval_frame_callback as _eval_frame_callback
from torch._dynamo.eval_frame import skip_code

__all__ = ["run_eagerly", "bind_untraced", "implements_forward"]

_F = TypeVar("_F", bound=Callable)

_REASON = "shardwise hooks run eagerly: they issue collectives and swap parameters"


def run_eagerly(fn: _F) -> _F:
    """``fn`` as a callable torch.compile never traces, nor anything it calls.

    Register the returned callable itself as the hook (see the module docstring). It
    carries ``torch.compiler.disable``'s marks, so a frame Dynamo traces treats it as
    disabled. Called in plain eager mode (no eval-frame callback installed, as in every
    step that compiles nothing around the hooks) it calls ``fn`` directly: the disabled
    wrapper's save-and-restore of the callback would cost ~0.45 µs per hook call there
    for nothing. Where a callback is installed (``block.compile()`` compiles the module
    call the hooks run in) it goes through the disabled wrapper, so nothing ``fn`` calls
    is compiled. Its own frame is one Dynamo skips (as torch's non-recursive disable).
    """
    disabled = torch.compiler.disable(fn, recursive=True, reason=_REASON)
    eager = _eager_unless_compiling(fn, disabled)
    functools.update_wrapper(eager, fn)
    eager._torchdynamo_disable = True  # type: ignore[attr-defined]
    eager._torchdynamo_disable_msg = _REASON  # type: ignore[attr-defined]
    eager._torchdynamo_disable_recursive = True  # type: ignore[attr-defined]
    eager._torchdynamo_orig_callable = fn  # type: ignore[attr-defined]
    eager._torchdynamo_wrapper_id = id(eager)  # type: ignore[attr-defined]
    return eager  # type: ignore[return-value]


def _eager_unless_compiling(fn: Callable, disabled: Callable) -> Callable:
    def eager(*args: Any) -> Any:
        if _eval_frame_callback() is None:  # nothing compiles around us: nothing to keep Dynamo out of
            return fn(*args)
        return disabled(*args)

    return eager


skip_code(_eager_unless_compiling(print, print).__code__)  # one code object for every such wrapper


def bind_untraced(fn: Callable, module: nn.Module) -> Callable:
    """``fn`` bound to ``module`` as a method whose own frame Dynamo never traces; the
    frames it calls are compiled as usual (non-recursive ``torch.compiler.disable``).

    Bound, not a plain function: ``torch.compile(f)`` unwraps a disabled ``f`` back to the
    original and would trace it; a bound method is compiled as it is, so
    ``torch.compile(module.method)`` skips the wrapper's frame and compiles what it calls.
    Called from a frame being traced it is one graph break, as a disabled hook is.
    """
    return types.MethodType(torch.compiler.disable(fn, recursive=False, reason=_REASON), module)


def implements_forward(module: nn.Module) -> bool:
    """True when calling ``module`` runs a forward of its own: its class overrides
    ``nn.Module.forward``, or the instance carries one (``torch.compile``'s
    ``OptimizedModule`` sets ``self.forward`` to the compiled call of ``_orig_mod``).
    False for containers such as ``nn.ModuleList``, whose hooks would never fire."""
    return type(module).forward is not nn.Module.forward or "forward" in module.__dict__
