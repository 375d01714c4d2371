"""Scale recipes: the single source of truth for how a tensor is quantized.

A recipe fixes the block shape, the element format, the scale format and how the scale is
rounded. Scales are always *dequantization multipliers*: ``x ≈ q * scale``.

Named recipes (``get_recipe(name, **options)``):

==================  ===========  ======  ======  ==========================================
name                block        elem    scale   options
==================  ===========  ======  ======  ==========================================
fp8_tensorwise      whole        e4m3    fp32    pow2_scale
fp8_rowwise         1 x K        e4m3    fp32    pow2_scale
fp8_block1x128      1 x 128      e4m3    fp32    pow2_scale   (activations, DeepSeek-V3)
fp8_block16x128     16 x 128     e4m3    fp32    pow2_scale   (weight gradients' activations)
fp8_block128x128    128 x 128    e4m3    fp32    pow2_scale   (weights)
mxfp8               1 x 32       e4m3    e8m0    rounding="rceil" (default) | "floor"
mxfp4               1 x 32       e2m1    e8m0    rounding="rceil" (default) | "floor"
nvfp4               1 x 16       e2m1    e4m3    weight_2d (16 x 16 blocks); + fp32 global
==================  ===========  ======  ======  ==========================================
"""

from __future__ import annotations

import inspect
import json
from dataclasses import asdict, dataclass

from .formats import ElementFormat, get_format

__all__ = ["ScaleRecipe", "get_recipe", "RECIPE_NAMES", "WHOLE", "LinearRecipe", "LINEAR_RECIPES", "get_linear_recipe",
           "DEFAULT_TRAIN_RECIPE"]

WHOLE = -1  # a block dimension spanning the whole extent (tensorwise, rowwise)

_ELEM_FORMATS = ("e4m3", "e5m2", "e2m1")
_SCALE_FORMATS = ("fp32", "e8m0", "e4m3")
_ROUNDINGS = ("exact", "pow2", "rceil", "floor")
# each named recipe's variants (filled below): kernels are chosen by a recipe's name, so a name is
# reserved for the recipe it names
_NAMED_VARIANTS: dict[str, tuple[ScaleRecipe, ...]] = {}


