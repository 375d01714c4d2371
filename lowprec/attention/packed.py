"""Packed variable-length sequences as the FP8 attention kernel reads them, built on the device.

FlashAttention's varlen layout (``[total, H, D]``, sequence ``i`` at rows ``cu[i]:cu[i+1]``) is
regrouped into a *padded* layout: per head, each sequence's tokens start at a multiple of 128
rows (its 128-token quantization blocks are the kernel's blocks), the rest of its last block
zero. The padded row count is a host bound (``round_up(total + 127·B, 128)``), so nothing here
reads a value back to the host: every step is a torch op on the device, CUDA-graph capturable.

The FP8 operands in that layout are each sequence's own, as :func:`lowprec.attention.quantize_qkv`
makes them for one sequence: Q and K scales per 128-token block, K smoothed by the sequence's
token mean, one V scale per (sequence, head, channel). The kernels read one row per sequence
(:func:`sequence_plan`); the forward's grid is (query blocks of the longest sequence, heads,
sequences), the CTAs past their sequence's end write nothing.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..quant.reference import ieee_div, scale_from_amax
from ..recipes import get_recipe
from .quantize import ATTN_BLOCK, _blocks, _rotate, v_keys_at_positions

__all__ = ["PaddedLayout", "padded_rows", "padded_layout", "pad_rows", "PackedFP8Inputs", "quantize_packed",
           "sequence_means",
           "sequence_plan", "longest_first", "SEQUENCE_FIELDS", "sequence_of_rows"]

_ROWWISE = get_recipe("fp8_rowwise")
# columns of a sequence-plan row (int32): first packed token, length, first padded row, of the
# queries then of the keys
SEQUENCE_FIELDS = ("q_first", "q_len", "q_row0", "batch", "k_first", "k_len", "k_row0", "unused")


class PaddedLayout(NamedTuple):
    """Where each padded row comes from (device tensors; ``rows`` a host int)."""

    rows: int              # padded rows, a multiple of 128
    src: torch.Tensor      # [rows] int64: the packed row (0 for padding)
    valid: torch.Tensor    # [rows] bool: a token (not padding)
    seq: torch.Tensor      # [rows] int64: the sequence of the row (clamped to B - 1 for trailing padding)
    start: torch.Tensor    # [B] int64: the sequence's first padded row (a multiple of 128)
    lengths: torch.Tensor  # [B] int64


def padded_rows(total: int, sequences: int) -> int:
    """Rows of the padded layout of ``sequences`` sequences of ``total`` tokens (a bound)."""
    return -(-(total + (ATTN_BLOCK - 1) * sequences) // ATTN_BLOCK) * ATTN_BLOCK


def _padded_spans(lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(first, end) padded row of each sequence (along the last dim): lengths rounded up to 128."""
    padded = (lengths + ATTN_BLOCK - 1) // ATTN_BLOCK * ATTN_BLOCK
    end = torch.cumsum(padded, -1)
    return end - padded, end


def padded_layout(cu: torch.Tensor, total: int) -> PaddedLayout:
    """The padded layout of ``cu`` (``[B + 1]`` prefix sums of the lengths, ``total`` = its last
    value) with every sequence starting at a multiple of 128 rows."""
    b = cu.numel() - 1
    cu = cu.long()
    lengths = cu[1:] - cu[:-1]
    start, end = _padded_spans(lengths)
    rows = padded_rows(total, b)
    r = torch.arange(rows, device=cu.device)
    seq = torch.searchsorted(end, r, right=True).clamp(max=max(b - 1, 0))
    local = r - start[seq] if b else r
    valid = (local < lengths[seq]) & (local >= 0) if b else torch.zeros_like(r, dtype=torch.bool)
    src = torch.where(valid, cu[seq] + local, 0) if b else r * 0
    return PaddedLayout(rows, src, valid, seq, start, lengths)


