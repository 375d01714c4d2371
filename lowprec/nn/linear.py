"""FP8 linear layers and ``convert(model)``, which swaps ``nn.Linear`` for them."""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable

import torch
from torch import nn
from torch.nn.utils.prune import BasePruningMethod
from torch.nn.utils.spectral_norm import SpectralNorm
from torch.nn.utils.weight_norm import WeightNorm

from ..gemm import gemm
from ..gemm.ops import weight_only
from ..gemm.weight_only import PackedFP8, pack_fp8
from ..quant import quantize
from ..recipes import DEFAULT_TRAIN_RECIPE, get_recipe
from ..runtime import differentiable_once, registry, version_of
from ..tensor import QuantizedTensor
from .buffers import QuantizedBuffersModule, check_out_dtype
from .fsdp import GATHER_RECIPE, FP8AllGatherWeight
from .functional import (
    LinearRecipe,
    follow_autocast,
    fp8_linear,
    get_linear_recipe,
    quantize_linear_weight,
    reject_tangents,
)
from .hooks import carry_hooks, has_hooks
from .nvfp4 import NVFP4InferenceLinear
from .swiglu import RECIPES as SWIGLU_RECIPES
from .swiglu import FP8SwiGLUMLP, swiglu_mlp_unsupported

__all__ = ["FP8Linear", "FP8InferenceLinear", "convert", "MIN_TRAIN_WEIGHT_NUMEL", "enable_fp8_all_gather"]

log = logging.getLogger("lowprec")
_ALIGN = 16  # the GEMM kernels take N and K in multiples of 16
# Training conversion keeps smaller layers in their dtype: on the H100 at 8192 tokens, eager,
# FP8Linear's forward + backward measured 0.12-0.36x nn.Linear's at 512x512..2048x2048,
# 0.77-0.83x at 2048x5632 / 5632x2048, 1.10x at 4096x4096, 1.21x at 4096x14336 (bench linear
# --shapes, queued steps: the small layers are bound by host time, not by the GPU)
MIN_TRAIN_WEIGHT_NUMEL = 4096 * 4096
_X_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_NVFP4 = "nvfp4"  # convert's weight-only inference recipe (NVFP4InferenceLinear)
_WEIGHT_HOOKS = (WeightNorm, SpectralNorm, BasePruningMethod)  # torch's forward pre-hooks computing a weight


def _check_features(in_features: int, out_features: int) -> None:
    for name, value in (("in_features", in_features), ("out_features", out_features)):
        if value <= 0 or value % _ALIGN:
            raise ValueError(f"{name}: must be a positive multiple of {_ALIGN} for the FP8 GEMM, got {value}")


class FP8Linear(nn.Module):
    """Drop-in ``nn.Linear`` whose three GEMMs (forward, input grad, weight grad) run in FP8.

    The master weight and bias keep their dtype and are ordinary parameters, so any optimizer
    works unchanged. ``recipe``: ``"fp8_block_wgrad16"`` (default; 1x128 activations and
    gradients, 128x128 weights, the weight gradient reading the activation in 16x128 blocks),
    ``"fp8_block"`` (DeepSeek-V3's: 1x128 there too), ``"fp8_block_wgrad2d"`` (128x128 there:
    :func:`~lowprec.nn.fp8_linear`), ``"fp8_rowwise"``,
    ``"fp8_tensorwise"``. The weight is quantized in every forward, or once per
    :func:`~lowprec.nn.reuse_quantized_weights` block (gradient accumulation).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, recipe: str = DEFAULT_TRAIN_RECIPE,
                 device=None, dtype=None) -> None:
        super().__init__()
        _check_features(in_features, out_features)
        self.in_features = in_features
        self.out_features = out_features
        self.recipe: LinearRecipe = get_linear_recipe(recipe)
        init = nn.Linear(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.weight = init.weight
        self.bias = init.bias

    def reset_parameters(self) -> None:
        """``nn.Linear``'s initialization of the weight and bias, in place (e.g. after building on the
        meta device and ``to_empty``)."""
        nn.Linear.reset_parameters(self)

    @classmethod
    def from_linear(cls, linear: nn.Linear, recipe: str = DEFAULT_TRAIN_RECIPE) -> FP8Linear:
        """Wrap ``linear``'s own weight and bias parameters (shared, not copied)."""
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        _check_features(linear.in_features, linear.out_features)
        layer.in_features, layer.out_features = linear.in_features, linear.out_features
        layer.recipe = get_linear_recipe(recipe)
        layer.weight = linear.weight
        layer.bias = linear.bias
        if isinstance(layer.weight, FP8AllGatherWeight):  # a new owner of a wrapped weight: plain state dict
            _hook_master_weights(layer)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, self.weight, self.bias, self.recipe)

    def fp8_block_weights(self) -> tuple[str, ...]:
        """The parameters quantized in 128x128 blocks (:func:`enable_fp8_all_gather`)."""
        return ("weight",) if self.recipe.weight == GATHER_RECIPE else ()

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, recipe={self.recipe.name}")


