"""Backend choice: run a CuTe DSL kernel or the plain-torch reference.

``LOWPREC_BACKEND`` (environment): ``auto`` (default: kernel where one exists for the device's
arch, else reference), ``reference`` (always the reference), ``kernel`` (a kernel or an error:
for testing kernels, never silently the reference). Code traced by ``torch.compile`` always
takes the reference ops (a graph cannot hold a CuTe DSL launch): the GEMM and the FP8
quantizations are ``torch.library`` custom ops that launch their kernels at run time, an MoE
layer without gradients is one custom op (``lowprec.moe.ops``), and the other MoE ops run eagerly
on CUDA (:func:`eager_under_compile`).
"""

from __future__ import annotations

import functools
import logging
import os
import warnings
from collections.abc import Callable

import torch

from .arch import device_arch

__all__ = ["backend_mode", "use_kernel", "warn_once", "kernel_failed", "dsl_available", "eager_under_compile"]

_MODES = ("auto", "reference", "kernel")
log = logging.getLogger("lowprec")


def backend_mode() -> str:
    mode = os.environ.get("LOWPREC_BACKEND", "auto").strip().lower() or "auto"
    if mode not in _MODES:
        raise ValueError(f"LOWPREC_BACKEND: expected one of {_MODES}, got {mode!r}")
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


def use_kernel(op: str, device: torch.device, supported_archs: tuple[str, ...],
               why_not: str | None | Callable[[], str | None] = None) -> bool:
    """Decide whether ``op`` runs a kernel on ``device``.

    ``why_not``: the caller's reason the inputs cannot take the kernel (None when they can), or
    a function returning it, called only on a device with a kernel. In ``kernel`` mode every
    reason is an error; in ``auto`` mode it means the reference.
    """
    mode = backend_mode()
    # traced by torch.compile: only the reference ops can go into a graph (CuTe DSL launches
    # cannot be traced; ops that keep their kernels there are custom ops or run eagerly)
    if mode == "reference" or torch.compiler.is_compiling():
        return False
    arch = device_arch(device)
    reason = None
    if arch not in supported_archs:
        reason = f"no {op} kernel for device {device} (arch {arch}; kernels for {list(supported_archs)})"
    elif callable(why_not):
        reason = why_not()
    else:
        reason = why_not
    if reason is None and not dsl_available():
        reason = "CuTe DSL (nvidia-cutlass-dsl) does not import"
    if reason is not None:
        if mode == "kernel":
            raise RuntimeError(f"LOWPREC_BACKEND=kernel but {op} cannot run a kernel: {reason}")
        return False
    return True


@functools.cache
def warn_once(message: str) -> None:
    warnings.warn(message, RuntimeWarning, stacklevel=3)


def kernel_failed(op: str, err: BaseException) -> None:
    """A kernel failed to compile or launch: re-raise in ``kernel`` mode, else warn once."""
    if backend_mode() == "kernel":
        raise err
    warn_once(f"lowprec: {op} kernel failed ({type(err).__name__}: {err}); falling back to the reference")


def _on_cuda(values) -> bool:
    return any(getattr(getattr(v, "device", None), "type", None) == "cuda" for v in values)


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