def pad_rows(x: torch.Tensor, layout: PaddedLayout, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``x`` ``[total, H, D]`` -> ``[H, rows, D]`` in the padded layout (padding rows 0)."""
    if x.shape[0] == 0:
        return torch.zeros(x.shape[1], layout.rows, x.shape[2], dtype=dtype or x.dtype, device=x.device)
    g = x.index_select(0, layout.src.clamp(max=x.shape[0] - 1))  # clamped: cu_seqlens are not checked in graphs
    if dtype is not None:
        g = g.to(dtype)
    g = torch.where(layout.valid[:, None, None], g, torch.zeros((), dtype=g.dtype, device=g.device))
    return g.transpose(0, 1).contiguous()


def sequence_of_rows(cu: torch.Tensor, total: int) -> torch.Tensor:
    """``[total]`` int64: the sequence each packed row belongs to."""
    return torch.searchsorted(cu[1:].long(), torch.arange(total, device=cu.device), right=True)


class PackedFP8Inputs(NamedTuple):
    """The varlen FP8 forward's operands (padded layout) and the smoothing means."""

    q: torch.Tensor        # [H, Rq, D] float8_e4m3fn
    q_scale: torch.Tensor  # [H, Rq/128] float32
    k: torch.Tensor        # [Hkv, Rk, D] float8_e4m3fn of K minus its sequence's mean
    k_scale: torch.Tensor  # [Hkv, Rk/128] float32
    v_t: torch.Tensor      # [Hkv, Dv, Rk] float8_e4m3fn (keys permuted within 16 if asked)
    v_scale: torch.Tensor  # [B, Hkv, Dv] float32: per sequence, head and channel
    k_mean: torch.Tensor   # [B, Hkv, D] float32


def _segment_sums(tile_sums: torch.Tensor, start: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Per sequence, the sum of its 128-row tiles' sums ``[H, T, D]`` -> ``[H, B, D]`` (FP64 prefix
    sums: deterministic, and exact enough that the difference keeps FP32's digits)."""
    prefix = torch.nn.functional.pad(torch.cumsum(tile_sums.double(), dim=1), (0, 0, 1, 0))
    first = start // ATTN_BLOCK
    last = first + (lengths + ATTN_BLOCK - 1) // ATTN_BLOCK
    return (prefix[:, last] - prefix[:, first]).float()


def sequence_means(xp: torch.Tensor, layout: PaddedLayout) -> torch.Tensor:
    """Each sequence's token mean of ``xp`` ``[H, rows, D]`` (padded layout, padding rows 0) ->
    ``[H, B, D]`` FP32 (0 for an empty sequence)."""
    h, _, d = xp.shape
    tile_sums = xp.view(h, layout.rows // ATTN_BLOCK, ATTN_BLOCK, d).sum(dim=2, dtype=torch.float32)
    return _segment_sums(tile_sums, layout.start, layout.lengths) / layout.lengths.clamp(min=1)[None, :, None]


def quantize_packed(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor, *,
                    smooth: bool = True, incoherent: bool = False, permute_v_keys: bool = False) -> PackedFP8Inputs:
    """The FP8 operands of packed ``q`` ``[total_q, H, D]``, ``k`` ``[total_k, Hkv, D]``, ``v``
    ``[total_k, Hkv, Dv]`` in the padded layout, each sequence quantized as its own dense call
    would be. ``permute_v_keys``: Vᵀ's keys stored in ``V_KEY_PERM`` order within each 16."""
    lq, lk = padded_layout(cu_q, q.shape[0]), padded_layout(cu_k, k.shape[0])
    hkv, d, dv = k.shape[1], q.shape[2], v.shape[2]
    f32 = torch.float32
    qp = pad_rows(q, lq)
    q_codes, q_scale = _blocks(_rotate(qp, incoherent)[None])
    kp = _rotate(pad_rows(k, lk), incoherent)
    tiles_k = lk.rows // ATTN_BLOCK
    if smooth:
        k_mean = sequence_means(kp, lk)
        kp = torch.where(lk.valid[None, :, None], torch.sub(kp, k_mean[:, lk.seq]), 0.0)
    else:
        k_mean = torch.zeros(hkv, lk.lengths.numel(), d, dtype=f32, device=k.device)
    k_codes, k_scale = _blocks(kp[None])
    # V: one scale per (sequence, head, channel), from the amax of the sequence's tiles
    vp = pad_rows(v, lk, f32)
    tile_amax = vp.abs().nan_to_num(nan=0.0, posinf=torch.inf).view(hkv, tiles_k, ATTN_BLOCK, dv).amax(dim=2)
    nseq = lk.lengths.numel()
    tile_seq = lk.seq[::ATTN_BLOCK]
    amax = torch.zeros(hkv, nseq, dv, dtype=f32, device=v.device).scatter_reduce_(
        1, tile_seq[None, :, None].expand(hkv, tiles_k, dv), tile_amax, "amax")
    v_scale = scale_from_amax(amax, _ROWWISE, None)
    inv = ieee_div(torch.ones_like(v_scale), v_scale)
    codes = (vp * inv[:, lk.seq]).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    if permute_v_keys:  # stored position p of each 16 holds key V_KEY_PERM[p]
        codes = codes.index_select(1, v_keys_at_positions(torch.arange(lk.rows, device=v.device)))
    v_t = codes.transpose(1, 2).contiguous()
    return PackedFP8Inputs(q_codes[0], q_scale[0], k_codes[0], k_scale[0], v_t, v_scale.transpose(0, 1).contiguous(),
                           k_mean.transpose(0, 1).contiguous())


def sequence_plan(cu_q: torch.Tensor, cu_k: torch.Tensor, total_q: int, total_k: int) -> torch.Tensor:
    """``[B, 8]`` int32, one row per sequence (columns :data:`SEQUENCE_FIELDS`): where its tokens are
    in the packed tensors and in the padded layout. Columns 0-3 (queries) and 4-7 (keys) are the
    packed pre-pass kernels' sequence tables; the varlen forward kernel reads the whole row.

    Lengths are clamped so that no sequence reaches past ``total_q`` output rows or the padded K
    rows (GPU ``cu_seqlens`` are not checked: a bad one must not write out of bounds)."""
    b = cu_q.numel() - 1
    cu = torch.stack([cu_q.long().clamp(0, total_q), cu_k.long().clamp(0, total_k)])  # [2, B + 1]
    lengths = (cu[:, 1:] - cu[:, :-1]).clamp(min=0)
    starts, _ = _padded_spans(lengths)
    for i, total in enumerate((total_q, total_k)):  # zig-zag cu_seqlens: lengths past the padded rows
        lengths[i] = torch.minimum(lengths[i], (padded_rows(total, b) - starts[i]).clamp(min=0))
    index = torch.arange(b, device=cu.device).expand(2, b)  # the sequence's index (its V scales, K mean)
    return torch.stack([cu[:, :-1], lengths, starts, index], 2).transpose(0, 1).reshape(b, 8).to(torch.int32)


def longest_first(plan: torch.Tensor) -> torch.Tensor:
    """The plan's rows, the most work (query x key tokens) first: the forward kernel's grid walks its
    sequences in this order, so the longest ones do not start in the last wave (a stable sort:
    deterministic)."""
    work = plan[:, 1].long() * plan[:, 5].long()
    return plan.index_select(0, torch.sort(work, descending=True, stable=True).indices)