class _FrozenFP8Linear(torch.autograd.Function):
    """``x · Wᵀ + b`` with a constant FP8 weight: the input gradient ``dX = dY_q · (Wᵀ)_q`` as
    :class:`FP8Linear`'s, ``(Wᵀ)_q`` the codes transposed for square blocks and tensorwise
    scales, else the weight requantized along its other dim."""

    @staticmethod
    def forward(ctx, x2, w: QuantizedTensor, bias, recipe: LinearRecipe):
        ctx.w, ctx.recipe = w, recipe
        return gemm(quantize(x2, recipe.activation, check_finite=False), w, out_dtype=x2.dtype, bias=bias)

    @staticmethod
    @differentiable_once(grads_only=True)  # dX depends on dy alone (the weight is a constant)
    def backward(ctx, dy):
        w = ctx.w
        w_t = w.transpose() if w.transposable else quantize(w.dequantize(torch.float32).t(), w.recipe,
                                                            check_finite=False)
        dy_q = quantize(dy.contiguous(), ctx.recipe.grad, check_finite=False)
        return gemm(dy_q, w_t, out_dtype=dy.dtype), None, None, None


# FP8InferenceLinear: rows up to which bf16 activations stay unquantized (H200, session 47,
# benchmarks/fp8_weight_only_crossover.py: the weight-only kernel is faster than W8A8 on all four
# Llama projections at M <= 32, slower on three of four at 48 and 64)
WEIGHT_ONLY_MAX_M = 32


