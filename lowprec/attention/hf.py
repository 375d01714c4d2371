"""lowprec's FP8 attention as a transformers attention implementation (transformers >= 5).

``register_transformers_attention()`` registers ``"lowprec_fp8"`` in transformers'
``AttentionInterface`` (and its mask interface, with SDPA's masks), so any model that dispatches
its attention through that interface (Llama, Qwen2/3, Mistral, Mixtral, Qwen3-MoE, ...) runs
:func:`lowprec.attention` with ``quant="fp8"``: Q, K in per-128-token blocks (K smoothed), V per
channel, P in FP8, differentiable (the backward is exact attention's gradient in bf16):

    from lowprec.attention import register_transformers_attention

    model.set_attn_implementation(register_transformers_attention())

The calls the FP8 forward does not compute run transformers' own ``sdpa`` implementation, with one
warning per reason: an attention mask (padding, sliding windows: transformers passes no mask for a
plain causal pattern), dropout, a softcap, chunked prefill over a cache (``1 < q_len != kv_len``),
decode over transformers' bf16 cache (its whole K and V would be quantized again at every step:
:class:`lowprec.attention.FP8KVCache` keeps a cache in FP8), and on CUDA inputs the kernel does not
read (dtype other than bf16 / fp16, head dims other than 64 / 128 / 256, ``Dv != D``).
"""

from __future__ import annotations

import torch

from ..runtime import warn_once
from .dense import attention

__all__ = ["ATTENTION_IMPLEMENTATION", "register_transformers_attention", "transformers_attention_forward"]

ATTENTION_IMPLEMENTATION = "lowprec_fp8"
_KERNEL_DTYPES = (torch.bfloat16, torch.float16)
_KERNEL_HEAD_DIMS = (64, 128, 256)


def register_transformers_attention() -> str:
    """Register ``"lowprec_fp8"`` with transformers (>= 5) and return that name, for
    ``model.set_attn_implementation(name)`` or ``from_pretrained(..., attn_implementation=name)``."""
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    except ImportError as err:
        raise ImportError("register_transformers_attention: needs transformers >= 5 (its AttentionInterface)") from err
    AttentionInterface.register(ATTENTION_IMPLEMENTATION, transformers_attention_forward)
    # SDPA's masks: None for a plain causal pattern (the FP8 forward's causal flag), a tensor otherwise
    AttentionMaskInterface.register(ATTENTION_IMPLEMENTATION, sdpa_mask)
    return ATTENTION_IMPLEMENTATION


def _sdpa_reason(module, query, key, value, attention_mask, dropout: float, kwargs) -> str | None:
    """Why this call runs transformers' SDPA instead of the FP8 forward (None: it does not)."""
    q_len, kv_len = query.shape[2], key.shape[2]
    if attention_mask is not None:
        return "an attention mask (padding, a sliding window or another pattern than plain causal)"
    if dropout:
        return "attention dropout"
    if kwargs.get("softcap") is not None:
        return "a logit softcap"
    if q_len == 1 < kv_len or (q_len <= 16 and q_len < kv_len):
        return ("decode over transformers' bf16 KV cache (the FP8 forward would quantize the whole cache at every "
                "step; lowprec.attention.FP8KVCache keeps a cache in FP8)")
    if q_len != kv_len:
        return "queries over a longer cache (chunked prefill)"
    if query.is_cuda:
        d, dv = query.shape[-1], value.shape[-1]
        if query.dtype not in _KERNEL_DTYPES:
            return f"{query.dtype} inputs (the FP8 kernel reads bf16 / fp16)"
        if d not in _KERNEL_HEAD_DIMS or dv != d:
            return f"head dims D={d}, Dv={dv} (the FP8 kernel serves D = Dv in {_KERNEL_HEAD_DIMS})"
    return None


def transformers_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                                   value: torch.Tensor, attention_mask: torch.Tensor | None, dropout: float = 0.0,
                                   scaling: float | None = None, is_causal: bool | None = None, **kwargs):
    """The ``"lowprec_fp8"`` attention implementation, with transformers' signature: ``query``
    ``[B, H, S, D]``, ``key`` / ``value`` ``[B, Hkv, S, D]`` (grouped heads are not repeated).
    Returns ``(attn_output [B, S, H, D], None)`` (no attention weights)."""
    why = _sdpa_reason(module, query, key, value, attention_mask, dropout, kwargs)
    if why is not None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        warn_once(f"lowprec: attn_implementation={ATTENTION_IMPLEMENTATION!r}: {why}; those calls run 'sdpa'")
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    out = attention(query, key, value, causal=bool(causal) and query.shape[2] > 1, scale=scaling, quant="fp8")
    return out.transpose(1, 2).contiguous(), None
