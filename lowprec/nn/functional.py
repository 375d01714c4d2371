"""FP8 linear as an autograd function: all three GEMMs (fprop, dgrad, wgrad) in FP8.

``y = x · Wᵀ + b`` with
- fprop: ``X_q · W_qᵀ``;
- dgrad: ``dX = dY_q · (Wᵀ)_q`` — for 128x128 and tensorwise weights ``(Wᵀ)_q`` is the forward's
  quantized weight transposed (same blocks, transposed scale grid); rowwise weights are quantized
  again along the other dim;
- wgrad: ``dW = (dYᵀ)_q · (Xᵀ)_q``, both quantized along tokens (the reduction dim). X and dY are
  each quantized once in both orientations (:func:`lowprec.quant.quantize_dual`); ``(Xᵀ)_q`` is
  saved (FP8), so the high-precision activation is not kept.
Master weights keep their dtype; gradients come back in it.
"""

from __future__ import annotations

import contextlib
import math

import torch
from torch.autograd import forward_ad

from ..gemm import gemm
from ..quant import quantize, quantize_dual
from ..recipes import DEFAULT_TRAIN_RECIPE, LINEAR_RECIPES, LinearRecipe, get_linear_recipe
from ..runtime import differentiable_once, graph_anchors
from ..tensor import QuantizedTensor, flatten_all, unflatten_all
from .weight_cache import quantize_weight

__all__ = ["LinearRecipe", "LINEAR_RECIPES", "get_linear_recipe", "fp8_linear", "follow_autocast"]


_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_WEIGHT_DTYPES = (*_FLOAT_DTYPES, torch.float64)  # what quantize takes


_NO_CONTEXT = contextlib.nullcontext()  # reusable: entered and left per call, holds no state


def output_as(y: torch.Tensor, shape) -> torch.Tensor:
    """A layer's output ``y`` in ``shape`` as a tensor of its own, not a view (as ``nn.Linear``'s):
    FSDP2 hooks a wrapped module's outputs for its backward, and an in-place op on an output that
    is a view (``out += residual``) drops that hook, so the sharded weights get no gradients."""
    shape = tuple(shape)
    return y if tuple(y.shape) == shape and y._base is None else torch.ops.aten._unsafe_view(y, shape)


def follow_autocast(x: torch.Tensor) -> tuple[torch.Tensor, contextlib.AbstractContextManager]:
    """``x`` as ``nn.Linear`` sees it under ``torch.autocast`` for ``x``'s device (cast to the
    autocast dtype, differentiably: its gradient comes back in ``x``'s dtype), else ``x``; and a
    context that turns autocast off for lowprec's own ops, which choose their dtypes themselves
    (master weights are quantized from their own dtype, not from a half-precision copy)."""
    device_type = x.device.type
    # meta (shape inference) has no autocast and raises on the query; a plain comparison, which
    # dynamo traces (not torch.amp.is_autocast_available)
    if device_type == "meta" or not torch.is_autocast_enabled(device_type):
        return x, _NO_CONTEXT
    return x.to(torch.get_autocast_dtype(device_type)), torch.autocast(device_type, enabled=False)


def reject_tangents(name: str, *tensors: torch.Tensor | None) -> None:
    """Forward-mode AD (``torch.func.jvp``, ``torch.autograd.forward_ad``) is not supported: the
    quantize and GEMM ops would drop the tangents, a silent zero (the autograd Functions raise)."""
    if any(t is not None and forward_ad.unpack_dual(t).tangent is not None for t in tensors):
        raise NotImplementedError(f"{name}: forward-mode AD (torch.func.jvp, forward_ad dual tensors) is not "
                                  "supported; use reverse mode (backward, torch.autograd.grad)")


