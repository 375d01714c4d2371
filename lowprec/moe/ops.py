"""torch.library custom ops for the MoE layer, used while ``torch.compile`` traces.

CuTe DSL launches cannot go into a graph, and the dispatch plan has data-dependent sizes on the
CPU, so a traced MoE layer used to cost a graph break (its steps ran eagerly). An inference call
(no input needs a gradient) is instead one op: ``moe_layer`` (the modules: router, top-k,
dispatch, packing, both grouped GEMMs, the activation, the combine) or ``moe_experts``
(:func:`lowprec.moe.experts`: routing given), run eagerly inside. Their output is ``[T, H]``
whatever the routing, so the graph around them holds (``fullgraph=True``); on CUDA the whole step
can be captured (``mode="reduce-overhead"``: CUDA graphs), which removes the host time of its
launches. The router runs inside ``moe_layer`` too: inductor's softmax rounds differently in the
last bit, and in the op the result is the eager one bit for bit.

With gradients to come, :func:`lowprec.moe.experts` is an autograd function over two ops,
``moe_experts_train`` (the forward: besides ``y`` it returns the dispatch plan and the FP8
activations the backward needs, as op outputs) and ``moe_experts_backward``; the weights are
quantized in the traced graph around them (the quantize ops). The modules trace their router
(inductor's softmax may then differ from eager in the last bit of a routing weight) and call it:
a training step compiles without a graph break too.
"""

from __future__ import annotations

import torch

from ..quant.layouts import empty_mn_major_tma_aligned
from ..recipes import get_recipe
from ..tensor import QuantizedTensor
from .core import (
    _ACT_RECIPE,
    _WEIGHT_RECIPE,
    _backward_core,
    _dispatch_and_apply,
    _forward_core,
    _needs_grad,
    _prepare_weights,
    _route_and_apply_eager,
)
from .routing import Routing, dispatch

__all__ = ["moe_experts", "moe_layer", "moe_experts_train", "moe_experts_backward", "traced_experts"]



def _weights(w1, w1_scale, w2, w2_scale, dtype: torch.dtype):
    if w1_scale is None:
        return w1, w2
    recipe = get_recipe(_WEIGHT_RECIPE)
    return (QuantizedTensor(w1, w1_scale, recipe, w1.shape, dtype),
            QuantizedTensor(w2, w2_scale, recipe, w2.shape, dtype))


@torch.library.custom_op("lowprec::moe_experts", mutates_args=())
def moe_experts(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, w1: torch.Tensor,
                w1_scale: torch.Tensor | None, w2: torch.Tensor, w2_scale: torch.Tensor | None, recipe: str | None,
                capacity_factor: float | None, drop_policy: str, activation: str, check_ids: bool) -> torch.Tensor:
    """:func:`lowprec.moe.experts` without autograd. ``w1``/``w2``: float weights, or FP8 codes
    with their 128x128 scales ``w1_scale``/``w2_scale`` (both given or both None)."""
    w1, w2 = _weights(w1, w1_scale, w2, w2_scale, x.dtype)
    with torch.no_grad():
        return _dispatch_and_apply(x, topk_weights, topk_ids, w1, w2, recipe, capacity_factor, drop_policy, activation,
                                   check_ids)


@moe_experts.register_fake
def _(x, topk_weights, topk_ids, w1, w1_scale, w2, w2_scale, recipe, capacity_factor, drop_policy, activation,
      check_ids):
    return x.new_empty(x.shape)


@torch.library.custom_op("lowprec::moe_layer", mutates_args=())
def moe_layer(tokens: torch.Tensor, router_weight: torch.Tensor, w1: torch.Tensor, w1_scale: torch.Tensor | None,
              w2: torch.Tensor, w2_scale: torch.Tensor | None, recipe: str | None, top_k: int, score_func: str,
              renormalize: bool, capacity_factor: float | None, drop_policy: str, activation: str) -> torch.Tensor:
    """The MoE modules' forward on ``tokens`` [T, H] without autograd: router in FP32, top-k
    routing, the routed experts (weights as in :func:`moe_experts`)."""

    w1, w2 = _weights(w1, w1_scale, w2, w2_scale, router_weight.dtype)
    with torch.no_grad():
        return _route_and_apply_eager(tokens, router_weight, w1, w2, recipe, top_k, score_func, renormalize,
                                      capacity_factor, drop_policy, activation)[0]


@moe_layer.register_fake
def _(tokens, router_weight, w1, w1_scale, w2, w2_scale, recipe, top_k, score_func, renormalize, capacity_factor,
      drop_policy, activation):
    return tokens.new_empty(tokens.shape)


