"""The custom op of FP8 attention over packed sequences, with its fake implementation and autograd.

``lowprec::attention_fp8_varlen``: packed Q, K, V and ``cu_seqlens`` in, ``(out, lse of the smoothed
scores [H, total_q], k_mean [B, Hkv, D])`` out. On Hopper: the padded-layout pre-pass (torch ops)
and the varlen kernel, no host sync (CUDA-graph capturable, ``torch.compile(fullgraph=True)``);
elsewhere (or when the kernel fails) one dense FP8 call per sequence, after reading ``cu_seqlens``.
The backward is exact attention's from the FP8 forward's output and LSE, on K smoothed by each
sequence's mean (as the dense op's): PyTorch's varlen flash attention backward on CUDA for
fp16/bf16, else plain torch per sequence.
"""

from __future__ import annotations

import math

import torch

from ..runtime import kernel_failed, registry
from .ops import _attention_fp8, _flash_ok, expand_kv_heads, flash_backward_state, fold_kv_heads
from .packed import pad_rows, padded_layout, sequence_means, sequence_of_rows
from .quantize import _rotate
from .reference import attention_backward_reference

__all__ = ["attention_fp8_varlen", "attention_fp8_varlen_call", "attention_varlen_backward", "packed_lse_correction"]


def _per_sequence(q, k, v, cu_q, cu_k, causal: bool, scale: float, incoherent: bool):
    """The op's result by one dense FP8 call per sequence (reads ``cu_seqlens`` on the host)."""
    total_q, h, _ = q.shape
    b, hkv, d = cu_q.numel() - 1, k.shape[1], q.shape[2]
    out = q.new_zeros(total_q, h, v.shape[-1])
    lse = torch.full((h, total_q), -math.inf, dtype=torch.float32, device=q.device)
    k_mean = torch.zeros(b, hkv, d, dtype=torch.float32, device=q.device)
    cq, ck = cu_q.tolist(), cu_k.tolist()
    for i in range(b):
        rq, rk = slice(cq[i], cq[i + 1]), slice(ck[i], ck[i + 1])
        if rq.stop == rq.start or rk.stop == rk.start:
            continue
        o, l_, m = _attention_fp8(q[rq].transpose(0, 1)[None], k[rk].transpose(0, 1)[None],
                                  v[rk].transpose(0, 1)[None], causal, scale, incoherent)
        out[rq], lse[:, rq], k_mean[i] = o[0].transpose(0, 1), l_[0], m[0]
    return out, lse, k_mean


def _attention_fp8_varlen(q, k, v, cu_q, cu_k, max_q: int, max_k: int, causal: bool, scale: float,
                          incoherent: bool):
    args = (q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, incoherent)
    return registry.run("attention_fp8_varlen", q.device, args,
                        lambda: _per_sequence(q, k, v, cu_q, cu_k, causal, scale, incoherent))


@torch.library.custom_op("lowprec::attention_fp8_varlen", mutates_args=())
def attention_fp8_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
                         max_q: int, max_k: int, causal: bool, scale: float, incoherent: bool
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FP8 attention of packed float Q, K, V: ``(out [total_q, H, Dv] in q's dtype, lse [H, total_q]
    FP32 of the smoothed scores, k_mean [B, Hkv, D] FP32)``; ``max_q``, ``max_k`` bound the
    sequence lengths (the backward's flash kernel needs them)."""
    return _attention_fp8_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, incoherent)


@attention_fp8_varlen.register_fake
def _(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, incoherent):
    total_q, h, d = q.shape
    return (q.new_empty((total_q, h, v.shape[-1])), q.new_empty((h, total_q), dtype=torch.float32),
            q.new_empty((cu_q.shape[0] - 1, k.shape[1], d), dtype=torch.float32))


def _token_means(k: torch.Tensor, cu_k: torch.Tensor) -> torch.Tensor:
    """Each sequence's token mean of packed ``k`` ``[total_k, Hkv, D]`` -> ``[B, Hkv, D]`` FP32."""
    layout = padded_layout(cu_k, k.shape[0])
    return sequence_means(pad_rows(k, layout), layout).transpose(0, 1)


