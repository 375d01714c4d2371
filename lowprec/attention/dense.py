"""Dense attention ``[B, H, S, D]``: exact, or FP8-quantized (FlashAttention-3 / SageAttention scheme)."""

from __future__ import annotations

import math
import numbers

import torch

from ..nn.functional import reject_tangents
from ..runtime import autocast_off, backend_mode, registry
from ..tensor import QuantizedTensor
from . import ops
from .quantize import (
    FLOAT_DTYPES,
    kv_views,
    qk_from_quantized,
    quantize_v,
    unpermute_v_keys,
    v_from_quantized,
)
from .reference import attention_reference, lse_correction

__all__ = ["attention", "check_flag"]

_QUANT = (None, "fp8")


def check_flag(name: str, value) -> None:
    """A TypeError naming ``name`` unless ``value`` is a bool: a float passed positionally (a scale,
    or FlashAttention's dropout_p in ``causal``'s place) read as True silently changed the mask."""
    if not isinstance(value, bool):
        raise TypeError(f"{name}: expected a bool, got {value!r}")


def _check_input(name: str, t, device: torch.device | None, dtype: torch.dtype | None = None) -> None:
    if isinstance(t, QuantizedTensor):
        if t.dim() != 4:
            raise ValueError(f"{name}: expected a 4-D QuantizedTensor, got shape {tuple(t.shape)}")
    elif not isinstance(t, torch.Tensor) or t.dtype not in FLOAT_DTYPES or t.dim() != 4:
        raise ValueError(f"{name}: expected a 4-D float16/bfloat16/float32/float64 tensor [B, H, S, D] (FP8 "
                         f"inputs as QuantizedTensors), got {getattr(t, 'dtype', type(t))} "
                         f"{tuple(getattr(t, 'shape', ()))}")
    if device is not None and t.device != device:
        raise ValueError(f"{name}: on {t.device}, but q is on {device}")
    # one dtype for q, k, v tensors (as torch's SDPA, whose CUDA error would not name the argument);
    # QuantizedTensors are codes, their original dtype aside
    if dtype is not None and isinstance(t, torch.Tensor) and t.dtype != dtype:
        raise ValueError(f"{name}: {t.dtype}, but q is {dtype}: q, k and v tensors share one dtype (cast them)")


def softmax_scale(scale, head_dim: int) -> float:
    """``scale`` as a float (None: ``1/sqrt(head_dim)``), else a ValueError naming it: a NaN or Inf
    scale gave NaN rows (FP8 with Inf: zeros), and a tensor's gradient was dropped without a word."""
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(scale, torch.Tensor):
        real = scale.numel() == 1 and not scale.is_complex() and not scale.requires_grad
    else:
        real = isinstance(scale, numbers.Real) and not isinstance(scale, bool)
    if not real or not math.isfinite(float(scale)):
        raise ValueError(f"scale: expected a finite real number (a tensor without gradient: none flows to it), "
                         f"got {scale!r}")
    return float(scale)


