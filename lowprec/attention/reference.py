"""Reference attention in plain torch, exact (FP32) or emulating the FP8 kernel scheme.

FP8 scheme (FA3 / SageAttention style), per (batch, head):
- K is smoothed: its mean over tokens is subtracted before quantizing (softmax-invariant: each
  row of S shifts by a constant; the returned LSE is corrected back with the unquantized Q).
- Q and K: E4M3 with one FP32 scale per block of ``block`` tokens × head dim.
- V: E4M3 with one FP32 scale per channel (over all tokens).
- Online softmax over KV blocks of ``block`` tokens; P (in [0, 1]) is quantized to E4M3 with the
  static scale 448 (row max maps to 448) before P·V; each block's P·V is accumulated in fresh
  FP32 and added into the FP32 output accumulator. At head dims <= 128 the running max is lazy:
  it moves only when a block's max passes it by more than a factor 4 of p, and P's scale is 112.
- Optional incoherent processing (FA3): Q and K rotated by the same random ±1 · Hadamard matrix
  before quantization (:mod:`lowprec.attention.quantize`).

The scheme is split as the kernel is: the pre-pass (:func:`lowprec.attention.quantize.quantize_qkv`)
makes the kernel's operands, :func:`fp8_forward_reference` is the kernel's math on them (its LSE is
that of the smoothed scores), and the host adds the smoothing correction ``scale · q·k_mean``.
"""

from __future__ import annotations

import math

import torch

from .quantize import ATTN_BLOCK, _rotate, quantize_qkv
from .sm90.config import rescale_slack as kernel_rescale_slack

__all__ = ["attention_reference", "fp8_forward_reference", "attention_backward_reference", "lse_correction",
           "combine_kv_splits", "dense_rescale_slack", "ATTENTION_BLOCK"]

ATTENTION_BLOCK = ATTN_BLOCK
_P_SCALE = 448.0


def _causal_mask(sq: int, sk: int, rows: slice, cols: slice, device: torch.device) -> torch.Tensor:
    """True where query i may attend key j (bottom-right aligned: j ≤ i + sk − sq)."""
    i = torch.arange(sq, device=device)[rows, None]
    j = torch.arange(sk, device=device)[None, cols]
    return j <= i + (sk - sq)


def _expand_kv(t: torch.Tensor, heads: int) -> torch.Tensor:
    return t.repeat_interleave(heads // t.shape[1], dim=1) if t.shape[1] != heads else t


def _exact(q, k, v, causal, scale):
    s = (q @ k.transpose(-1, -2)) * scale
    if causal:
        s = s.masked_fill(~_causal_mask(q.shape[-2], k.shape[-2], slice(None), slice(None), q.device), -math.inf)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)[..., None])
    return p @ v, lse


def _dequant_blocks(codes: torch.Tensor, scales: torch.Tensor, block: int) -> torch.Tensor:
    """FP32 values of ``codes`` [B, H, S, D] with one scale per ``block`` tokens [B, H, ceil(S/block)]."""
    s = codes.shape[-2]
    return codes.float() * scales.repeat_interleave(block, dim=-1)[..., :s, None]


