"""QuantizedTensor: quantized data, its scales, the recipe and the logical shape."""

from __future__ import annotations

import json

import torch

from .recipes import ScaleRecipe

__all__ = ["QuantizedTensor"]


class QuantizedTensor:
    """A tensor quantized with a :class:`~lowprec.recipes.ScaleRecipe`.

    Attributes:
        data: the elements. FP8 recipes: ``torch.float8_e4m3fn`` (``float8_e5m2`` for E5M2
            elements) with the logical shape. FP4
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

    @property
    def transposable(self) -> bool:
        """Whether :meth:`transpose` applies: square 2D blocks or tensorwise, FP8 elements."""
        return self.dim() >= 2 and self.recipe.transposable

    def transpose(self) -> QuantizedTensor:
        """Swap the last two dims without requantizing: the same codes, the scale grid transposed.

        Exactly ``quantize(x.transpose(-1, -2))`` for square-block (128x128) and tensorwise
        recipes; other recipes raise ValueError (requantize the transposed tensor instead).
        """
        if not self.transposable:
            raise ValueError(f"transpose: recipe {self.recipe.name} blocks are not square; requantize instead")
        shape = (*self.shape[:-2], self.shape[-1], self.shape[-2])
        return QuantizedTensor(self.data.transpose(-1, -2).contiguous(), self.scale.transpose(-1, -2).contiguous(),
                               self.recipe, shape, self.dtype, self.global_scale)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Return ``q * scale`` with the logical shape, in ``dtype`` (default: the original)."""
        from .quant import dequantize

        return dequantize(self, dtype=dtype)

    def to(self, device: torch.device | str) -> QuantizedTensor:
        """A copy on ``device`` (data, scales and global scale move together)."""
        g = None if self.global_scale is None else self.global_scale.to(device)
        return QuantizedTensor(self.data.to(device), self.scale.to(device), self.recipe, self.shape, self.dtype, g)

    def metadata(self) -> dict:
        """Everything but the tensors, JSON-serializable: recipe, logical shape, original dtype."""
        return {"recipe": json.loads(self.recipe.to_json()), "shape": list(self.shape),
                "dtype": str(self.dtype).removeprefix("torch.")}

    @classmethod
    def from_parts(cls, data: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor | None,
                   metadata: dict, where: str = "metadata") -> QuantizedTensor:
        """Inverse of (``data``, ``scale``, ``global_scale``, :meth:`metadata`)."""
        if "recipe" not in metadata:
            raise ValueError(f"{where}: no recipe")
        try:
            recipe = ScaleRecipe.from_json(json.dumps(metadata["recipe"]))
        except ValueError as err:
            raise ValueError(f"{where}: unknown recipe: {err}") from None
        dtype = getattr(torch, str(metadata.get("dtype")), None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"{where}: unknown dtype {metadata.get('dtype')!r}")
        return cls(data, scale, recipe, metadata["shape"], dtype, global_scale)

    def __repr__(self) -> str:
        return (
            f"QuantizedTensor(recipe={self.recipe.name}, shape={tuple(self.shape)}, dtype={self.dtype}, "
            f"data={self.data.dtype}{tuple(self.data.shape)}, scale={self.scale.dtype}{tuple(self.scale.shape)}, "
            f"device={self.device})"
        )
