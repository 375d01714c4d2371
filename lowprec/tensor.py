"""QuantizedTensor: quantized data, its scales, the recipe and the logical shape."""

from __future__ import annotations

import json

import torch

from .blocks import dequantize_blocks
from .recipes import WHOLE, ScaleRecipe

__all__ = ["QuantizedTensor", "scale_grid", "flatten_all", "unflatten_all"]

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_SCALE_DTYPES = {"fp32": torch.float32, "e8m0": torch.float8_e8m0fnu, "e4m3": torch.float8_e4m3fn}


def scale_grid(recipe: ScaleRecipe, shape: torch.Size | tuple[int, ...]) -> tuple[int, ...]:
    """The shape of ``recipe``'s row-major scale grid for a tensor of ``shape`` (see
    :class:`QuantizedTensor`); a 1-dim tensor is one row and has a 1-dim grid."""
    *lead, cols = shape
    br, bc = recipe.block
    if br == WHOLE:  # tensorwise: one scale, also for an empty tensor
        return (1,) * len(shape)
    per_row = min(cols, 1) if bc == WHOLE else -(-cols // bc)  # a row of no columns has no scale
    if not lead:
        return (per_row,)
    *batch, rows = lead
    return (*batch, rows if br == 1 else -(-rows // br), per_row)


def _check_part(name: str, t: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...], what: str,
                kind: str = "shape") -> None:
    if t.dtype != dtype:
        raise TypeError(f"{name}: expected {dtype} for {what}, got {t.dtype}")
    if tuple(t.shape) != shape:
        raise ValueError(f"{name}: expected a {shape} {kind}, got {tuple(t.shape)}" if kind != "shape"
                         else f"{name}: expected shape {shape}, got {tuple(t.shape)}")


_TO_ARGS = ("device", "dtype", "non_blocking", "copy")  # torch.Tensor.to's positional arguments


class QuantizedTensor:
    """A tensor quantized with a :class:`~lowprec.recipes.ScaleRecipe`.

    Attributes:
        data: the elements. FP8 recipes: ``torch.float8_e4m3fn`` (``float8_e5m2`` for E5M2
            elements) with the logical shape. FP4
            recipes: ``uint8`` holding two E2M1 codes per byte along the last dim (element 2i in
            the low nibble), last dim ``ceil(cols / 2)``.
        scale: dequantization multipliers, indexed as the blocks: ``[..., rows, ceil(cols / block)]``
            for row-block recipes, ``[..., ceil(rows / br), ceil(cols / bc)]`` for 2D blocks
            (leading dims are a batch, e.g. experts), all-ones shape for tensorwise. dtype float32,
            or ``torch.float8_e8m0fnu`` (MX) / ``torch.float8_e4m3fn`` (NVFP4). The strides are
            the producer's: the Hopper 1x128 kernel stores them MN-major (``stride(-2) == 1``,
            TMA-aligned, as its GEMM reads them; :mod:`lowprec.quant.layouts` converts).
        global_scale: FP32 0-dim tensor for recipes with a per-tensor scale (NVFP4), else None.
        recipe: the ScaleRecipe used.
        shape: the logical shape of the original tensor.
        dtype: the dtype of the original tensor (what :meth:`dequantize` returns by default).

    ``x ≈ dequantize(quantize(x))``, with ``x ≈ q * scale (* global_scale)`` per block.

    Pickles as its tensors and :meth:`metadata`: ``torch.save`` / ``torch.load`` (also with the
    default ``weights_only=True``, once ``lowprec`` is imported) give it back, validated as
    :meth:`from_parts` validates; :func:`lowprec.save` / :func:`lowprec.load` write safetensors.
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
        if dtype not in _FLOAT_DTYPES:
            raise TypeError(f"dtype: expected one of {[str(d) for d in _FLOAT_DTYPES]} (the original tensor's "
                            f"dtype), got {dtype!r}")
        given = shape  # named in the error as passed (not as the None a failed conversion leaves)
        try:
            shape = torch.Size(shape)
        except (TypeError, ValueError):
            shape = None
        if not shape or any(n < 0 for n in shape):
            raise ValueError(f"shape: expected the logical shape, ≥ 1 dim of sizes ≥ 0, got {given!r}")
        for name, t in (("data", data), ("scale", scale), ("global_scale", global_scale)):
            if t is not None and not isinstance(t, torch.Tensor):
                raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        cols = shape[-1]
        expected = ((torch.uint8, (*shape[:-1], -(-cols // 2))) if recipe.is_fp4
                    else (recipe.element.torch_dtype, tuple(shape)))
        _check_part("data", data, *expected, f"{recipe.elem_format} elements")
        _check_part("scale", scale, _SCALE_DTYPES[recipe.scale_format], scale_grid(recipe, shape),
                    f"{recipe.scale_format} scales", "scale grid")
        if recipe.global_scale != (global_scale is not None):
            raise ValueError(
                f"global_scale: recipe {recipe.name!r} {'needs' if recipe.global_scale else 'takes no'} global scale"
            )
        if global_scale is not None and (global_scale.dtype != torch.float32 or global_scale.dim() != 0):
            raise ValueError(f"global_scale: expected a 0-dim float32 tensor, got {global_scale.dtype} "
                             f"{tuple(global_scale.shape)}")
        for name, t in (("scale", scale), ("global_scale", global_scale)):
            if t is not None and t.device != data.device:
                raise ValueError(f"{name}: on {t.device}, but data is on {data.device}")
        self.data = data
        self.scale = scale
        self.global_scale = global_scale
        self.recipe = recipe
        self.shape = shape
        self.dtype = dtype

    @classmethod
    def _unchecked(cls, data: torch.Tensor, scale: torch.Tensor, recipe: ScaleRecipe, shape: torch.Size,
                   dtype: torch.dtype, global_scale: torch.Tensor | None = None) -> QuantizedTensor:
        """A QuantizedTensor of parts known to be valid (a quantize kernel's own outputs, built to
        the recipe's shapes; a flattened QuantizedTensor): no validation, which costs several µs
        of host time per eager call."""
        self = cls.__new__(cls)
        self.data, self.scale, self.global_scale = data, scale, global_scale
        self.recipe, self.shape, self.dtype = recipe, torch.Size(shape), dtype
        return self

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
        if self.dim() < 2:
            raise ValueError(f"transpose: needs ≥ 2 dims, got shape {tuple(self.shape)}")
        if not self.transposable:
            # FP4 codes with square blocks (nvfp4 weight_2d) are refused too: say why, not only "not square"
            raise ValueError(f"transpose: recipe {self.recipe.name!r} is not transposable (needs square blocks or a "
                             f"tensorwise scale, FP8 elements; it has {self.recipe.block[0]}x{self.recipe.block[1]} "
                             f"blocks of {self.recipe.elem_format}); requantize instead")
        shape = (*self.shape[:-2], self.shape[-1], self.shape[-2])
        return QuantizedTensor(self.data.transpose(-1, -2).contiguous(), self.scale.transpose(-1, -2).contiguous(),
                               self.recipe, shape, self.dtype, self.global_scale)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Return ``q * scale`` with the logical shape, in ``dtype`` (default: the original).

        Pass ``dtype=torch.float64`` for an exact dequantization (error references)."""
        return dequantize_blocks(self, dtype)

    def to(self, *args, **kwargs) -> QuantizedTensor:
        """On another device, called as ``torch.Tensor.to`` for a device move: ``to(device,
        dtype=None, non_blocking=False, copy=False, *, memory_format=None)`` or ``to(dtype, ...)``.
        Data, scales and global scale move together; as ``torch.Tensor.to``, the tensors are shared
        when they are there already, unless ``copy``. Devices only: the codes and scales keep their
        formats, so a ``dtype`` raises TypeError (``dequantize(dtype)`` gives a float tensor), as do
        ``to(tensor)`` (it would take the tensor's dtype) and a ``memory_format`` other than
        ``torch.preserve_format``."""
        if args and isinstance(args[0], torch.Tensor):
            raise TypeError("tensor: QuantizedTensor.to(tensor) would take the tensor's dtype too, and a "
                            "QuantizedTensor changes dtype only via dequantize(dtype); pass tensor.device")
        names = _TO_ARGS[1:] if args and isinstance(args[0], torch.dtype) else _TO_ARGS
        if len(args) > len(names):
            raise TypeError(f"to: takes at most {len(names)} positional arguments ({', '.join(names)}), "
                            f"got {len(args)}")
        opts = dict(zip(names, args))
        for name, value in kwargs.items():
            if name not in (*_TO_ARGS, "memory_format"):
                raise TypeError(f"to: unexpected keyword argument {name!r}")
            if name in opts:
                raise TypeError(f"to: got {name} both positionally and as a keyword")
            opts[name] = value
        dtype = opts.get("dtype")
        if dtype is not None:
            hint = f"; use dequantize({dtype}) for a {dtype} tensor" if dtype in _FLOAT_DTYPES else ""
            raise TypeError(f"dtype: QuantizedTensor.to moves between devices only, got {dtype!r}{hint}")
        memory_format = opts.get("memory_format")
        if memory_format not in (None, torch.preserve_format):
            raise TypeError(f"memory_format: a QuantizedTensor keeps its codes' layout, got {memory_format}")
        for name in ("non_blocking", "copy"):
            if not isinstance(opts.get(name, False), bool):
                raise TypeError(f"{name}: expected a bool, got {opts[name]!r}")
        device = opts.get("device")
        if device is None:
            device = self.device
        elif not isinstance(device, (torch.device, str, int)) or isinstance(device, bool):
            raise TypeError(f"device: expected a torch.device, str or int, got {device!r}")
        move = {"non_blocking": opts.get("non_blocking", False), "copy": opts.get("copy", False)}
        g = None if self.global_scale is None else self.global_scale.to(device, **move)
        return QuantizedTensor(self.data.to(device, **move), self.scale.to(device, **move), self.recipe,
                               self.shape, self.dtype, g)

    def flatten(self) -> tuple[tuple[torch.Tensor, ...], tuple]:
        """The tensors ``(data, scale[, global_scale])`` and the plain metadata ``(recipe, shape,
        dtype)`` that :meth:`unflatten` rebuilds this from (for ``save_for_backward`` and the
        like: the one way to take a QuantizedTensor apart)."""
        tensors = (self.data, self.scale) if self.global_scale is None else (self.data, self.scale, self.global_scale)
        return tensors, (self.recipe, tuple(self.shape), self.dtype)

    @classmethod
    def unflatten(cls, tensors, meta: tuple) -> QuantizedTensor:
        """Inverse of :meth:`flatten`."""
        recipe, shape, dtype = meta
        return cls._unchecked(tensors[0], tensors[1], recipe, shape, dtype, tensors[2] if len(tensors) > 2 else None)

    def metadata(self) -> dict:
        """Everything but the tensors, JSON-serializable: recipe, logical shape, original dtype."""
        # int(): torch.Size keeps numpy integers (a shape from numpy), which JSON and torch.load's
        # weights_only unpickler refuse
        return {"recipe": json.loads(self.recipe.to_json()), "shape": [int(n) for n in self.shape],
                "dtype": str(self.dtype).removeprefix("torch.")}

    @classmethod
    def from_parts(cls, data: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor | None,
                   metadata: dict, where: str = "metadata") -> QuantizedTensor:
        """Inverse of (``data``, ``scale``, ``global_scale``, :meth:`metadata`). Raises ValueError,
        prefixed by ``where``, for anything that does not make a valid QuantizedTensor."""
        if not isinstance(metadata, dict):
            raise ValueError(f"{where}: expected a JSON object (recipe, shape, dtype), got {metadata!r}")
        if "recipe" not in metadata:
            raise ValueError(f"{where}: no recipe")
        try:
            recipe = ScaleRecipe.from_json(json.dumps(metadata["recipe"]))
        except ValueError as err:
            raise ValueError(f"{where}: unknown recipe: {err}") from None
        shape = metadata.get("shape")
        if not isinstance(shape, list) or not all(isinstance(n, int) and not isinstance(n, bool) for n in shape):
            raise ValueError(f"{where}: 'shape' must be a list of sizes, got {shape!r}")
        dtype = getattr(torch, str(metadata.get("dtype")), None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"{where}: unknown dtype {metadata.get('dtype')!r}")
        try:
            return cls(data, scale, recipe, shape, dtype, global_scale)
        except (TypeError, ValueError) as err:
            raise ValueError(f"{where}: {err}") from None

    def __reduce__(self):
        # plain tensors and JSON values rebuilt by one allow-listed function: torch.load's default
        # weights_only=True unpickler takes it, and validates the parts as lowprec.load does
        return _rebuild_quantized_tensor, (self.data, self.scale, self.global_scale, self.metadata())

    def __repr__(self) -> str:
        return (
            f"QuantizedTensor(recipe={self.recipe.name}, shape={tuple(self.shape)}, dtype={self.dtype}, "
            f"data={self.data.dtype}{tuple(self.data.shape)}, scale={self.scale.dtype}{tuple(self.scale.shape)}, "
            f"device={self.device})"
        )


def _rebuild_quantized_tensor(data: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor | None,
                               metadata: dict) -> QuantizedTensor:
    """How ``torch.load`` (and ``copy.deepcopy``) rebuild a pickled :class:`QuantizedTensor`."""
    return QuantizedTensor.from_parts(data, scale, global_scale, metadata, "QuantizedTensor (unpickled)")


# the only lowprec global a pickled QuantizedTensor names; its class is not allow-listed, so a
# pickle cannot set its fields without the validation above
torch.serialization.add_safe_globals([_rebuild_quantized_tensor])


def flatten_all(*items: torch.Tensor | QuantizedTensor | None) -> tuple[list[torch.Tensor], list]:
    """Plain tensors for ``save_for_backward`` from tensors, QuantizedTensors and Nones, and the
    specs :func:`unflatten_all` rebuilds the items from."""
    tensors, specs = [], []
    for item in items:
        if isinstance(item, QuantizedTensor):
            parts, meta = item.flatten()
            tensors += parts
            specs.append((len(parts), meta))
        elif item is None:
            specs.append((0, None))
        else:
            tensors.append(item)
            specs.append((1, None))
    return tensors, specs


def unflatten_all(tensors, specs: list) -> list[torch.Tensor | QuantizedTensor | None]:
    """Inverse of :func:`flatten_all`."""
    items, i = [], 0
    for count, meta in specs:
        if meta is not None:
            items.append(QuantizedTensor.unflatten(tensors[i:i + count], meta))
        else:
            items.append(tensors[i] if count else None)
        i += count
    return items