@dataclass(frozen=True)
class ScaleRecipe:
    """How to quantize a tensor.

    Attributes:
        name: the recipe's family name (``"fp8_block1x128"``, ``"mxfp8"``, ...).
        block: ``(rows, cols)`` of one scaling block over the last two dims; ``WHOLE`` (-1) spans
            the full extent. ``(WHOLE, WHOLE)`` is tensorwise: one scale for the whole tensor.
        elem_format: ``"e4m3"`` or ``"e2m1"`` (packed two per byte).
        scale_format: ``"fp32"``, ``"e8m0"`` or ``"e4m3"``.
        scale_rounding: ``"exact"`` (amax / max), ``"pow2"`` (exact rounded up to a power of two),
            ``"rceil"`` (E8M0: 2^ceil(log2(amax / max))), ``"floor"`` (E8M0, OCP:
            2^(floor(log2 amax) - emax)).
        global_scale: an extra FP32 per-tensor scale (NVFP4).
    """

    name: str
    block: tuple[int, int]
    elem_format: str = "e4m3"
    scale_format: str = "fp32"
    scale_rounding: str = "exact"
    global_scale: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.name, str):
            raise ValueError(f"name: expected a str, got {self.name!r}")
        if self.elem_format not in _ELEM_FORMATS:
            raise ValueError(f"elem_format: expected one of {_ELEM_FORMATS}, got {self.elem_format!r}")
        if self.scale_format not in _SCALE_FORMATS:
            raise ValueError(f"scale_format: expected one of {_SCALE_FORMATS}, got {self.scale_format!r}")
        if self.scale_rounding not in _ROUNDINGS:
            raise ValueError(f"scale_rounding: expected one of {_ROUNDINGS}, got {self.scale_rounding!r}")
        if not isinstance(self.global_scale, bool):
            raise ValueError(f"global_scale: expected a bool, got {self.global_scale!r}")
        if self.scale_format == "e8m0" and self.scale_rounding not in ("rceil", "floor"):
            raise ValueError("scale_rounding: E8M0 scales need 'rceil' or 'floor'")
        if self.scale_format != "e8m0" and self.scale_rounding in ("rceil", "floor"):
            raise ValueError(f"scale_rounding: {self.scale_rounding!r} applies to E8M0 scales only")
        # E4M3 block scales exist to be refined by a per-tensor FP32 scale (NVFP4); over FP32 or
        # E8M0 block scales a global scale would be applied twice
        if self.global_scale != (self.scale_format == "e4m3"):
            raise ValueError(f"global_scale: goes with E4M3 block scales only (E4M3 block scales need "
                             f"global_scale=True), got scale_format={self.scale_format!r}, "
                             f"global_scale={self.global_scale}")
        if self.scale_format == "e4m3" and self.scale_rounding != "exact":
            raise ValueError(f"scale_rounding: E4M3 block scales round to nearest ('exact'), "
                             f"got {self.scale_rounding!r}")
        if not isinstance(self.block, tuple) or len(self.block) != 2:
            raise ValueError(f"block: expected a tuple of two sizes (rows, cols), got {self.block!r}")
        if any(isinstance(b, bool) or not isinstance(b, int) for b in self.block):
            raise ValueError(f"block: sizes must be integers, got {self.block}")
        rows, cols = self.block
        if rows == WHOLE and cols != WHOLE:
            raise ValueError(f"block: a whole-extent row block needs whole columns too, got {self.block}")
        if any(b != WHOLE and b < 1 for b in self.block):
            raise ValueError(f"block: sizes must be positive or WHOLE (-1), got {self.block}")
        if self.name in _NAMED_VARIANTS and self not in _NAMED_VARIANTS[self.name]:
            raise ValueError(f"name: {self.name!r} is a named recipe (get_recipe({self.name!r}, ...)); "
                             f"give a custom recipe a name of its own")
        # made once: traced by torch.compile, a recompile may turn the block sizes into SymInts,
        # which an f-string cannot format (a string attribute is a constant to dynamo)
        object.__setattr__(self, "_spec", f"{self.name}:{self.block[0]}x{self.block[1]}:{self.elem_format}:"
                                          f"{self.scale_format}:{self.scale_rounding}:{int(self.global_scale)}")

    @property
    def element(self) -> ElementFormat:
        return get_format(self.elem_format)

    @property
    def is_fp4(self) -> bool:
        return self.elem_format == "e2m1"

    @property
    def tensorwise(self) -> bool:
        return self.block == (WHOLE, WHOLE)

    @property
    def is_2d(self) -> bool:
        """Blocks span several rows (and so need a matrix: 128x128, 16x16)."""
        return self.block[0] not in (1, WHOLE)

    @property
    def transposable(self) -> bool:
        """Quantizing xᵀ gives xq's codes transposed (and its scale grid transposed): square 2D
        blocks or a tensorwise scale, FP8 elements."""
        return not self.is_fp4 and (self.tensorwise or (self.is_2d and self.block[0] == self.block[1]))

    def spec(self) -> str:
        """A compact string form (for custom-op arguments; traceable by torch.compile)."""
        return self._spec

    @classmethod
    def from_spec(cls, spec: str) -> ScaleRecipe:
        """Inverse of :meth:`spec`."""
        try:
            # from the right: the name is free-form and may hold ':' itself
            name, block, elem, scale_format, rounding, global_scale = spec.rsplit(":", 5)
            rows, cols = (int(b) for b in block.split("x"))
            return cls(name, (rows, cols), elem, scale_format, rounding, bool(int(global_scale)))
        except ValueError as err:
            raise ValueError(f"spec: cannot read a ScaleRecipe from {spec!r}: {err}") from None

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> ScaleRecipe:
        try:
            fields = json.loads(text)
            fields["block"] = tuple(fields["block"])
            return cls(**fields)
        except (ValueError, TypeError, KeyError) as err:
            raise ValueError(f"recipe: cannot read a ScaleRecipe from {text!r}: {err}") from None


def _flag(option: str, value) -> bool:
    """A boolean option, as a bool (``"no"`` would be truthy)."""
    if not isinstance(value, bool):
        raise TypeError(f"{option}: expected a bool, got {value!r}")
    return value


def _fp32(name: str, block: tuple[int, int], pow2_scale: bool) -> ScaleRecipe:
    return ScaleRecipe(name, block, "e4m3", "fp32", "pow2" if _flag("pow2_scale", pow2_scale) else "exact")


def _mx(name: str, elem: str, rounding: str) -> ScaleRecipe:
    if rounding not in ("rceil", "floor"):
        raise ValueError(f"rounding: expected 'rceil' or 'floor', got {rounding!r}")
    return ScaleRecipe(name, (1, 32), elem, "e8m0", rounding)


_FACTORIES = {
    "fp8_tensorwise": lambda pow2_scale=False: _fp32("fp8_tensorwise", (WHOLE, WHOLE), pow2_scale),
    "fp8_rowwise": lambda pow2_scale=False: _fp32("fp8_rowwise", (1, WHOLE), pow2_scale),
    "fp8_block1x128": lambda pow2_scale=False: _fp32("fp8_block1x128", (1, 128), pow2_scale),
    "fp8_block16x128": lambda pow2_scale=False: _fp32("fp8_block16x128", (16, 128), pow2_scale),
    "fp8_block128x128": lambda pow2_scale=False: _fp32("fp8_block128x128", (128, 128), pow2_scale),
    "mxfp8": lambda rounding="rceil": _mx("mxfp8", "e4m3", rounding),
    "mxfp4": lambda rounding="rceil": _mx("mxfp4", "e2m1", rounding),
    "nvfp4": lambda weight_2d=False: ScaleRecipe(
        "nvfp4", (16, 16) if _flag("weight_2d", weight_2d) else (1, 16), "e2m1", "e4m3", "exact", global_scale=True
    ),
}

