"""The SwiGLU MLP ``down(silu(gate(x)) · up(x))`` (Llama's) in FP8, its activation fused with the
quantizations around it.

Every GEMM is an FP8 GEMM of the ``fp8_block`` recipe (or ``fp8_block_wgrad2d``: the weight
gradients read ``x`` and ``A`` in 128x128 blocks), as with three :class:`~lowprec.nn.FP8Linear` layers; what
changes is the work between them (on Hopper, one pass of the quantize kernels each):

- ``x`` is quantized once (both orientations) for the gate and up GEMMs, not once per layer;
- forward: ``A = silu(g) · u`` in FP32 from the two GEMM outputs, quantized along features (the
  down GEMM's input) and along tokens (its weight gradient's) in one pass: ``A`` is never written
  in 16 bits, and the separate silu, product and quantization passes go;
- backward: the gate's gradient ``silu_backward(dA · u, g)`` and the up projection's ``dA ·
  silu(g)`` come quantized in both orientations from ``g``, ``u`` and ``dA``, one pass each,
  instead of two products, silu's backward and two quantizations.

Saved for the backward: ``x`` and ``A`` in FP8 along tokens, ``g`` and ``u`` in the compute dtype,
the transposed FP8 weights. The SwiGLU values are FP32 (:func:`lowprec.quant.ops.swiglu_values`;
the GPU kernels' sigmoid is approximate to a few ulp before the E4M3 cast), so the result differs
from three FP8Linear layers where those round ``silu(g) · u`` to 16 bits first.
"""

from __future__ import annotations

import torch
from torch import nn

from ..gemm import gemm
from ..quant import quantize, quantize_dual, swiglu_quantize_dual
from ..recipes import DEFAULT_TRAIN_RECIPE, LINEAR_RECIPES, LinearRecipe
from ..runtime import differentiable_once, graph_anchors
from ..tensor import flatten_all, unflatten_all
from .functional import _FLOAT_DTYPES, follow_autocast, output_as, reject_tangents
from .hooks import has_hooks
from .weight_cache import quantize_weight

__all__ = ["FP8SwiGLUMLP", "SwiGLUMLP", "fp8_swiglu_mlp", "SWIGLU_MLP_CLASSES"]

RECIPES = ("fp8_block", "fp8_block_wgrad16", "fp8_block_wgrad2d")  # the linear recipes the fused MLP computes
_ALIGN = 16
# modules convert() recognises as ``down_proj(act_fn(gate_proj(x)) * up_proj(x))`` with SiLU: the
# transformers MLPs of that form, by class name (their forward is that line), and SwiGLUMLP
SWIGLU_MLP_CLASSES = ("LlamaMLP", "MistralMLP", "Qwen2MLP", "Qwen3MLP", "Qwen2MoeMLP", "Qwen3MoeMLP", "Qwen3NextMLP",
                      "DeepseekV3MLP", "OlmoeMLP", "SwiGLUMLP")


