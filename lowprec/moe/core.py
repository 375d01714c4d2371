"""The MoE's computation (no modules, no custom ops): the routed experts' forward and backward
over FP8 (or unquantized) grouped GEMMs as an autograd function, and the eager routing paths.
:mod:`.ops` wraps it in custom ops for ``torch.compile``; :mod:`.layer` builds the public
:func:`~lowprec.moe.experts` and the modules on both.

Mixture-of-experts layer on block-scaled FP8 grouped GEMMs, forward and backward.

With ``recipe="fp8_block"`` (DeepSeek-V3's scheme) every GEMM goes through an FP8 grouped GEMM,
activations quantized 1x128 and weights 128x128. Per expert ``e``, over its packed rows:

- forward: ``H = X · W1ₑᵀ`` (X from :func:`pack`), ``A = w · act(H)``, ``O = A · W2ₑᵀ``, then
  ``y[t] = Σ_j O[row(t, j)]`` (:func:`unpack`).
- dgrad: ``dA = dO · W2ₑ`` and ``dX = dH · W1ₑ`` (dO from ``pack(dy)``, dH quantized 1x128), the
  transposed weights being the forward's 128x128 codes with the scale grid transposed (square
  blocks: no requantization); ``dx[t] = Σ_j dX[row(t, j)]``.
- wgrad: ``dW2ₑ = dOₑᵀ · Aₑ`` and ``dW1ₑ = dHₑᵀ · Xₑ``, K-grouped over each expert's tokens, both
  operands quantized 1x128 along tokens (:mod:`lowprec.moe.wgrad`).

The routing weight ``w`` scales the activation rows instead of the output rows: the same function,
but the combine becomes a plain sum and ``∂y/∂w = ⟨dA, act(H)⟩`` comes from tensors the backward
has anyway, so the expert outputs ``O`` need not be kept.

Saved for the backward pass: ``x`` in FP8 1x128 (one row per token), ``H`` in FP8 1x128 (the
activation's input, cached as DeepSeek-V3 does; the activation is recomputed from it), the FP8
weights and one FP32 weight per row. For ``dW1`` the FP8 ``x`` is dequantized and requantized along
tokens. ``recipe=None`` is the baseline: the same steps in ``x``'s dtype, nothing quantized.

On Hopper, besides the GEMMs, the FP8 forward runs three kernels, each one pass over its input and
bit-identical to the torch steps: :func:`~lowprec.moe.packing.pack_tokens` (the packed X and the
saved FP8 ``x``), SwiGLU + quantization (A and the saved FP8 ``H``) and :func:`unpack`.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from ..gemm import grouped_gemm
from ..gemm.reference import grouped_mm_rows
from ..nn.weight_cache import quantize_weight
from ..quant import quantize
from ..recipes import LINEAR_RECIPES, get_recipe
from ..runtime import differentiable_once, eager_under_compile, graph_anchors, registry
from ..tensor import QuantizedTensor, flatten_all, unflatten_all
from .packing import gather_rows, pack, pack_tokens, unpack
from .routing import (
    Routing,
    dispatch,
    route,
)
from .wgrad import grouped_gemm_wgrad, quantize_k_grouped_many

RECIPES = ("fp8_block", None)
# the expert GEMMs' operands: the per-operand recipe "fp8_block" that FP8Linear uses too
_OPERANDS = LINEAR_RECIPES["fp8_block"]
_ACT_RECIPE = _OPERANDS.activation
_WEIGHT_RECIPE = _OPERANDS.weight
_GRAD_RECIPE = _OPERANDS.grad
_GATES = {"swiglu": F.silu, "geglu": F.gelu}
_GATE_GRADS = {"swiglu": torch.ops.aten.silu_backward, "geglu": torch.ops.aten.gelu_backward}
ACTIVATIONS = tuple(_GATES)
_X_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _activation(name: str, h: torch.Tensor) -> torch.Tensor:
    """Gated activation of ``h = [gate | up]`` (first half gate, second half up): ``gate_fn(gate) · up``."""
    gate, up = h.chunk(2, dim=-1)
    return _GATES[name](gate) * up


def gated_activation(name: str, h: torch.Tensor) -> torch.Tensor:
    """``act(h)`` in ``h``'s dtype: the FP32 gated activation of ``h = [gate | up]`` rounded once. On
    Hopper, SwiGLU is one kernel, bit-identical to the torch ops on the GPU."""
    def reference():
        return _activation(name, h.float()).to(h.dtype)

    if name != "swiglu":
        return reference()
    return registry.run("moe_swiglu", h.device, (h,), reference)


def _quantized_activation(name: str, h: torch.Tensor, row_w: torch.Tensor) -> tuple[QuantizedTensor,
                                                                                     QuantizedTensor]:
    """``(quantize(act(h) · row_w), quantize(h))``, both 1x128: the second GEMM's input (the
    activation in FP32 from ``h``'s values) and the copy of ``h`` the backward pass keeps.

    On Hopper, SwiGLU runs one kernel that reads ``h`` once and writes both (``h``'s quantization
    joins it when F is a multiple of 128, else it is a separate quantize), bit-identical to the
    torch ops on the GPU (silu as torch's CUDA kernel computes it), without syncs.
    """
    def reference():
        a = _activation(name, h.float()) * row_w[:, None]
        return quantize(a, _ACT_RECIPE, check_finite=False), quantize(h, _ACT_RECIPE, check_finite=False)

    def wrap(q, s, hq, hs):
        recipe = get_recipe(_ACT_RECIPE)
        a = QuantizedTensor(q, s, recipe, (h.shape[0], h.shape[1] // 2), torch.float32)
        if hq is None:
            return a, quantize(h, _ACT_RECIPE, check_finite=False)
        return a, QuantizedTensor(hq, hs, recipe, h.shape, h.dtype)

    if name != "swiglu":  # other activations are plain torch ops, whatever the backend
        return reference()
    return registry.run("swiglu_quantize", h.device, (h, row_w), reference, lambda kernel: wrap(*kernel(h, row_w)))


def _activation_backward(name: str, h: torch.Tensor | QuantizedTensor, da: torch.Tensor, row_w: torch.Tensor,
                         quantized: bool) -> tuple[torch.Tensor, QuantizedTensor | None, torch.Tensor, torch.Tensor]:
    """From the saved ``h`` and ``da = ∂y/∂A`` (FP32): ``(dh, dh quantized 1x128 (None unless
    quantized), act(h) · row_w, ∂y/∂row_w)``, all FP32, ``A = act(h) · row_w``.

    On Hopper, SwiGLU from an FP8 ``h`` runs one kernel (:mod:`lowprec.moe.sm90.swiglu_backward`)
    that reads ``h`` and ``da`` once and writes all four (dh's quantization joins it when F is a
    multiple of 128), the elementwise steps rounded as torch's autograd rounds them on the GPU."""
    def wrap(dh, dhq, dhs, a, d_row_w):
        dh_q = (quantize(dh, _GRAD_RECIPE, check_finite=False) if dhq is None
                else QuantizedTensor(dhq, dhs, get_recipe(_GRAD_RECIPE), dh.shape, torch.float32))
        return dh, dh_q, a, d_row_w

    reference = lambda: _activation_backward_reference(name, h, da, row_w, quantized)  # noqa: E731
    if not (quantized and name == "swiglu"):
        return reference()
    return registry.run("swiglu_backward", da.device, (h, da, row_w), reference,
                    lambda kernel: wrap(*kernel(h, da, row_w)))


def _activation_backward_reference(name: str, h: torch.Tensor | QuantizedTensor, da: torch.Tensor,
                                   row_w: torch.Tensor, quantized: bool
                                   ) -> tuple[torch.Tensor, QuantizedTensor | None, torch.Tensor, torch.Tensor]:
    h = h.dequantize(torch.float32) if quantized else h.float()
    gate, up = h.chunk(2, dim=-1)
    gated = _GATES[name](gate)
    s = gated * up
    # the ops autograd would run, called directly: custom ops (torch.compile) run below autograd
    ds = da * row_w[:, None]
    dh = torch.cat([_GATE_GRADS[name](ds * up, gate), ds * gated], dim=-1)
    dh_q = quantize(dh, _GRAD_RECIPE, check_finite=False) if quantized else None
    return dh, dh_q, s * row_w[:, None], (da * s).sum(dim=-1)


def _wgrad(dy_rows: torch.Tensor, x_rows: torch.Tensor, group_ends: torch.Tensor, dtype: torch.dtype
           ) -> torch.Tensor:
    """Unquantized ``dW[e] = dy_rowsₑᵀ · x_rowsₑ`` in ``dtype``, ``[E, N, P]``."""
    dy_rows, x_rows = dy_rows.to(dtype), x_rows.to(dtype)
    out = dy_rows.new_zeros(group_ends.numel(), dy_rows.shape[1], x_rows.shape[1])
    start = 0
    for e, end in enumerate(group_ends.tolist()):
        if end > start:
            out[e] = dy_rows[start:end].T @ x_rows[start:end]
        start = end
    return out


def _wgrad_fp8(routing: Routing, dy: torch.Tensor, a: torch.Tensor, dh: torch.Tensor, x: QuantizedTensor,
               needs: tuple[bool, bool], dtypes: tuple[torch.dtype, torch.dtype]) -> list[torch.Tensor | None]:
    """``[dW1, dW2]`` (None where ``needs`` is False; ``dtypes``: theirs): ``dW2ₑ = dOₑᵀ · Aₑ``,
    ``dW1ₑ = dHₑᵀ · Xₑ``, FP8 K-grouped over each expert's packed rows, FP32 accumulation, one
    rounding to the weight's dtype. The token-level ``dy`` and ``x`` are read through the packed
    rows' token map, not gathered; the operands share one column layout."""
    token_of_row = torch.where(routing.row_slots >= 0, routing.row_slots // routing.top_k, -1)
    # x: FP8 along features -> FP8 along tokens (DeepSeek-V3 requantizes the same way)
    pairs = ([(dh, None), (x.dequantize(torch.float32), token_of_row)], [(dy, token_of_row), (a, None)])
    operands = [op for need, pair in zip(needs, pairs) if need for op in pair]
    quantized, aligned_ends = quantize_k_grouped_many(operands, routing.group_ends, get_recipe(_ACT_RECIPE),
                                                      routing.num_rows)
    pending = iter(quantized)  # (dY, X) per needed gradient, in order
    return [grouped_gemm_wgrad(next(pending), next(pending), aligned_ends, out_dtype=_store_dtype(dtype)).to(dtype)
            if need else None for need, dtype in zip(needs, dtypes)]


def packed_row_weights(topk_weights: torch.Tensor, routing: Routing) -> torch.Tensor:
    """The FP32 combine weight of each packed row (no autograd); padding rows (slot -1) index the
    0 appended last."""
    return F.pad(topk_weights.detach().reshape(-1).float(), (0, 1))[routing.row_slots]


def _store_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the K-grouped kernel stores a ``dtype`` gradient in (FP32 where it cannot store ``dtype``)."""
    return dtype if dtype in (torch.bfloat16, torch.float16, torch.float32) else torch.float32


def _prepare_weights(w1, w2, quantized: bool, for_backward: bool) -> tuple:
    """``(w1, w2)`` as the forward GEMMs take them and ``(w1ᵀ, w2ᵀ)`` as the backward's (None
    without a backward to come): FP8 128x128 when ``quantized``, else the float weights as given."""
    if not quantized:
        return w1, w2, w1, w2
    if isinstance(w1, QuantizedTensor):  # FP8 weights given (inference): used as they are
        return w1, w2, *((w1.transpose(), w2.transpose()) if for_backward else (None, None))
    w1q, w1t = quantize_weight(w1, _WEIGHT_RECIPE, with_transpose=for_backward)
    w2q, w2t = quantize_weight(w2, _WEIGHT_RECIPE, with_transpose=for_backward)
    return w1q, w2q, w1t, w2t


def _forward_core(x, topk_weights, w1, w2, routing: Routing, quantized: bool, activation: str,
                  x_codes: QuantizedTensor | None = None) -> tuple:
    """The experts' forward with prepared weights: ``(y, x_saved, h_saved, row_w)``, the last three
    what the backward needs (FP8 1x128 ``x`` and ``h`` when ``quantized``, else ``x`` and ``h``).
    ``x_codes``: the tokens already quantized (1x128, e.g. as they arrived from another rank),
    computed on as they are; ``x`` then only stands for them (its dtype, autograd)."""
    dt = x.dtype
    ends = routing.group_ends
    row_w = packed_row_weights(topk_weights, routing)
    if quantized:
        if x_codes is None:
            x_rows, x_saved, _ = pack_tokens(x, routing, _ACT_RECIPE)
        else:
            x_rows, x_saved = gather_rows(x_codes, routing), x_codes
        h = grouped_gemm(x_rows, w1, group_ends=ends, out_dtype=dt)
        a, h_saved = _quantized_activation(activation, h, row_w)
        o = grouped_gemm(a, w2, group_ends=ends, out_dtype=dt)
    else:
        x_saved = x
        h_saved = grouped_mm_rows(gather_rows(x, routing), w1.to(dt), ends)
        a = (_activation(activation, h_saved.float()) * row_w[:, None]).to(dt)
        o = grouped_mm_rows(a, w2.to(dt), ends)
    return unpack(o, routing, out_dtype=dt), x_saved, h_saved, row_w


def _backward_core(dy, routing: Routing, x, h, w1, w2, row_w, quantized: bool, activation: str, dtypes: tuple,
                   needs: tuple) -> tuple:
    """``(dx, dtopk_weights, dw1, dw2)`` (None where ``needs`` is False) from what
    :func:`_forward_core` saved, ``w1``/``w2`` the backward's weights (:func:`_prepare_weights`);
    ``dtypes``: ``(x, topk_weights, w1, w2)`` dtypes."""
    ends = routing.group_ends
    dt, weights_dtype, w1_dtype, w2_dtype = dtypes
    need_x, need_weights, need_w1, need_w2 = needs
    if quantized:
        da = grouped_gemm(pack(dy, routing, _GRAD_RECIPE)[0], w2, group_ends=ends,  # w2: quantized w2ᵀ
                          out_dtype=torch.float32)
    else:
        da = grouped_mm_rows(gather_rows(dy, routing), w2.to(dt).transpose(-1, -2), ends).float()
    dh, dh_q, a, d_row_w = _activation_backward(activation, h, da, row_w, quantized)

    dx = dweights = dw1 = dw2 = None
    if need_weights:
        dweights = torch.where(routing.kept, d_row_w[routing.slot_rows.clamp(min=0)], 0.0).to(weights_dtype)
    if need_x:
        if quantized:
            dx_rows = grouped_gemm(dh_q, w1, group_ends=ends, out_dtype=dt)  # w1: quantized w1ᵀ
        else:
            dx_rows = grouped_mm_rows(dh.to(dt), w1.to(dt).transpose(-1, -2), ends)
        dx = unpack(dx_rows, routing, out_dtype=dt)
    if quantized:
        if need_w1 or need_w2:
            dw1, dw2 = _wgrad_fp8(routing, dy, a, dh, x, (need_w1, need_w2), (w1_dtype, w2_dtype))
    else:
        if need_w2:
            dw2 = _wgrad(gather_rows(dy, routing), a, ends, dt).to(w2_dtype)
        if need_w1:
            dw1 = _wgrad(dh, gather_rows(x, routing), ends, dt).to(w1_dtype)
    return dx, dweights, dw1, dw2


class _ExpertsFunction(torch.autograd.Function):
    """``y = experts(x)`` for a fixed routing; gradients for x, the combine weights, w1 and w2
    (``x_codes``: see :func:`_forward_core`)."""

    @staticmethod
    def forward(ctx, x, topk_weights, w1, w2, routing: Routing, quantized: bool, activation: str,
                for_backward: bool, x_codes: QuantizedTensor | None = None):
        w1f, w2f, w1b, w2b = _prepare_weights(w1, w2, quantized, for_backward)
        y, x_saved, h_saved, row_w = _forward_core(x, topk_weights, w1f, w2f, routing, quantized, activation,
                                                   x_codes)
        # the backward multiplies by the transposed weights only: keep those
        tensors, ctx.specs = flatten_all(x_saved, h_saved, w1f if w1b is None else w1b, w2f if w2b is None else w2b,
                                      row_w)
        ctx.save_for_backward(*tensors)
        # index tensors only: the router's autograd graph must not live on in this node
        ctx.routing = dataclasses.replace(routing, topk_weights=routing.topk_weights.detach())
        ctx.quantized, ctx.activation = quantized, activation
        ctx.dtypes = (x.dtype, topk_weights.dtype, w1.dtype, w2.dtype)
        ctx.graph_anchors = graph_anchors(x, topk_weights, w1, w2)  # for differentiable_once
        return y

    @staticmethod
    @differentiable_once  # the saved h, act(h) carry no graph: a second derivative is an error, not a wrong value
    def backward(ctx, dy):
        x, h, w1, w2, row_w = unflatten_all(ctx.saved_tensors, ctx.specs)
        grads = _backward_core(dy, ctx.routing, x, h, w1, w2, row_w, ctx.quantized, ctx.activation, ctx.dtypes,
                               ctx.needs_input_grad[:4])
        return *grads, None, None, None, None, None


def _check_float(name: str, t: torch.Tensor, dims: int, dtypes: tuple[torch.dtype, ...] | None = None) -> None:
    ok = isinstance(t, torch.Tensor) and t.is_floating_point() and t.dim() == dims
    if not ok or (dtypes is not None and t.dtype not in dtypes):
        kinds = "a float" if dtypes is None else "/".join(str(d).removeprefix("torch.") for d in dtypes)
        raise ValueError(f"{name}: expected {kinds} tensor with {dims} dims, got "
                         f"{getattr(t, 'dtype', type(t))} {tuple(getattr(t, 'shape', ()))}")


def _check_weights(w1, w2, recipe: str | None) -> None:
    """Both float tensors, or both 128x128 FP8 QuantizedTensors (recipe fp8_block only)."""
    quantized = [isinstance(w, QuantizedTensor) for w in (w1, w2)]
    if not any(quantized):
        _check_float("w1", w1, 3)
        _check_float("w2", w2, 3)
        return
    for name, w, q in (("w1", w1, quantized[0]), ("w2", w2, quantized[1])):
        if not q or w.recipe.name != _WEIGHT_RECIPE or w.dim() != 3:
            raise ValueError(f"{name}: with FP8 weights both w1 and w2 must be 3-D QuantizedTensors of "
                             f"{_WEIGHT_RECIPE!r}, got {type(w).__name__} "
                             f"{getattr(getattr(w, 'recipe', None), 'name', '')} {tuple(getattr(w, 'shape', ()))}")
    if recipe is None:
        raise ValueError("recipe: FP8 weights (QuantizedTensor) need recipe='fp8_block', got None")


def _check_options(recipe: str | None, activation: str, hidden_size: int, ffn_size: int) -> None:
    if recipe not in RECIPES:
        raise ValueError(f"recipe: expected one of {RECIPES}, got {recipe!r}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation: expected one of {ACTIVATIONS}, got {activation!r}")
    if recipe is not None:
        for name, size in (("hidden_size", hidden_size), ("ffn_size", ffn_size)):
            if size % 16:
                raise ValueError(f"{name}: must be a multiple of 16 for recipe {recipe!r} (FP8 GEMM alignment), "
                                 f"got {size}")


def _apply_experts(x: torch.Tensor, routing: Routing, w1: torch.Tensor | QuantizedTensor,
                   w2: torch.Tensor | QuantizedTensor, recipe: str | None, activation: str,
                   x_codes: QuantizedTensor | None = None) -> torch.Tensor:
    for_backward = torch.is_grad_enabled() and any(
        isinstance(t, torch.Tensor) and t.requires_grad for t in (x, routing.topk_weights, w1, w2))
    return _ExpertsFunction.apply(x, routing.topk_weights, w1, w2, routing, recipe is not None, activation,
                                  for_backward, x_codes)


def _check_experts_args(x, topk_weights, topk_ids, w1, w2, recipe: str | None, activation: str) -> None:
    _check_float("x", x, 2, _X_DTYPES)
    _check_weights(w1, w2, recipe)
    tokens, hidden = x.shape
    num_experts, two_ffn, _ = w1.shape
    if w1.shape[2] != hidden or two_ffn % 2:
        raise ValueError(f"w1: expected [E, 2F, H={hidden}] (gate and up rows), got {tuple(w1.shape)}")
    if w2.shape != (num_experts, hidden, two_ffn // 2):
        raise ValueError(f"w2: expected [E={num_experts}, H={hidden}, F={two_ffn // 2}], got {tuple(w2.shape)}")
    for name, t in (("w1", w1), ("w2", w2), ("topk_weights", topk_weights), ("topk_ids", topk_ids)):
        if isinstance(t, (torch.Tensor, QuantizedTensor)) and t.device != x.device:
            raise ValueError(f"{name}: on {t.device}, but x is on {x.device}")
    if isinstance(topk_ids, torch.Tensor) and topk_ids.dim() == 2 and topk_ids.shape[0] != tokens:
        raise ValueError(f"topk_ids: expected [T={tokens}, k], got {tuple(topk_ids.shape)}")
    _check_options(recipe, activation, hidden, two_ffn // 2)


def _needs_grad(*tensors) -> bool:
    return torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors)


@eager_under_compile
def _dispatch_and_apply(x, topk_weights, topk_ids, w1, w2, recipe, capacity_factor, drop_policy, activation,
                        check_ids, x_codes: QuantizedTensor | None = None) -> torch.Tensor:
    routing = dispatch(topk_weights, topk_ids, w1.shape[0], capacity_factor=capacity_factor, drop_policy=drop_policy,
                       check_ids=check_ids)
    return _apply_experts(x, routing, w1, w2, recipe, activation, x_codes)


@eager_under_compile
def _route_and_apply_eager(tokens: torch.Tensor, router_weight: torch.Tensor, w1, w2, recipe: str | None, top_k: int,
                           score_func: str, renormalize: bool, capacity_factor: float | None, drop_policy: str,
                           activation: str) -> tuple[torch.Tensor, Routing]:
    logits = F.linear(tokens.float(), router_weight.float())
    routing = route(logits, top_k, score_func=score_func, renormalize=renormalize, capacity_factor=capacity_factor,
                    drop_policy=drop_policy)
    return _apply_experts(tokens, routing, w1, w2, recipe, activation), routing
