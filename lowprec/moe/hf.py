"""transformers' MoE models on lowprec: the sparse MoE blocks as lowprec MoE layers (for
:func:`lowprec.convert`), and lowprec's FP8 experts as a transformers experts implementation.

**Blocks** (:func:`moe_from_hf`).

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

**Experts implementations** (:func:`register_transformers_experts`): transformers 5 dispatches every
MoE model's experts module (Mixtral, Qwen2/3-MoE, Qwen3-Next, DeepSeek-V3, OLMoE, ...) through its
``ExpertsInterface``; registered there, ``"lowprec_fp8"`` runs the experts as
:func:`lowprec.moe.experts` (``fp8_block``: 1x128 tokens, 128x128 weights, FP32 accumulation, forward
and backward) and ``"lowprec_nvfp4"`` on NVFP4 weights for inference, while the model's own router
chooses the experts and their weights, as it always does.
"""

from __future__ import annotations

import functools
import weakref

import torch
from torch import nn

from ..nn.hooks import has_hooks
from ..nn.swiglu import _is_silu
from ..runtime import eager_under_compile, version_of

HF_MOE_BLOCKS = ("MixtralSparseMoeBlock", "Qwen3MoeSparseMoeBlock")
# where transformers defines its output capturing hooks and their collector (a private name, moved in 5.x)
_OUTPUT_CAPTURING = ("transformers.utils.output_capturing", "transformers.utils.generic")
_SILU_CLASSES = ("SiLU", "SiLUActivation")


def experts_module_unsupported(experts: nn.Module | None, probe: bool = True) -> str | None:
    """Why lowprec cannot compute a transformers experts module (None: it can): parameters
    ``gate_up_proj`` [E, 2F, H] (gate rows first) and ``down_proj`` [E, H, F], SiLU (an ``act_fn``
    without hooks: lowprec does not call it), no biases,
    not transposed, no post-expert norm, not expert-parallel. ``probe=False``: SiLU known by its
    class (``nn.SiLU``, transformers' ``SiLUActivation``), not by running it (for a traced call)."""
    if (why := _layout_unsupported(experts)) is not None:
        return why
    return _activation_unsupported(getattr(experts, "act_fn", None), probe)


def _layout_unsupported(experts: nn.Module | None) -> str | None:
    """:func:`experts_module_unsupported` but the activation (attribute checks only: cheap)."""
    # transformers' layout flags first: a transposed / bias / ungated layout also fails the shape
    # checks below, whose message would then name the wrong cause
    if getattr(experts, "has_bias", False) or any(getattr(experts, name, None) is not None
                                                  for name in ("gate_up_proj_bias", "down_proj_bias")):
        return "expert biases are not supported"
    for flag, ok in (("is_transposed", False), ("is_concatenated", True), ("has_gate", True),
                     ("has_post_expert_norm", False), ("_is_expert_parallel", False)):
        if getattr(experts, flag, ok) != ok:
            return f"experts with {flag}={not ok} are not supported"
    gate_up, down = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
    if not all(isinstance(t, nn.Parameter) for t in (gate_up, down)) or gate_up.dim() != 3 or down.dim() != 3:
        return ("expected transformers 5's layout: parameters experts.gate_up_proj [E, 2F, H], "
                "experts.down_proj [E, H, F]")
    e, h, f = down.shape
    if tuple(gate_up.shape) != (e, 2 * f, h):
        return f"expert weights gate_up_proj {tuple(gate_up.shape)} and down_proj {tuple(down.shape)} do not match"
    gate_fn = getattr(type(experts), "_apply_gate", None)  # transformers' default: _default_apply_gate
    if gate_fn is not None and getattr(gate_fn, "__name__", None) != "_default_apply_gate":
        return (f"a custom gate {type(experts).__name__}._apply_gate (e.g. a clamped SwiGLU): only "
                "silu(gate) · up")
    act = getattr(experts, "act_fn", None)
    if isinstance(act, nn.Module) and has_hooks(act):  # lowprec calls no act_fn (and the probe would fire them)
        return "act_fn must have no forward or backward hooks"
    return None


def _activation_unsupported(act, probe: bool) -> str | None:
    if act is torch.nn.functional.silu:  # the function itself (LFM2-MoE's experts)
        return None
    if not (_is_silu(act) if probe else type(act).__name__ in _SILU_CLASSES):
        return f"activation {type(act).__name__}: only SiLU (SwiGLU experts)"
    return None