def attention(q, k, v, causal: bool = False, scale: float | None = None, quant: str | None = None,
              return_lse: bool = False, *, incoherent: bool = False):
    """Scaled dot-product attention, ``softmax(q · kᵀ · scale) · v``.

    Args:
        q: ``[B, H, Sq, D]``; k: ``[B, Hkv, Sk, D]``; v: ``[B, Hkv, Sk, Dv]`` (torch SDPA layout;
            ``H`` a multiple of ``Hkv`` for grouped-query attention). Float dtypes, one for the
            three (else a ValueError naming the argument; a QuantizedTensor input aside).
            With ``quant="fp8"`` they may also be already quantized (an FP8 KV cache):
            ``QuantizedTensor``\\ s of Q or K in :data:`ATTN_QK_RECIPE` and of Vᵀ ``[B, Hkv, Dv, Sk]`` in
            ``fp8_rowwise`` (see :func:`quantize_kv_cache`), taken as they are: a quantized input
            stands for its dequantized value (a quantized K is not smoothed again). No gradients then.
            A QuantizedTensor V is always read as Vᵀ (one scale per channel): a V ``[B, Hkv, Sk, Dv]``
            quantized as it is (one scale per token) is refused by shape only where ``Sk != Dv``;
            where they are equal the shapes cannot tell, so quantize V with :func:`quantize_kv_cache`.
        causal: mask keys after the query, bottom-right aligned when ``Sq != Sk`` (query ``i``
            sees keys ``j ≤ i + Sk − Sq``). Rows that see no key give 0 and LSE −inf.
        scale: softmax scale, a finite real number (default ``1/sqrt(D)``).
        quant: None (exact) or ``"fp8"`` (the FP8 scheme in :mod:`lowprec.attention.reference`:
            the sm_90a kernel where it applies, else its plain-torch emulation).
        return_lse: also return the log-sum-exp ``[B, H, Sq]`` (FP32, natural log). With
            ``quant="fp8"`` (and from PyTorch's fused kernels on CUDA) it carries no gradient.
        incoherent: ``quant="fp8"`` only: rotate Q and K by one random ±1 · Hadamard matrix before
            quantizing (FlashAttention-3's incoherent processing; D a power of two). Off by default.

    Inputs are assumed finite with ``quant="fp8"`` (as :func:`~lowprec.quantize` with
    ``check_finite=False``): an Inf reaches every value that shares its scale or K's mean, so one
    Inf in Q makes its 128-row block NaN, and one in K or V every row of its head.

    Exact attention (``quant=None``) on CUDA runs PyTorch's fused kernels
    (``F.scaled_dot_product_attention``; with ``return_lse`` the flash attention op), forward and
    backward; elsewhere the FP32 reference (FP64 for FP64 inputs). ``quant="fp8"`` is
    differentiable: the backward is exact attention's gradient from the FP8 forward's output and
    LSE (on CUDA for fp16/bf16 PyTorch's cuDNN attention backward where ``Sq == Sk`` or not causal, its flash attention
    backward otherwise; plain torch elsewhere).

    Decode (``Sq`` of 1..16 new queries over a long ``Sk``) is this same call: with ``causal`` the
    queries are the last rows of the prefill (bottom-right). With float K and V, ``quant="fp8"``
    quantizes all of them in every call, which at decode costs more than exact attention (B64
    H32/8 Sk8192 on an H200: 0.3× cuDNN SDPA; ``bench attention``): keep the keys and values in FP8
    across steps (:class:`~lowprec.attention.FP8KVCache` and its ``attend``: 1.8× there; or
    :func:`quantize_kv_cache` once, whose plain Vᵀ layout the forward reads 8-15% slower than the
    cache's). Packed variable-length batches: :func:`attention_varlen`.
    """
    check_flag("causal", causal)
    check_flag("incoherent", incoherent)
    _check_input("q", q, None)
    for name, t in (("k", k), ("v", v)):
        _check_input(name, t, q.device, q.dtype if isinstance(q, torch.Tensor) else None)
    v_transposed = isinstance(v, QuantizedTensor)
    b, h, sq, d = q.shape
    if d == 0:  # no score to scale or quantize
        raise ValueError(f"q: expected a head dim D ≥ 1, got shape {tuple(q.shape)}")
    if k.shape[1] == 0:
        raise ValueError(f"k: expected Hkv ≥ 1 key/value heads (dividing H={h}), got shape {tuple(k.shape)}")
    if k.shape[0] != b or k.shape[-1] != d or h % k.shape[1]:
        raise ValueError(f"k: expected [B={b}, Hkv dividing H={h}, Sk, D={d}], got {tuple(k.shape)}")
    v_lead = (v.shape[0], v.shape[1], v.shape[3]) if v_transposed else tuple(v.shape[:3])
    if v_lead != tuple(k.shape[:3]):
        what = "Vᵀ [B, Hkv, Dv, Sk]" if v_transposed else "[B, Hkv, Sk]"
        raise ValueError(f"v: expected {what} matching k's {tuple(k.shape[:3])}, got {tuple(v.shape)}")
    if quant not in _QUANT:
        raise ValueError(f"quant: expected None or 'fp8', got {quant!r}")
    if incoherent and quant is None:
        raise ValueError("incoherent: applies to quant='fp8' only")
    scale = softmax_scale(scale, d)
    quantized = [n for n, t in (("q", q), ("k", k), ("v", v)) if isinstance(t, QuantizedTensor)]

    if quant is None:
        if quantized:
            raise ValueError(f"{quantized[0]}: a QuantizedTensor input needs quant='fp8'")
        if q.is_cuda and backend_mode() != "reference" and sq and k.shape[2]:
            out, lse = ops.exact_cuda(q, k, v, bool(causal), scale, return_lse)
        else:
            with autocast_off(q.device):  # the FP32 reference: autocast ran its matmuls in fp16 (NaN past 65504)
                out, lse = attention_reference(q, k, v, bool(causal), scale, None)
    else:
        # the quantizers and the custom backward drop tangents: an error, not a silent zero
        reject_tangents("attention(quant='fp8')", *(t for t in (q, k, v) if isinstance(t, torch.Tensor)))
        # the scheme's own arithmetic (the rotation, the LSE correction, the emulation) in its
        # precision under torch.autocast too, as the kernel's: autocast made the LSE 4x less exact
        with autocast_off(q.device):
            if quantized:
                out, lse = _fp8_quantized_inputs(q, k, v, bool(causal), scale, incoherent, return_lse)
            else:
                out, lse, k_mean = ops.attention_fp8_call(q, k, v, bool(causal), scale, bool(incoherent))
                if return_lse:  # the LSE of the unsmoothed scores (not differentiable, as the op's)
                    lse = lse + lse_correction(q.detach(), k_mean, scale, incoherent)
    return (out, lse) if return_lse else out


