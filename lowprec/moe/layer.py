"""The MoE's public forms: :func:`experts` (routed experts on given top-k choices) and the
:class:`MoE` / :class:`FP8InferenceMoE` modules (router included). The computation is in
:mod:`.core` (its docstring describes the FP8 scheme); under ``torch.compile`` both go through
the custom ops of :mod:`.ops`."""

from __future__ import annotations

import math
import warnings

import torch
import torch.nn.functional as F
from torch import nn

from ..nn.buffers import QuantizedBuffersModule
from ..nn.functional import follow_autocast, output_as
from ..quant import quantize
from ..recipes import get_recipe
from ..tensor import QuantizedTensor
from .core import (
    _WEIGHT_RECIPE,
    _X_DTYPES,
    ACTIVATIONS,
    RECIPES,
    _check_experts_args,
    _check_options,
    _dispatch_and_apply,
    _needs_grad,
    _route_and_apply_eager,
)
from .ops import moe_layer, split_weight, traced_experts
from .routing import (
    DROP_POLICIES,
    SCORE_FUNCS,
    Routing,
    _check_capacity_factor,
    _check_renormalize,
    _check_size,
    _check_top_k,
    _plain_capacity_factor,
    select_experts,
)

__all__ = ["MoE", "FP8InferenceMoE", "experts", "ACTIVATIONS", "RECIPES"]


def experts(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, w1: torch.Tensor | QuantizedTensor,
            w2: torch.Tensor | QuantizedTensor, *, recipe: str | None = "fp8_block",
            capacity_factor: float | None = None, drop_policy: str = "probs", activation: str = "swiglu",
            check_ids: bool = True) -> torch.Tensor:
    """Routed experts: ``y[t] = Σ_j topk_weights[t, j] · FFN_{topk_ids[t, j]}(x[t])`` over kept slots.

    ``FFN_e(x) = act(x · W1ₑᵀ) · W2ₑᵀ`` with a gated activation (``swiglu``: ``silu(gate) · up``;
    ``geglu``: ``gelu(gate) · up``), ``W1ₑ = [gate rows; up rows]``. Differentiable with respect to
    ``x``, ``topk_weights`` (so the router trains), ``w1`` and ``w2``; none of them is modified.

    Args:
        x: ``[T, H]`` float32 / bfloat16 / float16 tokens; the output and the GEMM outputs use
            this dtype.
        topk_weights: ``[T, k]`` float combine weights.
        topk_ids: ``[T, k]`` int32/int64 expert ids.
        w1: ``[E, 2F, H]`` gate and up projections; w2: ``[E, H, F]`` down projections (any float
            dtype: master weights stay as they are, their gradients come in their dtype). With
            ``recipe="fp8_block"`` they may also be FP8 already, ``QuantizedTensor`` s of
            ``fp8_block128x128`` (``lowprec.quantize(w, "fp8_block128x128")``, e.g. kept for
            inference): used as they are, no per-call quantization, no gradient for them.
        recipe: ``"fp8_block"`` (module docstring; H and F multiples of 16) or None (unquantized).
        capacity_factor, drop_policy: see :func:`~lowprec.moe.dispatch`.
        activation: ``"swiglu"`` or ``"geglu"``.
        check_ids: check that every id is in ``[0, E)``; on CUDA this reads a flag back from the
            device. Pass False for a call without host sync (CUDA-graph capture) when the ids
            come from a top-k over E experts (as in :class:`MoE`, which never checks).

    Returns:
        ``[T, H]`` in ``x``'s dtype (the autocast dtype inside ``torch.autocast``, as ``nn.Linear``;
        gradients come back in each input's dtype); tokens whose slots were all dropped give 0.

    Under ``torch.compile`` (no graph break, :mod:`lowprec.moe.ops`) a call that needs no gradient
    is one custom op (``lowprec::moe_experts``, CUDA-graph capturable with ``check_ids=False``);
    one that needs gradients is an autograd function over a forward and a backward op, the
    weights quantized in the traced graph. Both give the eager result bit for bit.
    """
    _check_experts_args(x, topk_weights, topk_ids, w1, w2, recipe, activation)
    x, autocast_off = follow_autocast(x)
    with autocast_off:
        if torch.compiler.is_compiling():
            if capacity_factor is not None and type(capacity_factor) not in (int, float):
                # dynamo makes numpy scalars tensors and cannot trace Fraction; without
                # fullgraph this graph-breaks and the call runs eagerly
                raise TypeError("capacity_factor: expected a Python float, int or None under torch.compile "
                                "(numpy scalars and Fraction do not trace): pass float(capacity_factor)")
            return traced_experts(x, topk_weights, topk_ids, w1, w2, recipe, capacity_factor, drop_policy,
                                  activation, check_ids)
        return _dispatch_and_apply(x, topk_weights, topk_ids, w1, w2, recipe, capacity_factor, drop_policy,
                                   activation, check_ids)


