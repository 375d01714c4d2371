"""Compile cache for CuTe DSL kernels: in memory, and on disk for TVM-FFI kernels.

The key holds the kernel's name, its config, the target arch and a fingerprint of the whole
``lowprec`` package source (every ``.py`` under it) plus the installed nvidia-cutlass-dsl,
apache-tvm-ffi and Python versions, so editing any kernel or shared helper, or upgrading the DSL,
never reuses a stale binary.

On disk, a TVM-FFI kernel is exported to an object file and loaded back directly (JITLink, one
isolated link unit per kernel, as quack and FlashAttention-4 do), with its cubin beside it for
:func:`lowprec.runtime.compile.sass_of`. The directory is ``$LOWPREC_CACHE_DIR`` (default
``~/.cache/lowprec/kernels``) with one subdirectory per source fingerprint (the 8 most recently
written are kept; any can be deleted at any time). ``LOWPREC_DISK_CACHE=0`` turns the disk layer
off. Files are written to a temporary name and renamed into place, so a reader never sees half a
file; an unreadable file is ignored with a warning and the kernel recompiled. Kernels compiled
without TVM-FFI are cached in memory only.

Before, each object file was linked into a shared library. Every export names its symbols after
the export name, the same for every kernel, so two such libraries in one process resolved the
second's same-named symbols to the first's: whichever kernel was loaded second failed to launch
(CUDA error 98), which, as the GEMM and the quantize kernels were the ones loaded, read as "kernels
with shared memory fail" (H100, nvidia-cutlass-dsl 4.8.1: each library alone, or names made
unique, ran; preloading the runtime libraries globally did not help). Object files loaded by
JITLink each stay in their own link unit.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import pathlib
import shutil
import sys
import tempfile
import threading
import warnings
from collections.abc import Callable, Mapping

__all__ = ["KernelCache", "kernel_cache", "cache_key", "source_fingerprint", "DEFAULT_CACHE_DIR"]

log = logging.getLogger("lowprec")
_EXPORT_NAME = "lowprec_kernel"
_PACKAGE_ROOT = pathlib.Path(__file__).resolve().parents[1]
DEFAULT_CACHE_DIR = os.path.join("~", ".cache", "lowprec", "kernels")
KEEP_FINGERPRINTS = 8  # source versions kept on disk


def source_fingerprint(root: str | os.PathLike | None = None) -> str:
    """sha256 over every ``.py`` file under ``root`` (default: the ``lowprec`` package), sorted
    relative paths and contents; computed once per process and root."""
    return _tree_fingerprint(str(pathlib.Path(root).resolve() if root is not None else _PACKAGE_ROOT))


@functools.cache
def _tree_fingerprint(root: str) -> str:
    # once per process: sources do not change under a running program, and launches are hot
    h = hashlib.sha256()
    base = pathlib.Path(root)
    for path in sorted(p for p in base.rglob("*.py") if p.is_file()):
        content = path.read_bytes()
        h.update(path.relative_to(base).as_posix().encode() + b"\0")
        h.update(len(content).to_bytes(8, "little"))
        h.update(content)
    return h.hexdigest()


@functools.cache
def _versions() -> dict[str, str]:
    """The versions a compiled kernel depends on besides its source."""
    from importlib import metadata

    def version(dist: str, module: str) -> str:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:  # installed without metadata: ask the module
            try:
                return getattr(__import__(module), "__version__", "unknown")
            except ImportError:
                return "none"

    return {"cutlass-dsl": version("nvidia-cutlass-dsl", "cutlass"), "tvm-ffi": version("apache-tvm-ffi", "tvm_ffi"),
            "python": f"{sys.version_info.major}.{sys.version_info.minor}"}


def cache_key(kernel: str, config: Mapping, arch: str, fingerprint: str | None = None) -> str:
    """The disk key of a kernel: its name, config, arch, the package fingerprint and the versions."""
    payload = {"kernel": kernel, "config": {k: str(v) for k, v in sorted(config.items())}, "arch": arch,
               "src": fingerprint if fingerprint is not None else source_fingerprint(), "versions": _versions()}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:32]


_DISK_CACHE_SWITCH = {"0": False, "false": False, "off": False, "no": False,
                      "1": True, "true": True, "on": True, "yes": True}


def _disk_cache_on() -> bool:
    """``LOWPREC_DISK_CACHE``: ``1`` (default) or ``0``; other spellings of off (``false``, ``off``,
    ``no``) must not leave the disk cache on, and a value that is neither is an error."""
    value = os.environ.get("LOWPREC_DISK_CACHE", "1").strip().lower() or "1"
    if value not in _DISK_CACHE_SWITCH:
        raise ValueError(f"LOWPREC_DISK_CACHE: expected 0 or 1 (or false / true, off / on, no / yes), got {value!r}")
    return _DISK_CACHE_SWITCH[value]


class KernelCache:
    """Maps a key to a compiled (launchable) kernel; compiles once per key, thread-safely."""

    def __init__(self, directory: str | None = None) -> None:
        self._memory: dict[str, object] = {}
        self._by_args: dict[tuple, object] = {}  # launch-time fast path: no hashing
        self._lock = threading.Lock()
        self._directory = directory
        self.compiles = 0  # kernels compiled by this cache (not loaded from disk)
        self.loads = 0  # kernels loaded from disk

    @property
    def directory(self) -> str | None:
        """Where kernels are kept on disk (one subdirectory per source fingerprint), or None."""
        if not _disk_cache_on():
            return None
        # expanded as the default is: a '~' the shell did not expand (a quoted value, an env file,
        # os.environ) would otherwise make a directory named '~' in the working directory
        return os.path.expanduser(self._directory or os.environ.get("LOWPREC_CACHE_DIR") or DEFAULT_CACHE_DIR)

    def __len__(self) -> int:
        return len(self._memory)

    def clear_memory(self) -> None:
        with self._lock:
            self._memory.clear()
            self._by_args.clear()

    def get(self, kernel: str, config: Mapping, arch: str, compile_fn: Callable[[], object]):
        """The kernel for ``(kernel, config, arch)``: from memory, disk, or ``compile_fn()``."""
        try:
            # with the types: 1 == True == 1.0 hash alike, but cache_key (str) tells them apart
            args_key = (kernel, tuple((k, type(v), v) for k, v in sorted(config.items())), arch)
            hit = self._by_args.get(args_key)
        except TypeError:  # unhashable config values: take the slow path every time
            args_key, hit = None, None
        if hit is not None:
            return hit
        hit = self._get(cache_key(kernel, config, arch), compile_fn)
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
                path = self._path(key)
                hit = (_load(path) if path is not None else None)
                if hit is not None:
                    self.loads += 1
                else:
                    hit = compile_fn()
                    self.compiles += 1
                    if path is not None:
                        _store(hit, path)
                self._memory[key] = hit
        return hit

    def _path(self, key: str) -> str | None:
        d = self.directory
        return None if d is None else os.path.join(d, source_fingerprint()[:16], f"{key}.o")


def _load(path: str):
    """The kernel exported to ``path``, or None when there is none (or it is unreadable)."""
    if not os.path.exists(path):
        return None
    cubin_path = path[:-2] + ".cubin"
    try:
        _check_object_file(path)
        cubin = None
        if os.path.exists(cubin_path):  # for sass_of, as on a freshly compiled kernel
            try:
                _check_object_file(cubin_path)
                cubin = pathlib.Path(cubin_path).read_bytes()
            except (OSError, ValueError) as err:  # unreadable or truncated: as a bad object file
                raise ValueError(f"its cubin {cubin_path}: {err}") from err
        from cutlass.runtime import load_module

        fn = getattr(load_module(path, enable_tvm_ffi=True), _EXPORT_NAME)
        if cubin is not None:
            fn.__cubin__ = cubin
    except Exception as err:  # a corrupt or foreign file: recompile (and overwrite it)
        warnings.warn(f"lowprec: ignoring unreadable cached kernel {path} ({err}); recompiling",
                      RuntimeWarning, stacklevel=4)
        return None
    log.debug("lowprec: loaded %s", path)
    return fn


def _check_object_file(path: str) -> None:
    """Refuse what is not a whole 64-bit ELF object before handing it to the linker: a truncated
    file must be recompiled, not linked."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(64)
    if len(head) < 64 or head[:5] != b"\x7fELF\x02":
        raise ValueError("not a 64-bit ELF object")
    order = "little" if head[5] == 1 else "big"
    shoff = int.from_bytes(head[40:48], order)
    shentsize, shnum = int.from_bytes(head[58:60], order), int.from_bytes(head[60:62], order)
    if shoff + shentsize * shnum > size:
        raise ValueError(f"truncated ({size} bytes, section headers end at {shoff + shentsize * shnum})")


