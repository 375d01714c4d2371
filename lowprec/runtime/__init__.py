"""Runtime: arch detection, backend choice, CuTe DSL compilation and the kernel cache."""

from . import registry
from .arch import SUPPORTED_ARCHS, device_arch, on_device, on_operand_device, sm_count
from .backend import (
    autocast_off,
    backend_mode,
    differentiable_once,
    dsl_available,
    eager_under_compile,
    graph_anchors,
    kernel_failed,
    self_check_mode,
    version_of,
    warn_once,
)
from .cache import KernelCache, cache_key, kernel_cache, source_fingerprint
from .compile import compile_for_arch, cubin_arch, ffi_entry, local_memory_ops, nvdisasm_path, sass_of

__all__ = [
    "SUPPORTED_ARCHS", "device_arch", "on_device", "on_operand_device", "sm_count", "autocast_off", "backend_mode",
    "self_check_mode",
    "dsl_available", "differentiable_once", "eager_under_compile", "graph_anchors",
    "kernel_failed",
    "version_of", "warn_once", "KernelCache", "cache_key", "kernel_cache", "source_fingerprint", "compile_for_arch",
    "cubin_arch", "ffi_entry", "local_memory_ops", "nvdisasm_path", "sass_of", "registry",
]
