"""Token packing: tokens to expert-contiguous rows (fused with quantization) and the weighted combine back.

This is the reference the GPU kernels match bit for bit. Buffers have ``T·k`` rows, sized from the
shapes alone (no device-to-host sync); see :mod:`lowprec.moe.routing` for the row order.
"""

from __future__ import annotations

import dataclasses

import torch

from ..quant import quantize
from ..recipes import ScaleRecipe, get_recipe
from ..runtime import differentiable_once, eager_under_compile, graph_anchors, registry
from ..tensor import QuantizedTensor
from .routing import Routing

__all__ = ["gather_rows", "pack", "pack_tokens", "unpack"]

_KERNEL_RECIPE = "fp8_block1x128"  # the Hopper packing kernel's recipe (exact FP32 scales)


def _check_routing(routing: Routing) -> None:
    if not isinstance(routing, Routing):
        raise TypeError(f"routing: expected a lowprec.moe.Routing (route / dispatch), got {type(routing).__name__}")


def gather_rows(x: torch.Tensor | QuantizedTensor, routing: Routing) -> torch.Tensor | QuantizedTensor:
    """Rows of ``x`` (``[T, H]``, one per token) in packed order: ``[T·k, H]``, padding rows zero.

    ``x`` may be a QuantizedTensor of a row-local recipe (see :func:`pack`): the result is then the
    packed QuantizedTensor, padding rows holding what quantizing a zero row gives (data 0, and
    that row's scale: 1 for FP32 scales).
    """
    _check_routing(routing)
    _check_tokens(x, routing)
    tokens = routing.num_tokens
    # padding rows (slot -1) read the appended zero row at index T
    src = torch.where(routing.row_slots >= 0, routing.row_slots // routing.top_k, tokens)
    if isinstance(x, QuantizedTensor):
        if not _row_local(x.recipe):
            raise ValueError(f"x: rows must be quantized independently (1 x N blocks, no global scale), got "
                             f"{x.recipe.name!r} with block {x.recipe.block}")
        zero = quantize(torch.zeros(1, x.shape[1], dtype=torch.float32, device=x.device), x.recipe, check_finite=False)
        data = torch.cat([x.data, zero.data])[src]
        scale = torch.cat([x.scale, zero.scale])[src]
        return QuantizedTensor(data, scale, x.recipe, (routing.num_rows, x.shape[1]), x.dtype)
    return torch.cat([x, x.new_zeros(1, x.shape[1])])[src]


def _check_tokens(x: torch.Tensor | QuantizedTensor, routing: Routing) -> None:
    tokens = routing.num_tokens
    if not isinstance(x, (torch.Tensor, QuantizedTensor)) or x.dim() != 2 or x.shape[0] != tokens:
        raise ValueError(f"x: expected [T={tokens}, H], got {type(x).__name__} {tuple(getattr(x, 'shape', ()))}")
    if x.device != routing.row_slots.device:
        raise ValueError(f"x: on {x.device}, but routing is on {routing.row_slots.device}")


def _row_local(recipe: ScaleRecipe) -> bool:
    """Each row quantized on its own, so quantizing and gathering rows commute."""
    return recipe.block[0] == 1 and not recipe.global_scale


@eager_under_compile
def pack(x: torch.Tensor, routing: Routing, recipe: str | ScaleRecipe | None = "fp8_block1x128"
         ) -> tuple[torch.Tensor | QuantizedTensor, torch.Tensor]:
    """Gather tokens into expert-contiguous rows, quantized on the way (the grouped GEMM's ``a``).

    Args:
        x: ``[T, H]`` float tokens (not modified).
        routing: from :func:`~lowprec.moe.route` or :func:`~lowprec.moe.dispatch`.
        recipe: a row-local recipe (rows quantized independently: ``fp8_block1x128``,
            ``fp8_rowwise``, ``mxfp8``, ...), or None for plain rows in ``x``'s dtype.

    Returns:
        ``(rows, group_ends)``: ``[T·k, H]`` rows (row ``p < group_ends[-1]`` is token
        ``row_slots[p] // k``, the rest zero padding) and the int32 cumulative ends of the experts'
        groups. Bit-identical to quantizing the gathered rows; computed, as the kernel does, by
        quantizing the ``T`` tokens once and copying each to its ``k`` rows. On Hopper,
        ``fp8_block1x128`` runs one CuTe DSL kernel (scales MN-major, as the GEMM reads them),
        without device-to-host syncs (CUDA-graph capturable).
    """
    _check_pack_input(x, routing)
    if recipe is None:
        return gather_rows(x, routing), routing.group_ends
    rows, _ = _pack_quantized(x, routing, _pack_recipe(recipe), with_tokens=False)
    return rows, routing.group_ends


@eager_under_compile
def pack_tokens(x: torch.Tensor, routing: Routing, recipe: str | ScaleRecipe = "fp8_block1x128"
                ) -> tuple[QuantizedTensor, QuantizedTensor, torch.Tensor]:
    """:func:`pack`, and the tokens quantized in place (``quantize(x, recipe)``, one row per token).

    Returns ``(rows, tokens, group_ends)``, bit-identical to ``(gather_rows(tokens, routing),
    quantize(x, recipe), routing.group_ends)``. On Hopper (``fp8_block1x128``) one kernel writes
    both from one read of ``x``, sync-free.
    """
    _check_pack_input(x, routing)
    rows, tokens = _pack_quantized(x, routing, _pack_recipe(recipe), with_tokens=True)
    return rows, tokens, routing.group_ends


def _check_pack_input(x: torch.Tensor, routing: Routing) -> None:
    _check_routing(routing)
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise ValueError(f"x: expected a float tensor [T={routing.num_tokens}, H], got "
                         f"{getattr(x, 'dtype', type(x))} {tuple(getattr(x, 'shape', ()))}")


def _pack_recipe(recipe: str | ScaleRecipe) -> ScaleRecipe:
    r = get_recipe(recipe)
    if not _row_local(r):
        raise ValueError(f"recipe: pack needs a recipe that quantizes each row on its own (1 x N blocks, no global "
                         f"scale), got {r.name!r} with block {r.block}")
    return r


def _pack_quantized(x: torch.Tensor, routing: Routing, r: ScaleRecipe, with_tokens: bool
                    ) -> tuple[QuantizedTensor, QuantizedTensor | None]:
    """The packed rows and the quantized tokens (None from the kernel without ``with_tokens``)."""
    _check_tokens(x, routing)
    x = x.detach()

    def reference():
        tokens = quantize(x, r, check_finite=False)
        return gather_rows(tokens, routing), tokens

    def wrap(q, s, xq, xs):
        rows = QuantizedTensor(q, s, r, (routing.num_rows, x.shape[1]), x.dtype)
        return rows, (QuantizedTensor(xq, xs, r, x.shape, x.dtype) if with_tokens else None)

    args = (x, routing, r, with_tokens)
    return registry.run("moe_pack", x.device, args, reference, lambda kernel: wrap(*kernel(*args)))


@eager_under_compile
def unpack(rows: torch.Tensor | QuantizedTensor, routing: Routing, weights: torch.Tensor | None = None,
           out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Combine packed rows back to tokens: ``out[t] = Σ_j weights[t, j] · rows[slot_rows[t, j]]``.

    Deterministic: accumulated in FP32 in top-k slot order ``j = 0, …, k−1`` from 0, each term
    rounded to FP32 (``weight · row``, not fused) before it is added; dropped slots add nothing.
    Differentiable with respect to ``rows`` and ``weights``. No atomics, no device-to-host sync.
    On Hopper (rows and ``out_dtype`` bf16 / fp16 / fp32, ``H`` a multiple of 16) one CuTe DSL
    kernel reads each token's k rows once, bit-identical to the reference (plain torch ops, which
    also run on CPU); its backward is torch ops (:class:`_UnpackKernel`).

    Args:
        rows: ``[T·k, H]`` packed rows (a QuantizedTensor is dequantized).
        routing: the routing the rows were packed with.
        weights: ``[T, k]`` combine weights, or None for all ones (a plain sum).
        out_dtype: default ``rows``' dtype.

    Returns:
        ``[T, H]``; tokens whose slots were all dropped are zero.
    """
    _check_routing(routing)
    # else an int dtype truncates the sums silently, and a string fails inside torch as a device name
    if out_dtype is not None and not (isinstance(out_dtype, torch.dtype) and out_dtype.is_floating_point):
        raise TypeError(f"out_dtype: expected a float torch.dtype or None, got {out_dtype!r}")
    if isinstance(rows, QuantizedTensor):
        out_dtype = rows.dtype if out_dtype is None else out_dtype  # the rows' dtype, not the FP32 dequantized
        rows = rows.dequantize(torch.float32)
    if not isinstance(rows, torch.Tensor) or not rows.is_floating_point() or rows.dim() != 2 \
            or rows.shape[0] != routing.num_rows:
        raise ValueError(f"rows: expected a float tensor [T·k={routing.num_rows}, H], got "
                         f"{getattr(rows, 'dtype', type(rows))} {tuple(getattr(rows, 'shape', ()))}")
    if weights is not None and (not isinstance(weights, torch.Tensor) or not weights.is_floating_point()
                                or weights.shape != routing.kept.shape):
        raise ValueError(f"weights: expected a float tensor of shape {tuple(routing.kept.shape)}, got "
                         f"{getattr(weights, 'dtype', type(weights))} {tuple(getattr(weights, 'shape', ()))}")
    if weights is not None and weights.device != rows.device:
        raise ValueError(f"weights: on {weights.device}, but rows are on {rows.device}")
    if rows.device != routing.slot_rows.device:
        raise ValueError(f"rows: on {rows.device}, but routing is on {routing.slot_rows.device}")
    out_dtype = rows.dtype if out_dtype is None else out_dtype
    needs_grad = torch.is_grad_enabled() and (rows.requires_grad or (weights is not None and weights.requires_grad))

    def launch(kernel):
        if needs_grad:
            return _UnpackKernel.apply(kernel, rows, weights, routing, out_dtype)
        return kernel(rows, routing, weights, out_dtype)

    return registry.run("moe_unpack", rows.device, (rows, routing, weights, out_dtype),
                        lambda: _unpack_reference(rows, routing, weights, out_dtype), launch)


def _unpack_reference(rows: torch.Tensor, routing: Routing, weights: torch.Tensor | None,
                      out_dtype: torch.dtype) -> torch.Tensor:
    src = routing.slot_rows.clamp(min=0)
    acc = rows.new_zeros(routing.num_tokens, rows.shape[1], dtype=torch.float32)
    zero = acc.new_zeros(())
    for j in range(routing.top_k):
        term = rows[src[:, j]].float()
        if weights is not None:
            term = term * weights[:, j, None].float()
        acc = acc + torch.where(routing.kept[:, j, None], term, zero)
    return acc.to(out_dtype)


def _fp32_weights(rows: torch.Tensor, routing: Routing, weights: torch.Tensor | None) -> torch.Tensor:
    """FP32 ``[T, k]`` contiguous weights, as the reference rounds them (ones for a plain sum: exact)."""
    if weights is None:
        return torch.ones(routing.kept.shape, dtype=torch.float32, device=rows.device)
    return weights.detach().float().contiguous()


class _UnpackKernel(torch.autograd.Function):
    """An unpack ``kernel`` with gradients for ``rows`` and ``weights``, computed with torch ops:
    packed row ``p`` holding slot ``(t, j)`` gets ``weights[t, j] · dout[t]`` (rounded to FP32, then
    to ``rows``' dtype: the reference's gradient), padding rows 0; ``dweights[t, j] =
    ⟨dout[t], rows[slot_rows[t, j]]⟩`` over kept slots (FP32; the sum's order is torch's)."""

    @staticmethod
    def forward(ctx, kernel, rows, weights, routing: Routing, out_dtype):
        w = _fp32_weights(rows, routing, weights)
        ctx.save_for_backward(rows, w)
        ctx.graph_anchors = graph_anchors(rows, weights)  # for differentiable_once
        ctx.routing = dataclasses.replace(routing, topk_weights=routing.topk_weights.detach())
        ctx.weights_dtype = None if weights is None else weights.dtype
        return kernel(rows.detach(), routing, w, out_dtype)

    @staticmethod
    @differentiable_once  # the saved weights are detached: a second derivative is an error, not a partial value
    def backward(ctx, dout):
        rows, w = ctx.saved_tensors
        routing = ctx.routing
        dout = dout.float()
        drows = dweights = None
        if ctx.needs_input_grad[1]:
            slots = routing.row_slots.clamp(min=0)
            drows = dout[slots // routing.top_k] * w.reshape(-1)[slots, None]
            drows = torch.where((routing.row_slots >= 0)[:, None], drows, 0.0).to(rows.dtype)
        if ctx.needs_input_grad[2]:
            src = routing.slot_rows.clamp(min=0)
            dweights = torch.stack([torch.linalg.vecdot(dout, rows[src[:, j]].float())
                                    for j in range(routing.top_k)], dim=1)
            dweights = torch.where(routing.kept, dweights, 0.0).to(ctx.weights_dtype)
        return None, drows, dweights, None, None