def _store(compiled, path: str) -> None:
    """Export a TVM-FFI kernel to ``path`` (and its cubin beside it); an optimization only."""
    if not hasattr(compiled, "export_to_c"):
        return
    try:
        if not os.path.isdir(os.path.dirname(path)):
            os.makedirs(os.path.dirname(path), exist_ok=True)
            _prune(os.path.dirname(os.path.dirname(path)))
        cubin = getattr(compiled, "__cubin__", None)
        if isinstance(cubin, (bytes, bytearray)):
            _atomic_write(path[:-2] + ".cubin", lambda tmp: pathlib.Path(tmp).write_bytes(cubin))
        # the object last: it is what a reader looks for
        _atomic_write(path, lambda tmp: compiled.export_to_c(tmp, function_name=_EXPORT_NAME))
    except Exception as err:
        log.info("lowprec: kernel %s kept in memory only (%s)", path, err)


def _prune(directory: str, keep: int = KEEP_FINGERPRINTS) -> None:
    """Delete all but the ``keep`` most recently written fingerprint subdirectories: every source
    edit starts a new one, and nothing reads the old ones again."""
    try:
        subdirs = [e for e in os.scandir(directory) if e.is_dir() and len(e.name) == 16
                   and all(c in "0123456789abcdef" for c in e.name)]
        subdirs.sort(key=lambda e: e.stat().st_mtime, reverse=True)
        for old in subdirs[keep:]:
            shutil.rmtree(old.path, ignore_errors=True)
    except OSError:
        pass


def _atomic_write(path: str, write: Callable[[str], object]) -> None:
    """``write(tmp)`` to a temporary file beside ``path``, then rename it over ``path``: a reader
    (another process) sees the old file or the whole new one, never half of one."""
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".tmp-", suffix=os.path.splitext(path)[1])
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


kernel_cache = KernelCache()