def dense_rescale_slack(q: torch.Tensor, k: torch.Tensor) -> int:
    """The dense FP8 forward's slack for ``q [B, H, Sq, D]`` and ``k [B, Hkv, Sk, D]``."""
    return kernel_rescale_slack(q.shape[-1], q.shape[1] // max(k.shape[1], 1), q.shape[2])


def fp8_forward_reference(q, q_scale, k, k_scale, v_t, v_scale, causal: bool, scale: float,
                          block: int = ATTN_BLOCK,
                          rescale_slack: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The FP8 forward kernel's math on its operands (the contract tensors of
    :class:`~lowprec.attention.quantize.FP8AttentionInputs`).

    ``rescale_slack`` (lazy rescaling): a row's running max moves only when a block's max passes it
    by more than a factor ``2**rescale_slack`` of p, and P is scaled by ``448 / 2**rescale_slack``;
    ``None``: the shipped kernel's at this head dim (:func:`lowprec.attention.sm90.config.rescale_slack`;
    the dense forward's packed GQA decode runs another: its callers pass it).

    Returns ``(out [B, H, Sq, Dv] FP32, lse [B, H, Sq] FP32)``: the LSE of the scores as computed
    (of the smoothed K; no correction). Rows that see no key: 0 and −inf.
    """
    heads, sq, sk = q.shape[1], q.shape[-2], k.shape[-2]
    q_hat = _dequant_blocks(q, q_scale, block)
    k_hat = _expand_kv(_dequant_blocks(k, k_scale, block), heads)
    v_codes = _expand_kv(v_t[..., :sk].float().transpose(-1, -2), heads)  # [B, H, Sk, Dv]
    v_scale = _expand_kv(v_scale[:, :, None, :], heads)  # [B, H, 1, Dv]

    m = q_hat.new_full(q.shape[:-1], -math.inf)
    row_sum = q_hat.new_zeros(q.shape[:-1])
    acc = q_hat.new_zeros(*q.shape[:-1], v_codes.shape[-1])
    if rescale_slack is None:
        rescale_slack = kernel_rescale_slack(q.shape[-1])
    p_scale = _P_SCALE / 2.0 ** rescale_slack
    for start in range(0, sk, block):
        cols = slice(start, min(start + block, sk))
        s = (q_hat @ k_hat[..., cols, :].transpose(-1, -2)) * scale
        if causal:
            s = s.masked_fill(~_causal_mask(sq, sk, slice(None), cols, q.device), -math.inf)
        m_new = torch.maximum(m, s.amax(dim=-1))
        if rescale_slack:
            m_new = torch.where(m_new > m + rescale_slack * math.log(2.0), m_new, m)
        m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
        p = torch.exp(s - m_safe[..., None])
        alpha = torch.exp(m - m_safe)
        row_sum = row_sum * alpha + p.sum(dim=-1)
        p_q = (p * p_scale).to(torch.float8_e4m3fn).float()
        pv = (p_q @ v_codes[..., cols, :]) * (v_scale / p_scale)
        acc = acc * alpha[..., None] + pv
        m = m_new
    empty = row_sum == 0
    out = torch.where(empty[..., None], torch.zeros_like(acc), acc / torch.where(empty, 1.0, row_sum)[..., None])
    lse = torch.where(empty, torch.full_like(m, -math.inf), m + torch.log(torch.where(empty, 1.0, row_sum)))
    return out, lse


def lse_correction(q: torch.Tensor, k_mean: torch.Tensor, scale: float, incoherent: bool = False) -> torch.Tensor:
    """``scale · q·k_mean`` per row ``[B, H, Sq]`` FP32 (exact Q; rotated as K was): the smoothing's
    shift of each score row, added to the kernel's LSE to give the LSE of the unsmoothed scores."""
    qf = _rotate(q, incoherent).float()
    mean = _expand_kv(k_mean[:, :, :, None], q.shape[1])  # [B, H, D, 1]
    return (qf @ mean).squeeze(-1) * scale


def attention_reference(q, k, v, causal: bool, scale: float, quant: str | None,
                        block: int = ATTN_BLOCK, incoherent: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns ``(out [B, H, Sq, Dv] in q's dtype, lse [B, H, Sq] FP32, natural log)``. Exact
    attention computes in FP32, FP64 for FP64 inputs (as the backward reference)."""
    if quant is None:
        heads = q.shape[1]
        # FP64 inputs stay FP64: an FP32 pass would make the "exact" FP64 reference (and gradcheck) FP32-accurate
        work = torch.float64 if q.dtype == torch.float64 else torch.float32
        out, lse = _exact(q.to(work), _expand_kv(k.to(work), heads), _expand_kv(v.to(work), heads), causal, scale)
        return out.to(q.dtype), lse.float()
    if block != ATTN_BLOCK:
        raise ValueError(f"block: the FP8 scheme quantizes in blocks of {ATTN_BLOCK} tokens, got {block}")
    x = quantize_qkv(q, k, v, incoherent=incoherent)
    out, lse = fp8_forward_reference(x.q, x.q_scale, x.k, x.k_scale, x.v_t, x.v_scale, causal, scale, block,
                                     dense_rescale_slack(x.q, x.k))
    # undo the smoothing shift (-inf stays -inf: the mean of no keys is 0)
    lse = lse + lse_correction(q, x.k_mean, scale, incoherent)
    return out.to(q.dtype), lse


def combine_kv_splits(outs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Split-KV combine (decode): partial attentions over disjoint key ranges into the whole one.

    ``outs`` ``[splits, ..., Sq, Dv]`` (each normalized over its own keys), ``lses`` ``[splits, ..., Sq]``
    natural log (−inf where a split saw no key). Returns ``(Σ_i exp(lse_i − lse) · out_i, lse)`` with
    ``lse = logsumexp_i lse_i``; rows no split saw give 0 and −inf. FP32.
    """
    lse = torch.logsumexp(lses.float(), dim=0)
    lse_safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    weights = torch.exp(lses.float() - lse_safe)  # exp(-inf) = 0 for empty splits
    out = (weights[..., None] * outs.float()).sum(dim=0)
    return out, lse


def attention_backward_reference(dout, q, k, v, out, lse, causal: bool, scale: float
                                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Exact-attention gradients ``(dq, dk, dv)`` from a forward's ``out`` and natural-log ``lse``
    (as FlashAttention's backward: P recomputed as ``exp(q·kᵀ·scale − lse)``, ``Δ = rowsum(dO ∘ O)``).

    FP32 math (FP64 for FP64 inputs); GQA: dK and dV summed over the query heads of each group.
    Rows with LSE −inf (no key seen) contribute nothing.
    """
    work = torch.float64 if q.dtype == torch.float64 else torch.float32
    heads, hkv, sq, sk = q.shape[1], k.shape[1], q.shape[-2], k.shape[-2]
    qf, dof, of = q.to(work), dout.to(work), out.to(work)
    kf, vf = _expand_kv(k.to(work), heads), _expand_kv(v.to(work), heads)
    s = (qf @ kf.transpose(-1, -2)) * scale
    if causal:
        s = s.masked_fill(~_causal_mask(sq, sk, slice(None), slice(None), q.device), -math.inf)
    lse_w = lse.to(work)
    lse_safe = torch.where(torch.isinf(lse_w), torch.full_like(lse_w, math.inf), lse_w)  # empty rows: p = 0
    p = torch.exp(s - lse_safe[..., None])
    dv = p.transpose(-1, -2) @ dof
    dp = dof @ vf.transpose(-1, -2)
    delta = (dof * of).sum(dim=-1, keepdim=True)
    ds = p * (dp - delta)
    dq = (ds @ kf) * scale
    dk = (ds.transpose(-1, -2) @ qf) * scale
    if hkv != heads:
        dk = dk.unflatten(1, (hkv, heads // hkv)).sum(dim=2)
        dv = dv.unflatten(1, (hkv, heads // hkv)).sum(dim=2)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