def hf_moe_unsupported(block: nn.Module, recipe: str | None = "fp8_block") -> str | None:
    """Why :func:`moe_from_hf` cannot take ``block`` with experts of ``recipe`` (None: it can); FP8
    recipes need the hidden and expert sizes in multiples of 16."""
    if type(block).__name__ not in HF_MOE_BLOCKS:
        return f"{type(block).__name__} is not one of {HF_MOE_BLOCKS}"
    gate, experts = getattr(block, "gate", None), getattr(block, "experts", None)
    router = getattr(gate, "weight", None)
    if not isinstance(router, nn.Parameter) or router.dim() != 2:
        return "expected transformers 5's layout: parameter gate.weight [E, H]"
    if (why := experts_module_unsupported(experts)) is not None:
        return why
    e, h = router.shape
    if tuple(experts.down_proj.shape[:2]) != (e, h):
        return f"expert weights down_proj {tuple(experts.down_proj.shape)} do not match the router's [E={e}, H={h}]"
    if not isinstance(getattr(gate, "top_k", None), int):
        return "gate.top_k missing"
    if getattr(block, "jitter_noise", 0):
        return "router jitter noise (training) is not reproduced"
    if getattr(getattr(experts, "config", None), "output_router_logits", False):
        # transformers records them from the router module's forward (its load-balancing loss), which
        # the lowprec layer does not call: the model would find no logits
        return ("the model records router logits (config.output_router_logits=True, the load-balancing "
                "loss): use the 'lowprec_fp8' experts implementation, which keeps the model's router")
    f = experts.down_proj.shape[2]
    if recipe is not None and (h % 16 or f % 16):
        return f"hidden size {h} and expert size {f}: recipe {recipe!r} needs multiples of 16"
    return None


def hf_moe_hooked(block: nn.Module) -> str | None:
    """Which of ``block``'s ``gate`` and ``experts`` have forward or backward hooks (None: neither),
    which the lowprec MoE would drop: it reads their weights and calls neither. transformers' own
    output capturing hooks are not counted (on the router: its logits, which a converted block
    refuses to record)."""
    hooked = [name for name in ("gate", "experts") if has_hooks(
        getattr(block, name, None), ignore=lambda hook: getattr(hook, "__module__", None) in _OUTPUT_CAPTURING)]
    return " and ".join(hooked) or None


def moe_from_hf(block: nn.Module, recipe: str | None = "fp8_block") -> nn.Module:
    """A :class:`lowprec.moe.MoE` computing ``block`` (see the module docstring), on the block's
    own parameters (shared, not copied: training one trains the other). ``recipe``: the MoE's."""
    from .layer import MoE

    if (why := hf_moe_unsupported(block, recipe)) is not None:
        raise ValueError(f"block: {why}")
    gate, experts = block.gate, block.experts
    e, h = gate.weight.shape
    moe = MoE(h, experts.down_proj.shape[2], e, gate.top_k, recipe=recipe, activation="swiglu",
              score_func="softmax", renormalize=bool(getattr(gate, "norm_topk_prob", True)), device="meta",
              dtype=experts.gate_up_proj.dtype)
    moe.router.weight = gate.weight
    moe.w1, moe.w2 = experts.gate_up_proj, experts.down_proj
    return moe


_COLLECTOR: list = []  # transformers' context of the outputs a forward records, looked up once (at convert)


def _find_collector() -> None:
    if _COLLECTOR:
        return
    collector = None
    for where in _OUTPUT_CAPTURING:
        try:
            collector = getattr(__import__(where, fromlist=["_active_collector"]), "_active_collector", None)
        except ImportError:
            continue
        if collector is not None:
            break
    _COLLECTOR.append(collector)


def _router_logits_recorded() -> bool:
    """A transformers forward is recording router logits (``output_router_logits``, per call or config)."""
    collector = _COLLECTOR[0] if _COLLECTOR else None
    if collector is None:
        return False
    # dynamo cannot trace ContextVar.get: traced, only transformers' compile-time global (set where
    # the model's own forward is traced) is read; a collector set eagerly around a traced block
    # (regional compilation, or transformers' forward breaking the graph) is refused instead by the
    # model's hook (refuse_router_logits_calls)
    if torch.compiler.is_compiling() and not getattr(collector, "compiling", False):
        return False
    outputs = collector.get()
    return isinstance(outputs, dict) and "router_logits" in outputs


def _refuse_router_logits(module: nn.Module, args) -> None:
    # convert refuses config.output_router_logits=True; a per-call model(..., output_router_logits=True)
    # is seen only here: transformers records the logits from the router module this layer replaced,
    # and would find none (an IndexError or a load-balancing loss of 0)
    if _router_logits_recorded():
        raise ValueError("output_router_logits=True: transformers records router logits from the MoE block's router "
                         f"module, which lowprec.convert replaced with a lowprec {type(module).__name__}; keep the "
                         "block (convert's filter_fn) and use the 'lowprec_fp8' experts implementation, which keeps "
                         "the model's router")


