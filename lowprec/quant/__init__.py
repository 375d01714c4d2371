"""quantize / dequantize: the public entry points over the reference (and, later, kernels)."""

from __future__ import annotations

import torch

from ..recipes import ScaleRecipe, get_recipe
from ..tensor import QuantizedTensor
from .reference import dequantize_reference, quantize_reference

__all__ = ["quantize", "dequantize"]

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def quantize(x: torch.Tensor, recipe: str | ScaleRecipe, *, check_finite: bool = True, **options) -> QuantizedTensor:
    """Quantize ``x`` with ``recipe`` (a name from :data:`lowprec.RECIPE_NAMES` or a ScaleRecipe).

    Args:
        x: a float32 / bfloat16 / float16 / float64 tensor on any device. Row-block recipes take
            any shape (leading dims are rows); 2D-block recipes (128x128, NVFP4 ``weight_2d``)
            need at least 2 dims and treat leading dims as a batch (per-matrix blocks). Shapes not
            divisible by the block are padded internally; the logical shape is kept.
        recipe: e.g. ``"fp8_block1x128"``, ``"mxfp8"``, ``"nvfp4"``.
        check_finite: raise on NaN / Inf input (default). This reads a flag back from the device;
            pass False on hot paths where the input is known finite. Without the check, NaN and
            Inf give undefined codes in formats that cannot represent them.
        **options: recipe options, e.g. ``pow2_scale=True``, ``rounding="floor"``,
            ``weight_2d=True`` (see :mod:`lowprec.recipes`).

    Returns:
        A :class:`QuantizedTensor` with ``x ≈ q * scale``.
    """
    r = get_recipe(recipe, **options)
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x: expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"x: expected one of {[str(d) for d in _FLOAT_DTYPES]}, got {x.dtype}")
    if x.dim() == 0:
        raise ValueError("x: expected at least 1 dim, got a 0-dim tensor")
    if r.is_2d and x.dim() < 2:
        raise ValueError(f"x: recipe {r.name!r} uses {r.block[0]}x{r.block[1]} blocks and needs ≥ 2 dims, "
                         f"got shape {tuple(x.shape)}")
    if check_finite and x.numel() and not bool(torch.isfinite(x).all()):
        raise ValueError("x: contains NaN or Inf; quantization needs finite values "
                         "(check_finite=False skips this check)")
    return quantize_reference(x.detach(), r)


def dequantize(qt: QuantizedTensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``q * scale`` with the logical shape, as ``dtype`` (default: the original dtype).

    Pass ``dtype=torch.float64`` for an exact dequantization (error references).
    """
    if not isinstance(qt, QuantizedTensor):
        raise TypeError(f"qt: expected a QuantizedTensor, got {type(qt).__name__}")
    return dequantize_reference(qt, dtype)
