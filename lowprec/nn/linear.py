"""FP8 linear layers and ``convert(model)``, which swaps ``nn.Linear`` for them."""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import nn

from ..gemm import gemm
from ..quant import quantize
from ..recipes import get_recipe
from ..tensor import QuantizedTensor
from .functional import LinearRecipe, fp8_linear, get_linear_recipe

__all__ = ["FP8Linear", "FP8InferenceLinear", "convert"]

log = logging.getLogger("lowprec")
_ALIGN = 16  # the GEMM kernels take N and K in multiples of 16


def _check_features(in_features: int, out_features: int) -> None:
    for name, value in (("in_features", in_features), ("out_features", out_features)):
        if value <= 0 or value % _ALIGN:
            raise ValueError(f"{name}: must be a positive multiple of {_ALIGN} for the FP8 GEMM, got {value}")


class FP8Linear(nn.Module):
    """Drop-in ``nn.Linear`` whose three GEMMs (forward, input grad, weight grad) run in FP8.

    The master weight and bias keep their dtype and are ordinary parameters, so any optimizer
    works unchanged. ``recipe``: ``"fp8_block"`` (default; 1x128 activations and gradients,
    128x128 weights, as DeepSeek-V3), ``"fp8_rowwise"``, ``"fp8_tensorwise"``. The weight is
    quantized in every forward, or once per :func:`~lowprec.nn.reuse_quantized_weights` block
    (gradient accumulation).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, recipe: str = "fp8_block",
                 device=None, dtype=None) -> None:
        super().__init__()
        _check_features(in_features, out_features)
        self.in_features = in_features
        self.out_features = out_features
        self.recipe: LinearRecipe = get_linear_recipe(recipe)
        init = nn.Linear(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.weight = init.weight
        self.bias = init.bias

    @classmethod
    def from_linear(cls, linear: nn.Linear, recipe: str = "fp8_block") -> FP8Linear:
        """Wrap ``linear``'s own weight and bias parameters (shared, not copied)."""
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        _check_features(linear.in_features, linear.out_features)
        layer.in_features, layer.out_features = linear.in_features, linear.out_features
        layer.recipe = get_linear_recipe(recipe)
        layer.weight = linear.weight
        layer.bias = linear.bias
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, self.weight, self.bias, self.recipe)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, recipe={self.recipe.name}")


class FP8InferenceLinear(nn.Module):
    """Inference-only linear holding just the FP8 weight and its scales (about half the memory).

    Buffers: ``weight`` (float8_e4m3fn ``[out, in]``), ``weight_scale`` (FP32, the recipe's
    row-major scale grid) and ``bias`` (if any). Save and load with ``model.state_dict()`` and
    :func:`lowprec.save` / :func:`lowprec.load`.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, recipe: str = "fp8_block",
                 device=None, out_dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__()
        _check_features(in_features, out_features)
        self.in_features = in_features
        self.out_features = out_features
        self.recipe: LinearRecipe = get_linear_recipe(recipe)
        self.out_dtype = out_dtype
        w = quantize(torch.zeros(out_features, in_features, device=device), self.recipe.weight)
        self.register_buffer("weight", w.data)
        self.register_buffer("weight_scale", w.scale)
        self.register_buffer("bias", torch.zeros(out_features, dtype=out_dtype, device=device) if bias else None)

    @classmethod
    def from_linear(cls, linear: nn.Linear | FP8Linear, recipe: str = "fp8_block") -> FP8InferenceLinear:
        """Quantize ``linear``'s weight once (an ``nn.Linear``, or a trained :class:`FP8Linear`)."""
        dtype = linear.weight.dtype if linear.weight.dtype in (torch.bfloat16, torch.float16) else torch.float32
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None, recipe,
                    device=linear.weight.device, out_dtype=dtype)
        w = quantize(linear.weight.detach(), layer.recipe.weight)
        layer.weight, layer.weight_scale = w.data, w.scale
        if linear.bias is not None:
            layer.bias = linear.bias.detach().to(dtype).clone()
        return layer

    def quantized_weight(self) -> QuantizedTensor:
        return QuantizedTensor(self.weight, self.weight_scale, get_recipe(self.recipe.weight),
                               self.weight.shape, self.out_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"x: last dim must be in_features={self.in_features}, got shape {tuple(x.shape)}")
        x2 = x.reshape(-1, self.in_features)
        x_q = quantize(x2, self.recipe.activation, check_finite=False)
        bias = None if self.bias is None else self.bias.float()
        y = gemm(x_q, self.quantized_weight(), out_dtype=x.dtype, bias=bias)
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, recipe={self.recipe.name}")


