"""torch.library custom ops for the GEMMs, on plain tensors, with fake implementations.

``torch.compile`` traces through them without a graph break and CUDA graphs capture them. The
friendly API (:func:`lowprec.gemm`) unpacks QuantizedTensors into ``(data, scale, global_scale,
recipe spec)`` (plus the logical K) for the op, and the op rebuilds them to choose kernel or
reference.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from ..recipes import ScaleRecipe, get_recipe
from ..runtime import registry
from ..tensor import QuantizedTensor
from .reference import gemm_reference
from .weight_only import (
    PackedFP8,
    PackedNVFP4,
    PackedNVFP4Experts,
    grouped_weight_only_reference,
    unpack_fp8,
    unpack_nvfp4,
)

__all__ = ["gemm_op", "gemm_dispatch", "weight_only_op", "weight_only", "grouped_weight_only"]


def gemm_dispatch(a: QuantizedTensor, b: QuantizedTensor, out_dtype: torch.dtype,
                  bias: torch.Tensor | None) -> torch.Tensor:
    """Run a kernel where the device and operands allow, else a vendor library's block-scaled GEMM
    where one is registered (cuBLASLt on sm_100a), else the reference (validated inputs)."""
    args = (a, b, out_dtype, bias)
    return registry.run("gemm", a.device, args,
                        lambda: registry.run("gemm_cublaslt", a.device, args, lambda: gemm_reference(*args)))


@torch.library.custom_op("lowprec::gemm", mutates_args=())
def gemm_op(a_data: torch.Tensor, a_scale: torch.Tensor, a_global: torch.Tensor | None, a_recipe: str,
            b_data: torch.Tensor, b_scale: torch.Tensor, b_global: torch.Tensor | None, b_recipe: str,
            k: int, bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    # the original dtype is irrelevant here: the op returns out_dtype
    a = QuantizedTensor(a_data, a_scale, ScaleRecipe.from_spec(a_recipe), (a_data.shape[0], k), out_dtype, a_global)
    b = QuantizedTensor(b_data, b_scale, ScaleRecipe.from_spec(b_recipe), (b_data.shape[0], k), out_dtype, b_global)
    return gemm_dispatch(a, b, out_dtype, bias)


@gemm_op.register_fake
def _(a_data, a_scale, a_global, a_recipe, b_data, b_scale, b_global, b_recipe, k, bias, out_dtype):
    return a_data.new_empty((a_data.shape[0], b_data.shape[0]), dtype=out_dtype)


def _gemm_setup_context(ctx, inputs, output):
    bias = inputs[9]
    ctx.bias_dtype = None if bias is None else bias.dtype


def _gemm_backward(ctx, grad):
    """The bias's gradient, as the eager reference's autograd gives it (``d + bias`` in FP32, then
    the cast to ``out_dtype``); the quantized operands' codes and scales carry none."""
    db = None
    if ctx.bias_dtype is not None and ctx.needs_input_grad[9]:
        db = grad.float().sum(0).to(ctx.bias_dtype)
    return None, None, None, None, None, None, None, None, None, db, None


gemm_op.register_autograd(_gemm_backward, setup_context=_gemm_setup_context)


def weight_only(x: torch.Tensor, packed: PackedNVFP4 | PackedFP8 | None,
                weight: QuantizedTensor | Callable[[], QuantizedTensor], bias: torch.Tensor | None) -> torch.Tensor:
    """``x [M, K] · dequant(W)ᵀ (+ bias)`` in ``x``'s dtype, ``x`` not quantized: the weight-only
    kernel (``packed``: the weight in its layout; NVFP4 from ``DEQUANT_MIN_M`` rows: the weight
    decoded to bf16 once, then cuBLAS) where one serves, else (also with ``packed``
    None) ``F.linear`` on the dequantized ``weight`` (a QuantizedTensor, or a function making it:
    called only then). Traced by ``torch.compile`` as the ``lowprec::weight_only`` op, whose
    fallback rebuilds the weight from ``packed``."""
    if packed is None:
        return F.linear(x, _materialized(weight).dequantize(x.dtype), bias)
    if torch.compiler.is_compiling():
        fmt, scale = ("nvfp4", packed.global_scale) if isinstance(packed, PackedNVFP4) else ("fp8", packed.scale)
        return weight_only_op(x, packed.data, scale, fmt, packed.n, packed.k, bias)
    return _weight_only_run(x, packed, weight, bias)


