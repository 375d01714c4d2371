"""Attention: exact, or FP8-quantized (FlashAttention-3 / SageAttention scheme)."""

from __future__ import annotations

import math

import torch

from .reference import attention_reference

__all__ = ["attention"]

_QUANT = (None, "fp8")


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False, scale: float | None = None,
              quant: str | None = None, return_lse: bool = False):
    """Scaled dot-product attention, ``softmax(q · kᵀ · scale) · v``.

    Args:
        q: ``[B, H, Sq, D]``; k: ``[B, Hkv, Sk, D]``; v: ``[B, Hkv, Sk, Dv]`` (torch SDPA layout;
            ``H`` a multiple of ``Hkv`` for grouped-query attention). Float dtypes.
        causal: mask keys after the query, bottom-right aligned when ``Sq != Sk`` (query ``i``
            sees keys ``j ≤ i + Sk − Sq``). Rows that see no key give 0 and LSE −inf.
        scale: softmax scale, default ``1/sqrt(D)``.
        quant: None (exact, FP32 math) or ``"fp8"`` (the FP8 scheme in
            :mod:`lowprec.attention.reference`).
        return_lse: also return the log-sum-exp ``[B, H, Sq]`` (FP32, natural log).
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point() or t.dim() != 4:
            raise ValueError(f"{name}: expected a 4-D float tensor [B, H, S, D], got "
                             f"{getattr(t, 'dtype', type(t))} {tuple(getattr(t, 'shape', ()))}")
        if t.device != q.device:
            raise ValueError(f"{name}: on {t.device}, but q is on {q.device}")
    b, h, _, d = q.shape
    if k.shape[1] == 0:
        raise ValueError(f"k: expected Hkv ≥ 1 key/value heads (dividing H={h}), got shape {tuple(k.shape)}")
    if k.shape[0] != b or k.shape[-1] != d or h % k.shape[1]:
        raise ValueError(f"k: expected [B={b}, Hkv dividing H={h}, Sk, D={d}], got {tuple(k.shape)}")
    if v.shape[:3] != k.shape[:3]:
        raise ValueError(f"v: expected [B, Hkv, Sk] = {tuple(k.shape[:3])} leading dims, got {tuple(v.shape)}")
    if quant not in _QUANT:
        raise ValueError(f"quant: expected None or 'fp8', got {quant!r}")
    if quant is not None and torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        raise NotImplementedError(f"attention: quant={quant!r} has no backward yet; inputs requiring grad would "
                                  "silently lose their gradient (use quant=None, or detach)")
    if scale is None:
        scale = 1.0 / math.sqrt(d)
    out, lse = attention_reference(q, k, v, causal, float(scale), quant)
    return (out, lse) if return_lse else out
