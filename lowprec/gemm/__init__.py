"""Block-scaled GEMMs: ``D = A · Bᵀ`` on quantized operands with FP32 accumulation."""

from __future__ import annotations

import torch

from ..runtime import eager_under_compile, registry
from ..tensor import QuantizedTensor
from .ops import gemm_dispatch, gemm_op
from .reference import grouped_gemm_contiguous_reference, grouped_gemm_masked_reference

__all__ = ["gemm", "grouped_gemm"]

registry.load_arch_packages(__name__, __path__)

_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _check_operand(name: str, t: QuantizedTensor, ndim: int) -> None:
    if not isinstance(t, QuantizedTensor):
        raise TypeError(f"{name}: expected a QuantizedTensor (lowprec.quantize), got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name}: expected {ndim} dims, got shape {tuple(t.shape)}")


def _check_common(a: QuantizedTensor, b: QuantizedTensor, out_dtype: torch.dtype) -> None:
    if a.shape[-1] != b.shape[-1]:
        raise ValueError(f"b: K mismatch: a has K={a.shape[-1]}, b has K={b.shape[-1]} (b is [N, K]: D = a · bᵀ)")
    if a.device != b.device:
        raise ValueError(f"b: on {b.device}, but a is on {a.device}")
    check_out_dtype(out_dtype)


def check_out_dtype(out_dtype: torch.dtype) -> None:
    """The output dtypes of the GEMMs (dense, grouped, weight gradient): the kernels write no other."""
    if out_dtype not in _OUT_DTYPES:
        raise TypeError(f"out_dtype: expected one of {[str(d) for d in _OUT_DTYPES]}, got {out_dtype}")


def _scales_need_grad(a: QuantizedTensor, b: QuantizedTensor) -> bool:
    return any(t is not None and t.requires_grad
               for t in (a.scale, a.global_scale, b.scale, b.global_scale))


def gemm(a: QuantizedTensor, b: QuantizedTensor, out_dtype: torch.dtype = torch.bfloat16,
         bias: torch.Tensor | None = None) -> torch.Tensor:
    """``D[M, N] = dequant(a)[M, K] · dequant(b)[N, K]ᵀ (+ bias)``, accumulated in FP32.

    Any recipes work through the reference path. On Hopper (sm_90a), ``a`` in ``fp8_block1x128``,
    ``fp8_rowwise`` or ``fp8_tensorwise`` and ``b`` in ``fp8_block128x128`` (weights),
    ``fp8_block1x128`` or ``fp8_block16x128`` (weight gradients), ``fp8_rowwise`` or
    ``fp8_tensorwise`` run the CuTe DSL kernel (on Blackwell see README; ``LOWPREC_BACKEND``
    chooses, see :mod:`lowprec.runtime.backend`).

    Args:
        a: quantized ``[M, K]``.
        b: quantized ``[N, K]`` (row-major weights, as ``nn.Linear.weight``).
        out_dtype: bfloat16 (default), float16 or float32.
        bias: optional ``[N]`` floating-point tensor added (in FP32) before the cast; the only
            differentiable input (its gradient is the output gradient summed over rows; the
            quantized operands get none).
    """
    _check_operand("a", a, 2)
    _check_operand("b", b, 2)
    _check_common(a, b, out_dtype)
    n = b.shape[0]
    if bias is not None:
        if not isinstance(bias, torch.Tensor) or bias.shape != (n,):
            raise ValueError(f"bias: expected a tensor of shape ({n},), got {getattr(bias, 'shape', type(bias))}")
        if not bias.is_floating_point():  # the FP32 cast would drop a complex bias's imaginary part
            raise TypeError(f"bias: expected a real floating-point tensor, got {bias.dtype}")
        if bias.device != a.device:
            raise ValueError(f"bias: on {bias.device}, but a is on {a.device}")
    bias_grad = bias is not None and bias.requires_grad and torch.is_grad_enabled()
    if not torch.compiler.is_compiling() and not bias_grad:
        # eager: the op's dispatch (tens of µs per call) buys nothing outside a traced graph, unless
        # the bias needs its gradient (the op's autograd formula; a kernel's output has no graph)
        if torch.is_grad_enabled() and _scales_need_grad(a, b):
            # the quantized operands get no gradient, as through the op (its formula) and the kernels:
            # the reference would otherwise differentiate through scales that require grad
            with torch.no_grad():
                return gemm_dispatch(a, b, out_dtype, bias)
        return gemm_dispatch(a, b, out_dtype, bias)
    return gemm_op(a.data, a.scale, a.global_scale, a.recipe.spec(),
                   b.data, b.scale, b.global_scale, b.recipe.spec(), a.shape[1], bias, out_dtype)


