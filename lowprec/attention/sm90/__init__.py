"""Hopper (sm_90a) FP8 attention forward kernel and its pre-pass kernels, registered with the
kernel registry. Importing this package does not import cutlass."""

from ...runtime.registry import register
from . import config

register("attention_fp8", "sm_90a", f"{__name__}.interface:attention_fp8_forward_op", config.attention_unsupported)
register("attention_fp8_q", "sm_90a", f"{__name__}.interface:attention_fp8_q_op", config.q_unsupported)
register("attention_fp8_qkv", "sm_90a", f"{__name__}.interface:attention_fp8_qkv_op", config.qkv_unsupported)
register("attention_fp8_varlen", "sm_90a", f"{__name__}.interface:attention_fp8_varlen_op", config.varlen_unsupported)
register("attention_prepass_k", "sm_90a", f"{__name__}.interface:attention_prepass_k_op", config.prepass_k_unsupported)
register("attention_prepass_v", "sm_90a", f"{__name__}.interface:attention_prepass_v_op", config.prepass_v_unsupported)
register("attention_fp8_cache_attend", "sm_90a", f"{__name__}.interface:cache_attention_op",
         config.cache_attention_unsupported)
register("attention_fp8_cache_append", "sm_90a", f"{__name__}.interface:cache_append_op", config.kv_append_unsupported)
