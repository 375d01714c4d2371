"""torch.library custom ops for the GEMMs, on plain tensors, with fake implementations.

``torch.compile`` traces through them without a graph break and CUDA graphs capture them. The
friendly API (:func:`lowprec.gemm`) unpacks QuantizedTensors into ``(data, scale, global_scale,
recipe spec)`` (plus the logical K) for the op, and the op rebuilds them to choose kernel or
reference.
"""

from __future__ import annotations

import torch

from ..recipes import ScaleRecipe
from ..runtime import registry
from ..tensor import QuantizedTensor
from .reference import gemm_reference

__all__ = ["gemm_op", "gemm_dispatch"]


def gemm_dispatch(a: QuantizedTensor, b: QuantizedTensor, out_dtype: torch.dtype,
                  bias: torch.Tensor | None) -> torch.Tensor:
    """Run a kernel where the device and operands allow, else the reference (validated inputs)."""
    return registry.run("gemm", a.device, (a, b, out_dtype, bias), lambda: gemm_reference(a, b, out_dtype, bias))


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
