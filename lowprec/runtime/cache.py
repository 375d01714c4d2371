"""Compile cache for CuTe DSL kernels: in memory, and on disk for TVM-FFI kernels.

The key holds the kernel's name, its config, the target arch, the CuTe DSL version and a
fingerprint of the kernel's source files, so editing a kernel or upgrading the DSL never reuses a
stale binary. On disk, a TVM-FFI kernel is exported to an object file and linked into a shared
library (``$LOWPREC_CACHE_DIR``, default ``~/.cache/lowprec/kernels``). The disk layer is opt-in
(``LOWPREC_DISK_CACHE=1``): with nvidia-cutlass-dsl 4.8.1, kernels that use shared memory fail to
launch when loaded back from the exported library (CUDA error 98, seen on H100), while kernels
without shared memory run. Kernels compiled without TVM-FFI are cached in memory only.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable, Iterable, Mapping
from types import ModuleType

__all__ = ["KernelCache", "kernel_cache", "cache_key", "source_fingerprint"]

log = logging.getLogger("lowprec")
_EXPORT_NAME = "lowprec_kernel"


def source_fingerprint(sources: Iterable[ModuleType | Callable | str]) -> str:
    """sha256 over the source files of modules / functions (or file paths)."""
    return _fingerprint_paths(tuple(src if isinstance(src, str) else inspect.getsourcefile(src) for src in sources))


@functools.cache
def _fingerprint_paths(paths: tuple[str, ...]) -> str:
    # once per process: kernel sources do not change under a running program, and launches are hot
    h = hashlib.sha256()
    for path in paths:
        with open(path, "rb") as f:
            h.update(f.read())
    return h.hexdigest()


def _dsl_version() -> str:
    import cutlass

    return cutlass.__version__


def cache_key(kernel: str, config: Mapping, arch: str, fingerprint: str) -> str:
    payload = {"kernel": kernel, "config": {k: str(v) for k, v in sorted(config.items())},
               "arch": arch, "dsl": _dsl_version(), "src": fingerprint}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:32]


class KernelCache:
    """Maps a key to a compiled (launchable) kernel; compiles once per key, thread-safely."""

    def __init__(self, directory: str | None = None) -> None:
        self._memory: dict[str, object] = {}
        self._by_args: dict[tuple, object] = {}  # launch-time fast path: no hashing of sources
        self._modules: dict[str, object] = {}  # loaded shared libraries, kept alive
        self._lock = threading.Lock()
        self._directory = directory

    @property
    def directory(self) -> str | None:
        if os.environ.get("LOWPREC_DISK_CACHE", "0") != "1":
            return None
        return self._directory or os.environ.get("LOWPREC_CACHE_DIR") or os.path.expanduser("~/.cache/lowprec/kernels")

    def __len__(self) -> int:
        return len(self._memory)

    def clear_memory(self) -> None:
        with self._lock:
            self._memory.clear()
            self._by_args.clear()

    def get(self, kernel: str, config: Mapping, arch: str, sources: Iterable, compile_fn: Callable[[], object]):
        """The kernel for ``(kernel, config, arch, sources)``: from memory, disk, or ``compile_fn()``."""
        sources = tuple(sources)
        try:
            args_key = (kernel, tuple(sorted(config.items())), arch, sources)
            hit = self._by_args.get(args_key)
        except TypeError:  # unhashable config values: take the slow path every time
            args_key, hit = None, None
        if hit is not None:
            return hit
        hit = self._get(cache_key(kernel, config, arch, source_fingerprint(sources)), compile_fn)
        if args_key is not None:
            self._by_args[args_key] = hit
        return hit

    def _get(self, key: str, compile_fn: Callable[[], object]):
        hit = self._memory.get(key)
        if hit is not None:
            return hit
        with self._lock:
            hit = self._memory.get(key)
            if hit is None:
                hit = self._load(key) or self._compile_and_store(key, compile_fn)
                self._memory[key] = hit
        return hit

    def _path(self, key: str) -> str | None:
        d = self.directory
        return None if d is None else os.path.join(d, f"{key}.so")

    def _load(self, key: str):
        path = self._path(key)
        if path is None or not os.path.exists(path):
            return None
        try:
            from cutlass.runtime import load_module

            module = load_module(path, enable_tvm_ffi=True)
            fn = getattr(module, _EXPORT_NAME)
        except Exception as err:  # a corrupt or foreign file: recompile
            log.warning("lowprec: ignoring unreadable cached kernel %s (%s)", path, err)
            return None
        self._modules[key] = module
        return fn

    def _compile_and_store(self, key: str, compile_fn: Callable[[], object]):
        compiled = compile_fn()
        path = self._path(key)
        if path is not None and hasattr(compiled, "export_to_c") and shutil.which("cc"):
            try:
                _export_shared_library(compiled, path)
            except Exception as err:  # the disk layer is an optimization only
                log.info("lowprec: kernel %s kept in memory only (%s)", key, err)
        return compiled


def _export_shared_library(compiled, path: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with tempfile.TemporaryDirectory(dir=os.path.dirname(path)) as tmp:
        obj = os.path.join(tmp, "kernel.o")
        lib = os.path.join(tmp, "kernel.so")
        compiled.export_to_c(obj, function_name=_EXPORT_NAME)
        subprocess.run(["cc", "-shared", "-o", lib, obj], check=True, capture_output=True)
        os.replace(lib, path)  # atomic: concurrent processes never see half a file


kernel_cache = KernelCache()