def _empty_train_outputs(x: torch.Tensor, topk_ids: torch.Tensor, w1: torch.Tensor, quantized: bool
                         ) -> list[torch.Tensor]:
    """``moe_experts_train``'s outputs, uninitialised, in their layouts: ``y`` [T, H], the plan
    (kept, slot_rows [T, k], row_slots [T·k], counts, group_ends [E]), the packed rows' combine
    weights [T·k], then FP8 ``x`` and ``h`` with 1x128 scales (MN-major, as the kernels write
    them) or, unquantized, ``h`` [T·k, 2F]."""
    (tokens, hidden), top_k, (experts, two_ffn) = x.shape, topk_ids.shape[1], w1.shape[:2]
    rows, dev = tokens * top_k, x.device
    out = [x.new_empty(tokens, hidden), torch.empty(tokens, top_k, dtype=torch.bool, device=dev),
           torch.empty(tokens, top_k, dtype=torch.int64, device=dev), torch.empty(rows, dtype=torch.int64, device=dev),
           torch.empty(experts, dtype=torch.int32, device=dev), torch.empty(experts, dtype=torch.int32, device=dev),
           torch.empty(rows, dtype=torch.float32, device=dev)]
    if not quantized:
        return out + [x.new_empty(rows, two_ffn)]
    for r, c in ((tokens, hidden), (rows, two_ffn)):
        out += [torch.empty(r, c, dtype=torch.float8_e4m3fn, device=dev),
                empty_mn_major_tma_aligned(r, -(-c // 128), dev)]
    return out


def _into(empty: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """``value`` if it has ``empty``'s strides, else copied into ``empty``."""
    return value if value.stride() == empty.stride() else empty.copy_(value)


@torch.library.custom_op("lowprec::moe_experts_train", mutates_args=())
def moe_experts_train(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, w1: torch.Tensor,
                      w1_scale: torch.Tensor | None, w2: torch.Tensor, w2_scale: torch.Tensor | None,
                      recipe: str | None, capacity_factor: float | None, drop_policy: str, activation: str,
                      check_ids: bool) -> list[torch.Tensor]:
    """The forward of :func:`lowprec.moe.experts` with a backward to come (``w1``/``w2`` as in
    :func:`moe_experts`, FP8 when ``recipe`` is set): ``y`` and what the backward needs, laid out
    as :func:`_empty_train_outputs` says."""

    w1, w2 = _weights(w1, w1_scale, w2, w2_scale, x.dtype)
    with torch.no_grad():
        routing = dispatch(topk_weights, topk_ids, w1.shape[0], capacity_factor=capacity_factor,
                           drop_policy=drop_policy, check_ids=check_ids)
        y, x_saved, h_saved, row_w = _forward_core(x, topk_weights, w1, w2, routing, recipe is not None, activation)
    values = [y, routing.kept, routing.slot_rows, routing.row_slots, routing.counts, routing.group_ends, row_w]
    values += [h_saved] if recipe is None else [x_saved.data, x_saved.scale, h_saved.data, h_saved.scale]
    return [_into(e, v) for e, v in zip(_empty_train_outputs(x, topk_ids, w1, recipe is not None), values)]


@moe_experts_train.register_fake
def _(x, topk_weights, topk_ids, w1, w1_scale, w2, w2_scale, recipe, capacity_factor, drop_policy, activation,
      check_ids):
    return _empty_train_outputs(x, topk_ids, w1, recipe is not None)


@torch.library.custom_op("lowprec::moe_experts_backward", mutates_args=())
def moe_experts_backward(dy: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                         plan: list[torch.Tensor], x: torch.Tensor, x_scale: torch.Tensor | None, h: torch.Tensor,
                         h_scale: torch.Tensor | None, w1: torch.Tensor, w1_scale: torch.Tensor | None,
                         w2: torch.Tensor, w2_scale: torch.Tensor | None, activation: str, w1_dtype: torch.dtype,
                         w2_dtype: torch.dtype, needs: list[bool]) -> list[torch.Tensor]:
    """Gradients ``[dx, dtopk_weights, dw1, dw2]`` (an empty tensor where ``needs`` is False) from
    :func:`moe_experts_train`'s outputs: ``plan`` (kept, slot_rows, row_slots, counts,
    group_ends, row weights), ``x``/``h`` (FP8 with scales, or float without) and the transposed
    weights ``w1`` [E, H, 2F], ``w2`` [E, F, H] (FP8 with 128x128 scales, or the float weights
    [E, 2F, H], [E, H, F] unquantized)."""

    kept, slot_rows, row_slots, counts, group_ends, row_w = plan
    routing = Routing(topk_weights=topk_weights, topk_ids=topk_ids.long(), kept=kept, slot_rows=slot_rows,
                      row_slots=row_slots, counts=counts, group_ends=group_ends, capacity=None)
    quantized = x_scale is not None
    if quantized:
        act = get_recipe(_ACT_RECIPE)
        x = QuantizedTensor(x, x_scale, act, x.shape, dy.dtype)
        h = QuantizedTensor(h, h_scale, act, h.shape, dy.dtype)
        weight = get_recipe(_WEIGHT_RECIPE)
        w1 = QuantizedTensor(w1, w1_scale, weight, w1.shape, w1_dtype)
        w2 = QuantizedTensor(w2, w2_scale, weight, w2.shape, w2_dtype)
    with torch.no_grad():
        grads = _backward_core(dy.contiguous(), routing, x, h, w1, w2, row_w, quantized, activation,
                               (dy.dtype, topk_weights.dtype, w1_dtype, w2_dtype), tuple(needs))
    return [_into(e, g) if g is not None else e
            for e, g in zip(_empty_grads(dy, topk_weights, w1.shape, w2.shape, quantized, w1_dtype, w2_dtype, needs),
                            grads)]


def _empty_grads(dy, topk_weights, w1_shape, w2_shape, quantized: bool, w1_dtype, w2_dtype, needs) -> list:
    """``moe_experts_backward``'s outputs: shapes of the inputs they are gradients of (size 0 where
    not needed); quantized, ``w1_shape``/``w2_shape`` are the transposed weights'."""
    e = w1_shape[0]
    if quantized:  # [E, H, 2F] and [E, F, H] -> [E, 2F, H] and [E, H, F]
        w1_shape, w2_shape = (e, w1_shape[2], w1_shape[1]), (e, w2_shape[2], w2_shape[1])
    shapes = (dy.shape, topk_weights.shape, w1_shape, w2_shape)
    dtypes = (dy.dtype, topk_weights.dtype, w1_dtype, w2_dtype)
    return [dy.new_empty(shape if need else (0,), dtype=dtype) for shape, dtype, need in zip(shapes, dtypes, needs)]


@moe_experts_backward.register_fake
def _(dy, topk_weights, topk_ids, plan, x, x_scale, h, h_scale, w1, w1_scale, w2, w2_scale, activation, w1_dtype,
      w2_dtype, needs):
    return _empty_grads(dy, topk_weights, w1.shape, w2.shape, x_scale is not None, w1_dtype, w2_dtype, needs)


class _TracedExperts(torch.autograd.Function):
    """:func:`lowprec.moe.experts` with gradients, as torch.compile traces it: the weights'
    quantization in the graph, the rest in the two ops above."""

    @staticmethod
    def forward(ctx, x, topk_weights, topk_ids, w1, w1_scale, w2, w2_scale, recipe, capacity_factor, drop_policy,
                activation, check_ids):

        quantized = recipe is not None
        w1_master, w2_master = _weights(w1, w1_scale, w2, w2_scale, x.dtype)
        w1f, w2f, w1b, w2b = _prepare_weights(w1_master, w2_master, quantized, for_backward=True)
        outs = moe_experts_train(x, topk_weights, topk_ids, *split_weight(w1f), *split_weight(w2f), recipe,
                                 capacity_factor, drop_policy, activation, check_ids)
        if quantized:  # codes and scales
            x_saved, h_saved = outs[7:9], outs[9:11]
        else:
            (h,) = outs[7:]
            x_saved, h_saved = (x, None), (h, None)
        ctx.save_for_backward(topk_weights, topk_ids, *outs[1:7], *x_saved, *h_saved, *split_weight(w1b),
                              *split_weight(w2b))
        ctx.activation = activation
        ctx.dtypes = (w1.dtype if w1_scale is None else x.dtype, w2.dtype if w2_scale is None else x.dtype)
        return outs[0]

    @staticmethod
    def backward(ctx, dy):
        topk_weights, topk_ids, *rest = ctx.saved_tensors
        plan, saved = rest[:6], rest[6:]
        needs = [ctx.needs_input_grad[i] for i in (0, 1, 3, 5)]
        grads = moe_experts_backward(dy, topk_weights, topk_ids, plan, *saved, ctx.activation, *ctx.dtypes, needs)
        dx, dweights, dw1, dw2 = (g if need else None for g, need in zip(grads, needs))
        return dx, dweights, None, dw1, None, dw2, None, None, None, None, None, None


def split_weight(w) -> tuple:
    """``(data, scale)`` of a QuantizedTensor, ``(w, None)`` of a float tensor."""
    return (w.data, w.scale) if isinstance(w, QuantizedTensor) else (w, None)


def traced_experts(x, topk_weights, topk_ids, w1, w2, recipe, capacity_factor, drop_policy, activation, check_ids):
    """:func:`lowprec.moe.experts` under torch.compile: one op without gradients, else the
    autograd function over the training ops."""

    w1, w1_scale = split_weight(w1)
    w2, w2_scale = split_weight(w2)
    if _needs_grad(x, topk_weights, w1, w2):
        return _TracedExperts.apply(x, topk_weights, topk_ids, w1, w1_scale, w2, w2_scale, recipe, capacity_factor,
                                    drop_policy, activation, check_ids)
    return moe_experts(x, topk_weights, topk_ids, w1, w1_scale, w2, w2_scale, recipe, capacity_factor, drop_policy,
                       activation, check_ids)
