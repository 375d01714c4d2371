"""Backend policy: run a CuTe DSL kernel or the plain-torch reference.

``LOWPREC_BACKEND`` (environment): ``auto`` (default: kernel where one exists for the device's
arch, else reference), ``reference`` (always the reference), ``kernel`` (a kernel or an error:
for testing kernels, never silently the reference). The kernel registry
(:mod:`lowprec.runtime.registry`) applies it. Code traced by ``torch.compile`` always
takes the reference ops (a graph cannot hold a CuTe DSL launch): the GEMM and the FP8
quantizations are ``torch.library`` custom ops that launch their kernels at run time, an MoE
layer without gradients is one custom op (``lowprec.moe.ops``), and the other MoE ops run eagerly
on CUDA (:func:`eager_under_compile`).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import warnings
from collections.abc import Callable

import torch

__all__ = ["backend_mode", "self_check_mode", "warn_once", "kernel_failed", "dsl_available", "eager_under_compile"]

_MODES = ("auto", "reference", "kernel")
_SELF_CHECK_MODES = ("auto", "0", "always")
log = logging.getLogger("lowprec")


def backend_mode() -> str:
    mode = os.environ.get("LOWPREC_BACKEND", "auto").strip().lower() or "auto"
    if mode not in _MODES:
        raise ValueError(f"LOWPREC_BACKEND: expected one of {_MODES}, got {mode!r}")
    return mode


def self_check_mode() -> str:
    """``LOWPREC_SELF_CHECK``: ``auto`` (default; also ``1``): each configuration of a kernel
    registered with a self-check is proven on a small problem before its first run in the
    process; ``0``: never; ``always``: every configuration of such a kernel, at its op's first run."""
    mode = os.environ.get("LOWPREC_SELF_CHECK", "auto").strip().lower() or "auto"
    mode = "auto" if mode == "1" else mode
    if mode not in _SELF_CHECK_MODES:
        raise ValueError(f"LOWPREC_SELF_CHECK: expected one of {_SELF_CHECK_MODES} (or 1), got {mode!r}")
    return mode


@functools.cache
def dsl_available() -> bool:
    """Whether CuTe DSL (nvidia-cutlass-dsl) imports here."""
    try:
        import cutlass  # noqa: F401
        import cutlass.cute  # noqa: F401
    except Exception as err:  # any import failure means: no kernels
        log.info("lowprec: CuTe DSL unavailable (%s); using reference ops", err)
        return False
    return True


@functools.cache
def warn_once(message: str) -> None:
    warnings.warn(message, RuntimeWarning, stacklevel=3)


_FAILED_OPS: set[str] = set()


def kernel_failed(op: str, err: BaseException) -> None:
    """A kernel failed to compile or launch: re-raise in ``kernel`` mode, else warn once."""
    if backend_mode() == "kernel":
        raise err
    if op in _FAILED_OPS:  # once per op: a message naming the shapes would warn again for each new one
        return
    _FAILED_OPS.add(op)
    warnings.warn(f"lowprec: {op} kernel failed ({type(err).__name__}: {err}); falling back to the reference",
                  RuntimeWarning, stacklevel=3)


def _on_cuda(values) -> bool:
    return any(getattr(getattr(v, "device", None), "type", None) == "cuda" for v in values)


