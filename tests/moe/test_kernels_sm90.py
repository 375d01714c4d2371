"""The MoE's fused kernels (pack, SwiGLU quantized or not, and its backward) compile for sm_90a on any machine, with
wide accesses and no local memory; their GPU tests are in test_packing_sm90 / test_activation_sm90."""

import re

import pytest
import torch

from lowprec.moe.sm90.interface import KERNELS, build_kernel
from lowprec.runtime import cubin_arch, local_memory_ops, sass_of


@pytest.mark.parametrize("kind", KERNELS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_kernel_compiles_for_sm90a_with_wide_loads_and_no_spills(kind, dtype):
    sass = sass_of(build_kernel(kind, dtype))
    assert cubin_arch(sass) == "sm_90a"
    assert local_memory_ops(sass) == 0
    assert re.search(r"LDG\.E\.128", sass)
    if kind not in ("swiglu_backward", "swiglu_rows"):  # the two kernels that quantize nothing
        assert "F2FP" in sass  # packed cvt to e4m3
    assert "ACQBULK" in sass  # griddepcontrol.wait: safe under programmatic dependent launch


def test_unknown_kind_is_refused():
    with pytest.raises(ValueError, match="kind"):
        build_kernel("1x128", torch.bfloat16)
