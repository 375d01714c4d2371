"""CuTe DSL kernels compile on this CPU-only machine for sm_90a and sm_100a, for real."""

import pytest

from lowprec.runtime import compile_for_arch, cubin_arch, local_memory_ops, sass_of


def _probe():
    import importlib.util
    import pathlib

    spec = importlib.util.spec_from_file_location("probe_kernel", pathlib.Path(__file__).with_name("probe_kernel.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_probe_kernel_compiles_for_arch(arch):
    k = _probe()
    compiled = compile_for_arch(k.scale, *k.fake_args(), arch=arch)
    assert f".target {arch}" in compiled.__ptx__
    sass = sass_of(compiled)
    assert cubin_arch(sass) == arch
    assert "FMUL" in sass and local_memory_ops(sass) == 0


def test_cubin_arch_parsing():
    assert cubin_arch('.headerflags @"EF_CUDA_ACCELERATORS EF_CUDA_SM90 EF_CUDA_VIRTUAL_SM(EF_CUDA_SM90)"') == "sm_90a"
    assert cubin_arch('.headerflags @"EF_CUDA_SM90"') == "sm_90"
    assert cubin_arch("\t.target\tsm_100a\n") == "sm_100a"
    assert local_memory_ops("  STL [R1], R2 ;\n  LDL.64 R4, [R1] ;\n  LDG.E R3, [R2] ;") == 2
    with pytest.raises(ValueError):
        cubin_arch("nothing")


def test_ffi_entry_falls_back_to_the_compiled_object():
    """Without a TVM-FFI function (a build without it, or no GPU to load it on) the compiled
    object itself is what gets called; with one, the positional function."""
    from types import SimpleNamespace

    from lowprec.runtime import ffi_entry

    plain = SimpleNamespace()
    assert ffi_entry(plain) is plain
    unloaded = SimpleNamespace(__tvm_ffi_object__=lambda: None)
    assert ffi_entry(unloaded) is unloaded
    raw = object()
    loaded = SimpleNamespace(__tvm_ffi_object__=lambda: raw,
                             execution_args=SimpleNamespace(has_pointer_address_arg_specs=False))
    assert ffi_entry(loaded) is raw
    pointers = SimpleNamespace(__tvm_ffi_object__=lambda: raw,
                               execution_args=SimpleNamespace(has_pointer_address_arg_specs=True))
    assert ffi_entry(pointers) is pointers  # pointer arguments need the wrapper's conversion