def refuse_router_logits(layer: nn.Module) -> nn.Module:
    """``layer`` (converted from a transformers MoE block) raising in a forward that records router logits."""
    _find_collector()  # here, not in a forward torch.compile may trace
    layer.register_forward_pre_hook(_refuse_router_logits)
    return layer


def _refuse_router_logits_call(model: nn.Module, args, kwargs) -> None:
    # the flag as transformers reads it (the call's, else the config's): plain Python values, which
    # torch.compile guards on, unlike the collector the layers' hook reads
    if kwargs.get("output_router_logits", getattr(model.config, "output_router_logits", False)):
        raise ValueError("output_router_logits=True: transformers records router logits from the MoE blocks' router "
                         f"modules, which lowprec.convert replaced in this {type(model).__name__}; keep the blocks "
                         "(convert's filter_fn) and use the 'lowprec_fp8' experts implementation, which keeps the "
                         "model's router")


def refuse_router_logits_calls(model: nn.Module) -> None:
    """Each transformers model in ``model`` (a module with ``config.output_router_logits``) holding a
    layer of :func:`refuse_router_logits` refuses a call that asks for router logits, before it runs:
    the layers' own check cannot read the request inside a compiled forward (transformers' IndexError
    there otherwise)."""
    for module in model.modules():
        if (hasattr(getattr(module, "config", None), "output_router_logits")
                and not module.__dict__.get("_lowprec_refuses_router_logits")
                and any(hook is _refuse_router_logits for m in module.modules()
                        for hook in m._forward_pre_hooks.values())):
            module.register_forward_pre_hook(_refuse_router_logits_call, with_kwargs=True)
            module.__dict__["_lowprec_refuses_router_logits"] = True


EXPERTS_IMPLEMENTATIONS = {"fp8": "lowprec_fp8", "nvfp4": "lowprec_nvfp4"}


def register_transformers_experts(fmt: str = "fp8") -> str:
    """Register lowprec's experts with transformers (>= 5) and return the name for ``fmt``.

    Both are registered: ``"lowprec_fp8"`` (``fmt="fp8"``) runs each MoE block's experts with
    :func:`lowprec.moe.experts` (``fp8_block``) on the experts module's own parameters, forward and
    backward (gradients for the tokens, the combine weights and both projections); for inference,
    run under :func:`lowprec.nn.reuse_quantized_weights` so each expert weight is quantized once, not
    per call. ``"lowprec_nvfp4"`` (``fmt="nvfp4"``, inference only: gradients are refused) quantizes
    each module's expert weights to NVFP4 once (again after an in-place update, a load, a cast or a
    move) and runs the grouped weight-only NVFP4 GEMMs, tokens in their dtype (the decode path of
    :class:`~lowprec.moe.NVFP4InferenceMoE`); it keeps that copy beside the module's bf16 weights,
    freed with them (``model.cpu()`` frees the GPU copy).
    Either way the model's router is untouched. Use with ``model.set_experts_implementation(name)``
    or ``from_pretrained(..., experts_implementation=name)``. An experts module lowprec cannot
    compute (:func:`experts_module_unsupported`) raises with the reason at its first call.
    """
    if fmt not in EXPERTS_IMPLEMENTATIONS:
        raise ValueError(f"fmt: expected one of {tuple(EXPERTS_IMPLEMENTATIONS)}, got {fmt!r}")
    try:
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    except ImportError as err:
        raise ImportError("register_transformers_experts: needs transformers >= 5 (its ExpertsInterface)") from err
    ALL_EXPERTS_FUNCTIONS.register(EXPERTS_IMPLEMENTATIONS["fp8"], transformers_experts_forward)
    ALL_EXPERTS_FUNCTIONS.register(EXPERTS_IMPLEMENTATIONS["nvfp4"], transformers_nvfp4_experts_forward)
    return EXPERTS_IMPLEMENTATIONS[fmt]


def _check_module(module: nn.Module, name: str) -> None:
    # the layout every call (attribute checks: act_fn, the weights or the flags may be replaced
    # after a first call); the activation's probe once per act_fn object, kept as
    # (act_fn, verdict, probed). Traced (torch.compile): no probe, whose result depends on data, and
    # a verdict by class name is not kept for an eager call, which probes
    why = _layout_unsupported(module)
    if why is None:
        act = getattr(module, "act_fn", None)
        probe = not torch.compiler.is_compiling()
        checked = module.__dict__.get("_lowprec_unsupported")
        if checked is not None and checked[0] is act and (checked[2] or not probe):
            why = checked[1]
        else:
            why = _activation_unsupported(act, probe)
            module.__dict__["_lowprec_unsupported"] = (act, why, probe)
    if why is not None:
        raise ValueError(f"experts_implementation={name!r}: {type(module).__name__}: {why}")