class MoE(nn.Module):
    """Mixture-of-experts feed-forward layer: router, top-k routing, routed gated-FFN experts.

    Args:
        hidden_size: H (a multiple of 16 for FP8 recipes).
        ffn_size: F, each expert's intermediate size (a multiple of 16 for FP8 recipes).
        num_experts: E.
        top_k: experts per token, ``1 ≤ top_k ≤ E``.
        capacity_factor: None (dropless) or > 0; drop_policy: ``"probs"`` or ``"position"``
            (see :func:`~lowprec.moe.dispatch`).
        activation: ``"swiglu"`` or ``"geglu"``.
        recipe: ``"fp8_block"`` or None (see :func:`experts`).
        score_func, renormalize: see :func:`~lowprec.moe.select_experts`.

    Parameters: ``router`` (``nn.Linear(H, E, bias=False)``, applied in FP32, never quantized),
    ``w1`` ``[E, 2F, H]`` (gate rows, then up rows) and ``w2`` ``[E, H, F]``; FP8 copies of the
    weights are made each forward (once per :func:`lowprec.nn.reuse_quantized_weights` block,
    e.g. over the micro-batches of a step; not while ``torch.compile`` traces), the parameters keep
    their dtype. Under ``torch.compile`` (:mod:`lowprec.moe.ops`) ``fullgraph=True`` holds: a
    forward without gradients (inference, evaluation) is one custom op (``mode="reduce-overhead"``
    captures it into CUDA graphs, the eager result bit for bit); with gradients the router is
    traced (inductor may round its softmax differently in the last bit) and the experts run as an
    autograd function over a forward and a backward op.
    """

    def __init__(self, hidden_size: int, ffn_size: int, num_experts: int, top_k: int,
                 capacity_factor: float | None = None, activation: str = "swiglu", recipe: str | None = "fp8_block",
                 score_func: str = "softmax", renormalize: bool = True, drop_policy: str = "probs",
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        _set_config(self, hidden_size, ffn_size, num_experts, top_k, capacity_factor, activation, recipe,
                    score_func, renormalize, drop_policy)
        if self.top_k == 1 and self.renormalize:
            warnings.warn("MoE: top_k=1 with renormalize=True makes every routing weight 1, so the router "
                          "gets no gradient and never trains; pass renormalize=False to weight each token's "
                          "expert by its score", UserWarning, stacklevel=2)
        self.recipe = recipe
        factory = {"device": device, "dtype": dtype}
        self.router = nn.Linear(hidden_size, num_experts, bias=False, **factory)
        self.w1 = nn.Parameter(torch.empty(num_experts, 2 * ffn_size, hidden_size, **factory))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, ffn_size, **factory))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Router: nn.Linear's default; experts: uniform ±1/√fan_in, as nn.Linear per expert."""
        self.router.reset_parameters()
        nn.init.uniform_(self.w1, -1 / math.sqrt(self.hidden_size), 1 / math.sqrt(self.hidden_size))
        nn.init.uniform_(self.w2, -1 / math.sqrt(self.ffn_size), 1 / math.sqrt(self.ffn_size))

    def forward(self, x: torch.Tensor, return_routing: bool = False) -> torch.Tensor | tuple[torch.Tensor, Routing]:
        """``x [..., H]`` to ``[..., H]``; with ``return_routing`` also the :class:`Routing` (``.stats()``)."""
        return _route_and_apply(self, x, self.w1, self.w2, self.recipe, return_routing)

    def fp8_block_weights(self) -> tuple[str, ...]:
        """The parameters quantized in 128x128 blocks (:func:`lowprec.nn.enable_fp8_all_gather`):
        the expert weights, each expert's matrix on its own (FSDP shards them along the experts)."""
        return ("w1", "w2") if self.recipe == "fp8_block" else ()

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, ffn_size={self.ffn_size}, num_experts={self.num_experts}, "
                f"top_k={self.top_k}, capacity_factor={self.capacity_factor}, drop_policy={self.drop_policy!r}, "
                f"activation={self.activation!r}, recipe={self.recipe!r}, score_func={self.score_func!r}, "
                f"renormalize={self.renormalize}")


