"""torch.library custom ops for the GEMMs, on plain tensors, with fake implementations.

``torch.compile`` traces through them without a graph break and CUDA graphs capture them. The
friendly API (:func:`lowprec.gemm`) unpacks QuantizedTensors into ``(data, scale, global_scale,
recipe spec)`` (plus the logical K) for the op, and the op rebuilds them to choose kernel or
reference.
"""

from __future__ import annotations

import torch

from ..recipes import ScaleRecipe
from ..runtime import kernel_failed, use_kernel
from ..tensor import QuantizedTensor
from .reference import gemm_reference

__all__ = ["gemm_op", "gemm_dispatch"]


_FP8_FP32_SCALED = ("fp8_block1x128", "fp8_block128x128", "fp8_rowwise", "fp8_tensorwise")


def _sm90_unsupported(a: QuantizedTensor, b: QuantizedTensor, bias: torch.Tensor | None) -> str | None:
    """Why the Hopper kernel cannot take these operands (None: it can)."""
    for name, t in (("a", a), ("b", b)):
        if t.recipe.name not in _FP8_FP32_SCALED:
            return f"{name}'s recipe is {t.recipe.name}; the kernel takes FP8 with FP32 scales {_FP8_FP32_SCALED}"
    if a.recipe.name == "fp8_block128x128":
        return "a in 128x128 blocks (activations use 1x128, rowwise or tensorwise)"
    n, k = b.shape
    if a.shape[0] == 0:
        return "M=0: nothing to compute"
    if n % 16 or k % 16:
        return f"N={n} and K={k} must be multiples of 16"
    if bias is not None and bias.dtype not in (torch.float32, torch.bfloat16):
        return f"bias dtype {bias.dtype}"
    return None


def _blockwise_scales(a: QuantizedTensor, b: QuantizedTensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Scales as the kernel takes them: A [M, ceil(K/128)]; B [ceil(N/128) or N, ceil(K/128)].

    Rowwise and tensorwise scales are constant along K, so repeating them per 128-wide K block
    gives the same product: one kernel serves all FP8 recipes with FP32 scales.
    """
    m, k = a.shape
    n = b.shape[0]
    kb = -(-k // 128)
    sa = a.scale if a.recipe.name == "fp8_block1x128" else a.scale.reshape(-1, 1).expand(m, kb).contiguous()
    if b.recipe.name in ("fp8_block128x128", "fp8_block1x128"):
        sb = b.scale
    elif b.recipe.name == "fp8_rowwise":
        sb = b.scale.reshape(n, 1).expand(n, kb).contiguous()
    else:
        sb = b.scale.reshape(1, 1).expand(-(-n // 128), kb).contiguous()
    return sa, sb


def _k_major(data: torch.Tensor) -> torch.Tensor:
    """FP8 codes as the kernel reads them, K contiguous. Under torch.compile the op gets the
    layouts inductor chose for the traced reference quantization (e.g. strides (1, M))."""
    return data if data.stride(-1) == 1 else data.contiguous()


def gemm_dispatch(a: QuantizedTensor, b: QuantizedTensor, out_dtype: torch.dtype,
                  bias: torch.Tensor | None) -> torch.Tensor:
    """Run the kernel where the device and operands allow, else the reference (validated inputs)."""
    if use_kernel("gemm", a.device, ("sm_90a",), lambda: _sm90_unsupported(a, b, bias)):
        try:
            from .sm90.interface import gemm_blockwise_fp8

            sa, sb = _blockwise_scales(a, b)
            return gemm_blockwise_fp8(_k_major(a.data), sa, _k_major(b.data), sb, out_dtype=out_dtype, bias=bias)
        except Exception as err:
            kernel_failed("gemm", err)
    return gemm_reference(a, b, out_dtype, bias)


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
