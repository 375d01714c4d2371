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

First-use self-check: a kernel registered with a :class:`SelfCheck` (kernels that were never run
on real hardware here, such as the sm_100a ones) is proven once per configuration and device
in a process before it serves real inputs: the registry runs it on a small random problem of
that configuration and compares it with the reference. A configuration that fails (wrong
result, or an error) warns once and is not used again in the process: its calls take the
fallback. ``LOWPREC_SELF_CHECK`` (:func:`.backend.self_check_mode`) sets the policy.
"""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
import re
from collections.abc import Callable, Hashable, Iterable
from typing import Any, TypeVar

import torch

from .arch import device_arch, on_device
from .backend import backend_mode, dsl_available, kernel_failed, self_check_mode, warn_once

__all__ = ["Kernel", "SelfCheck", "register", "registered", "kernel_for", "run", "why_no_kernel",
           "load_arch_packages"]

T = TypeVar("T")
_ARCH_PACKAGE = re.compile(r"sm\d+[a-z]?")


@dataclasses.dataclass(frozen=True)
class SelfCheck:
    """How to prove a kernel's configuration before its first real run.

    ``config(*args)``: the configuration the kernel would run for these arguments (hashable);
    ``probe(config, device)``: arguments of a small random problem of that configuration;
    ``reference(*probe_args)``: the expected result; ``close(result, expected) -> bool``;
    ``configs()``: every shipped configuration (``LOWPREC_SELF_CHECK=always`` checks them all).
    """

    config: Callable[..., Hashable]
    probe: Callable[[Hashable, torch.device], tuple]
    reference: Callable[..., Any]
    close: Callable[[Any, Any], bool]
    configs: Callable[[], Iterable[Hashable]] = tuple


@dataclasses.dataclass(frozen=True)
class Kernel:
    """One registered implementation of an op on one arch."""

    op: str
    arch: str
    target: str  # "package.module:function"
    why_not: Callable[..., str | None]
    self_check: SelfCheck | None = None

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


def register(op: str, arch: str, target: str, why_not: Callable[..., str | None] | None = None,
             self_check: SelfCheck | None = None) -> None:
    """Register ``target`` ("module:function") as ``op``'s kernel on ``arch`` (with a
    :class:`SelfCheck` where its configurations must prove themselves before first use)."""
    if ":" not in target:
        raise ValueError(f"target: expected 'module:function', got {target!r}")
    _registry.setdefault(op, {})[arch] = Kernel(op, arch, target, why_not or _no_constraints, self_check)


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
    if reason is None and kernel.self_check is not None:  # a fact of this process, whatever the policy
        config = kernel.self_check.config(*args, **kwargs)
        if _check_key(kernel, device, config) in _failed_checks:
            reason = _failed(config, device)
    return kernel, reason


# --- first-use self-check ---------------------------------------------------------------------------
_passed_checks: set = set()
_failed_checks: set = set()
_checked_all: set = set()


def _check_key(kernel: Kernel, device: torch.device, config: Hashable) -> tuple:
    return kernel.op, kernel.arch, str(device), config


def _failed(config: Hashable, device: torch.device) -> str:
    return f"configuration {config!r} failed its first-use self-check on {device} in this process"


def _self_check(kernel: Kernel, fn: Callable, device: torch.device, config: Hashable) -> str | None:
    """Why ``config`` of ``kernel`` may not serve real inputs on ``device`` (None: it may): proven
    once on a small random problem against the reference, remembered for the process."""
    key = _check_key(kernel, device, config)
    if key in _passed_checks:
        return None
    if key in _failed_checks:
        return _failed(config, device)
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        # the comparison reads back to the host: not inside a capture (warm up before capturing)
        warn_once(f"lowprec: {kernel.op} configuration {config!r} was not self-checked before a CUDA graph capture; "
                  "the capture uses the fallback (run the op once before capturing)")
        return f"configuration {config!r} is not self-checked yet and a CUDA graph capture is under way"
    check = kernel.self_check
    try:
        probe = check.probe(config, device)
        ok = bool(check.close(fn(*probe), check.reference(*probe)))
    except Exception as err:  # a kernel that cannot run its own probe is not used either
        ok, why = False, f"{type(err).__name__}: {err}"
    else:
        why = "its result differs from the reference"
    (_passed_checks if ok else _failed_checks).add(key)
    if ok:
        return None
    warn_once(f"lowprec: {kernel.op} kernel ({kernel.arch}) configuration {config!r} failed its first-use "
              f"self-check on {device} ({why}); this process uses the fallback for it")
    return _failed(config, device)


def _self_check_reason(kernel: Kernel, device: torch.device, args, kwargs) -> str | None:
    """The self-check policy for one call: why the kernel may not take it (None: it may)."""
    if kernel.self_check is None:  # first: no environment read on the launch path of other kernels
        return None
    mode = self_check_mode()
    if mode == "0":
        return None
    check, fn = kernel.self_check, kernel.load()
    if mode == "always" and (kernel.op, kernel.arch, str(device)) not in _checked_all:
        _checked_all.add((kernel.op, kernel.arch, str(device)))
        for config in check.configs():
            _self_check(kernel, fn, device, config)
    return _self_check(kernel, fn, device, check.config(*args, **kwargs))


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
    if reason is None:
        reason = _self_check_reason(kernel, device, args, kwargs)
    if reason is not None:
        if mode == "kernel":
            raise RuntimeError(f"LOWPREC_BACKEND=kernel but {op} cannot run a kernel: {reason}")
        return None
    return kernel.load()


def run(op: str, device: torch.device, args: tuple, reference: Callable[[], T],
             launch: Callable[[Callable], T] | None = None) -> T:
    """Run ``op``: ``launch(kernel)`` (default ``kernel(*args)``) where a kernel serves ``args`` on
    ``device``, else ``reference()``. A kernel that fails to compile or launch warns once and falls
    back (raises under ``LOWPREC_BACKEND=kernel``). Both run with ``device`` current: some torch
    ops give wrong values on a CUDA device that is not the current one (``torch.ldexp``, torch
    2.11), and kernels launch on the current device's stream."""
    with on_device(device):
        kernel = kernel_for(op, device, *args)
        if kernel is not None:
            try:
                return kernel(*args) if launch is None else launch(kernel)
            except Exception as err:
                kernel_failed(op, err)
        return reference()