def _set_config(module: nn.Module, hidden_size: int, ffn_size: int, num_experts: int, top_k: int,
                capacity_factor: float | None, activation: str, recipe: str | None, score_func: str,
                renormalize: bool, drop_policy: str) -> None:
    """Validate the MoE modules' arguments and set them on ``module`` (all but the recipe)."""
    hidden_size, ffn_size, num_experts = (_check_size(name, value) for name, value in (
        ("hidden_size", hidden_size), ("ffn_size", ffn_size), ("num_experts", num_experts)))
    top_k = _check_top_k(top_k, num_experts)
    _check_capacity_factor(capacity_factor)
    _check_options(recipe, activation, hidden_size, ffn_size)
    if score_func not in SCORE_FUNCS:
        raise ValueError(f"score_func: expected one of {SCORE_FUNCS}, got {score_func!r}")
    if drop_policy not in DROP_POLICIES:
        raise ValueError(f"drop_policy: expected one of {DROP_POLICIES}, got {drop_policy!r}")
    renormalize = _check_renormalize(renormalize)
    module.hidden_size, module.ffn_size, module.num_experts, module.top_k = hidden_size, ffn_size, num_experts, top_k
    module.capacity_factor, module.drop_policy = _plain_capacity_factor(capacity_factor), drop_policy
    module.activation, module.score_func, module.renormalize = activation, score_func, renormalize


def _route_and_apply(module: MoE | FP8InferenceMoE, x: torch.Tensor, w1, w2, recipe: str | None,
                     return_routing: bool) -> torch.Tensor | tuple[torch.Tensor, Routing]:
    """The MoE modules' forward: router in FP32, top-k routing, then the routed experts. Traced by
    torch.compile without a gradient to come, all of it is the ``lowprec::moe_layer`` op (the
    eager result bit for bit); with gradients the router is traced and the experts are
    :func:`experts`' training ops; with ``return_routing`` it runs eagerly (a graph break)."""
    if not isinstance(x, torch.Tensor) or x.dtype not in _X_DTYPES or x.dim() < 1 \
            or x.shape[-1] != module.hidden_size:
        raise ValueError(f"x: expected a float32/bfloat16/float16 tensor [..., H={module.hidden_size}], got "
                         f"{getattr(x, 'dtype', type(x))} {tuple(getattr(x, 'shape', ()))}")
    config = (module.top_k, module.score_func, module.renormalize, module.capacity_factor, module.drop_policy,
              module.activation)
    tokens, autocast_off = follow_autocast(x.reshape(-1, module.hidden_size))
    with autocast_off:  # the router stays FP32
        if torch.compiler.is_compiling() and not return_routing:
            if not _needs_grad(x, module.router.weight, w1, w2):
                return moe_layer(tokens, module.router.weight, *split_weight(w1), *split_weight(w2), recipe,
                                 *config).reshape(x.shape)
            weights, ids = select_experts(F.linear(tokens.float(), module.router.weight.float()), module.top_k,
                                          score_func=module.score_func, renormalize=module.renormalize)
            return traced_experts(tokens, weights, ids, w1, w2, recipe, module.capacity_factor, module.drop_policy,
                                  module.activation, False).reshape(x.shape)
        y, routing = _route_and_apply_eager(tokens, module.router.weight, w1, w2, recipe, *config)
    return (output_as(y, x.shape), routing) if return_routing else output_as(y, x.shape)


