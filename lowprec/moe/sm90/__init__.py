"""Hopper MoE kernels (CuTe DSL): top-k ids, dispatch plan, token packing, SwiGLU and its backward, unpack;
registered with the kernel registry. Importing this package does not import cutlass."""

from ...runtime.registry import register
from . import config

_interface = f"{__name__}.interface"
register("moe_topk", "sm_90a", f"{_interface}:topk_ids", config.topk_unsupported)
register("moe_dispatch", "sm_90a", f"{_interface}:dispatch_plan", config.dispatch_unsupported)
register("moe_pack", "sm_90a", f"{_interface}:pack_1x128", config.pack_unsupported)
register("moe_unpack", "sm_90a", f"{_interface}:unpack_rows", config.unpack_unsupported)
register("swiglu_quantize", "sm_90a", f"{_interface}:swiglu_1x128", config.swiglu_unsupported)
register("moe_swiglu", "sm_90a", f"{_interface}:swiglu_rows", config.swiglu_rows_unsupported)
register("swiglu_backward", "sm_90a", f"{_interface}:swiglu_backward_1x128", config.swiglu_backward_unsupported)
