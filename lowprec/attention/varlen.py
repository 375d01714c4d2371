"""Variable-length attention on packed sequences (FlashAttention's ``flash_attn_varlen_func`` layout).

Semantics are those of :func:`lowprec.attention` applied to each sequence on its own (its causal
mask bottom-right aligned within the sequence; in the FP8 scheme its own K mean and its own
128-token blocks, starting at the sequence's first token).

``quant="fp8"`` on CUDA is one custom op (:mod:`.varlen_ops`): on Hopper the packed pre-pass
kernels and one launch of the varlen kernel, nothing read back to the host (CUDA-graph capturable,
``torch.compile(fullgraph=True)``). Exact attention on CUDA (fp16/bf16) is PyTorch's varlen flash
attention, also without a host read. Elsewhere one dense call per sequence after reading
``cu_seqlens`` to the host.
"""

from __future__ import annotations

import math
import operator

import torch

from ..runtime import autocast_off
from .dense import FLOAT_DTYPES, attention, check_flag, softmax_scale
from .ops import _flash_ok, expand_kv_heads
from .quantize import check_rotation_dim

__all__ = ["attention_varlen", "check_cu_seqlens"]


def check_cu_seqlens(name: str, cu: torch.Tensor, total: int, max_seqlen: int, device: torch.device) -> list[int]:
    """Validate a ``cu_seqlens`` tensor (``[B + 1]`` int32/int64 on ``device`` or the CPU, from 0 to
    ``total``, non-decreasing, no sequence longer than ``max_seqlen``) and return it as a host list."""
    _check_cu_shape(name, cu)
    # host tensors serve q on any device (read for free), as the flash and FP8 paths take them
    if cu.device != device and cu.device.type != "cpu":
        raise ValueError(f"{name}: on {cu.device}, but q is on {device} (expected q's device or the CPU)")
    values = cu.tolist()
    if values[0] != 0 or values[-1] != total:
        raise ValueError(f"{name}: must start at 0 and end at the packed length {total}, got "
                         f"{values[0]} ... {values[-1]}")
    lengths = [b - a for a, b in zip(values, values[1:])]
    if any(n < 0 for n in lengths):
        raise ValueError(f"{name}: must be non-decreasing, got {values}")
    if not isinstance(max_seqlen, int) or max_seqlen < max(lengths, default=0):
        raise ValueError(f"max_seqlen{name[-2:]}: expected an int ≥ the longest sequence "
                         f"({max(lengths, default=0)}), got {max_seqlen!r}")
    return values


def _check_cu_shape(name: str, cu) -> None:
    """A ``cu_seqlens`` tensor's type and shape (no values read)."""
    if not isinstance(cu, torch.Tensor) or cu.dim() != 1 or cu.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name}: expected a 1-D int32/int64 tensor [B + 1], got "
                         f"{getattr(cu, 'dtype', type(cu))} {tuple(getattr(cu, 'shape', ()))}")
    if cu.numel() < 1:
        raise ValueError(f"{name}: expected at least one entry (0), got an empty tensor")


def attention_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                     cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, causal: bool = False,
                     scale: float | None = None, quant: str | None = None, return_lse: bool = False, *,
                     incoherent: bool = False):
    """Attention over a batch of sequences of different lengths, packed.

    Args:
        q: ``[total_q, H, D]``; k: ``[total_k, Hkv, D]``; v: ``[total_k, Hkv, Dv]`` (``H`` a multiple
            of ``Hkv``): the sequences one after another, in one float dtype.
        cu_seqlens_q, cu_seqlens_k: ``[B + 1]`` int32 (or int64) prefix sums of the sequence lengths
            (sequence ``i`` is rows ``cu[i]:cu[i+1]``), on q's device or the CPU; empty sequences
            allowed. Their values are checked wherever that needs no GPU-to-host read: on the CPU,
            and on CUDA when they are CPU tensors (then copied to the GPU). On CUDA (the FP8
            kernel, or exact attention in fp16/bf16) GPU tensors are not read back, as in
            FlashAttention: a bad value gives wrong rows for its sequences, never a write outside
            the output.
        max_seqlen_q, max_seqlen_k: upper bounds of the lengths (checked with the values).
        causal, scale, quant, incoherent: as :func:`lowprec.attention`, per sequence.
        return_lse: also return the LSE ``[H, total_q]`` FP32 (FlashAttention's varlen layout).

    Returns ``out [total_q, H, Dv]`` in q's dtype (and the LSE). Differentiable as the dense call.
    """
    check_flag("causal", causal)
    check_flag("incoherent", incoherent)

    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dtype not in FLOAT_DTYPES or t.dim() != 3:
            raise ValueError(f"{name}: expected a 3-D float16/bfloat16/float32/float64 tensor [total, heads, D], got "
                             f"{getattr(t, 'dtype', type(t))} {tuple(getattr(t, 'shape', ()))}")
        if t.device != q.device:
            raise ValueError(f"{name}: on {t.device}, but q is on {q.device}")
        if t.dtype != q.dtype:  # as lowprec.attention
            raise ValueError(f"{name}: {t.dtype}, but q is {q.dtype}: q, k and v share one dtype (cast them)")
    h, d = q.shape[1:]
    if d == 0:  # no score to scale or quantize
        raise ValueError(f"q: expected a head dim D ≥ 1, got shape {tuple(q.shape)}")
    if k.shape[1] == 0 or h % k.shape[1] or k.shape[2] != d:
        raise ValueError(f"k: expected [total_k, Hkv ≥ 1 dividing H={h}, D={d}], got {tuple(k.shape)}")
    if v.shape[:2] != k.shape[:2]:
        raise ValueError(f"v: expected [total_k, Hkv] = {tuple(k.shape[:2])} leading dims, got {tuple(v.shape)}")
    if quant not in (None, "fp8"):
        raise ValueError(f"quant: expected None or 'fp8', got {quant!r}")
    if incoherent and quant is None:
        raise ValueError("incoherent: applies to quant='fp8' only")
    if incoherent:  # here too: no sequence with queries, no rotation built to refuse it
        check_rotation_dim(d)
    scale = softmax_scale(scale, d)
    max_seqlen_q, max_seqlen_k = _length("max_seqlen_q", max_seqlen_q), _length("max_seqlen_k", max_seqlen_k)
    if quant == "fp8" and q.is_cuda:
        with autocast_off(q.device):  # as lowprec.attention's FP8 path
            return _fp8_on_device(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, bool(causal),
                                  scale, return_lse, bool(incoherent))
    if quant is None and q.is_cuda and q.shape[0] and k.shape[0] and _flash_ok(q, k, v):
        return _exact_on_device(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, bool(causal), scale,
                                return_lse)
    cq = check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, q.shape[0], max_seqlen_q, q.device)
    ck = check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, k.shape[0], max_seqlen_k, q.device)
    if len(cq) != len(ck):
        raise ValueError(f"cu_seqlens_k: {len(ck) - 1} sequences, but cu_seqlens_q has {len(cq) - 1}")
    outs, lses = [], []
    for (q0, q1), (k0, k1) in zip(zip(cq, cq[1:]), zip(ck, ck[1:])):
        if q1 == q0:
            continue
        qi = q[q0:q1].transpose(0, 1)[None]
        ki, vi = k[k0:k1].transpose(0, 1)[None], v[k0:k1].transpose(0, 1)[None]
        o, lse = attention(qi, ki, vi, causal=causal, scale=scale, quant=quant, return_lse=True,
                           incoherent=incoherent)
        outs.append(o[0].transpose(0, 1))
        lses.append(lse[0])
    if outs:
        out, lse = torch.cat(outs, dim=0), torch.cat(lses, dim=1)
    else:
        # keeps the graph for autograd: q, k and v get zero gradients, as the dense call's over no queries
        out = q.new_zeros(0, h, v.shape[-1]) + 0 * (q.sum() + k.sum() + v.sum())
        lse = q.new_zeros(h, 0, dtype=torch.float32)
    return (out, lse) if return_lse else out