def transformers_experts_forward(module: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                                 top_k_weights: torch.Tensor) -> torch.Tensor:
    """The ``"lowprec_fp8"`` experts implementation: transformers' experts forward signature
    (``hidden_states`` [T, H], the router's ``top_k_index`` and ``top_k_weights`` [T, k])."""
    from .layer import experts

    _check_module(module, EXPERTS_IMPLEMENTATIONS["fp8"])
    # the ids come from the router's top-k over E experts: no range check (a host sync)
    return experts(hidden_states, top_k_weights, top_k_index, module.gate_up_proj, module.down_proj,
                   recipe="fp8_block", activation="swiglu", check_ids=False)


# experts module -> its NVFP4 copy, beside the module (not in its __dict__: a pickled or deep-copied
# model would carry the copy, and the weak references below cannot be pickled)
_NVFP4_PACKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class _NVFP4Copy:
    """An experts module's weights packed in NVFP4 and what identifies the weights they came from:
    each tensor (weakly), its storage (weakly: a weight cast or moved by ``module.to()`` gets a new
    one, possibly at the old address), its address, dtype, shape, strides and version counter."""

    __slots__ = ("packs", "key", "params", "storages")

    def __init__(self, module: nn.Module, params: tuple, packs: tuple):
        self.packs, self.key = packs, _weights_key(params)
        self.params = tuple(weakref.ref(p) for p in params)
        # a storage freed (model.cpu(), .half(), a weight assigned anew) drops the copy at once: on a
        # GPU it would otherwise hold its memory until the next forward
        forget = functools.partial(_forget_storage, weakref.ref(module))
        self.storages = tuple(weakref.ref(p.untyped_storage(), forget) for p in params)

    def serves(self, params: tuple) -> bool:
        return (all(ref() is p for ref, p in zip(self.params, params))
                and all(ref() is p.untyped_storage() for ref, p in zip(self.storages, params))
                and self.key == _weights_key(params))


def _weights_key(params: tuple) -> tuple:
    return tuple((p.data_ptr(), p.dtype, tuple(p.shape), p.stride(), version_of(p)) for p in params)


def _forget_storage(module_ref: weakref.ref, storage_ref: weakref.ref) -> None:
    module = module_ref()
    entry = _NVFP4_PACKS.get(module) if module is not None else None
    if entry is not None and any(ref is storage_ref for ref in entry.storages):
        del _NVFP4_PACKS[module]


@torch.compiler.disable  # a host-side cache: looked up and filled eagerly, never traced into a graph
def _nvfp4_weights(module: nn.Module) -> tuple:
    """The module's expert weights packed in NVFP4, made again when either weight is another tensor,
    on another storage (cast, moved), or written in place (its version counter), and after a
    ``load_state_dict`` (a load into inference tensors, made under ``torch.inference_mode``, bumps
    no version). Writes through ``weight.data`` and other in-place writes to inference tensors go
    unseen: they bypass the version counter."""
    from ..gemm.weight_only import pack_nvfp4_experts
    from .nvfp4 import quantize_nvfp4_experts

    params = (module.gate_up_proj, module.down_proj)
    cached = _NVFP4_PACKS.get(module)
    if cached is None or not cached.serves(params):
        _NVFP4_PACKS.pop(module, None)  # the old copy's memory first
        packs = tuple(pack_nvfp4_experts(*quantize_nvfp4_experts(p)) for p in params)
        if not module.__dict__.get("_lowprec_nvfp4_hooked"):
            module.register_load_state_dict_post_hook(_forget_nvfp4_weights)
            module.__dict__["_lowprec_nvfp4_hooked"] = True
        cached = _NVFP4_PACKS[module] = _NVFP4Copy(module, params, packs)
    return cached.packs


def _forget_nvfp4_weights(module: nn.Module, incompatible_keys) -> None:
    _NVFP4_PACKS.pop(module, None)


@eager_under_compile
def transformers_nvfp4_experts_forward(module: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                                       top_k_weights: torch.Tensor) -> torch.Tensor:
    """The ``"lowprec_nvfp4"`` experts implementation (inference; transformers' experts signature)."""
    from .nvfp4 import nvfp4_apply
    from .routing import dispatch

    name = EXPERTS_IMPLEMENTATIONS["nvfp4"]
    _check_module(module, name)
    if torch.is_grad_enabled() and (hidden_states.requires_grad or top_k_weights.requires_grad
                                    or module.gate_up_proj.requires_grad or module.down_proj.requires_grad):
        raise RuntimeError(f"experts_implementation={name!r} is for inference (no gradients): run under "
                           "torch.no_grad() / torch.inference_mode() (generate does), or use 'lowprec_fp8' to train")
    w1, w2 = _nvfp4_weights(module)
    routing = dispatch(top_k_weights.detach().float(), top_k_index, module.gate_up_proj.shape[0], check_ids=False)
    return nvfp4_apply(hidden_states, routing, w1, w2, "swiglu")
