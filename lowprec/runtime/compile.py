"""Compile CuTe DSL kernels for a given arch without a GPU, and inspect what came out.

CuTe DSL compiles on any machine: the target arch is a compile option and inputs can be fake
tensors (``cute.runtime.make_fake_compact_tensor``), so CI proves every shipped kernel config
compiles for sm_90a / sm_100a and that its SASS is what we meant (QGMMA, no local memory).
"""

from __future__ import annotations

import atexit
import glob
import os
import re
import shutil
import subprocess
import tempfile

__all__ = ["compile_for_arch", "ffi_entry", "sass_of", "cubin_arch", "nvdisasm_path", "local_memory_ops"]


def compile_for_arch(jit_fn, *args, arch: str, tvm_ffi: bool = False, **kwargs):
    """``cute.compile`` ``jit_fn(*args, **kwargs)`` for ``arch``, keeping PTX and cubin.

    Not thread-safe (``cute.compile`` is not): callers go through :mod:`lowprec.runtime.cache`.
    """
    import cutlass.cute as cute
    from cutlass.base_dsl.compiler import DumpDir

    # kept artifacts are also written to files: keep them out of the working directory
    options = [cute.GPUArch(arch), cute.KeepPTX(), cute.KeepCUBIN(), DumpDir(_dump_dir())]
    if tvm_ffi:
        options.append(cute.EnableTVMFFI())
    return cute.compile[tuple(options)](jit_fn, *args, **kwargs)


def ffi_entry(compiled):
    """What to call to launch ``compiled`` (a TVM-FFI build): its positional ``tvm_ffi.Function``
    where it has one, else ``compiled`` itself. The DSL's wrapper around that function maps
    keyword arguments, which lowprec never passes, and costs several µs per eager launch."""
    get = getattr(compiled, "__tvm_ffi_object__", None)
    raw = get() if get is not None else None
    pointer_args = getattr(getattr(compiled, "execution_args", None), "has_pointer_address_arg_specs", False)
    return compiled if raw is None or pointer_args else raw


_DUMP_DIR: str | None = None


def _dump_dir() -> str:
    """This process's own directory: the artifacts are named after the function and its argument
    types, not the kernel's configuration, so processes compiling at the same time must not
    share one (a cubin read back from another process's compile was seen in CI)."""
    global _DUMP_DIR
    if _DUMP_DIR is None:
        _DUMP_DIR = tempfile.mkdtemp(prefix="lowprec-cute-dumps-")
        atexit.register(shutil.rmtree, _DUMP_DIR, ignore_errors=True)
    return _DUMP_DIR


def nvdisasm_path() -> str | None:
    """nvdisasm from PATH or from the ``nvidia-cuda-nvdisasm`` pip package, or None."""
    found = shutil.which("nvdisasm")
    if found:
        return found
    try:
        import nvidia
    except ImportError:
        return None
    for root in nvidia.__path__:
        hits = sorted(glob.glob(os.path.join(root, "*", "bin", "nvdisasm")))
        if hits:
            return hits[-1]
    return None


def sass_of(compiled_or_cubin) -> str:
    """Disassemble a compiled kernel's cubin (or raw cubin bytes) to SASS text."""
    cubin = getattr(compiled_or_cubin, "__cubin__", compiled_or_cubin)
    if not isinstance(cubin, (bytes, bytearray)):
        raise ValueError("compiled_or_cubin: no cubin (compile with lowprec.runtime.compile_for_arch)")
    tool = nvdisasm_path()
    if tool is None:
        raise RuntimeError("nvdisasm not found: pip install nvidia-cuda-nvdisasm")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        done = subprocess.run([tool, "-c", path], capture_output=True, text=True, check=True)
    return done.stdout


def cubin_arch(sass: str) -> str:
    """The arch a cubin targets, from its disassembly header (e.g. ``"sm_90a"``)."""
    m = re.search(r"\.target\s+(sm_\w+)", sass)
    if m:
        return m.group(1)
    m = re.search(r"EF_CUDA_SM(\d+)\b", sass)
    if not m:
        raise ValueError("sass: no target arch in the disassembly header")
    return f"sm_{m.group(1)}" + ("a" if "EF_CUDA_ACCELERATORS" in sass else "")


def local_memory_ops(sass: str) -> int:
    """Count of local-memory loads/stores (LDL/STL: register spills) in ``sass``."""
    return len(re.findall(r"\b(?:LDL|STL)(?:\.\w+)*\s", sass))
