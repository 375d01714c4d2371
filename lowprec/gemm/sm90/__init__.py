"""Hopper (sm_90a) kernels of the GEMM family, registered with the kernel registry. Importing
this package does not import cutlass."""

from ...runtime.registry import register
from . import config

register("gemm", "sm_90a", f"{__name__}.interface:gemm_quantized", config.gemm_unsupported)
register("linear_inference", "sm_90a", f"{__name__}.interface:linear_inference", config.linear_inference_unsupported)
register("grouped_gemm", "sm_90a", f"{__name__}.interface:grouped_gemm_quantized", config.grouped_unsupported)
register("grouped_gemm_wgrad", "sm_90a", f"{__name__}.interface:grouped_gemm_wgrad_quantized",
         config.wgrad_unsupported)
register("weight_only_nvfp4", "sm_90a", f"{__name__}.weight_only_interface:weight_only_nvfp4",
         config.weight_only_unsupported)
register("weight_only_fp8", "sm_90a", f"{__name__}.weight_only_interface:weight_only_fp8",
         config.weight_only_unsupported)
register("grouped_weight_only_nvfp4", "sm_90a", f"{__name__}.weight_only_interface:grouped_weight_only_nvfp4",
         config.grouped_weight_only_unsupported)
