"""The kernel registry: which implementation serves an op's inputs on a device, and if none, why.

Each arch folder of an op (``lowprec/<op>/sm90/``, later ``sm100/``) registers its kernels in its
``__init__.py`` with :func:`register`: the op name, the arch, the implementation as a
``"module:function"`` path (imported on first use, so registering imports no cutlass) and its
constraints as a ``why_not(*args)`` function (the arch's ``config.py``: stated once, no cutlass
import), which returns None when the kernel takes the arguments, else the reason. An
implementation takes the same arguments as its ``why_not``.

An op package calls :func:`load_arch_packages` once at import: it imports every ``sm<N>``
subpackage, so adding an arch to an op is one new folder. Call sites ask :func:`kernel_for` or
:func:`run`; the backend policy (``LOWPREC_BACKEND``), the tracing rule and the
one-warning fallback live here and in :mod:`.backend`, not at the call sites.
"""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
import re
from collections.abc import Callable
from typing import TypeVar

import torch

from .arch import device_arch
from .backend import backend_mode, dsl_available, kernel_failed

__all__ = ["Kernel", "register", "registered", "kernel_for", "run", "why_no_kernel", "load_arch_packages"]

T = TypeVar("T")
_ARCH_PACKAGE = re.compile(r"sm\d+[a-z]?")


@dataclasses.dataclass(frozen=True)
class Kernel:
    """One registered implementation of an op on one arch."""

    op: str
    arch: str
    target: str  # "package.module:function"
    why_not: Callable[..., str | None]

    def load(self) -> Callable:
        fn = _loaded.get(self.target)
        if fn is None:
            module, _, name = self.target.partition(":")
            fn = _loaded[self.target] = getattr(importlib.import_module(module), name)
        return fn


_registry: dict[str, dict[str, Kernel]] = {}
_loaded: dict[str, Callable] = {}


def _no_constraints(*args, **kwargs) -> None:
    return None


def register(op: str, arch: str, target: str, why_not: Callable[..., str | None] | None = None) -> None:
    """Register ``target`` ("module:function") as ``op``'s kernel on ``arch``."""
    if ":" not in target:
        raise ValueError(f"target: expected 'module:function', got {target!r}")
    _registry.setdefault(op, {})[arch] = Kernel(op, arch, target, why_not or _no_constraints)


def registered(op: str) -> dict[str, Kernel]:
    """The kernels registered for ``op``, by arch."""
    return dict(_registry.get(op, {}))


def load_arch_packages(package: str, path) -> None:
    """Import every arch subpackage (``sm90``, ``sm100``, ...) of ``package``: they register."""
    for info in pkgutil.iter_modules(path):
        if info.ispkg and _ARCH_PACKAGE.fullmatch(info.name):
            importlib.import_module(f"{package}.{info.name}")


def _serving(op: str, device: torch.device, args, kwargs) -> tuple[Kernel | None, str | None]:
    """The kernel of ``op`` on ``device``'s arch and why it cannot take the arguments (None: it can)."""
    kernels = _registry.get(op, {})
    arch = device_arch(device)
    kernel = kernels.get(arch)
    if kernel is None:
        return None, f"no {op} kernel for device {device} (arch {arch}; kernels for {sorted(kernels)})"
    reason = kernel.why_not(*args, **kwargs)
    if reason is None and not dsl_available():
        reason = "CuTe DSL (nvidia-cutlass-dsl) does not import"
    return kernel, reason


def why_no_kernel(op: str, device: torch.device, *args, **kwargs) -> str | None:
    """Why no kernel of ``op`` serves these arguments on ``device`` (None: one does), ignoring
    the backend policy."""
    return _serving(op, device, args, kwargs)[1]


def kernel_for(op: str, device: torch.device, *args, **kwargs) -> Callable | None:
    """The kernel to run ``op`` with these arguments on ``device``, or None for the reference.

    ``LOWPREC_BACKEND=reference`` and code traced by ``torch.compile`` (a CuTe DSL launch cannot
    go into a graph: ops that keep their kernels there are custom ops) always get None;
    ``LOWPREC_BACKEND=kernel`` turns every reason for None into an error.
    """
    mode = backend_mode()
    if mode == "reference" or torch.compiler.is_compiling():
        return None
    kernel, reason = _serving(op, device, args, kwargs)
    if reason is not None:
        if mode == "kernel":
            raise RuntimeError(f"LOWPREC_BACKEND=kernel but {op} cannot run a kernel: {reason}")
        return None
    return kernel.load()


def run(op: str, device: torch.device, args: tuple, reference: Callable[[], T],
             launch: Callable[[Callable], T] | None = None) -> T:
    """Run ``op``: ``launch(kernel)`` (default ``kernel(*args)``) where a kernel serves ``args`` on
    ``device``, else ``reference()``. A kernel that fails to compile or launch warns once and falls
    back (raises under ``LOWPREC_BACKEND=kernel``)."""
    kernel = kernel_for(op, device, *args)
    if kernel is not None:
        try:
            return kernel(*args) if launch is None else launch(kernel)
        except Exception as err:
            kernel_failed(op, err)
    return reference()
