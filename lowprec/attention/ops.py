"""torch.library custom ops for attention, with fake implementations and autograd.

- ``lowprec::attention_fp8_forward``: the FP8 forward on the kernel's operands (the contract of
  ``sm90/CONTRACT.md``): the sm_90a kernel where it applies, else the reference emulation.
- ``lowprec::attention_fp8``: Q, K, V in, ``(out, lse, k_mean)`` out: the quantization pre-pass and
  the forward; the LSE is of the smoothed scores (the caller adds the correction). Differentiable:
  its backward is exact attention's, from the FP8 forward's ``out`` and that ``lse`` on K smoothed
  by ``k_mean``, as FlashAttention's backward computes it.
  The LSE output is not differentiable (as with the aten flash attention op).
- ``lowprec::attention_backward``: ``(dq, dk, dv)`` from ``(dout, q, k, v, out, lse)``: on CUDA for
  fp16/bf16 PyTorch's cuDNN attention backward (``aten._scaled_dot_product_cudnn_attention_backward``,
  SDPA's own backward on Hopper; grouped heads as they are) where its causal mask is ours (``Sq ==
  Sk`` or not causal), else its flash attention backward; elsewhere plain torch
  (:func:`~lowprec.attention.reference.attention_backward_reference`).

All shapes are static and nothing reads values back to the host: ``torch.compile(fullgraph=True)``
traces the ops whole, CUDA graphs capture them. Eager calls (:func:`attention_fp8_call`) run the
same functions without the custom op's dispatch, which costs tens of µs of host time per call.
"""

from __future__ import annotations

import math

import torch

from ..runtime import autocast_off, backend_mode, kernel_failed, registry, warn_once
from .quantize import quantize_qkv, token_mean
from .reference import attention_backward_reference, dense_rescale_slack, fp8_forward_reference, lse_correction

__all__ = ["attention_fp8", "attention_fp8_call", "attention_fp8_forward", "attention_fp8_forward_call",
           "forward_dispatch", "attention_backward", "exact_cuda"]

_HALF = (torch.float16, torch.bfloat16)


# --- the FP8 forward: kernel or emulation ---------------------------------------------------------