def _materialized(weight):
    return weight() if callable(weight) else weight


def _weight_only_run(x, packed, weight, bias):
    op = "weight_only_nvfp4" if isinstance(packed, PackedNVFP4) else "weight_only_fp8"
    return registry.run(op, x.device, (x, packed, bias),
                        lambda: F.linear(x, _materialized(weight).dequantize(x.dtype), bias))


def _unpacked(packed: PackedNVFP4 | PackedFP8, dtype: torch.dtype) -> QuantizedTensor:
    """The packed weight as a QuantizedTensor again (NVFP4 as 1x16 blocks: the same weight)."""
    if isinstance(packed, PackedNVFP4):
        weight, scale = unpack_nvfp4(packed)
        return QuantizedTensor(weight, scale, get_recipe("nvfp4"), (packed.n, packed.k), dtype,
                               packed.global_scale.reshape(()))
    return QuantizedTensor(unpack_fp8(packed), packed.scale, get_recipe("fp8_block128x128"), (packed.n, packed.k),
                           dtype)


@torch.library.custom_op("lowprec::weight_only", mutates_args=())
def weight_only_op(x: torch.Tensor, packed_data: torch.Tensor, packed_scale: torch.Tensor, fmt: str, n: int, k: int,
                   bias: torch.Tensor | None) -> torch.Tensor:
    kind = PackedNVFP4 if fmt == "nvfp4" else PackedFP8
    packed = kind(packed_data, packed_scale, n, k)
    return _weight_only_run(x, packed, lambda: _unpacked(packed, x.dtype), bias)


@weight_only_op.register_fake
def _(x, packed_data, packed_scale, fmt, n, k, bias):
    return x.new_empty((x.shape[0], n))


def grouped_weight_only(x: torch.Tensor, packed: PackedNVFP4Experts, group_ends: torch.Tensor,
                        zero_tail: bool = True) -> torch.Tensor:
    """Grouped weight-only GEMM: ``x [R, K]`` with expert ``e``'s rows at
    ``group_ends[e-1]:group_ends[e]`` (int32 ``[E]``, cumulative, as :func:`lowprec.grouped_gemm`
    takes them) -> ``[R, N]`` in ``x``'s dtype, each expert's rows times its dequantized NVFP4
    weight; rows after ``group_ends[-1]`` are zero (``zero_tail=False``: left unwritten, for a
    caller that knows there are none or never reads them). On Hopper (bf16 ``x``) one launch of
    the grouped weight-only kernel, no host sync; at prefill sizes (outside CUDA-graph capture:
    ``weight_only_interface.grouped_prefill``) one sync for the row ranges and each busy expert's
    weight decoded to bf16 for a cuBLAS GEMM. Elsewhere the reference (which reads
    ``group_ends`` back to the host)."""
    if not isinstance(packed, PackedNVFP4Experts):
        raise TypeError(f"packed: expected a PackedNVFP4Experts (pack_nvfp4_experts), got {type(packed).__name__}")
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[1] != packed.k or not x.is_floating_point():
        raise ValueError(f"x: expected a float tensor [R, K={packed.k}], got {getattr(x, 'dtype', type(x))} "
                         f"{tuple(getattr(x, 'shape', ()))}")
    if not isinstance(group_ends, torch.Tensor) or group_ends.dtype != torch.int32 \
            or group_ends.shape != (packed.experts,):
        raise ValueError(f"group_ends: expected int32 [E={packed.experts}], got "
                         f"{getattr(group_ends, 'dtype', type(group_ends))} {tuple(getattr(group_ends, 'shape', ()))}")
    return registry.run("grouped_weight_only_nvfp4", x.device, (x, packed, group_ends, zero_tail),
                        lambda: grouped_weight_only_reference(x, packed, group_ends))
