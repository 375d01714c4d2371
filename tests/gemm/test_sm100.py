"""Compile tests of the sm_100a block-scaled GEMM (lowprec.gemm.sm100), CPU only.

Every shipped config compiles for sm_100a; its SASS has the block-scaled tcgen05 MMA of its
format (UTCQMMA for mxf8, UTCOMMA for nvf4), the scale-factor copies to TMEM (UTCCP), the
commits that free stages (UTCBAR), the accumulator loads (LDTM) and no local memory. No test
runs the kernel: there is no Blackwell GPU here.
"""

from __future__ import annotations

import pytest

from ..hopper import HAS_CUTLASS, needs_cutlass

_MMA_SASS = {"mxf8": "UTCQMMA", "nvf4": "UTCOMMA"}


def _shipped():
    from lowprec.gemm.sm100.config import shipped_configs

    return shipped_configs() if HAS_CUTLASS else ()


@needs_cutlass
@pytest.mark.parametrize("config", _shipped(), ids=str)
def test_compile_shipped_config(config):
    from lowprec.gemm.sm100.interface import build_kernel
    from lowprec.runtime.compile import local_memory_ops, nvdisasm_path, sass_of

    compiled = build_kernel(config, arch="sm_100a")
    if nvdisasm_path() is None:
        pytest.skip("no nvdisasm available (pip install nvidia-cuda-nvdisasm)")
    sass = sass_of(compiled)
    for op in (_MMA_SASS[config.element_format], "UTCCP", "UTCBAR", "LDTM"):
        assert op in sass, f"no {op} in the SASS"
    spills = local_memory_ops(sass)
    assert not spills, f"local-memory traffic in SASS: {spills} LDL/STL"


def test_config_rejects_unsupported_values():
    from lowprec.gemm.sm100.config import GemmConfig

    with pytest.raises(ValueError, match="element_format"):
        GemmConfig(element_format="mxf4")
    with pytest.raises(ValueError, match="tile_n"):
        GemmConfig(tile_n=64)


@needs_cutlass
@pytest.mark.parametrize("rows, k, vec", [(160, 192, 32), (96, 224, 16), (256, 1024, 32)])
def test_scale_layout_the_kernel_reads_is_to_blocked(rows, k, vec):
    """The kernel addresses scale (row, k-block) through CuTe's blocked layout
    (``tile_atom_to_shape_SF``); ``lowprec.quant.layouts.to_blocked`` must put it at that same
    offset, tails (rows past 128-multiples, k-blocks past 4-multiples) included."""
    import cutlass
    import cutlass.cute as cute
    import cutlass.utils.blockscaled_layout as blockscaled_utils
    import torch

    from lowprec.quant.layouts import to_blocked

    blocks = k // vec
    offsets = {}

    @cute.jit
    def trace():  # evaluated while tracing: static coordinates give Python ints
        layout = blockscaled_utils.tile_atom_to_shape_SF((rows, k, 1), vec)
        for row in cutlass.range_constexpr(rows):
            for kb in cutlass.range_constexpr(blocks):
                offsets[row, kb] = cute.crd2idx((row, kb * vec, 0), layout)

    cute.compile[cute.GPUArch("sm_100a")](trace)
    ids = torch.arange(1, 1 + rows * blocks, dtype=torch.float64).view(rows, blocks)  # 0 marks padding
    where = {int(v): i for i, v in enumerate(to_blocked(ids).tolist()) if v}
    assert len(offsets) == rows * blocks
    assert all(where[1 + row * blocks + kb] == offset for (row, kb), offset in offsets.items())
