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