def _exact_on_device(q, k, v, cu_q, cu_k, max_q, max_k, causal: bool, scale: float, return_lse: bool):
    """Exact attention on CUDA: PyTorch's varlen flash attention (``aten._flash_attention_forward``,
    differentiable through its varlen backward), no host read of GPU ``cu_seqlens``."""
    cu_q, cu_k = _device_cu_seqlens(q, k, cu_q, cu_k, max_q, max_k)
    k, v = expand_kv_heads(k, v, q.shape[1])
    out, lse = torch.ops.aten._flash_attention_forward(q, k, v, cu_q.int(), cu_k.int(), max_q, max_k, 0.0, causal,
                                                       False, scale=scale)[:2]
    if not return_lse:
        return out
    return out, torch.where(lse == math.inf, -math.inf, lse)  # FlashAttention: +inf for rows with no key


def _fp8_on_device(q, k, v, cu_q, cu_k, max_q, max_k, causal: bool, scale: float, return_lse: bool,
                   incoherent: bool):
    """The FP8 call on CUDA through the varlen op, with no host read of GPU ``cu_seqlens``."""
    from .varlen_ops import attention_fp8_varlen_call, packed_lse_correction

    cu_q, cu_k = _device_cu_seqlens(q, k, cu_q, cu_k, max_q, max_k)
    out, lse, k_mean = attention_fp8_varlen_call(q, k, v, cu_q, cu_k, int(max_q), int(max_k), causal, scale,
                                                 incoherent)
    if not return_lse:
        return out
    return out, lse + packed_lse_correction(q.detach(), k_mean, cu_q, scale, incoherent)


def _length(name: str, value) -> int:
    """A ``max_seqlen`` as a Python int: numpy integers and 0-d integer tensors as FlashAttention's
    callers pass them (a CUDA tensor is read back to the host), not bools or floats."""
    if isinstance(value, bool) or (isinstance(value, torch.Tensor) and value.dtype == torch.bool):
        raise ValueError(f"{name}: expected an int ≥ the longest sequence, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise ValueError(f"{name}: expected an int ≥ the longest sequence, got {value!r}") from None


def _device_cu_seqlens(q, k, cu_q, cu_k, max_q, max_k) -> tuple[torch.Tensor, torch.Tensor]:
    """``cu_seqlens`` on q's GPU: checked and sent over when they are CPU tensors, else only their
    shapes and dtypes are checked (their values are not read back)."""
    cus = []
    for name, cu, total, longest in (("cu_seqlens_q", cu_q, q.shape[0], max_q),
                                     ("cu_seqlens_k", cu_k, k.shape[0], max_k)):
        _check_cu_shape(name, cu)
        if not isinstance(longest, int) or longest < 0:
            raise ValueError(f"max_seqlen{name[-2:]}: expected an int ≥ the longest sequence, got {longest!r}")
        if cu.device.type == "cpu":  # checked on the host for free, then sent over
            check_cu_seqlens(name, cu, total, longest, cu.device)
            cu = cu.to(q.device, non_blocking=True)
        elif cu.device != q.device:
            raise ValueError(f"{name}: on {cu.device}, but q is on {q.device} (expected q's device or the CPU)")
        cus.append(cu)
    cu_q, cu_k = cus
    if cu_k.numel() != cu_q.numel():
        raise ValueError(f"cu_seqlens_k: {cu_k.numel() - 1} sequences, but cu_seqlens_q has {cu_q.numel() - 1}")
    return cu_q, cu_k