class _FP8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2, weight, bias, recipe: LinearRecipe):
        if ctx.needs_input_grad[1]:
            x_q, xt_q = quantize_dual(x2, recipe.activation, recipe.wgrad_activation)
        else:
            x_q, xt_q = quantize(x2, recipe.activation, check_finite=False), None
        # the input gradient multiplies by the transposed weight: quantized now, with the weight
        w_q, w_t = quantize_weight(weight, recipe.weight, with_transpose=ctx.needs_input_grad[0])
        y = gemm(x_q, w_q, out_dtype=x2.dtype, bias=bias)
        ctx.recipe = recipe
        ctx.has_bias = bias is not None
        ctx.weight_dtype = weight.dtype
        tensors, ctx.specs = flatten_all(xt_q, w_t)
        ctx.save_for_backward(*tensors)
        ctx.graph_anchors = graph_anchors(x2, weight)  # dX depends on W, dW on X (differentiable_once)
        return y

    @staticmethod
    @differentiable_once
    def backward(ctx, dy):
        recipe = ctx.recipe
        xt_q, w_t = unflatten_all(ctx.saved_tensors, ctx.specs)
        dy = dy.contiguous()
        dx = dw = db = None
        if ctx.needs_input_grad[1]:
            dy_q, dyt_q = quantize_dual(dy, recipe.grad)
            # the GEMM stores bf16 / fp16 / fp32: other master weights (float64) get FP32, cast
            out = ctx.weight_dtype if ctx.weight_dtype in _FLOAT_DTYPES else torch.float32
            dw = gemm(dyt_q, xt_q, out_dtype=out).to(ctx.weight_dtype)
        else:
            dy_q = quantize(dy, recipe.grad, check_finite=False)
        if ctx.needs_input_grad[0]:
            dx = gemm(dy_q, w_t, out_dtype=dy.dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = dy.sum(0, dtype=torch.float32)
        return dx, dw, db, None


def quantize_linear_weight(linear: torch.nn.Module, recipe) -> QuantizedTensor:
    """``linear.weight`` quantized with ``recipe`` for an inference layer; a weight with NaN or Inf
    is an error that names it."""
    weight = linear.weight.detach()
    if weight.dtype not in _WEIGHT_DTYPES:  # an inference layer's FP8 / NVFP4 codes, not master weights
        raise TypeError(f"linear.weight: expected float32/bfloat16/float16/float64 weights to quantize, got "
                        f"{weight.dtype} ({type(linear).__name__}: quantize from the master weights)")
    if weight.numel() and not bool(torch.isfinite(weight).all()):
        raise ValueError("linear.weight: contains NaN or Inf; an inference layer quantizes finite weights only")
    return quantize(weight, recipe)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               recipe: str | LinearRecipe = DEFAULT_TRAIN_RECIPE) -> torch.Tensor:
    """``x · weightᵀ + bias`` with FP8 GEMMs forward and backward (see module doc).

    Args:
        x: ``[..., in_features]`` float32 / bfloat16 / float16; the output has its dtype, or
            the autocast dtype inside ``torch.autocast`` (as ``nn.Linear``'s; gradients come back
            in each input's dtype).
        weight: ``[out_features, in_features]`` master weight (float32 / bfloat16 / float16 /
            float64; it is quantized on every call, so optimizer updates are seen, or once per
            :func:`~lowprec.nn.reuse_quantized_weights` block).
        bias: optional ``[out_features]``.
        recipe: ``"fp8_block_wgrad16"`` (the default: activations and gradients 1x128, weights
            128x128, the weight gradient's activation in blocks of 16 features x 128 tokens),
            ``"fp8_block"`` (DeepSeek-V3: that activation in 1x128 blocks too; its weight gradient
            GEMM ~1.25x slower), ``"fp8_block_wgrad2d"`` (128x128 blocks there), ``"fp8_rowwise"``
            or ``"fp8_tensorwise"``.
    """
    r = get_linear_recipe(recipe)
    if not isinstance(x, torch.Tensor) or x.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"x: expected a float32/bfloat16/float16 tensor, got {getattr(x, 'dtype', type(x))}")
    if x.dim() == 0:
        raise ValueError("x: expected [..., in_features], got a 0-d tensor")
    if not isinstance(weight, torch.Tensor) or weight.dtype not in _WEIGHT_DTYPES:
        raise TypeError(f"weight: expected a float32/bfloat16/float16/float64 tensor, got "
                        f"{getattr(weight, 'dtype', type(weight))}")
    if weight.dim() != 2:
        raise ValueError(f"weight: expected [out_features, in_features], got shape {tuple(weight.shape)}")
    if x.shape[-1] != weight.shape[1]:
        raise ValueError(f"x: last dim {x.shape[-1]} does not match weight's in_features "
                         f"({tuple(weight.shape)} is [out_features, in_features])")
    if bias is not None and (not isinstance(bias, torch.Tensor) or not bias.is_floating_point()):
        raise TypeError(f"bias: expected a float tensor, got {getattr(bias, 'dtype', type(bias))}")
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(f"bias: expected shape ({weight.shape[0]},), got {tuple(bias.shape)}")
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and t.device != x.device:
            raise ValueError(f"{name}: on {t.device}, but x is on {x.device}")
    x2, autocast_off = follow_autocast(x.reshape(math.prod(x.shape[:-1]), x.shape[-1]))  # -1 fails at K = 0
    bias32 = None if bias is None else bias.to(torch.float32)
    with autocast_off:
        if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight, bias)):
            y = _FP8Linear.apply(x2, weight, bias32, r)
        else:  # evaluation: no transposed copies to make or save
            reject_tangents("fp8_linear", x, weight, bias)
            x_q = quantize(x2, r.activation, check_finite=False)
            w_q, _ = quantize_weight(weight, r.weight, with_transpose=False)
            y = gemm(x_q, w_q, out_dtype=x2.dtype, bias=bias32)
    return output_as(y, (*x.shape[:-1], weight.shape[0]))