def differentiable_once(backward=None, *, grads_only: bool = False):
    """``once_differentiable`` for backwards whose results carry no graph (quantized GEMMs, detached
    saved tensors): a second derivative is an error, not a silent zero or a missing term. Its error
    node (torch's ``DelayedError``, as ``once_differentiable`` makes) takes the results also where
    the incoming gradients are constants (a gradient taken straight from a loss with
    ``create_graph=True``: ``once_differentiable`` then adds none, yet dX depends on W and dW on X),
    and also hangs on the incoming gradients, the leaf inputs and the forward's ``ctx.graph_anchors``
    (:func:`graph_anchors` of the non-leaf inputs), so a derivative taken w.r.t. chosen tensors
    reaches it too. ``grads_only=True``: the results depend on the incoming gradients alone (an
    input gradient through a constant weight): the error node hangs on those only, and constant
    ones give constant results, as with ``once_differentiable``."""
    if backward is None:
        return functools.partial(differentiable_once, grads_only=grads_only)

    @functools.wraps(backward)
    def wrapper(ctx, *grads):
        with torch.no_grad():
            outputs = backward(ctx, *grads)
        if not torch.is_grad_enabled():
            return outputs
        outs = outputs if isinstance(outputs, tuple) else (outputs,)
        # once_differentiable's error node hangs on detached copies only: a second derivative taken
        # w.r.t. chosen tensors (torch.autograd.grad(..., weight), backward(inputs=...)) never reached
        # it and silently lacked this node's term. Also hang it on the incoming gradients' graph, on
        # the leaf inputs (their AccumulateGrad nodes hold them) and on the non-leaf ones' anchors, so
        # such a derivative fails too.
        anchors = [g for g in grads if isinstance(g, torch.Tensor) and g.requires_grad]
        if grads_only and not anchors:
            return outputs
        if not grads_only:
            anchors += [node.variable for node, _ in ctx.next_functions if hasattr(node, "variable")]
            anchors += getattr(ctx, "graph_anchors", ())
        fakes = [o.detach().requires_grad_() if isinstance(o, torch.Tensor) else o for o in outs]
        err = torch._C._functions.DelayedError(
            b"trying to differentiate twice a function that was marked with @once_differentiable",
            len(fakes) + len(anchors))
        results = err(*fakes, *anchors)[:len(fakes)]
        return results if isinstance(outputs, tuple) else results[0]

    return wrapper


def graph_anchors(*tensors) -> list[torch.Tensor]:
    """For an autograd Function's forward (``ctx.graph_anchors = graph_anchors(x, ...)``): an empty
    tensor on the graph of each non-leaf input, holding none of its memory. A backward with
    :func:`differentiable_once` hangs its error node on them: else a second derivative w.r.t. a
    tensor reached only through such an input (the layer's input, itself a view) never met it and
    silently lacked this node's term (when the incoming gradient is a constant)."""
    if torch.compiler.is_compiling():  # traced: the compiled backward is aot_autograd's, without the error node
        return []
    with torch.enable_grad():  # forward runs without grad: the slice must record its graph
        return [t[:0].clone() for t in tensors if isinstance(t, torch.Tensor) and t.grad_fn is not None and t.dim()]


def eager_under_compile(fn: Callable) -> Callable:
    """Run ``fn`` eagerly when ``torch.compile`` traces it with CUDA inputs (a graph break).

    CuTe DSL launches cannot be traced: traced, an op without a ``torch.library`` custom op would
    fall back to its reference (slow, memory-hungry for the grouped GEMMs) with a warning. Eager,
    it runs its kernels. CPU inputs keep tracing their reference path.
    """
    eager = torch.compiler.disable(fn)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if torch.compiler.is_compiling() and _on_cuda((*args, *kwargs.values())):
            return eager(*args, **kwargs)
        return fn(*args, **kwargs)

    return wrapper


def version_of(t: torch.Tensor) -> int | None:
    """``t._version``, or None for an inference tensor (made under ``torch.inference_mode``: it has
    no version counter, and reading one raises)."""
    return None if t.is_inference() else t._version


def autocast_off(device: torch.device) -> contextlib.AbstractContextManager:
    """A context without ``torch.autocast`` for ``device``: lowprec's own arithmetic (references,
    emulations, host-side corrections) keeps its precision whatever autocast says, as the kernels
    do (autocast would run FP32 matmuls in bf16 / fp16; fp16 also overflows past 65504)."""
    if device.type in ("cpu", "cuda"):
        return torch.autocast(device.type, enabled=False)
    return contextlib.nullcontext()