def packed_lse_correction(q: torch.Tensor, k_mean: torch.Tensor, cu_q: torch.Tensor, scale: float,
                          incoherent: bool = False) -> torch.Tensor:
    """``scale · q·k_mean`` of each packed query row ``[H, total_q]`` FP32 (``k_mean`` of its
    sequence and KV head): added to the smoothed LSE it gives the LSE of the unsmoothed scores."""
    total_q, h, d = q.shape
    hkv = k_mean.shape[1]
    qf = _rotate(q, incoherent).float().view(total_q, hkv, h // hkv, d)
    mean = k_mean[sequence_of_rows(cu_q, total_q)]  # [total_q, Hkv, D]
    return ((qf * mean[:, :, None, :]).sum(-1) * scale).reshape(total_q, h).transpose(0, 1)


def _smooth_rows(k: torch.Tensor, k_mean: torch.Tensor, cu_k: torch.Tensor) -> torch.Tensor:
    """Packed ``k`` minus its sequence's mean, in k's dtype."""
    return (k.float() - k_mean[sequence_of_rows(cu_k, k.shape[0])]).to(k.dtype)


def _setup_context(ctx, inputs, output):
    q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, incoherent = inputs
    out, lse, k_mean = output
    ctx.save_for_backward(q, k, v, cu_q, cu_k, out, lse, k_mean)
    ctx.max_q, ctx.max_k, ctx.causal, ctx.scale, ctx.incoherent = max_q, max_k, causal, scale, incoherent
    ctx.mark_non_differentiable(lse, k_mean)


def _backward(ctx, dout, _dlse, _dk_mean):
    """As the dense op's (``ops._fp8_backward``): exact attention's backward on K smoothed by the
    forward's mean, with the LSE of the smoothed scores."""
    q, k, v, cu_q, cu_k, out, lse, k_mean = ctx.saved_tensors
    if ctx.incoherent:  # the forward's mean is of the rotated K: smooth the unrotated K by its own
        own_mean = _token_means(k, cu_k)
        lse = (lse + packed_lse_correction(q, k_mean, cu_q, ctx.scale, True)
               - packed_lse_correction(q, own_mean, cu_q, ctx.scale))
        k_mean = own_mean
    dq, dk, dv = attention_varlen_backward(dout, q, _smooth_rows(k, k_mean, cu_k), v, out, lse, cu_q, cu_k,
                                           ctx.max_q, ctx.max_k, ctx.causal, ctx.scale)
    return dq, dk, dv, None, None, None, None, None, None, None


attention_fp8_varlen.register_autograd(_backward, setup_context=_setup_context)


class _AttentionFP8VarlenFunction(torch.autograd.Function):
    """The custom op's autograd, as a plain autograd.Function for eager calls."""

    @staticmethod
    def forward(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, incoherent):
        return _attention_fp8_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, incoherent)

    setup_context = staticmethod(_setup_context)
    backward = staticmethod(_backward)


def attention_fp8_varlen_call(q, k, v, cu_q, cu_k, max_q: int, max_k: int, causal: bool, scale: float,
                              incoherent: bool):
    """``attention_fp8_varlen``: the custom op where ``torch.compile`` traces, else the same functions
    without the op's dispatch (through an autograd.Function only where a gradient is wanted)."""
    args = (q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, incoherent)
    if torch.compiler.is_compiling():
        return attention_fp8_varlen(*args)
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return _AttentionFP8VarlenFunction.apply(*args)
    return _attention_fp8_varlen(*args)


# --- the backward ----------------------------------------------------------------------------------

def _flash_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale):
    ke, ve = expand_kv_heads(k, v, q.shape[1])
    lse_fa, rng, unused = flash_backward_state(lse)
    dq, dk, dv = torch.ops.aten._flash_attention_backward(
        dout.to(q.dtype).contiguous(), q.contiguous(), ke.contiguous(), ve.contiguous(), out.to(q.dtype).contiguous(),
        lse_fa, cu_q.int(), cu_k.int(), max_q, max_k, 0.0, causal, rng, unused, scale=scale)
    return (dq, *fold_kv_heads(dk, dv, k.shape[1]))


def _reference_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, causal, scale):
    dq, dk, dv = q.new_zeros(q.shape), k.new_zeros(k.shape), v.new_zeros(v.shape)  # contiguous, as the flash path's
    cq, ck = cu_q.tolist(), cu_k.tolist()
    for i in range(cu_q.numel() - 1):
        rq, rk = slice(cq[i], cq[i + 1]), slice(ck[i], ck[i + 1])
        if rq.stop == rq.start or rk.stop == rk.start:
            continue
        dense = [t[r].transpose(0, 1)[None] for t, r in ((dout, rq), (q, rq), (k, rk), (v, rk), (out, rq))]
        gq, gk, gv = attention_backward_reference(*dense, lse[None, :, rq], causal, scale)
        dq[rq], dk[rk], dv[rk] = gq[0].transpose(0, 1), gk[0].transpose(0, 1), gv[0].transpose(0, 1)
    return dq, dk, dv


@torch.library.custom_op("lowprec::attention_varlen_backward", mutates_args=())
def attention_varlen_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                              out: torch.Tensor, lse: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
                              max_q: int, max_k: int, causal: bool, scale: float
                              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Exact-attention gradients of packed sequences from a forward's ``out`` and natural-log ``lse``
    ``[H, total_q]``: the aten varlen flash backward on CUDA (fp16/bf16), else plain torch per
    sequence (a host read of ``cu_seqlens``)."""
    if q.shape[0] and k.shape[0] and _flash_ok(q, k, v):
        try:
            return tuple(t.contiguous() for t in _flash_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q,
                                                                         max_k, causal, scale))
        except Exception as err:
            kernel_failed("attention varlen backward (aten flash)", err)
    return _reference_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, causal, scale)


@attention_varlen_backward.register_fake
def _(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)  # contiguous, as both real paths
