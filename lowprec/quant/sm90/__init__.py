"""Hopper FP8 quantize kernels (CuTe DSL), registered with the kernel registry. Importing this
package does not import cutlass. The kernels use no sm_90-only instructions."""

from ...runtime.registry import register
from . import config

_interface = f"{__name__}.interface"
register("quantize", "sm_90a", f"{_interface}:quantize_codes", config.quantize_unsupported)
register("quantize_dual", "sm_90a", f"{_interface}:quantize_dual_codes", config.dual_unsupported)
register("quantize_with_transpose", "sm_90a", f"{_interface}:quantize_with_transpose_codes",
         config.transpose_unsupported)
register("quantize_t_gathered", "sm_90a", f"{_interface}:quantize_t_gathered_codes", config.gathered_unsupported)
for _kind in ("swiglu", "swiglu_dgate", "swiglu_dup"):
    register(f"quantize_{_kind}_dual", "sm_90a", f"{_interface}:{_kind}_quantize_dual", config.swiglu_dual_unsupported)
for _t_rows in (16, 128):
    register(f"quantize_swiglu_dual_t{_t_rows}x128", "sm_90a", f"{_interface}:swiglu_quantize_dual_t{_t_rows}x128",
             config.swiglu_dual_unsupported)