RECIPE_NAMES = tuple(_FACTORIES)
_OTHER_OPTION = {"mxfp8": {"rounding": "floor"}, "mxfp4": {"rounding": "floor"}, "nvfp4": {"weight_2d": True}}
_NAMED_VARIANTS.update({name: (factory(), factory(**_OTHER_OPTION.get(name, {"pow2_scale": True})))
                        for name, factory in _FACTORIES.items()})
# built at import: recipes are immutable and hot paths ask for them per op; building one lazily
# would write to this dict while torch.compile traces, a side effect it cannot keep in a graph
_DEFAULT_RECIPES: dict[str, ScaleRecipe] = {name: factory() for name, factory in _FACTORIES.items()}


def get_recipe(recipe: str | ScaleRecipe, **options) -> ScaleRecipe:
    """Return the named recipe (with ``options``), or ``recipe`` itself if already a ScaleRecipe."""
    if isinstance(recipe, ScaleRecipe):
        if options:
            raise TypeError(f"recipe: options {options} apply to named recipes only, not a ScaleRecipe")
        return recipe
    if not isinstance(recipe, str) or recipe not in _FACTORIES:  # a list would fail the lookup unhashable
        raise ValueError(f"recipe: unknown recipe {recipe!r}; expected one of {list(RECIPE_NAMES)}")
    if not options:
        return _DEFAULT_RECIPES[recipe]
    factory = _FACTORIES[recipe]
    try:
        return factory(**options)
    except TypeError:
        valid = list(inspect.signature(factory).parameters)
        unknown = [name for name in options if name not in valid]
        if not unknown:  # the factory's own error about an option's value
            raise
        raise TypeError(f"recipe {recipe!r}: unknown options {unknown}; its options: {valid}") from None


@dataclass(frozen=True)
class LinearRecipe:
    """Which scale recipe each operand of a linear layer uses: the activation (forward input),
    the weight, and the output gradient; ``activation_t``: the activation's copy along tokens that
    the weight gradient reads (None: ``activation``). Shared by ``lowprec.nn`` and the MoE's
    expert GEMMs."""

    name: str
    activation: str
    weight: str
    grad: str
    activation_t: str | None = None

    @property
    def wgrad_activation(self) -> str:
        """The recipe of the activation's transposed copy (the weight gradient's B operand)."""
        return self.activation if self.activation_t is None else self.activation_t


LINEAR_RECIPES = {
    "fp8_block": LinearRecipe("fp8_block", "fp8_block1x128", "fp8_block128x128", "fp8_block1x128"),
    # fp8_block with the weight gradient's activation in 128x128 blocks (along tokens x features)
    # instead of 1x128 along tokens: that GEMM then runs as the faster block kind (lowprec.gemm
    # NOTES, session 36); the gradients keep 1x128, finer than per-tensor FP8 training everywhere
    "fp8_block_wgrad2d": LinearRecipe("fp8_block_wgrad2d", "fp8_block1x128", "fp8_block128x128", "fp8_block1x128",
                                      activation_t="fp8_block128x128"),
    # fp8_block with the weight gradient's activation in blocks of 16 features x 128 tokens: one
    # scale product per 16 columns in the GEMM's promotion instead of one per column, ~1.25x the
    # 1x128 kind's speed there (lowprec.gemm NOTES, session 45), scales still per 16 channels
    "fp8_block_wgrad16": LinearRecipe("fp8_block_wgrad16", "fp8_block1x128", "fp8_block128x128", "fp8_block1x128",
                                      activation_t="fp8_block16x128"),
    "fp8_rowwise": LinearRecipe("fp8_rowwise", "fp8_rowwise", "fp8_rowwise", "fp8_rowwise"),
    "fp8_tensorwise": LinearRecipe("fp8_tensorwise", "fp8_tensorwise", "fp8_tensorwise", "fp8_tensorwise"),
}


# what FP8 training layers use unless told otherwise: fp8_block's numerics but for the weight
# gradient's activation, grouped per 16 features; the Llama-3-8B-shaped step 3-5% faster than
# fp8_block's, the same loss over 8 seeds (lowprec.quant NOTES, session 45)
DEFAULT_TRAIN_RECIPE = "fp8_block_wgrad16"


def get_linear_recipe(recipe: str | LinearRecipe) -> LinearRecipe:
    if isinstance(recipe, LinearRecipe):
        return recipe
    if not isinstance(recipe, str) or recipe not in LINEAR_RECIPES:
        raise ValueError(f"recipe: unknown linear recipe {recipe!r}; expected one of {list(LINEAR_RECIPES)}")
    return LINEAR_RECIPES[recipe]