class FP8InferenceMoE(QuantizedBuffersModule):
    """Inference :class:`MoE` keeping only FP8 expert weights: about half the memory of bf16
    experts, and no weight quantization per call (the expert weights are quantized once).

    Build it from a trained layer with :meth:`from_moe` or :func:`lowprec.convert` (``inference=True``);
    save and load it with ``state_dict()`` and :func:`lowprec.save` / :func:`lowprec.load`.
    Arguments as :class:`MoE`'s (its ``recipe`` is always ``"fp8_block"``); ``dtype``: the router's.

    Buffers: ``w1`` (float8_e4m3fn ``[E, 2F, H]``) with ``w1_scale`` (FP32
    ``[E, ceil(2F/128), ceil(H/128)]``, one scale per 128x128 block), ``w2`` (``[E, H, F]``) with
    ``w2_scale``; the ``router`` stays an ``nn.Linear`` applied in FP32. Module casts
    (``.half()``, ``.to(dtype)``) cast the router and leave these buffers as they are. The
    forward is the FP8 forward of :class:`MoE` with the same quantized weights, so it gives the
    same outputs; it is differentiable in ``x`` (the expert weights are constants).
    """

    _quantized = ("w1", "w1_scale", "w2", "w2_scale")

    def __init__(self, hidden_size: int, ffn_size: int, num_experts: int, top_k: int,
                 capacity_factor: float | None = None, activation: str = "swiglu", score_func: str = "softmax",
                 renormalize: bool = True, drop_policy: str = "probs", device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        _set_config(self, hidden_size, ffn_size, num_experts, top_k, capacity_factor, activation, "fp8_block",
                    score_func, renormalize, drop_policy)
        self.router = nn.Linear(hidden_size, num_experts, bias=False, device=device, dtype=dtype)
        for name, rows, cols in (("w1", 2 * ffn_size, hidden_size), ("w2", hidden_size, ffn_size)):
            self.register_buffer(name, torch.zeros(num_experts, rows, cols, dtype=torch.float8_e4m3fn,
                                                   device=device))
            # FP32 as quantize's scales, whatever the default dtype (a load checks the buffers' dtypes)
            self.register_buffer(f"{name}_scale", torch.ones(num_experts, -(-rows // 128), -(-cols // 128),
                                                             dtype=torch.float32, device=device))

    @classmethod
    def from_moe(cls, moe: MoE) -> FP8InferenceMoE:
        """Quantize ``moe``'s expert weights once (128x128 blocks); the router is copied. A
        meta-device ``moe`` gives a meta-device layer (values to come from ``load_state_dict(...,
        assign=True)``)."""
        if not isinstance(moe, MoE):
            raise TypeError(f"moe: expected a lowprec.moe.MoE, got {type(moe).__name__}")
        if moe.w1.is_meta or moe.w2.is_meta:  # a skeleton: no values to quantize
            return cls(moe.hidden_size, moe.ffn_size, moe.num_experts, moe.top_k, moe.capacity_factor, moe.activation,
                       moe.score_func, moe.renormalize, moe.drop_policy, device="meta", dtype=moe.router.weight.dtype)
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        _set_config(layer, moe.hidden_size, moe.ffn_size, moe.num_experts, moe.top_k, moe.capacity_factor,
                    moe.activation, "fp8_block", moe.score_func, moe.renormalize, moe.drop_policy)
        layer.router = nn.Linear(moe.hidden_size, moe.num_experts, bias=False, device=moe.router.weight.device,
                                 dtype=moe.router.weight.dtype)
        with torch.no_grad():
            layer.router.weight.copy_(moe.router.weight)
            for name in ("w1", "w2"):
                q = quantize(getattr(moe, name).detach(), _WEIGHT_RECIPE)
                layer.register_buffer(name, q.data)
                layer.register_buffer(f"{name}_scale", q.scale)
        return layer

    def quantized_weights(self) -> tuple[QuantizedTensor, QuantizedTensor]:
        """``(w1, w2)`` as ``fp8_block128x128`` QuantizedTensors (what :func:`experts` takes)."""
        recipe = get_recipe(_WEIGHT_RECIPE)
        return tuple(QuantizedTensor(getattr(self, name), getattr(self, f"{name}_scale"), recipe,
                                     getattr(self, name).shape, self.router.weight.dtype) for name in ("w1", "w2"))

    def forward(self, x: torch.Tensor, return_routing: bool = False) -> torch.Tensor | tuple[torch.Tensor, Routing]:
        """``x [..., H]`` to ``[..., H]``; with ``return_routing`` also the :class:`Routing` (``.stats()``)."""
        w1, w2 = self.quantized_weights()
        return _route_and_apply(self, x, w1, w2, "fp8_block", return_routing)

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, ffn_size={self.ffn_size}, num_experts={self.num_experts}, "
                f"top_k={self.top_k}, capacity_factor={self.capacity_factor}, drop_policy={self.drop_policy!r}, "
                f"activation={self.activation!r}, score_func={self.score_func!r}, renormalize={self.renormalize}")
