"""QuantizedTensor: quantized data, its scales, the recipe and the logical shape."""

from __future__ import annotations

import torch

from .recipes import ScaleRecipe

__all__ = ["QuantizedTensor"]


class QuantizedTensor:
    """A tensor quantized with a :class:`~lowprec.recipes.ScaleRecipe`.

    Attributes:
        data: the elements. FP8 recipes: ``torch.float8_e4m3fn`` with the logical shape. FP4
            recipes: ``uint8`` holding two E2M1 codes per byte along the last dim (element 2i in
            the low nibble), last dim ``ceil(cols / 2)``.
        scale: dequantization multipliers, row-major: ``[..., rows, ceil(cols / block)]`` for
            row-block recipes, ``[..., ceil(rows / br), ceil(cols / bc)]`` for 2D blocks (leading
            dims are a batch, e.g. experts), all-ones shape for tensorwise. dtype float32, or
            ``torch.float8_e8m0fnu`` (MX) / ``torch.float8_e4m3fn`` (NVFP4).
        global_scale: FP32 0-dim tensor for recipes with a per-tensor scale (NVFP4), else None.
        recipe: the ScaleRecipe used.
        shape: the logical shape of the original tensor.
        dtype: the dtype of the original tensor (what :meth:`dequantize` returns by default).

    ``x ≈ dequantize(quantize(x))``, with ``x ≈ q * scale (* global_scale)`` per block.
    """

    __slots__ = ("data", "scale", "global_scale", "recipe", "shape", "dtype")

    def __init__(
        self,
        data: torch.Tensor,
        scale: torch.Tensor,
        recipe: ScaleRecipe,
        shape: torch.Size | tuple[int, ...],
        dtype: torch.dtype,
        global_scale: torch.Tensor | None = None,
    ) -> None:
        if not isinstance(recipe, ScaleRecipe):
            raise TypeError(f"recipe: expected a ScaleRecipe, got {type(recipe).__name__}")
        if recipe.global_scale != (global_scale is not None):
            raise ValueError(
                f"global_scale: recipe {recipe.name!r} {'needs' if recipe.global_scale else 'takes no'} global scale"
            )
        if data.device != scale.device:
            raise ValueError(f"scale: on {scale.device}, but data is on {data.device}")
        self.data = data
        self.scale = scale
        self.global_scale = global_scale
        self.recipe = recipe
        self.shape = torch.Size(shape)
        self.dtype = dtype

    @property
    def device(self) -> torch.device:
        return self.data.device

    def dim(self) -> int:
        return len(self.shape)

    def numel(self) -> int:
        return self.shape.numel()

    @property
    def bits_per_element(self) -> float:
        """Storage bits per logical element, scales (and global scale) included."""
        nbytes = self.data.nbytes + self.scale.nbytes
        if self.global_scale is not None:
            nbytes += self.global_scale.nbytes
        return 8.0 * nbytes / max(self.numel(), 1)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Return ``q * scale`` with the logical shape, in ``dtype`` (default: the original)."""
        from .quant import dequantize

        return dequantize(self, dtype=dtype)

    def to(self, device: torch.device | str) -> QuantizedTensor:
        """A copy on ``device`` (data, scales and global scale move together)."""
        g = None if self.global_scale is None else self.global_scale.to(device)
        return QuantizedTensor(self.data.to(device), self.scale.to(device), self.recipe, self.shape, self.dtype, g)

    def __repr__(self) -> str:
        return (
            f"QuantizedTensor(recipe={self.recipe.name}, shape={tuple(self.shape)}, dtype={self.dtype}, "
            f"data={self.data.dtype}{tuple(self.data.shape)}, scale={self.scale.dtype}{tuple(self.scale.shape)}, "
            f"device={self.device})"
        )
