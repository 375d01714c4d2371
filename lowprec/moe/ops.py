"""torch.library custom ops for the MoE layer when no gradient is needed, used while
``torch.compile`` traces.

CuTe DSL launches cannot go into a graph, and the dispatch plan has data-dependent sizes on the
CPU, so a traced MoE layer used to cost a graph break (its steps ran eagerly). An inference call
(no input needs a gradient) is instead one op: ``moe_layer`` (the modules: router, top-k,
dispatch, packing, both grouped GEMMs, the activation, the combine) or ``moe_experts``
(:func:`lowprec.moe.experts`: routing given), run eagerly inside. Their output is ``[T, H]``
whatever the routing, so the graph around them holds (``fullgraph=True``); on CUDA the whole step
can be captured (``mode="reduce-overhead"``: CUDA graphs), which removes the host time of its
launches. The router runs inside ``moe_layer`` too: inductor's softmax rounds differently in the
last bit, and in the op the result is the eager one bit for bit.
"""

from __future__ import annotations

import torch

from ..recipes import get_recipe
from ..tensor import QuantizedTensor

__all__ = ["moe_experts", "moe_layer"]

_WEIGHT_RECIPE = "fp8_block128x128"


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
    from .layer import experts

    w1, w2 = _weights(w1, w1_scale, w2, w2_scale, x.dtype)
    with torch.no_grad():
        return experts(x, topk_weights, topk_ids, w1, w2, recipe=recipe, capacity_factor=capacity_factor,
                       drop_policy=drop_policy, activation=activation, check_ids=check_ids)


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
    from .layer import _route_and_apply_eager

    w1, w2 = _weights(w1, w1_scale, w2, w2_scale, router_weight.dtype)
    with torch.no_grad():
        return _route_and_apply_eager(tokens, router_weight, w1, w2, recipe, top_k, score_func, renormalize,
                                      capacity_factor, drop_policy, activation)[0]


@moe_layer.register_fake
def _(tokens, router_weight, w1, w1_scale, w2, w2_scale, recipe, top_k, score_func, renormalize, capacity_factor,
      drop_policy, activation):
    return tokens.new_empty(tokens.shape)
