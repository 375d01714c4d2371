"""Attention: exact, or FP8-quantized (FlashAttention-3 / SageAttention scheme); dense
``[B, H, S, D]`` (:mod:`.dense`) and packed variable-length sequences (:mod:`.varlen`)."""

from ..runtime import registry
from .dense import attention
from .hf import fp8_cache, register_transformers_attention
from .kv_cache import FP8KVCache
from .quantize import ATTN_QK_RECIPE, FP8AttentionInputs, quantize_kv_cache, quantize_qkv
from .varlen import attention_varlen

__all__ = ["attention", "attention_varlen", "quantize_qkv", "quantize_kv_cache", "FP8KVCache", "FP8AttentionInputs",
           "ATTN_QK_RECIPE", "register_transformers_attention", "fp8_cache"]

registry.load_arch_packages(__name__, __path__)
