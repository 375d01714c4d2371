"""transformers' sparse MoE blocks as lowprec MoE layers, for :func:`lowprec.convert`.

Taken: the blocks whose forward is "router, softmax over the experts, top-k (renormalized or not),
SwiGLU experts, weighted sum" with transformers 5's tensor layout, by class name (``HF_MOE_BLOCKS``;
transformers is not imported): the router's ``gate.weight`` ``[E, H]``, ``gate.top_k``,
``gate.norm_topk_prob`` (Qwen3-MoE; Mixtral always renormalizes), the experts' ``gate_up_proj``
``[E, 2F, H]`` (gate rows first) and ``down_proj`` ``[E, H, F]`` — lowprec's ``w1`` and ``w2``.
transformers 4's per-expert modules, biases, shared experts and other activations are not taken.

The lowprec layer computes the same function with its own rounding: router logits in FP32 (the
block computes them in the model's dtype, then the softmax in FP32), equal scores lower id first
(``torch.topk`` leaves their order open), the combine in FP32. A token whose top-k scores nearly tie
may route differently.
"""

from __future__ import annotations

from torch import nn

from ..nn.swiglu import _is_silu

HF_MOE_BLOCKS = ("MixtralSparseMoeBlock", "Qwen3MoeSparseMoeBlock")


def hf_moe_unsupported(block: nn.Module) -> str | None:
    """Why :func:`moe_from_hf` cannot take ``block`` (None: it can)."""
    if type(block).__name__ not in HF_MOE_BLOCKS:
        return f"{type(block).__name__} is not one of {HF_MOE_BLOCKS}"
    gate, experts = getattr(block, "gate", None), getattr(block, "experts", None)
    router = getattr(gate, "weight", None)
    gate_up, down = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
    if not all(isinstance(t, nn.Parameter) for t in (router, gate_up, down)) or router.dim() != 2 \
            or gate_up.dim() != 3 or down.dim() != 3:
        return ("expected transformers 5's layout: parameters gate.weight [E, H], experts.gate_up_proj "
                "[E, 2F, H], experts.down_proj [E, H, F]")
    e, h = router.shape
    f = down.shape[2]
    if tuple(gate_up.shape) != (e, 2 * f, h) or tuple(down.shape) != (e, h, f):
        return (f"expert weights gate_up_proj {tuple(gate_up.shape)} and down_proj {tuple(down.shape)} do not "
                f"match the router's [E={e}, H={h}]")
    if any(getattr(experts, name, None) is not None for name in ("gate_up_proj_bias", "down_proj_bias")):
        return "expert biases are not supported"
    if not _is_silu(getattr(experts, "act_fn", None)):
        return f"activation {type(getattr(experts, 'act_fn', None)).__name__}: only SiLU (SwiGLU experts)"
    if not isinstance(getattr(gate, "top_k", None), int):
        return "gate.top_k missing"
    if getattr(block, "jitter_noise", 0):
        return "router jitter noise (training) is not reproduced"
    return None


def moe_from_hf(block: nn.Module, recipe: str | None = "fp8_block") -> nn.Module:
    """A :class:`lowprec.moe.MoE` computing ``block`` (see the module docstring), on the block's
    own parameters (shared, not copied: training one trains the other). ``recipe``: the MoE's."""
    from .layer import MoE

    if (why := hf_moe_unsupported(block)) is not None:
        raise ValueError(f"block: {why}")
    gate, experts = block.gate, block.experts
    e, h = gate.weight.shape
    moe = MoE(h, experts.down_proj.shape[2], e, gate.top_k, recipe=recipe, activation="swiglu",
              score_func="softmax", renormalize=bool(getattr(gate, "norm_topk_prob", True)), device="meta",
              dtype=experts.gate_up_proj.dtype)
    moe.router.weight = gate.weight
    moe.w1, moe.w2 = experts.gate_up_proj, experts.down_proj
    return moe