class FP8InferenceLinear(QuantizedBuffersModule):
    """Inference linear holding just the FP8 weight and its scales (about half the memory);
    differentiable in ``x`` (the weight is a constant).

    Decode sizes: with the ``fp8_block`` recipe, a bfloat16 ``x`` of at most ``weight_only_max_m``
    rows (default 32; 0 turns it off) without gradient is multiplied by the dequantized weight
    with ``x`` left in bf16 (weight-only: no activation quantization, so closer to the float
    product): on Hopper the weight-only decode kernel (``lowprec.gemm.sm90.weight_only``) on a
    copy of the weight re-arranged for it (:meth:`packed_weight`: made at the first such eager
    call, kept beside the FP8 weight, which the W8A8 path reads), elsewhere ``F.linear`` on the
    dequantized weight; under ``torch.compile`` the traced op takes the copy if an eager call
    made it, else the dequantized product. Other calls quantize ``x`` with the recipe's
    activation format (W8A8).

    Buffers: ``weight`` (float8_e4m3fn ``[out, in]``), ``weight_scale`` (FP32, the recipe's
    row-major scale grid) and ``bias`` (if any). Module casts (``.half()``, ``.to(dtype)``) cast
    the bias, and ``out_dtype`` (the bias's dtype and that of :meth:`quantized_weight`) follows;
    the weight keeps its FP8 codes and FP32 scales (see :class:`QuantizedBuffersModule`). Save
    and load with ``model.state_dict()`` and :func:`lowprec.save` / :func:`lowprec.load`.
    """

    _quantized = ("weight", "weight_scale")
    _derived = ("_packed",)

    def __init__(self, in_features: int, out_features: int, bias: bool = True, recipe: str = "fp8_block",
                 device=None, out_dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__()
        _check_features(in_features, out_features)
        check_out_dtype(out_dtype)
        self.in_features = in_features
        self.out_features = out_features
        self.recipe: LinearRecipe = get_linear_recipe(recipe)
        self.out_dtype = out_dtype
        w = quantize(torch.zeros(out_features, in_features, device=device), self.recipe.weight, check_finite=False)
        self.register_buffer("weight", w.data)
        self.register_buffer("weight_scale", w.scale)
        self.register_buffer("bias", torch.zeros(out_features, dtype=out_dtype, device=device) if bias else None)
        self.weight_only_max_m = WEIGHT_ONLY_MAX_M
        self._packed: tuple[torch.Tensor, torch.Tensor, tuple, PackedFP8] | None = None

    @classmethod
    def from_linear(cls, linear: nn.Linear | FP8Linear, recipe: str = "fp8_block") -> FP8InferenceLinear:
        """Quantize ``linear``'s weight once (an ``nn.Linear``, or a trained :class:`FP8Linear`); a
        meta-device ``linear`` gives a meta-device layer (values to come from ``load_state_dict(...,
        assign=True)``)."""
        dtype = linear.weight.dtype if linear.weight.dtype in (torch.bfloat16, torch.float16) else torch.float32
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None, recipe,
                    device=linear.weight.device, out_dtype=dtype)
        if linear.weight.is_meta:  # a skeleton: no values to quantize
            return layer
        w = quantize_linear_weight(linear, layer.recipe.weight)
        layer.weight, layer.weight_scale = w.data, w.scale
        if linear.bias is not None:
            layer.bias = linear.bias.detach().to(dtype).clone()
        return layer

    def quantized_weight(self) -> QuantizedTensor:
        return QuantizedTensor(self.weight, self.weight_scale, get_recipe(self.recipe.weight),
                               self.weight.shape, self.out_dtype)

    def packed_weight(self) -> PackedFP8:
        """The weight in the weight-only kernel's layout (``fp8_block``), packed on first use and
        again whenever the buffers change (load, in-place update, device move; in-place writes to
        buffers made under ``torch.inference_mode``, which track no version, only by a load)."""
        w, s = self.weight, self.weight_scale
        key = (w.get_device(), w.data_ptr(), version_of(w), s.data_ptr(), version_of(s))  # a cheap check per call
        # and the tensors themselves: a buffer assigned anew (layer.weight = ...) can land in a freed
        # one's storage with the same version (0, or None for inference tensors)
        cached = self._packed
        if cached is None or cached[0] is not w or cached[1] is not s or cached[2] != key:
            self._packed = cached = (w, s, key, pack_fp8(w, s))
        return cached[3]

    def _load_from_state_dict(self, *args, **kwargs):
        super()._load_from_state_dict(*args, **kwargs)
        self._packed = None  # a load into inference tensors bumps no version: pack again

    def _weight_only(self, x2: torch.Tensor) -> bool:
        return (self.recipe.weight == "fp8_block128x128" and x2.dtype == torch.bfloat16
                and x2.shape[0] <= self.weight_only_max_m)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x · Wᵀ + b``, differentiable in ``x`` (the weight and bias are constants)."""
        if not isinstance(x, torch.Tensor) or x.dtype not in _X_DTYPES:
            raise TypeError(f"x: expected a float32/bfloat16/float16 tensor, got {getattr(x, 'dtype', type(x))}")
        if x.dim() == 0 or x.shape[-1] != self.in_features:
            raise ValueError(f"x: last dim must be in_features={self.in_features}, got shape {tuple(x.shape)}")
        if x.device != self.weight.device:
            raise ValueError(f"x: on {x.device}, but the layer is on {self.weight.device}")
        x2, autocast_off = follow_autocast(x if x.dim() == 2 else x.reshape(-1, self.in_features))
        with autocast_off:
            if torch.is_grad_enabled() and x.requires_grad:
                bias = None if self.bias is None else self.bias.float()
                y = _FrozenFP8Linear.apply(x2, self.quantized_weight(), bias, self.recipe)
            elif self._weight_only(x2):
                bias16 = None if self.bias is None else self.bias.to(torch.bfloat16)
                if not torch.compiler.is_compiling():
                    packed = self.packed_weight() if x2.is_cuda else None
                else:  # traced: the packed weight of an earlier eager call, or the dequantized product
                    packed = None if self._packed is None else self._packed[3]
                y = weight_only(x2, packed, self.quantized_weight, bias16)
            else:
                reject_tangents("FP8InferenceLinear", x2)
                bias = None if self.bias is None else self.bias.float()

                def composed():
                    x_q = quantize(x2, self.recipe.activation, check_finite=False)
                    return gemm(x_q, self.quantized_weight(), out_dtype=x2.dtype, bias=bias)

                if torch.compiler.is_compiling():  # the traced ops
                    y = composed()
                else:  # eager (decode): one lean host pass on Hopper
                    y = registry.run("linear_inference", x2.device, (
                        x2, self.weight, self.weight_scale, self.recipe.weight, self.recipe.activation, bias,
                        x2.dtype), composed)
        return y if x.dim() == 2 else y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, recipe={self.recipe.name}")


def _swap(linear: nn.Linear, name: str, recipe: str, inference: bool, min_numel: int, kept: list) -> nn.Module:
    # torch.nn.utils.weight_norm / spectral_norm: a forward pre-hook computes weight from the layer's
    # own parameters (weight_g and weight_v, weight_orig), which the new layer does not have
    computed_weight = not isinstance(linear.weight, nn.Parameter)
    if computed_weight and not inference:
        log.warning("lowprec.convert: keeping %s as nn.Linear: its weight is not a parameter (computed by a "
                    "forward pre-hook, as torch.nn.utils.weight_norm's)", name or "<model>")
        return linear
    if computed_weight and has_hooks(linear, ignore=lambda hook: isinstance(hook, _WEIGHT_HOOKS)):
        # hooks carry over all or none, and the one computing the weight cannot run on the inference layer
        log.warning("lowprec.convert: keeping %s as nn.Linear: its weight is computed by a forward pre-hook (as "
                    "torch.nn.utils.weight_norm's), which the inference layer would drop with its other hooks",
                    name or "<model>")
        return linear
    if linear.in_features % _ALIGN or linear.out_features % _ALIGN:
        log.warning("lowprec.convert: keeping %s as nn.Linear: in_features=%d, out_features=%d are not both "
                    "multiples of %d", name or "<model>", linear.in_features, linear.out_features, _ALIGN)
        return linear
    if linear.in_features * linear.out_features < min_numel:
        kept.append(f"{name} ({linear.in_features}x{linear.out_features})")
        return linear
    cls = FP8InferenceLinear if inference else FP8Linear
    new = NVFP4InferenceLinear.from_linear(linear) if recipe == _NVFP4 else cls.from_linear(linear, recipe)
    # an inference layer takes the computed weight as it is now; the hook computing it has no
    # parameters left to read there
    return new if computed_weight else carry_hooks(linear, new)


def convert(model: nn.Module, recipe: str | None = None, filter_fn: Callable[[str, nn.Module], bool] | None = None,
            inference: bool = False, min_weight_numel: int | None = None, fuse_mlp: bool = True) -> nn.Module:
    """Swap every ``nn.Linear`` in ``model`` (in place) for an FP8 layer and return the model.

    Args:
        model: any module; a bare ``nn.Linear`` (or :class:`~lowprec.moe.MoE`) is converted and
            returned.
        recipe: ``"fp8_block_wgrad16"`` (the training default), ``"fp8_block"`` (the inference
            default: the same forward), ``"fp8_block_wgrad2d"`` (:func:`~lowprec.nn.fp8_linear`),
            ``"fp8_rowwise"`` or ``"fp8_tensorwise"``; with ``inference=True``
            also ``"nvfp4"``: :class:`~lowprec.nn.NVFP4InferenceLinear` layers (NVFP4 weights,
            activations in their dtype; their state dicts are ModelOpt's NVFP4 checkpoint layout).
        filter_fn: ``filter_fn(qualified_name, module) -> bool``; only layers it accepts are
            swapped (default: all).
        inference: keep only FP8 weights and scales (:class:`FP8InferenceLinear`, no training);
            default: :class:`FP8Linear`, which keeps the master weights and trains.
        min_weight_numel: layers of a model with fewer weights (``in_features · out_features``)
            stay ``nn.Linear``. Default: :data:`MIN_TRAIN_WEIGHT_NUMEL` (4096²) for training, where
            smaller layers measured slower in FP8 (their step is bound by host time), 0 with
            ``inference=True`` (FP8 weights there also halve the memory). 0 converts every layer.
            A bare ``nn.Linear`` passed as ``model`` is converted whatever its size.

        fuse_mlp: training with an ``"fp8_block"`` recipe (``_wgrad16``, ``_wgrad2d``): SwiGLU MLPs
            (:class:`~lowprec.nn.SwiGLUMLP` and transformers' ``LlamaMLP``, ``MistralMLP``,
            ``Qwen2MLP``, ``Qwen3MLP`` and the MoE models' dense / shared-expert MLPs of the same form,
            ``nn.swiglu.SWIGLU_MLP_CLASSES``: ``down_proj(silu(gate_proj(x)) * up_proj(x))``) become
            :class:`~lowprec.nn.FP8SwiGLUMLP` (the same
            three GEMMs in FP8, the activation fused with its quantizations; the same parameters),
            when ``filter_fn`` accepts all three layers and the gate's weight has at least
            ``min_weight_numel`` entries. Other recipes, ``inference=True`` or ``fuse_mlp=False``
            turn such an MLP back into a plain one whose layers convert one by one (one that
            ``filter_fn`` rejects stays as it is).

    One log line (logger ``lowprec``, INFO) says how many layers were converted and which were
    kept for their size. Only exact ``nn.Linear`` instances are swapped (subclasses such as the attention output
    projection of ``nn.MultiheadAttention`` are read directly by their owners; transformers'
    ``Conv1D`` of GPT-2 and Falcon's ``FalconLinear`` stay too): another INFO line counts such
    linear-like layers left, by type. Layers whose
    features are not multiples of 16 stay as they are, with one log line each, and so do, for
    training, layers whose weight is not a parameter (``torch.nn.utils.weight_norm``), and for
    inference such layers with hooks of their own (the inference layer takes the weight as it is,
    and runs none of its hooks) and ``nn.TransformerEncoderLayer``'s ``linear1`` / ``linear2`` (its
    fast path multiplies by their weights itself). A swapped layer keeps its forward and backward
    hooks (their handles still remove them); a SwiGLU MLP whose layers or ``act_fn`` have hooks is
    not fused (their layers convert one by one). With ``inference=True``, :class:`FP8Linear` layers
    (a model trained after ``convert``) become :class:`FP8InferenceLinear` with their own recipe.

    Mixture-of-experts layers (:class:`lowprec.moe.MoE`) train in FP8 already (their own
    ``recipe``) and their router is never quantized: training conversion leaves them as they
    are; ``inference=True`` makes each a :class:`lowprec.moe.FP8InferenceMoE` (expert weights in
    128x128 FP8 blocks, for every FP8 ``recipe``) or, with ``"nvfp4"``, a
    :class:`lowprec.moe.NVFP4InferenceMoE` (NVFP4 expert weights, tokens in their dtype).
    transformers' sparse MoE blocks (Mixtral, Qwen3-MoE; transformers 5's layout, see
    :mod:`lowprec.moe.hf`) become such a :class:`~lowprec.moe.MoE` first, on the block's own
    parameters (``fp8_block`` experts for training; the state dict takes lowprec's names), keeping
    the block's hooks; a block whose ``gate`` or ``experts`` have hooks (the MoE calls neither) stays
    as it is, with one log line.

    Converting again: :class:`FP8Linear` layers take the new ``recipe`` (the same master
    weights); :class:`FP8InferenceLinear` layers of another recipe stay as they are, with one log
    line each (their FP8 weights cannot be requantized without the master weights). A module
    referenced several times (``self.b = self.a``) is converted once, by its first name, and
    stays shared. A layer tied to a float parameter elsewhere (transformers' ``lm_head`` with
    ``tie_word_embeddings``) is quantized from it and no longer shares it with ``inference=True``:
    ``tie_weights()`` afterwards (also called by ``resize_token_embeddings``) raises a
    ``TypeError``; tie or resize before converting.
    """
    from ..moe import FP8InferenceMoE, MoE, NVFP4InferenceMoE  # lowprec.moe imports lowprec.nn
    from ..moe.hf import refuse_router_logits_calls

    if recipe is None:
        recipe = "fp8_block" if inference else DEFAULT_TRAIN_RECIPE
    if recipe == _NVFP4:
        if not inference:
            raise ValueError("recipe: 'nvfp4' is a weight-only inference format: convert(model, 'nvfp4', "
                             "inference=True)")
    else:
        get_linear_recipe(recipe)
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected an nn.Module, got {type(model).__name__}")
    if min_weight_numel is None:
        min_weight_numel = 0 if inference else MIN_TRAIN_WEIGHT_NUMEL
    elif isinstance(min_weight_numel, bool) or not isinstance(min_weight_numel, int) or min_weight_numel < 0:
        raise ValueError(f"min_weight_numel: expected an int ≥ 0 or None, got {min_weight_numel!r}")
    if _convertible(model):
        return model if filter_fn is not None and not filter_fn("", model) else _same_mode(
            model, _converted(model, "", recipe, inference, 0, []))
    fuse = fuse_mlp and not inference and recipe in SWIGLU_RECIPES
    if isinstance(model, FP8SwiGLUMLP) and (filter_fn is None or _mlp_accepted("", model, filter_fn)):
        if not fuse:
            model = _same_mode(model, carry_hooks(model, model.unfused()))
        else:
            model.recipe = recipe  # as _fuse_mlps does for the fused MLPs inside a model
            return model
    if swiglu_mlp_unsupported(model) is None and fuse and (filter_fn is None or _mlp_accepted("", model, filter_fn)):
        return _same_mode(model, carry_hooks(model, FP8SwiGLUMLP.from_mlp(model, recipe)))
    fused = _fuse_mlps(model, fuse, filter_fn, min_weight_numel, recipe)
    kept: list[str] = []
    # transformers models name the layers they read in high precision (T5's ``wo``: its MLP casts its
    # input to ``wo.weight.dtype``, which an inference layer's FP8 / NVFP4 codes cannot take)
    high_precision = _keep_in_fp32_names(model) if inference else []
    done: dict[int, nn.Module] = {}  # id(module) -> what it became: shared modules stay shared
    for parent_name, parent in list(model.named_modules()):
        # the router is read as a weight, in FP32; fused MLPs read their layers' weights
        if isinstance(parent, (MoE, FP8InferenceMoE, NVFP4InferenceMoE, FP8SwiGLUMLP)):
            continue
        for child_name, child in list(parent._modules.items()):  # named_children() skips repeats
            if child is None or not _convertible(child):
                continue
            if id(child) not in done:
                name = f"{parent_name}.{child_name}" if parent_name else child_name
                keep = filter_fn is not None and not filter_fn(name, child)
                if not keep and type(child) is nn.Linear and _named_in(name, high_precision):
                    log.warning("lowprec.convert: keeping %s as nn.Linear: the model keeps it in high precision "
                                "(_keep_in_fp32_modules)", name)
                    keep = True
                if (not keep and inference and isinstance(parent, nn.TransformerEncoderLayer)
                        and child_name in ("linear1", "linear2")):
                    # its fast path (eval, no grad, batch_first) multiplies by these weights itself, as
                    # float matrices: an inference layer's codes fail there
                    log.warning("lowprec.convert: keeping %s as it is: nn.TransformerEncoderLayer's fast path reads "
                                "its weight directly", name)
                    keep = True
                done[id(child)] = child if keep else _same_mode(
                    child, _converted(child, name, recipe, inference, min_weight_numel, kept))
            setattr(parent, child_name, done[id(child)])
    converted = sum(isinstance(m, (FP8Linear, FP8InferenceLinear, NVFP4InferenceLinear)) for m in done.values())
    moes = sum(isinstance(m, (MoE, FP8InferenceMoE, NVFP4InferenceMoE)) for m in done.values())
    if moes:
        refuse_router_logits_calls(model)
    log.info("lowprec.convert: %d fused FP8 SwiGLU MLPs; %d low-precision linear layers; %d MoE layers; %d kept in "
             "their dtype (fewer than %d weights)%s", fused, converted, moes, len(kept), min_weight_numel,
             (": " + ", ".join(kept)) if kept else "")
    if left := _linear_like_left(model):
        log.info("lowprec.convert: %d linear-like layers left as they are, not exactly nn.Linear (%s)",
                 sum(left.values()), ", ".join(f"{n} {t}" for t, n in left.items()))
    return model


def _same_mode(old: nn.Module, new: nn.Module) -> nn.Module:
    """``new`` in ``old``'s train / eval mode (a module built anew is in training mode: converting a
    model after ``model.eval()`` would leave its new layers in it)."""
    if new is not old and new.training != old.training:
        new.train(old.training)
    return new


def _linear_like_left(model: nn.Module) -> dict[str, int]:
    """The linear-like modules of ``model`` that :func:`convert` leaves for not being exactly
    ``nn.Linear`` (subclasses such as Falcon's ``FalconLinear``, transformers' ``Conv1D`` of GPT-2),
    counted by type name."""
    conv1d = getattr(sys.modules.get("transformers.pytorch_utils"), "Conv1D", None)  # no Conv1D before its import
    left: dict[str, int] = {}
    for module in model.modules():
        if ((isinstance(module, nn.Linear) and type(module) is not nn.Linear)
                or (conv1d is not None and isinstance(module, conv1d))):
            left[type(module).__name__] = left.get(type(module).__name__, 0) + 1
    return left


def _keep_in_fp32_names(model: nn.Module) -> set[str]:
    """What the transformers models in ``model`` keep in FP32 (their ``_keep_in_fp32_modules`` and
    ``_keep_in_fp32_modules_strict``: module or parameter names, such as ``"wo"`` or ``"gate.weight"``)."""
    names = set()
    for module in model.modules():
        for attr in ("_keep_in_fp32_modules", "_keep_in_fp32_modules_strict"):
            entries = getattr(module, attr, None)
            if isinstance(entries, (list, tuple, set)):
                names.update(e for e in entries if isinstance(e, str) and e)
    return names


def _named_in(name: str, patterns: set[str]) -> bool:
    """A pattern names the layer ``name`` or its weight, by whole dotted components."""
    full = f".{name}.weight."
    return any(f".{p}." in full for p in patterns)


def _mlp_accepted(name: str, mlp: nn.Module, filter_fn: Callable[[str, nn.Module], bool]) -> bool:
    prefix = f"{name}." if name else ""
    return all(filter_fn(prefix + n, getattr(mlp, n)) for n in ("gate_proj", "up_proj", "down_proj"))


def _fuse_mlps(model: nn.Module, fuse: bool, filter_fn, min_numel: int, recipe: str) -> int:
    """Swap the SwiGLU MLPs of ``model`` for :class:`FP8SwiGLUMLP` of ``recipe`` (``fuse``; fused
    ones take ``recipe``), or fused ones back to plain ones (not ``fuse``); returns how many are fused."""
    fused = 0
    done: dict[int, nn.Module] = {}  # id(mlp) -> what it became: an MLP referenced twice stays shared
    for parent_name, parent in list(model.named_modules()):
        for child_name, child in list(parent._modules.items()):
            if id(child) in done:  # named_children() skips repeats: as convert, by the first name
                setattr(parent, child_name, done[id(child)])
                continue
            name = f"{parent_name}.{child_name}" if parent_name else child_name
            new = child
            if isinstance(child, FP8SwiGLUMLP):
                if filter_fn is None or _mlp_accepted(name, child, filter_fn):  # rejected: kept as it is
                    if fuse:
                        child.recipe = recipe
                    else:
                        new = carry_hooks(child, child.unfused())
                if new is child:
                    fused += 1
            elif (fuse and swiglu_mlp_unsupported(child) is None and child.gate_proj.weight.numel() >= min_numel
                  and (filter_fn is None or _mlp_accepted(name, child, filter_fn))):
                new = carry_hooks(child, FP8SwiGLUMLP.from_mlp(child, recipe))
                fused += 1
            if child is not None:
                done[id(child)] = new
            if new is not child:
                setattr(parent, child_name, _same_mode(child, new))
    return fused


def _convertible(module: nn.Module) -> bool:
    from ..moe import MoE
    from ..moe.hf import hf_moe_unsupported

    return (type(module) is nn.Linear or isinstance(module, (MoE, FP8Linear, FP8InferenceLinear))
            or hf_moe_unsupported(module, recipe=None) is None)


def _converted(module: nn.Module, name: str, recipe: str, inference: bool, min_numel: int, kept: list) -> nn.Module:
    """What :func:`convert` makes of one :func:`_convertible` module (itself where nothing applies)."""
    from ..moe import FP8InferenceMoE, MoE, NVFP4InferenceMoE
    from ..moe.hf import hf_moe_hooked, hf_moe_unsupported, moe_from_hf, refuse_router_logits

    if type(module) is nn.Linear:
        return _swap(module, name, recipe, inference, min_numel, kept)
    if hf_moe_unsupported(module, recipe=None) is None:  # a transformers MoE block: lowprec's MoE on its parameters
        if (why := hf_moe_unsupported(module)) is not None:
            log.warning("lowprec.convert: keeping %s as it is: %s", name or "<model>", why)
            return module
        if (hooked := hf_moe_hooked(module)) is not None:
            log.warning("lowprec.convert: keeping %s as it is: forward or backward hooks on its %s, which the "
                        "lowprec MoE would not call (it reads their weights)", name or "<model>", hooked)
            return module
        # the block's own hooks carry over: the same call and output
        moe = carry_hooks(module, moe_from_hf(module))
        return refuse_router_logits(_converted(moe, name, recipe, inference, min_numel, kept))
    if isinstance(module, MoE):
        if not inference:
            return module
        if module.hidden_size % _ALIGN or module.ffn_size % _ALIGN:
            log.warning("lowprec.convert: keeping %s as MoE: hidden_size=%d, ffn_size=%d are not both multiples of %d",
                        name or "<model>", module.hidden_size, module.ffn_size, _ALIGN)
            return module
        layer = NVFP4InferenceMoE.from_moe(module) if recipe == _NVFP4 else FP8InferenceMoE.from_moe(module)
        # the same call and outputs: the hooks carry over (on a transformers block converted for
        # training before, the one refusing router logits: the inference layer still replaces its router)
        return carry_hooks(module, layer)
    if isinstance(module, FP8Linear):
        if inference:
            if recipe == _NVFP4:  # from the master weights
                return carry_hooks(module, NVFP4InferenceLinear.from_linear(module))
            return carry_hooks(module, FP8InferenceLinear.from_linear(module, module.recipe.name))
        module.recipe = get_linear_recipe(recipe)
        return module
    # fp8_block_wgrad16 / _wgrad2d name fp8_block's forward (a layer from a trained FP8Linear keeps its name)
    asked = None if recipe == _NVFP4 else get_linear_recipe(recipe)
    same = inference and asked is not None and (asked.activation, asked.weight) == (module.recipe.activation,
                                                                                    module.recipe.weight)
    if module.recipe.name != recipe and not same:
        log.warning("lowprec.convert: keeping %s as FP8InferenceLinear in %s, not %s: its FP8 weights cannot be "
                    "requantized without the master weights", name or "<model>", module.recipe.name, recipe)
    return module


# --- FSDP2: FP8 all-gather of 128x128-quantized weights (the tensor subclasses: lowprec.nn.fsdp) ---

def _master_weights_in_state_dict(module, state_dict, prefix, local_metadata):
    # every wrapped weight, not only those fp8_block_weights() names now: converting again with a
    # recipe of other blocks (fp8_rowwise, ...) leaves the wrappers in place
    for name, param in module.named_parameters(remove_duplicate=False):
        key = prefix + name
        value = state_dict.get(key)
        if value is param:  # state_dict(keep_vars=True): the caller asked for the parameter itself
            continue
        if isinstance(value, FP8AllGatherWeight):  # savers need a plain tensor
            state_dict[key] = value.hp
        elif isinstance(getattr(value, "_local_tensor", None), FP8AllGatherWeight):
            # under FSDP2: a DTensor over this rank's shard of the master weight itself (a checkpoint
            # of the wrapper would pickle lowprec's class: torch.distributed.checkpoint's weights-only
            # load refuses it, and loading it would need lowprec)
            from torch.distributed.tensor import DTensor

            state_dict[key] = DTensor.from_local(value._local_tensor.hp, value.device_mesh, value.placements,
                                                 run_check=False, shape=value.shape, stride=value.stride())


def _wrap_master_weights_on_assign(module, state_dict, prefix, local_metadata, *_):
    # load_state_dict(assign=True) makes the loaded tensors the parameters: wrap each as the weight it
    # replaces, else the FP8 all-gather would be silently lost (a copying load keeps the wrapper). The
    # state dict is load_state_dict's own copy: the caller's dict and tensors are left as they are.
    if not local_metadata.get("assign_to_params_buffers", False):
        return
    from torch.distributed.tensor import DTensor

    for name, param in module._parameters.items():
        key = prefix + name
        value = state_dict.get(key)
        if not isinstance(value, torch.Tensor):
            continue
        if isinstance(value, DTensor):  # under FSDP2: rewrap this rank's shard
            if (isinstance(getattr(param, "_local_tensor", None), FP8AllGatherWeight)
                    and not isinstance(value._local_tensor, FP8AllGatherWeight)):
                state_dict[key] = DTensor.from_local(FP8AllGatherWeight(value._local_tensor.detach()),
                                                     value.device_mesh, value.placements, run_check=False,
                                                     shape=value.shape, stride=value.stride())
        elif isinstance(param, FP8AllGatherWeight) and not isinstance(value, FP8AllGatherWeight):
            state_dict[key] = FP8AllGatherWeight(value.detach())


def _hook_master_weights(module: nn.Module) -> None:
    if not getattr(module, "_lowprec_fp8_gather_hook", False):
        module.register_state_dict_post_hook(_master_weights_in_state_dict)
        module.register_load_state_dict_pre_hook(_wrap_master_weights_on_assign)
        module._lowprec_fp8_gather_hook = True


def _check_not_sharded(module: nn.Module) -> None:
    """FSDP2 holds on to the parameters it sharded: a wrapper swapped in afterwards is not what it
    all-gathers (its lazy init fails on it, or worse after a forward), so refuse clearly."""
    from torch.distributed.tensor import DTensor

    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch without FSDP2
        FSDPModule = ()
    for name, sub in module.named_modules():
        if isinstance(sub, FSDPModule):
            raise ValueError(f"enable_fp8_all_gather: {name or 'the module'} is already under fully_shard; call "
                             "enable_fp8_all_gather(model) before fully_shard")
    for name, param in module.named_parameters():
        if isinstance(param, DTensor):
            raise ValueError(f"enable_fp8_all_gather: {name} is already sharded (a DTensor); call "
                             "enable_fp8_all_gather(model) before fully_shard")


def enable_fp8_all_gather(module: nn.Module) -> int:
    """Make the weights that ``module``'s layers quantize in 128x128 blocks all-gather in FP8
    under FSDP2 (each shard's E4M3 codes and scales): every :class:`~lowprec.nn.FP8Linear`
    weight with the ``fp8_block`` recipe and the expert weights ``w1``, ``w2`` of
    :class:`lowprec.moe.MoE` (``fp8_block``) - any module whose ``fp8_block_weights()`` names
    them (also dotted names of a child's: :class:`~lowprec.nn.FP8SwiGLUMLP`'s three layers). Call
    before ``fully_shard``. Returns how many weights were wrapped. A weight tied between such
    layers is wrapped once (it stays tied); one tied to a layer that reads it unquantized (an
    embedding) keeps the plain all-gather.

    Outside FSDP nothing changes: a wrapped weight behaves as the master weight, and the
    module's state dict holds the master weight itself (under FSDP, DTensors as usual:
    ``full_tensor()`` gives the master weight); ``load_state_dict(..., assign=True)`` (e.g. into a
    model built on the meta device) wraps the loaded tensors as the weights they replace. With
    ``MixedPrecisionPolicy(param_dtype=torch.bfloat16)`` the shards are quantized from the master
    weights' own dtype, not from a bf16 copy (the plain all-gather's layer quantizes the gathered
    bf16 weight), so the codes can differ from the plain path's there."""
    _check_not_sharded(module)
    # every reference to each parameter (a tied weight has several owners)
    refs: dict[int, list[tuple[nn.Module, str]]] = {}
    for owner in module.modules():
        for leaf, param in owner._parameters.items():
            if param is not None:
                refs.setdefault(id(param), []).append((owner, leaf))
    listed: dict[int, tuple[nn.Parameter, set, list]] = {}  # the weights layers quantize in 128x128 blocks
    for layer in module.modules():
        for name in layer.fp8_block_weights() if hasattr(layer, "fp8_block_weights") else ():
            owner_name, _, leaf = name.rpartition(".")
            owner = layer.get_submodule(owner_name)
            weight = owner._parameters[leaf]
            entry = listed.setdefault(id(weight), (weight, set(), []))
            entry[1].add((id(owner), leaf))
            entry[2].append(layer)
    count = 0
    for key, (weight, fp8_refs, layers) in listed.items():
        if not isinstance(weight, FP8AllGatherWeight):
            others = [(owner, leaf) for owner, leaf in refs[key] if (id(owner), leaf) not in fp8_refs]
            if others:  # tied to a layer that reads it unquantized (an embedding): it would see FP8 values
                log.warning("lowprec.enable_fp8_all_gather: keeping the plain all-gather for a weight tied to "
                            "%s.%s, which does not quantize it in 128x128 blocks", type(others[0][0]).__name__,
                            others[0][1])
                continue
            wrapped = nn.Parameter(FP8AllGatherWeight(weight.data), requires_grad=weight.requires_grad)
            for owner, leaf in refs[key]:  # one wrapper for every owner: the weight stays tied
                setattr(owner, leaf, wrapped)
            count += 1
        # the owners too (a fused MLP's nn.Linear layers): convert again may unfuse the MLP and drop
        # the layer, keeping the owners, or swap an owner for an FP8Linear (from_linear hooks that)
        for module in (*layers, *(owner for owner, _ in refs[key])):
            _hook_master_weights(module)
    return count
