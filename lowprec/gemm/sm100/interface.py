"""Host wiring of the sm_100a block-scaled GEMM: compile on fake arguments (no GPU needed).

Nothing here launches: no Blackwell GPU is available to check the kernel on, see ``__init__``.
"""

from __future__ import annotations

from ...runtime import compile_for_arch


def build_kernel(config, arch: str = "sm_100a"):
    """Compile one ``GemmConfig`` on fake pointers and sizes, uncached; keeps PTX and cubin
    (``lowprec.runtime.compile.sass_of`` disassembles the result)."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_ptr

    from .blockscaled_gemm import BlockScaledGemmSm100

    kernel = BlockScaledGemmSm100(config)

    def fake_ptr(dtype, align):  # a placeholder address: the compile reads only type and alignment
        return make_ptr(dtype, align, cute.AddressSpace.gmem, assumed_align=align)

    a, b = fake_ptr(kernel.ab_dtype, 16), fake_ptr(kernel.ab_dtype, 16)
    sfa, sfb = fake_ptr(kernel.sf_dtype, 16), fake_ptr(kernel.sf_dtype, 16)
    d = fake_ptr(kernel.d_dtype, 32)
    sizes = [cutlass.Int32(0)] * 4  # m, n, k, l: dynamic
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=False)
    return compile_for_arch(kernel, a, b, sfa, sfb, d, *sizes, stream, arch=arch, tvm_ffi=False)
