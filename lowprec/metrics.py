"""Error metrics, computed in FP64: ``x`` is the approximation, ``ref`` the reference. Empty
tensors are identical by every metric."""

from __future__ import annotations

import math

import torch

__all__ = ["cos_sim", "rel_l1", "rel_l2", "rmse", "sqnr_db", "calc_diff", "max_rel_err", "error_report"]


def _pair(x: torch.Tensor, ref: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if x.shape != ref.shape:
        raise ValueError(f"x: shape {tuple(x.shape)} differs from ref's {tuple(ref.shape)}")
    return x.detach().to(torch.float64).flatten(), ref.detach().to(torch.float64).flatten().to(x.device)


def _pow2_scale(m: float) -> float:
    """The largest power of two not above ``m`` (dividing by it is exact; one above would overflow
    for m ≥ 2^1023), 1 for 0, Inf or NaN."""
    return math.ldexp(1.0, math.frexp(m)[1] - 1) if m > 0 and math.isfinite(m) else 1.0


def _scaled_pair(x: torch.Tensor, ref: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float]:
    """:func:`_pair` over their common largest magnitude ``m`` (and ``m``): FP64 squares of values
    beyond ~1e±154 overflow or flush to 0, so sums of squares are taken of the scaled values."""
    x, ref = _pair(x, ref)
    m = float(torch.maximum(x.abs().max(), ref.abs().max())) if x.numel() else 0.0
    m = _pow2_scale(m)
    return x / m, ref / m, m


def cos_sim(x: torch.Tensor, ref: torch.Tensor) -> float:
    """Cosine similarity (1.0 = same direction). Two all-zero tensors give 1.0 (identical); one
    all-zero tensor against another that is not gives 0.0 (no direction in common); a NaN or Inf
    in either gives NaN (no direction), as the other metrics do."""
    x, ref = _pair(x, ref)
    # each over its largest magnitude: FP64 norms of values beyond ~1e±154 underflow to 0 or overflow
    x_max, ref_max = (float(x.abs().max()), float(ref.abs().max())) if x.numel() else (0.0, 0.0)
    if not (math.isfinite(x_max) and math.isfinite(ref_max)):  # the clamp below would make NaN -1.0
        return math.nan
    if x_max == 0 or ref_max == 0:
        return 1.0 if x_max == ref_max else 0.0
    x, ref = x / x_max, ref / ref_max
    # within [-1, 1]: the rounded quotient of equal tensors can land an ulp past 1
    return min(1.0, max(-1.0, float(x @ ref / (x.norm() * ref.norm()))))


def rel_l1(x: torch.Tensor, ref: torch.Tensor) -> float:
    """Σ|x − ref| / Σ|ref|."""
    # over the largest magnitude: FP64 sums near its range overflow, and refs below the 1e-300
    # floor (there for an all-zero ref) are FP64 subnormals
    x, ref, _ = _scaled_pair(x, ref)
    return float((x - ref).abs().sum() / ref.abs().sum().clamp_min(1e-300))


def rel_l2(x: torch.Tensor, ref: torch.Tensor, chunk: int = 1 << 24) -> float:
    """‖x − ref‖₂ / ‖ref‖₂, in FP64 pieces of ``chunk`` elements (an FP64 copy of tensors as
    large as a layer's expert weights or their gradients need not fit)."""
    if x.shape != ref.shape:
        raise ValueError(f"x: shape {tuple(x.shape)} differs from ref's {tuple(ref.shape)}")
    pieces = list(zip(x.detach().reshape(-1).split(chunk), ref.detach().reshape(-1).split(chunk)))
    # over the largest magnitude, as _scaled_pair: FP64 squares past ~1e±154 overflow or flush to 0;
    # taken in FP64, as the other metrics take theirs: torch has no abs() of a bool tensor
    m = max((float(torch.maximum(a.double().abs().max(), b.double().abs().max().to(a.device)))
             for a, b in pieces if a.numel()), default=0.0)
    m = _pow2_scale(m)
    diff_sq = ref_sq = 0.0
    for a, b in pieces:
        a, b = a.to(torch.float64) / m, b.to(torch.float64).to(a.device) / m
        diff_sq += float((a - b).square().sum())
        ref_sq += float(b.square().sum())
    return math.sqrt(diff_sq) / max(math.sqrt(ref_sq), 1e-300)


def rmse(x: torch.Tensor, ref: torch.Tensor) -> float:
    """Root mean squared error."""
    x, ref, m = _scaled_pair(x, ref)
    return m * float((x - ref).pow(2).mean().sqrt()) if x.numel() else 0.0


def sqnr_db(x: torch.Tensor, ref: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio, 10·log10(Σref² / Σ(x − ref)²), in dB (inf if exact,
    -inf for an infinite error against a finite ``ref``, NaN for a NaN)."""
    x, ref, _ = _scaled_pair(x, ref)
    noise = float((x - ref).pow(2).sum())
    signal = float(ref.pow(2).sum())
    if noise == 0:
        return math.inf
    ratio = max(signal, 1e-300) / noise
    if ratio == 0:  # an Inf noise: math.log10(0) raises
        return -math.inf
    return 10 * math.log10(ratio)


def calc_diff(x: torch.Tensor, ref: torch.Tensor) -> float:
    """DeepGEMM's metric: 1 − 2·Σ(x·ref) / Σ(x² + ref²) (0 = identical)."""
    x, ref, _ = _scaled_pair(x, ref)
    denom = float((x * x + ref * ref).sum())
    return 0.0 if denom == 0 else 1 - 2 * float((x * ref).sum()) / denom


def max_rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """max|x − ref| / max|ref|: the worst element error relative to the tensor's range."""
    x, ref, _ = _scaled_pair(x, ref)  # as rel_l1: |x − ref| may overflow, |ref| lie below the floor
    if not x.numel():
        return 0.0
    return float((x - ref).abs().max() / ref.abs().max().clamp_min(1e-300))


def error_report(x: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    """All metrics at once."""
    return {f.__name__: f(x, ref) for f in (cos_sim, rel_l1, rel_l2, rmse, sqnr_db, calc_diff, max_rel_err)}