def _grad_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the GEMM stores a weight gradient in (FP32 for other master weights, then cast)."""
    return dtype if dtype in _FLOAT_DTYPES else torch.float32


class _FP8SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2, w_gate, w_up, w_down, recipe: LinearRecipe):
        dt = x2.dtype
        # x along tokens (xt_q) is read only by W_gate's and W_up's gradients, not by W_down's
        if ctx.needs_input_grad[1] or ctx.needs_input_grad[2]:
            x_q, xt_q = quantize_dual(x2, recipe.activation, recipe.wgrad_activation)
        else:
            x_q, xt_q = quantize(x2, recipe.activation, check_finite=False), None
        # the transposed weights the backward multiplies by: dA = dY · W_down (any gradient but
        # W_down's own), dX = dG · W_gate + dU · W_up
        need_x = ctx.needs_input_grad[0]
        wg, wg_t = quantize_weight(w_gate, recipe.weight, with_transpose=need_x)
        wu, wu_t = quantize_weight(w_up, recipe.weight, with_transpose=need_x)
        wd, wd_t = quantize_weight(w_down, recipe.weight, with_transpose=any(ctx.needs_input_grad[:3]))
        y, g, u, at = _gemms(x_q, wg, wu, wd, recipe, dt)
        ctx.recipe = recipe
        ctx.weight_dtypes = (w_gate.dtype, w_up.dtype, w_down.dtype)
        # A along tokens is read only by W_down's gradient: not kept until the backward without it
        at = at if ctx.needs_input_grad[3] else None
        tensors, ctx.specs = flatten_all(xt_q, at, g, u, wg_t, wu_t, wd_t)
        ctx.save_for_backward(*tensors)
        ctx.graph_anchors = graph_anchors(x2, w_gate, w_up, w_down)  # for differentiable_once
        return y

    @staticmethod
    @differentiable_once
    def backward(ctx, dy):
        xt_q, at, g, u, wg_t, wu_t, wd_t = unflatten_all(ctx.saved_tensors, ctx.specs)
        dy = dy.contiguous()
        need_x, need_g, need_u, need_d = ctx.needs_input_grad[:4]
        dx = dwg = dwu = dwd = None
        if need_d:
            dy_q, dyt_q = quantize_dual(dy, ctx.recipe.grad)
            dwd = gemm(dyt_q, at, out_dtype=_grad_dtype(ctx.weight_dtypes[2])).to(ctx.weight_dtypes[2])
        else:
            dy_q = quantize(dy, ctx.recipe.grad, check_finite=False)
        if need_x or need_g or need_u:
            da = gemm(dy_q, wd_t, out_dtype=dy.dtype)
            dg, dgt = swiglu_quantize_dual("swiglu_dgate", g, u, da)
            du, dut = swiglu_quantize_dual("swiglu_dup", g, da)
            if need_g:
                dwg = gemm(dgt, xt_q, out_dtype=_grad_dtype(ctx.weight_dtypes[0])).to(ctx.weight_dtypes[0])
            if need_u:
                dwu = gemm(dut, xt_q, out_dtype=_grad_dtype(ctx.weight_dtypes[1])).to(ctx.weight_dtypes[1])
            if need_x:
                dx = gemm(dg, wg_t, out_dtype=dy.dtype)
                dx += gemm(du, wu_t, out_dtype=dy.dtype)
        return dx, dwg, dwu, dwd, None


def _check(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor) -> None:
    if not isinstance(x, torch.Tensor) or x.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"x: expected a float32 / bfloat16 / float16 tensor, got {getattr(x, 'dtype', type(x))}")
    if x.dim() < 1:
        raise ValueError("x: expected [..., H], got a 0-d tensor")
    for name, w in (("w_gate", w_gate), ("w_up", w_up), ("w_down", w_down)):
        if not isinstance(w, torch.Tensor) or not w.is_floating_point() or w.dim() != 2:
            raise ValueError(f"{name}: expected a 2-D float tensor, got {getattr(w, 'dtype', type(w))} "
                             f"{tuple(getattr(w, 'shape', ()))}")
        if w.device != x.device:
            raise ValueError(f"{name}: on {w.device}, but x is on {x.device}")
    ffn, hidden = w_gate.shape
    if x.shape[-1] != hidden:
        raise ValueError(f"x: last dim {x.shape[-1]} does not match w_gate's H={hidden} (w_gate is [F, H])")
    if w_gate.shape != (ffn, hidden) or w_up.shape != (ffn, hidden):
        raise ValueError(f"w_gate, w_up: expected [F, H={hidden}] each, got {tuple(w_gate.shape)} and "
                         f"{tuple(w_up.shape)}")
    if w_down.shape != (hidden, ffn):
        raise ValueError(f"w_down: expected [H={hidden}, F={ffn}], got {tuple(w_down.shape)}")
    for name, size in (("hidden size", hidden), ("ffn size", ffn)):
        if size % _ALIGN:
            raise ValueError(f"{name}: must be a multiple of {_ALIGN} for the FP8 GEMM, got {size}")


def _swiglu_recipe(recipe: str) -> LinearRecipe:
    if recipe not in RECIPES:
        raise ValueError(f"recipe: the fused SwiGLU MLP computes {RECIPES}, got {recipe!r}")
    return LINEAR_RECIPES[recipe]


def fp8_swiglu_mlp(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor,
                   recipe: str = DEFAULT_TRAIN_RECIPE) -> torch.Tensor:
    """``silu(x · w_gateᵀ) · (x · w_upᵀ)`` times ``w_downᵀ``, every GEMM in FP8, the activation
    fused with its quantizations (module docstring). Differentiable in all four.

    Args:
        x: ``[..., H]`` float32 / bfloat16 / float16; the output has its dtype (inside
            ``torch.autocast`` the autocast dtype, as ``nn.Linear``; gradients come back in each
            input's dtype).
        w_gate, w_up: ``[F, H]``; w_down: ``[H, F]`` (``nn.Linear`` weights; any float dtype, kept
            as they are). H and F multiples of 16.
        recipe: ``"fp8_block"``, ``"fp8_block_wgrad16"`` or ``"fp8_block_wgrad2d"``
            (:func:`~lowprec.nn.fp8_linear`).
    """
    r = _swiglu_recipe(recipe)
    _check(x, w_gate, w_up, w_down)
    x, autocast_off = follow_autocast(x)
    with autocast_off:
        x2 = x.reshape(-1, x.shape[-1])
        if not x2.is_contiguous():
            x2 = x2.contiguous()
        if torch.is_grad_enabled() and any(t.requires_grad for t in (x2, w_gate, w_up, w_down)):
            y = _FP8SwiGLU.apply(x2, w_gate, w_up, w_down, r)
        else:  # evaluation: the forward's own bits, without the copies along tokens and transposed weights
            reject_tangents("fp8_swiglu_mlp", x2, w_gate, w_up, w_down)
            y = _swiglu_forward(x2, w_gate, w_up, w_down, r)
    return output_as(y, (*x.shape[:-1], y.shape[-1]))


def _swiglu_forward(x2, w_gate, w_up, w_down, recipe: LinearRecipe) -> torch.Tensor:
    x_q = quantize(x2, recipe.activation, check_finite=False)
    wg, wu, wd = (quantize_weight(w, recipe.weight, with_transpose=False)[0] for w in (w_gate, w_up, w_down))
    return _gemms(x_q, wg, wu, wd, recipe, x2.dtype)[0]  # the activation's copy along tokens unused


def _gemms(x_q, wg, wu, wd, recipe: LinearRecipe, dt: torch.dtype):
    """The forward's GEMMs and the fused activation between them (training and evaluation alike):
    ``(y, g, u, A along tokens)``."""
    g = gemm(x_q, wg, out_dtype=dt)
    u = gemm(x_q, wu, out_dtype=dt)
    a, at = swiglu_quantize_dual("swiglu", g, u, recipe_t=recipe.wgrad_activation)
    return gemm(a, wd, out_dtype=dt), g, u, at


class SwiGLUMLP(nn.Module):
    """Llama's MLP in plain torch (``down_proj(silu(gate_proj(x)) * up_proj(x))``, no biases), with
    transformers' parameter names: what :func:`lowprec.convert` turns into :class:`FP8SwiGLUMLP`."""

    def __init__(self, hidden_size: int, ffn_size: int, device=None, dtype=None) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, ffn_size, bias=False, device=device, dtype=dtype)
        self.up_proj = nn.Linear(hidden_size, ffn_size, bias=False, device=device, dtype=dtype)
        self.down_proj = nn.Linear(ffn_size, hidden_size, bias=False, device=device, dtype=dtype)
        self.act_fn = nn.SiLU()

    @classmethod
    def from_linears(cls, gate_proj: nn.Linear, up_proj: nn.Linear, down_proj: nn.Linear) -> SwiGLUMLP:
        """The MLP of these layers (shared, not copied)."""
        mlp = cls.__new__(cls)
        nn.Module.__init__(mlp)
        mlp.gate_proj, mlp.up_proj, mlp.down_proj, mlp.act_fn = gate_proj, up_proj, down_proj, nn.SiLU()
        return mlp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class FP8SwiGLUMLP(nn.Module):
    """:class:`SwiGLUMLP` (or a transformers Llama-family MLP) computed by :func:`fp8_swiglu_mlp`.

    Holds the original ``gate_proj``, ``up_proj``, ``down_proj`` ``nn.Linear`` modules (their
    parameters, shared, not copied: optimizers and state dicts see the same names and tensors).
    ``recipe``: ``"fp8_block"``, ``"fp8_block_wgrad16"`` or ``"fp8_block_wgrad2d"``.
    """

    def __init__(self, gate_proj: nn.Linear, up_proj: nn.Linear, down_proj: nn.Linear,
                 recipe: str = DEFAULT_TRAIN_RECIPE) -> None:
        super().__init__()
        if any(getattr(m, "bias", None) is not None for m in (gate_proj, up_proj, down_proj)):
            raise ValueError("gate_proj, up_proj, down_proj: the fused MLP computes no biases; got a layer with one")
        self.gate_proj, self.up_proj, self.down_proj = gate_proj, up_proj, down_proj
        self.recipe = _swiglu_recipe(recipe).name
        # an FP32 probe x: the default dtype (torch.set_default_dtype(torch.float64)) would fail x's check
        _check(torch.empty(0, gate_proj.in_features, dtype=torch.float32, device=gate_proj.weight.device),
               gate_proj.weight, up_proj.weight, down_proj.weight)

    @classmethod
    def from_mlp(cls, mlp: nn.Module, recipe: str = DEFAULT_TRAIN_RECIPE) -> FP8SwiGLUMLP:
        reason = swiglu_mlp_unsupported(mlp)
        if reason:
            raise ValueError(f"mlp: {reason}")
        return cls(mlp.gate_proj, mlp.up_proj, mlp.down_proj, recipe)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_swiglu_mlp(x, self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight, self.recipe)

    def extra_repr(self) -> str:
        return f"recipe={self.recipe}"

    def fp8_block_weights(self) -> tuple[str, ...]:
        """The parameters quantized in 128x128 blocks (:func:`~lowprec.nn.enable_fp8_all_gather`)."""
        return ("gate_proj.weight", "up_proj.weight", "down_proj.weight")

    def unfused(self) -> SwiGLUMLP:
        """The same layers as a plain :class:`SwiGLUMLP`."""
        return SwiGLUMLP.from_linears(self.gate_proj, self.up_proj, self.down_proj)


