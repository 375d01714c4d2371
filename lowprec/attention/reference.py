"""Reference attention in plain torch, exact (FP32) or emulating the FP8 kernel scheme.

FP8 scheme (FA3 / SageAttention style), per (batch, head):
- K is smoothed: its mean over tokens is subtracted before quantizing (softmax-invariant: each
  row of S shifts by a constant; the returned LSE is corrected back with the unquantized Q).
- Q and K: E4M3 with one FP32 scale per block of ``block`` tokens × head dim.
- V: E4M3 with one FP32 scale per channel (over all tokens).
- Online softmax over KV blocks of ``block`` tokens; P (in [0, 1]) is quantized to E4M3 with the
  static scale 448 (row max maps to 448) before P·V; each block's P·V is accumulated in fresh
  FP32 and added into the FP32 output accumulator.
"""

from __future__ import annotations

import math

import torch

from ..quant import quantize
from ..recipes import WHOLE, ScaleRecipe

__all__ = ["attention_reference", "ATTENTION_BLOCK"]

ATTENTION_BLOCK = 128
_P_SCALE = 448.0


def _causal_mask(sq: int, sk: int, rows: slice, cols: slice, device: torch.device) -> torch.Tensor:
    """True where query i may attend key j (bottom-right aligned: j ≤ i + sk − sq)."""
    i = torch.arange(sq, device=device)[rows, None]
    j = torch.arange(sk, device=device)[None, cols]
    return j <= i + (sk - sq)


def _expand_kv(t: torch.Tensor, heads: int) -> torch.Tensor:
    return t.repeat_interleave(heads // t.shape[1], dim=1)


def _exact(q, k, v, causal, scale):
    s = (q @ k.transpose(-1, -2)) * scale
    if causal:
        s = s.masked_fill(~_causal_mask(q.shape[-2], k.shape[-2], slice(None), slice(None), q.device), -math.inf)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)[..., None])
    return p @ v, lse


def _fp8_dequant_blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    recipe = ScaleRecipe("attn_block", (block, WHOLE))
    return quantize(x, recipe, check_finite=False).dequantize(torch.float32)


def _fp8(q, k, v, causal, scale, block):
    sq, sk = q.shape[-2], k.shape[-2]
    k_mean = k.sum(dim=-2, keepdim=True) / max(sk, 1)  # Sk = 0: mean 0, not NaN
    q_hat = _fp8_dequant_blocks(q, block)
    k_hat = _fp8_dequant_blocks(k - k_mean, block)
    v_q = quantize(v.transpose(-1, -2), "fp8_rowwise", check_finite=False)  # one scale per channel
    v_codes = v_q.data.float().transpose(-1, -2)
    v_scale = v_q.scale.transpose(-1, -2)  # [B, H, 1, Dv]

    m = q.new_full(q.shape[:-1], -math.inf)
    row_sum = q.new_zeros(q.shape[:-1])
    acc = q.new_zeros(*q.shape[:-1], v.shape[-1])
    for start in range(0, sk, block):
        cols = slice(start, min(start + block, sk))
        s = (q_hat @ k_hat[..., cols, :].transpose(-1, -2)) * scale
        if causal:
            s = s.masked_fill(~_causal_mask(sq, sk, slice(None), cols, q.device), -math.inf)
        m_new = torch.maximum(m, s.amax(dim=-1))
        m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
        p = torch.exp(s - m_safe[..., None])
        alpha = torch.exp(m - m_safe)
        row_sum = row_sum * alpha + p.sum(dim=-1)
        p_q = (p * _P_SCALE).to(torch.float8_e4m3fn).float()
        pv = (p_q @ v_codes[..., cols, :]) * (v_scale / _P_SCALE)
        acc = acc * alpha[..., None] + pv
        m = m_new
    empty = row_sum == 0
    out = torch.where(empty[..., None], torch.zeros_like(acc), acc / torch.where(empty, 1.0, row_sum)[..., None])
    lse = torch.where(empty, torch.full_like(m, -math.inf), m + torch.log(torch.where(empty, 1.0, row_sum)))
    lse = lse + (q @ k_mean.transpose(-1, -2)).squeeze(-1) * scale  # undo the smoothing shift (exact q)
    return out, lse


def attention_reference(q, k, v, causal: bool, scale: float, quant: str | None,
                        block: int = ATTENTION_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns ``(out [B, H, Sq, Dv] in q's dtype, lse [B, H, Sq] FP32, natural log)``."""
    heads = q.shape[1]
    qf, kf, vf = q.float(), _expand_kv(k.float(), heads), _expand_kv(v.float(), heads)
    out, lse = _exact(qf, kf, vf, causal, scale) if quant is None else _fp8(qf, kf, vf, causal, scale, block)
    return out.to(q.dtype), lse
