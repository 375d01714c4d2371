"""GPU architecture detection."""

from __future__ import annotations

import contextlib
import functools
import inspect

import torch

__all__ = ["device_arch", "sm_count", "on_device", "on_operand_device", "SUPPORTED_ARCHS", "GRID_YZ_MAX",
           "INT32_OFFSET_MAX"]

SUPPORTED_ARCHS = ("sm_90a", "sm_100a")
GRID_YZ_MAX = 65535  # CUDA's gridDim.y / gridDim.z limit
# elements a kernel may address from one base with a 32-bit offset (a static stride times an
# Int32 row index: CuTe computes row · stride + col in Int32, which wraps past this)
INT32_OFFSET_MAX = 1 << 31
_BY_CAPABILITY = {(9, 0): "sm_90a", (10, 0): "sm_100a"}


@functools.cache
def _cuda_arch(index: int) -> str | None:
    return _BY_CAPABILITY.get(torch.cuda.get_device_capability(index))


@functools.cache
def _cuda_available() -> bool:
    """``torch.cuda.is_available()``, asked once: every kernel call site checks its device, and
    the answer cannot change once a process has seen it."""
    return torch.cuda.is_available()


def device_arch(device: torch.device | str | None) -> str | None:
    """The kernel arch lowprec targets on ``device`` (``"sm_90a"``, ``"sm_100a"``), or None.

    None means no lowprec kernel runs there (CPU, or a GPU of another generation).
    """
    if device is None:
        return None
    if not isinstance(device, torch.device):
        device = torch.device(device)
    if device.type != "cuda" or not _cuda_available():
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _cuda_arch(index)


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of the CUDA ``device`` (cached: launch paths ask on every call)."""
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


_SAME_DEVICE = contextlib.nullcontext()


def on_device(device: torch.device):
    """``torch.cuda.device(device)`` where ``device`` is not the current CUDA device, else a no-op
    context: kernels launch on the current device's stream, and the guard costs several µs of
    host time per launch where it changes nothing. A no-op while torch.compile traces: the
    compiled code guards the device of its kernels itself."""
    if device.index is None or torch.compiler.is_compiling() or device.index == torch.cuda.current_device():
        return _SAME_DEVICE
    return torch.cuda.device(device)


def on_operand_device(fn):
    """Decorator: ``fn`` runs with its first argument's device current (:func:`on_device`), for
    plain torch code on a CUDA device that may not be the current one: some torch ops give wrong
    values there (``torch.ldexp``, torch 2.11, 2x H200)."""
    first = next(iter(inspect.signature(fn).parameters))

    @functools.wraps(fn)
    def on_operand(*args, **kwargs):
        device = getattr(args[0] if args else kwargs.get(first), "device", None)
        with on_device(device) if isinstance(device, torch.device) else _SAME_DEVICE:
            return fn(*args, **kwargs)

    return on_operand