_SILU_PROBE = torch.linspace(-10.0, 10.0, 41)


def _is_silu(act) -> bool:
    """``act`` is a parameter-free module computing SiLU (``nn.SiLU``, transformers'
    ``SiLUActivation``...): checked on a probe tensor, not by its type alone."""
    if not isinstance(act, nn.Module) or any(True for _ in act.parameters()):
        return False
    try:
        with torch.no_grad():
            return torch.equal(act(_SILU_PROBE.clone()), torch.nn.functional.silu(_SILU_PROBE))  # act may be in-place
    except Exception:  # an activation that cannot run on a CPU float tensor is not fused
        return False


def swiglu_mlp_unsupported(module: nn.Module) -> str | None:
    """Why ``module`` is not a SwiGLU MLP :class:`FP8SwiGLUMLP` can take (None: it is)."""
    if type(module).__name__ not in SWIGLU_MLP_CLASSES:
        return f"{type(module).__name__} is not one of {SWIGLU_MLP_CLASSES}"
    linears = [getattr(module, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
    if any(type(m) is not nn.Linear or m.bias is not None for m in linears):
        return "gate_proj, up_proj and down_proj must be nn.Linear layers without bias"
    if any(has_hooks(m) for m in linears):  # the fused MLP reads their weights, calls none of them
        return "gate_proj, up_proj and down_proj must have no forward or backward hooks"
    if any(not isinstance(m.weight, nn.Parameter) for m in linears):  # the fused MLP reads them, runs no hook
        return ("gate_proj, up_proj and down_proj must hold their weights as parameters (not computed by a "
                "forward pre-hook, as torch.nn.utils.weight_norm's)")
    act = getattr(module, "act_fn", None)
    if isinstance(act, nn.Module) and has_hooks(act):  # the fused MLP calls no act_fn (and the probe would fire them)
        return "act_fn must have no forward or backward hooks"
    if not _is_silu(act):
        return f"act_fn must compute SiLU, got {type(getattr(module, 'act_fn', None)).__name__}"
    gate, up, down = linears
    if up.weight.shape != gate.weight.shape or down.weight.shape != gate.weight.shape[::-1]:
        return "gate_proj / up_proj [F, H] and down_proj [H, F] shapes do not match"
    if gate.in_features % _ALIGN or gate.out_features % _ALIGN:
        return f"hidden and ffn sizes must be multiples of {_ALIGN}"
    return None