def forward_dispatch(q, q_scale, k, k_scale, v_t, v_scale, causal: bool, scale: float,
                     out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The FP8 forward on the kernel's operands: the kernel where it applies, else the emulation."""
    def reference():
        out, lse = fp8_forward_reference(q, q_scale, k, k_scale, v_t, v_scale, causal, scale,
                                         rescale_slack=dense_rescale_slack(q, k))
        return out.to(out_dtype), lse

    args = (q, q_scale, k, k_scale, v_t, v_scale, causal, scale, out_dtype)
    return registry.run("attention_fp8", q.device, args, reference)


@torch.library.custom_op("lowprec::attention_fp8_forward", mutates_args=())
def attention_fp8_forward(q: torch.Tensor, q_scale: torch.Tensor, k: torch.Tensor, k_scale: torch.Tensor,
                          v_t: torch.Tensor, v_scale: torch.Tensor, causal: bool, scale: float,
                          out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [B, H, Sq, Dv] out_dtype, lse [B, H, Sq] FP32 of the smoothed scores)``."""
    return forward_dispatch(q, q_scale, k, k_scale, v_t, v_scale, causal, scale, out_dtype)


def attention_fp8_forward_call(q, q_scale, k, k_scale, v_t, v_scale, causal: bool, scale: float,
                               out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``attention_fp8_forward``: the custom op where ``torch.compile`` traces (it keeps the kernel
    in the graph), the dispatch itself in eager calls (no op dispatch on the host path)."""
    fn = attention_fp8_forward if torch.compiler.is_compiling() else forward_dispatch
    return fn(q, q_scale, k, k_scale, v_t, v_scale, causal, scale, out_dtype)


@attention_fp8_forward.register_fake
def _(q, q_scale, k, k_scale, v_t, v_scale, causal, scale, out_dtype):
    b, h, sq, _ = q.shape
    return q.new_empty((b, h, sq, v_t.shape[-2]), dtype=out_dtype), q.new_empty((b, h, sq), dtype=torch.float32)


def _attention_fp8(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
                   incoherent: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The pre-pass and forward: on Hopper one host pass over all kernels
    (``attention_fp8_qkv``), else (or incoherent) step by step, each on its kernel or reference."""
    # the one-pass kernels read contiguous [B, H, S, D]; transformers passes transposed views of
    # [B, S, H, D]: a copy each costs less than the composed steps
    q, k, v = (t.contiguous() for t in (q, k, v))

    def composed():
        x = quantize_qkv(q, k, v, incoherent=incoherent)
        out, lse = forward_dispatch(x.q, x.q_scale, x.k, x.k_scale, x.v_t, x.v_scale, causal, scale, q.dtype)
        return out, lse, x.k_mean

    if incoherent:
        return composed()
    return registry.run("attention_fp8_qkv", q.device, (q, k, v, causal, scale), composed)


@torch.library.custom_op("lowprec::attention_fp8", mutates_args=())
def attention_fp8(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
                  incoherent: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FP8 attention of float Q, K, V: ``(out in q's dtype, lse FP32 of the smoothed scores, k_mean
    [B, Hkv, D] FP32)``. The LSE of the unsmoothed scores is ``lse + lse_correction(q, k_mean,
    scale, incoherent)``: a pass over Q that only ``return_lse`` pays; the backward takes the
    smoothed LSE as it is."""
    return _attention_fp8(q, k, v, causal, scale, incoherent)


@attention_fp8.register_fake
def _(q, k, v, causal, scale, incoherent):
    b, h, sq, d = q.shape
    return (q.new_empty((b, h, sq, v.shape[-1])), q.new_empty((b, h, sq), dtype=torch.float32),
            q.new_empty((b, k.shape[1], d), dtype=torch.float32))


def _fp8_setup_context(ctx, inputs, output):
    q, k, v, causal, scale, incoherent = inputs
    out, lse, k_mean = output
    ctx.save_for_backward(q, k, v, out, lse, k_mean)
    ctx.causal, ctx.scale, ctx.incoherent = causal, scale, incoherent
    ctx.mark_non_differentiable(lse, k_mean)


def _fp8_backward(ctx, dout, _dlse, _dk_mean):
    """Exact attention's backward on smoothed K: ``dQ = dS · K`` picks up ``(Σ_j dS_ij) · mean(K)``,
    and ``Σ_j dS_ij`` is 0 only for the exact ``out`` and LSE, not the FP8 forward's: with a K bias
    of 5 that leak took dQ's cosine to FP64 from 0.9999 to 0.966. With ``K − mean(K)`` and the LSE of
    the smoothed scores (the same P, dP, dK, dV in exact math) it is gone."""
    q, k, v, out, lse, k_mean = ctx.saved_tensors
    # as the forward, in its precision when backward() runs under torch.autocast
    with autocast_off(q.device):
        if ctx.incoherent:  # the forward's mean is of the rotated K: smooth the unrotated K by its own
            own_mean = token_mean(k)
            lse = lse + lse_correction(q, k_mean, ctx.scale, True) - lse_correction(q, own_mean, ctx.scale)
            k_mean = own_mean
        k_smooth = (k.float() - k_mean[:, :, None, :]).to(k.dtype)
        dq, dk, dv = attention_backward(dout, q, k_smooth, v, out, lse, ctx.causal, ctx.scale)
    return dq, dk, dv, None, None, None


attention_fp8.register_autograd(_fp8_backward, setup_context=_fp8_setup_context)


class _AttentionFP8Function(torch.autograd.Function):
    """The custom op's autograd, as a plain autograd.Function for eager calls."""

    @staticmethod
    def forward(q, k, v, causal, scale, incoherent):
        return _attention_fp8(q, k, v, causal, scale, incoherent)

    setup_context = staticmethod(_fp8_setup_context)
    backward = staticmethod(_fp8_backward)


def attention_fp8_call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
                       incoherent: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``attention_fp8``, the same results and gradients: traced by ``torch.compile`` as the custom
    op; eager without the op's dispatch (tens of µs of host time per call), through an
    autograd.Function only where a gradient is wanted."""
    if torch.compiler.is_compiling():
        return attention_fp8(q, k, v, causal, scale, incoherent)
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return _AttentionFP8Function.apply(q, k, v, causal, scale, incoherent)
    return _attention_fp8(q, k, v, causal, scale, incoherent)


# --- the backward: PyTorch's cuDNN or flash attention backward, or plain torch -------------------

def _flash_ok(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """The aten flash attention ops take these inputs (fp16/bf16 on CUDA, D = Dv ≤ 256, D % 8 == 0)."""
    d = q.shape[-1]
    return (q.is_cuda and q.dtype in _HALF and k.dtype == q.dtype and v.dtype == q.dtype
            and v.shape[-1] == d and d % 8 == 0 and d <= 256 and backend_mode() != "reference")


def expand_kv_heads(k: torch.Tensor, v: torch.Tensor, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """GQA for the aten flash ops, which take as many K / V heads as Q heads (heads: dim 1)."""
    group = heads // k.shape[1]
    if group == 1:
        return k, v
    return k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)


def fold_kv_heads(dk: torch.Tensor, dv: torch.Tensor, hkv: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradients of expanded K / V summed over each group of query heads (heads: dim 1)."""
    group = dk.shape[1] // hkv
    if group == 1:
        return dk, dv
    return dk.unflatten(1, (hkv, group)).sum(dim=2), dv.unflatten(1, (hkv, group)).sum(dim=2)


def flash_backward_state(lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(lse, philox seed, philox offset)`` as the aten flash backward ops read them: FlashAttention
    marks rows that see no key with LSE +inf (p = exp(s - inf) = 0), ours say -inf; dropout 0
    leaves the philox state unread."""
    lse_fa = torch.where(lse == -math.inf, math.inf, lse).float().contiguous()
    return (lse_fa, torch.empty(2, dtype=torch.uint64, device=lse.device),
            torch.empty((), dtype=torch.uint64, device=lse.device))


def _flash_backward(dout, q, k, v, out, lse, causal, scale):
    ke, ve = expand_kv_heads(k, v, q.shape[1])
    lse_fa, seed, offset = flash_backward_state(lse)
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
        dout.to(q.dtype).contiguous(), q.contiguous(), ke.contiguous(), ve.contiguous(), out.to(q.dtype).contiguous(),
        lse_fa, None, None, q.shape[-2], k.shape[-2], 0.0, causal, seed, offset, scale=scale)
    return (dq, *fold_kv_heads(dk, dv, k.shape[1]))


# (dtype, D, grouped heads) the cuDNN backward refused once: the flash backward serves them
_CUDNN_REFUSED: set[tuple] = set()


def _cudnn_key(q: torch.Tensor, k: torch.Tensor) -> tuple:
    return q.dtype, q.shape[-1], q.shape[1] != k.shape[1]


def _cudnn_ok(q: torch.Tensor, k: torch.Tensor, causal: bool) -> bool:
    """The cuDNN backward computes our gradients here: its causal mask is top-left aligned, ours
    bottom-right, so they agree (and no row is left without keys) when ``Sq == Sk``."""
    return ((not causal or q.shape[-2] == k.shape[-2]) and _cudnn_key(q, k) not in _CUDNN_REFUSED
            and torch.backends.cuda.cudnn_sdp_enabled())


def _cudnn_backward(dout, q, k, v, out, lse, causal, scale):
    b, h, sq, _ = q.shape
    unused_rng = torch.empty((), dtype=torch.int64, device=q.device)  # dropout 0: the philox state is not read
    # None: no bias, not nested (cuDNN's LSE is ours, natural log, with a trailing unit dim)
    return torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
        dout.to(q.dtype).contiguous(), q.contiguous(), k.contiguous(), v.contiguous(), out.to(q.dtype).contiguous(),
        lse.float().reshape(b, h, sq, 1).contiguous(), unused_rng, unused_rng, None, None, None, sq, k.shape[-2],
        0.0, causal, scale=scale)


@torch.library.custom_op("lowprec::attention_backward", mutates_args=())
def attention_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                       lse: torch.Tensor, causal: bool, scale: float
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Exact-attention gradients from a forward's ``out`` and natural-log ``lse`` [B, H, Sq]."""
    if q.shape[-2] == 0 or k.shape[-2] == 0:  # contiguous, as every other path (and the fake) returns them
        return q.new_zeros(q.shape), k.new_zeros(k.shape), v.new_zeros(v.shape)
    if _flash_ok(q, k, v):
        if _cudnn_ok(q, k, causal):
            try:
                return tuple(t.contiguous() for t in _cudnn_backward(dout, q, k, v, out, lse, causal, scale))
            except RuntimeError as err:  # a configuration cuDNN does not build: flash from now on
                _CUDNN_REFUSED.add(_cudnn_key(q, k))
                warn_once(f"lowprec: the cuDNN attention backward refused {q.dtype} D={q.shape[-1]} "
                          f"({type(err).__name__}: {str(err).splitlines()[0][:200]}); using the flash backward")
        try:
            return tuple(t.contiguous() for t in _flash_backward(dout, q, k, v, out, lse, causal, scale))
        except Exception as err:
            kernel_failed("attention backward (aten flash)", err)
    return attention_backward_reference(dout, q, k, v, out, lse, causal, scale)


@attention_backward.register_fake
def _(dout, q, k, v, out, lse, causal, scale):
    # contiguous whatever the inputs' strides (transformers passes transposed views): the cuDNN /
    # flash paths return .contiguous() and the reference returns fresh matmul results
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


# --- exact attention on CUDA: PyTorch's fused kernels ---------------------------------------------

def exact_cuda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
               return_lse: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(out, lse or None)`` by PyTorch's fused attention (differentiable through their backward).

    Without LSE: ``F.scaled_dot_product_attention`` (cuDNN / flash / efficient, as it picks;
    ``enable_gqa`` for GQA; bottom-right causal by ``causal_lower_right`` when ``Sq < Sk``). With
    LSE: ``aten._scaled_dot_product_flash_attention`` (natural-log LSE [B, H, Sq]; for this op
    ``is_causal`` is bottom-right aligned) for fp16/bf16, else the reference with one warning.
    Needs ``Sq, Sk > 0`` (the caller sends empty sequences to the reference).
    """
    sq, sk = q.shape[-2], k.shape[-2]
    if causal and sq > sk:  # the first sq - sk query rows see no key: 0 and LSE -inf
        skip = sq - sk
        out, lse = exact_cuda(q[..., skip:, :], k, v, causal, scale, return_lse)
        out = torch.cat([out.new_zeros(*out.shape[:-2], skip, out.shape[-1]), out], dim=-2)
        if lse is not None:
            lse = torch.cat([lse.new_full((*lse.shape[:-1], skip), -math.inf), lse], dim=-1)
        return out, lse
    gqa = q.shape[1] != k.shape[1]
    if return_lse:
        if not _flash_ok(q, k, v):
            from .reference import attention_reference

            warn_once(f"lowprec: attention(return_lse=True) on CUDA with {q.dtype}, D={q.shape[-1]}, "
                      f"Dv={v.shape[-1]}: no fused kernel returns the LSE; running the (slow) reference")
            return attention_reference(q, k, v, causal, scale, None)
        res = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
        out, lse = res[0], res[1]
        return out, torch.where(lse == math.inf, -math.inf, lse)  # FlashAttention: +inf for rows with no key
    f = torch.nn.functional.scaled_dot_product_attention
    if causal and sq < sk:
        from torch.nn.attention.bias import causal_lower_right

        if gqa and q.dtype not in _HALF:  # only the flash route of CausalBias knows GQA
            k, v, gqa = k.repeat_interleave(q.shape[1] // k.shape[1], 1), v.repeat_interleave(
                q.shape[1] // v.shape[1], 1), False
        return f(q, k, v, attn_mask=causal_lower_right(sq, sk), scale=scale, enable_gqa=gqa), None
    return f(q, k, v, is_causal=causal, scale=scale, enable_gqa=gqa), None