def _fp8_quantized_inputs(q, k, v, causal: bool, scale: float, incoherent: bool, return_lse: bool):
    """FP8 attention where some inputs are QuantizedTensors: the others go through the pre-pass."""
    if incoherent:
        raise ValueError("incoherent: cannot rotate already-quantized inputs (quantize Q and K from tensors)")
    plain = [n for n, t in (("q", q), ("k", k), ("v", v)) if isinstance(t, torch.Tensor) and t.requires_grad
             and torch.is_grad_enabled()]
    if plain:
        raise ValueError(f"{plain[0]}: requires grad, but other inputs are QuantizedTensors; gradients through "
                         "FP8 attention need q, k, v as tensors")
    from .quantize import quantize_k

    if isinstance(k, QuantizedTensor):
        (kc, ks), k_mean = qk_from_quantized(k, "k"), None
    else:
        kc, ks, k_mean = quantize_k(k)
    vt, vs = v_from_quantized(v) if isinstance(v, QuantizedTensor) else quantize_v(v)
    out, lse = fp8_over_kv_operands(q, kc, ks, vt, vs, causal, scale)
    if k_mean is not None and return_lse:
        q_exact = q.dequantize(torch.float32) if isinstance(q, QuantizedTensor) else q
        lse = lse + lse_correction(q_exact, k_mean, scale)
    return out, lse


def fp8_over_kv_operands(q, kc, ks, vt, vs, causal: bool, scale: float, kv_lengths: torch.Tensor | None = None,
                         v_keys_permuted: bool = False):
    """The FP8 forward of a float (or quantized) Q over K / Vᵀ already in the kernel's operands
    (an FP8 KV cache; K, Vᵀ and K's scales may be length-Sk views of longer buffers). Returns
    ``(out, lse)``, the LSE of the scores as the operands give them. ``kv_lengths``: the cache's
    ``[B, 8]`` int32 plan of device-side lengths (field 5), the operands its whole buffers: on
    sm_90a the decode kernels read the lengths (CUDA graphs); else they are read back (a sync) and
    each row attends over its own. ``v_keys_permuted``: ``vt`` in the kernel's permuted key order
    (an :class:`~lowprec.attention.FP8KVCache`'s), which the paths without the kernel undo first."""
    from .quantize import quantize_q

    out_dtype = q.dtype if q.dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64) else torch.float32

    def composed():
        qc, qs = qk_from_quantized(q, "q") if isinstance(q, QuantizedTensor) else quantize_q(q)
        plain = unpermute_v_keys(vt) if v_keys_permuted else vt
        return ops.attention_fp8_forward_call(qc, qs, kc, ks, plain, vs, causal, scale, out_dtype)

    if kv_lengths is not None:
        def per_row():  # the host path: each row over its own length
            rows = []
            for b, n in enumerate(kv_lengths[:, 5].tolist()):
                row = slice(b, b + 1)
                rows.append(fp8_over_kv_operands(q[row], *kv_views(kc[row], ks[row], vt[row], n), vs[row], causal,
                                                 scale, v_keys_permuted=v_keys_permuted))
            return torch.cat([r[0] for r in rows]), torch.cat([r[1] for r in rows])

        return registry.run("attention_fp8_q", q.device, (q, kc, ks, vt, vs, causal, scale, kv_lengths,
                                                          v_keys_permuted), per_row)
    if isinstance(q, QuantizedTensor) or torch.compiler.is_compiling():
        return composed()
    # eager: on Hopper one lean host pass (Q pre-pass + forward)
    return registry.run("attention_fp8_q", q.device, (q, kc, ks, vt, vs, causal, scale, None, v_keys_permuted),
                        composed)