def _swap(linear: nn.Linear, name: str, recipe: str, inference: bool) -> nn.Module:
    if linear.in_features % _ALIGN or linear.out_features % _ALIGN:
        log.warning("lowprec.convert: keeping %s as nn.Linear: in_features=%d, out_features=%d are not both "
                    "multiples of %d", name or "<model>", linear.in_features, linear.out_features, _ALIGN)
        return linear
    cls = FP8InferenceLinear if inference else FP8Linear
    return cls.from_linear(linear, recipe)


def convert(model: nn.Module, recipe: str = "fp8_block", filter_fn: Callable[[str, nn.Module], bool] | None = None,
            inference: bool = False) -> nn.Module:
    """Swap every ``nn.Linear`` in ``model`` (in place) for an FP8 layer and return the model.

    Args:
        model: any module; a bare ``nn.Linear`` (or :class:`~lowprec.moe.MoE`) is converted and
            returned.
        recipe: ``"fp8_block"``, ``"fp8_rowwise"`` or ``"fp8_tensorwise"``.
        filter_fn: ``filter_fn(qualified_name, module) -> bool``; only layers it accepts are
            swapped (default: all).
        inference: keep only FP8 weights and scales (:class:`FP8InferenceLinear`, no training);
            default: :class:`FP8Linear`, which keeps the master weights and trains.

    Only exact ``nn.Linear`` instances are swapped (subclasses such as the attention output
    projection of ``nn.MultiheadAttention`` are read directly by their owners). Layers whose
    features are not multiples of 16 stay as they are, with one log line each. With
    ``inference=True``, :class:`FP8Linear` layers (a model trained after ``convert``) become
    :class:`FP8InferenceLinear` with their own recipe.

    Mixture-of-experts layers (:class:`lowprec.moe.MoE`) train in FP8 already (their own
    ``recipe``) and their router is never quantized: training conversion leaves them as they
    are; ``inference=True`` makes each a :class:`lowprec.moe.FP8InferenceMoE` (expert weights in
    128x128 FP8 blocks, whatever ``recipe`` says).
    """
    from ..moe import FP8InferenceMoE, MoE  # lowprec.moe imports lowprec.nn

    get_linear_recipe(recipe)
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected an nn.Module, got {type(model).__name__}")
    if filter_fn is not None and type(model) in (nn.Linear, MoE) and not filter_fn("", model):
        return model
    if type(model) is nn.Linear:
        return _swap(model, "", recipe, inference)
    if isinstance(model, MoE):
        return FP8InferenceMoE.from_moe(model) if inference else model
    if inference and isinstance(model, FP8Linear):
        return FP8InferenceLinear.from_linear(model, model.recipe.name)
    for parent_name, parent in list(model.named_modules()):
        if isinstance(parent, (MoE, FP8InferenceMoE)):  # the router is read as a weight, in FP32
            continue
        for child_name, child in list(parent.named_children()):
            trained = inference and isinstance(child, FP8Linear)
            moe = inference and isinstance(child, MoE)
            if type(child) is not nn.Linear and not trained and not moe:
                continue
            name = f"{parent_name}.{child_name}" if parent_name else child_name
            if filter_fn is not None and not filter_fn(name, child):
                continue
            if moe:
                setattr(parent, child_name, FP8InferenceMoE.from_moe(child))
            elif trained:
                setattr(parent, child_name, FP8InferenceLinear.from_linear(child, child.recipe.name))
            else:
                setattr(parent, child_name, _swap(child, name, recipe, inference))
    return model