@eager_under_compile
def grouped_gemm(a: QuantizedTensor, b: QuantizedTensor, *, group_ends: torch.Tensor | None = None,
                 masked_counts: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """One GEMM per group (expert) against that group's weights ``b[e]``.

    Two layouts, pick one by the keyword given:

    - contiguous (``group_ends``): ``a`` is ``[M, K]`` with the rows of group ``e`` in
      ``group_ends[e-1]:group_ends[e]`` (int32 or int64 cumulative ends, non-decreasing); ``b`` is
      ``[E, N, K]``. Returns ``[M, N]``; rows after ``group_ends[-1]`` are zero.
    - masked (``masked_counts``): ``a`` is ``[E, M_max, K]`` and group ``e`` uses its first
      ``masked_counts[e]`` rows; returns ``[E, M_max, N]`` with the other rows zero.

    On Hopper, ``a`` in ``fp8_block1x128`` and ``b`` in ``fp8_block128x128`` run one persistent
    CuTe DSL kernel over all groups: groups need no padding, empty groups cost nothing, and the
    group tensor is read on the device only (no host sync, CUDA-graph capturable). Its values
    are therefore checked on the CPU only; on CUDA, values breaking the contract give wrong
    rows (never out-of-bounds accesses).
    """
    if (group_ends is None) == (masked_counts is None):
        raise ValueError("grouped_gemm: pass exactly one of group_ends= (contiguous) or masked_counts= (masked)")
    _check_operand("b", b, 3)
    num_groups = b.shape[0]
    if group_ends is not None:
        _check_operand("a", a, 2)
        _check_common(a, b, out_dtype)
        _check_groups("group_ends", group_ends, num_groups, a.device)
        if group_ends.device.type == "cpu" and group_ends.numel() and (
                bool((group_ends.diff() < 0).any()) or int(group_ends[-1]) > a.shape[0] or int(group_ends[0]) < 0):
            raise ValueError(
                f"group_ends: must be non-decreasing within [0, M={a.shape[0]}], got {group_ends.tolist()}")
        return _grouped_kernel(a, b, out_dtype, group_ends=group_ends)
    _check_operand("a", a, 3)
    _check_common(a, b, out_dtype)
    if a.shape[0] != num_groups:
        raise ValueError(f"a: masked layout needs a [E, M_max, K] with E={num_groups} like b, got {tuple(a.shape)}")
    _check_groups("masked_counts", masked_counts, num_groups, a.device)
    if masked_counts.device.type == "cpu" and (
            bool((masked_counts < 0).any()) or bool((masked_counts > a.shape[1]).any())):
        raise ValueError(f"masked_counts: each count must be in [0, M_max={a.shape[1]}], got {masked_counts.tolist()}")
    return _grouped_kernel(a, b, out_dtype, masked_counts=masked_counts)


def _grouped_kernel(a: QuantizedTensor, b: QuantizedTensor, out_dtype: torch.dtype,
                    group_ends: torch.Tensor | None = None, masked_counts: torch.Tensor | None = None) -> torch.Tensor:
    def reference():
        if group_ends is not None:
            return grouped_gemm_contiguous_reference(a, b, group_ends, out_dtype)
        return grouped_gemm_masked_reference(a, b, masked_counts, out_dtype)

    return registry.run("grouped_gemm", a.device, (a, b, out_dtype, group_ends, masked_counts), reference)


def _check_groups(name: str, t: torch.Tensor, num_groups: int, device: torch.device) -> None:
    if not isinstance(t, torch.Tensor) or t.dtype not in (torch.int32, torch.int64) or t.shape != (num_groups,):
        # int64 is taken too (the kernels copy it to int32): an int32-only message misled its callers
        raise ValueError(f"{name}: expected an int32 or int64 tensor of shape ({num_groups},), got "
                         f"{getattr(t, 'dtype', type(t))} {tuple(getattr(t, 'shape', ()))}")
    if t.device != device:
        raise ValueError(f"{name}: on {t.device}, but a is on {device}")
