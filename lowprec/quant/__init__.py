"""quantize / dequantize: the public entry points; Hopper kernels where they apply, else the reference."""

from __future__ import annotations

import functools

import torch

from ..recipes import ScaleRecipe, get_recipe
from ..runtime import registry
from ..tensor import QuantizedTensor
from . import ops
from .reference import dequantize_reference, quantize_reference

__all__ = ["quantize", "dequantize", "quantize_dual", "quantize_with_transpose", "swiglu_quantize_dual"]

registry.load_arch_packages(__name__, __path__)

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_DUAL_T_RECIPES = tuple(ops.DUAL_T_RECIPES.values())
_FP32_MAX = torch.finfo(torch.float32).max


def quantize(x: torch.Tensor, recipe: str | ScaleRecipe, *, check_finite: bool = True, **options) -> QuantizedTensor:
    """Quantize ``x`` with ``recipe`` (a name from :data:`lowprec.RECIPE_NAMES` or a ScaleRecipe).

    Args:
        x: a float32 / bfloat16 / float16 / float64 tensor on any device. Row-block recipes take
            any shape (leading dims are rows); 2D-block recipes (128x128, NVFP4 ``weight_2d``)
            need at least 2 dims and treat leading dims as a batch (per-matrix blocks). Shapes not
            divisible by the block are padded internally; the logical shape is kept.
        recipe: e.g. ``"fp8_block1x128"``, ``"mxfp8"``, ``"nvfp4"``.
        check_finite: raise on NaN / Inf input, and on float64 values beyond FP32's range (which
            the cast to FP32 would make Inf) (default). This reads a flag back from the device;
            pass False on hot paths where the input is known finite. Without the check a NaN
            dequantizes to NaN (E2M1, which has no NaN: to 0) and its block's scale comes from
            the other values; an Inf makes its whole block NaN (NVFP4: the whole tensor, through
            the global scale).
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
    if check_finite and x.numel() and x.device.type != "meta":  # a meta tensor has no values to check
        _check_finite(x)
    x = x.detach()
    if _traced_on_cuda(x) and _custom_op_recipe(x, r):
        return _wrap_kernel_output(x, r, *ops.quantize_fp8(x.reshape(-1, x.shape[-1]), r.name))
    return registry.run("quantize", x.device, (x, r), lambda: quantize_reference(x, r),
                    lambda kernel: _wrap_kernel_output(x, r, *kernel(x, r)))


def _check_finite(x: torch.Tensor) -> None:
    """NaN / Inf, or float64 values that the cast to FP32 (where quantization computes) makes Inf."""
    if x.dtype == torch.float64:
        ok = bool((x.abs() <= _FP32_MAX).all())  # False for NaN too
    else:
        ok = bool(torch.isfinite(x).all())
    if ok:
        return
    if x.dtype == torch.float64 and bool(torch.isfinite(x).all()):
        raise ValueError(f"x: float64 values beyond FP32's range (|x| ≤ {_FP32_MAX:.6g}): quantization computes "
                         f"in FP32, where they would be Inf")
    raise ValueError("x: contains NaN or Inf; quantization needs finite values (check_finite=False skips this check)")


def _traced_on_cuda(x: torch.Tensor) -> bool:
    """torch.compile is tracing a CUDA input: the kernels go in as custom ops (:mod:`.ops`)."""
    return torch.compiler.is_compiling() and x.is_cuda


def _custom_op_recipe(x: torch.Tensor, r: ScaleRecipe) -> bool:
    """Recipes and shapes the quantize custom ops (:mod:`.ops`) take."""
    if x.dtype == torch.float64 or r.name not in ops.RECIPES or r.scale_rounding != "exact":
        return False
    if not x.numel():  # nothing for a kernel; the ops view x as [-1, cols] (or [-1, rows, cols]), ambiguous when empty
        return False
    return not (r.is_2d and x.dim() > 2 and x.shape[-2] % r.block[0])


def _wrap_kernel_output(x: torch.Tensor, r: ScaleRecipe, q: torch.Tensor, s: torch.Tensor) -> QuantizedTensor:
    # 128x128: a batch of matrices (experts) is one tall matrix, as no block spans two of them
    s = (s.view(*x.shape[:-2], -(-x.shape[-2] // r.block[0]), s.shape[-1]) if r.is_2d
         else s.view(*x.shape[:-1], s.shape[-1]))
    return QuantizedTensor._unchecked(q.view(x.shape), s, r, x.shape, x.dtype)


def quantize_dual(x: torch.Tensor, recipe: str | ScaleRecipe = "fp8_block1x128",
                  recipe_t: str | ScaleRecipe | None = None) -> tuple[QuantizedTensor, QuantizedTensor]:
    """Quantize ``x`` [..., K] (viewed as [T, K]) along both dims in one pass, for training.

    Returns ``(quantize(x2, recipe), quantize(x_padᵀ, recipe_t))`` where ``x2`` is ``x`` viewed as
    ``[T, K]`` (leading dims flattened: the first result is 2-D whatever ``x``'s dims) and ``x_pad``
    is ``x2`` with zero rows appended up to ``T_pad = round_up(T, 16)``: the first feeds the forward GEMM (blocks
    along K), the second the weight-gradient GEMM (``[K, T_pad]``, zero padding columns, so GEMMs
    over tokens meet the kernels' multiple-of-16 rule). ``recipe_t`` defaults to ``recipe``;
    ``"fp8_block16x128"`` or ``"fp8_block128x128"`` with ``fp8_block1x128`` gives the weight
    gradient's activation blocks of 16 or 128 features x 128 tokens (the GEMM's faster kinds; one
    kernel pass on Hopper either way). Inputs are assumed finite.
    """
    r = get_recipe(recipe)
    r_t = r if recipe_t is None else _get_recipe_t(recipe_t)
    if not isinstance(x, torch.Tensor) or x.dim() < 2 or x.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"x: expected a float tensor with ≥ 2 dims, got "
                         f"{getattr(x, 'dtype', type(x).__name__)} {tuple(getattr(x, 'shape', ()))}")
    if r_t.elem_format != r.elem_format:
        raise ValueError(f"recipe_t: expected the element format of recipe {r.name!r} ({r.element}), "
                         f"got {r_t.name!r} ({r_t.element})")
    x2 = x.detach().flatten(0, -2)  # [T, K]; reshape(-1, K) cannot infer T when K is 0
    t = x2.shape[0]
    t_pad = -(-t // 16) * 16
    wrap = functools.partial(_dual_tensors, r, r_t, x2.shape, x.dtype)

    def reference():
        padded = torch.nn.functional.pad(x2, (0, 0, 0, t_pad - t))
        return quantize_reference(x2, r), quantize_reference(padded.t(), r_t)

    if (_traced_on_cuda(x) and r.name == "fp8_block1x128" and r_t.name in _DUAL_T_RECIPES
            and r_t.scale_rounding == "exact" and _custom_op_recipe(x2, r)):
        return wrap(*ops.quantize_dual_fp8(x2, r_t.block[0]))
    return registry.run("quantize_dual", x.device, (x2, r, r_t), reference, lambda kernel: wrap(*kernel(x2, r, r_t)))


def _get_recipe_t(recipe_t: str | ScaleRecipe) -> ScaleRecipe:
    """``get_recipe(recipe_t)``, its error naming ``recipe_t`` (get_recipe's names ``recipe``, the other argument)."""
    try:
        return get_recipe(recipe_t)
    except ValueError as err:
        raise ValueError(f"recipe_t: {str(err).removeprefix('recipe: ')}") from None


def _dual_tensors(r: ScaleRecipe, r_t: ScaleRecipe, shape, dtype, q, s, qt, st
                  ) -> tuple[QuantizedTensor, QuantizedTensor]:
    """``quantize_dual``'s two QuantizedTensors from the codes and scales of both orientations
    (``[T, K]``, and ``[K, T_pad]`` along tokens)."""
    return (QuantizedTensor._unchecked(q, s, r, shape, dtype),
            QuantizedTensor._unchecked(qt, st, r_t, (shape[1], qt.shape[1]), dtype))


def swiglu_quantize_dual(kind: str, *inputs: torch.Tensor, recipe_t: str | ScaleRecipe | None = None
                         ) -> tuple[QuantizedTensor, QuantizedTensor]:
    """``quantize_dual`` (``fp8_block1x128``) of the dense SwiGLU MLP's FP32 values ``kind`` of
    ``inputs`` [T, F] (:func:`lowprec.quant.ops.swiglu_values`: ``"swiglu"`` of gate, up;
    ``"swiglu_dgate"`` of gate, up, dA; ``"swiglu_dup"`` of gate, dA), computed and quantized in
    one pass on Hopper (:mod:`lowprec.quant.ops` says how close the kernels are to the reference).
    ``recipe_t``: the transposed half's, ``fp8_block1x128`` (None, the default), ``fp8_block16x128``
    or ``fp8_block128x128`` (``"swiglu"`` only), as :func:`quantize_dual`'s."""
    if kind not in ops.SWIGLU_KINDS:
        raise ValueError(f"kind: expected one of {list(ops.SWIGLU_KINDS)}, got {kind!r}")
    if len(inputs) != ops.SWIGLU_KINDS[kind] or any(
            not isinstance(t, torch.Tensor) or t.dim() != 2 or t.shape != inputs[0].shape for t in inputs):
        raise ValueError(f"inputs: kind {kind!r} takes {ops.SWIGLU_KINDS[kind]} tensors [T, F] of one shape, got "
                         f"{[tuple(getattr(t, 'shape', ())) for t in inputs]}")
    args = tuple(t.contiguous() for t in inputs)
    r = get_recipe("fp8_block1x128")
    r_t = r if recipe_t is None else _get_recipe_t(recipe_t)
    if r_t.name not in _DUAL_T_RECIPES or r_t.scale_rounding != "exact":
        raise ValueError(f"recipe_t: expected one of {_DUAL_T_RECIPES} (exact scales), got {r_t.name!r}")
    if r_t.block[0] != 1 and kind != "swiglu":  # checked here: the ops below would name their t_rows
        raise ValueError(f"recipe_t: {r_t.name!r} (the weight gradient's activation blocks) is for kind 'swiglu' "
                         f"only, got kind {kind!r}; its gradients take 'fp8_block1x128' (None)")
    wrap = functools.partial(_dual_tensors, r, r_t, args[0].shape, torch.float32)
    if _traced_on_cuda(args[0]):
        return wrap(*ops.swiglu_dual_fp8(kind, list(args), r_t.block[0]))
    return wrap(*ops.swiglu_dual_codes(kind, args, r_t.block[0]))


def quantize_with_transpose(x: torch.Tensor, recipe: str | ScaleRecipe = "fp8_block128x128"
                            ) -> tuple[QuantizedTensor, QuantizedTensor]:
    """``(quantize(x), quantize(x.transpose(-1, -2)))`` for square-block recipes, from one pass
    over ``x`` where a kernel exists (128x128 FP8 on Hopper), else ``q.transpose()``.

    For weights whose GEMMs need both orientations (forward and input gradient). Leading dims of
    ``x`` are a batch of matrices. Inputs are assumed finite.
    """
    r = get_recipe(recipe)
    if not r.transposable:
        raise ValueError(f"recipe: {r.name!r} is not transposable (needs square blocks or a tensorwise scale, "
                         f"FP8 elements); quantize the transposed tensor instead")
    if not isinstance(x, torch.Tensor) or x.dim() < 2 or x.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"x: expected a float tensor with ≥ 2 dims, got "
                         f"{getattr(x, 'dtype', type(x))} {tuple(getattr(x, 'shape', ()))}")
    x = x.detach()
    rows, cols = x.shape[-2:]

    def wrap(q, s, qt):
        batch = x.shape[:-2]
        s = s.view(*batch, -(-rows // 128), s.shape[-1])
        t_shape = (*batch, cols, rows)
        return (QuantizedTensor._unchecked(q.view(x.shape), s, r, x.shape, x.dtype),
                QuantizedTensor._unchecked(qt.view(t_shape), s.transpose(-1, -2).contiguous(), r, t_shape, x.dtype))

    def reference():
        q = quantize(x, r, check_finite=False)
        return q, q.transpose()

    if _traced_on_cuda(x) and r.name == "fp8_block128x128" and rows % 16 == 0 and _custom_op_recipe(x, r):
        return wrap(*ops.quantize_128x128_t_fp8(x.reshape(-1, cols), rows))
    return registry.run("quantize_with_transpose", x.device, (x, r), reference, lambda kernel: wrap(*kernel(x, r)))


def dequantize(qt: QuantizedTensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``q * scale`` with the logical shape, as ``dtype`` (default: the original dtype).

    Pass ``dtype=torch.float64`` for an exact dequantization (error references).
    """
    if not isinstance(qt, QuantizedTensor):
        raise TypeError(f"qt: expected a QuantizedTensor, got {type(qt).__name__}")
    return dequantize_reference(qt, dtype)
