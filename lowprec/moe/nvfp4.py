"""NVFP4 experts for inference: :class:`NVFP4InferenceMoE`, the MoE with 4.5-bit expert weights and
activations kept in their dtype (weight-only), for decode-sized batches on Hopper."""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..gemm.ops import grouped_weight_only
from ..gemm.weight_only import CHUNK_BYTES, ROW_BYTES, PackedNVFP4, PackedNVFP4Experts, pack_nvfp4_experts, unpack_nvfp4
from ..nn.buffers import QuantizedBuffersModule
from ..nn.functional import follow_autocast
from ..quant import quantize
from ..recipes import get_recipe
from ..runtime import eager_under_compile, on_operand_device
from .core import _X_DTYPES, gated_activation
from .packing import unpack
from .routing import Routing, route

__all__ = ["NVFP4InferenceMoE", "nvfp4_moe_layer"]

_PROJECTIONS = ("w1", "w2")


class NVFP4InferenceMoE(QuantizedBuffersModule):
    """Inference :class:`~lowprec.moe.MoE` with NVFP4 expert weights (E2M1 codes, an E4M3 scale per
    16 weights of a row, an FP32 global scale per expert matrix: about 0.28x the bytes of bf16
    experts) and tokens kept in their dtype.

    Build it from a trained layer with :meth:`from_moe` or :func:`lowprec.convert` (``"nvfp4"``,
    ``inference=True``), or from a ModelOpt NVFP4 checkpoint's expert tensors with
    :meth:`from_modelopt` (taken as they are). The forward routes as :class:`~lowprec.moe.MoE` does (router in FP32, the
    same top-k, capacity and packed order), then runs each expert's ``W1`` and ``W2`` on its rows
    with the grouped weight-only GEMM (on Hopper with bf16 tokens: one launch per projection, the
    4.5-bit weights of the experts that got tokens read once and decoded to bf16 in registers, no
    host sync, CUDA-graph capturable; at prefill sizes outside a capture, ~1024 rows and enough
    work per expert on average, one sync and each busy expert's weight decoded to bf16 for a
    cuBLAS GEMM; elsewhere the dequantized reference), the gated activation
    in FP32 rounded once to the tokens' dtype, and the combine back to tokens (each row times its
    combine weight in FP32). Under ``torch.compile`` a
    call without ``return_routing`` is one custom op (``lowprec::nvfp4_moe_layer``, run eagerly
    inside, the eager result bit for bit): ``fullgraph=True`` holds and ``mode="reduce-overhead"``
    captures it into CUDA graphs. The forward is differentiable in neither ``x`` nor the router:
    an ``x`` that requires a gradient (with grad mode on) is refused rather than silently cut from
    the graph (:class:`~lowprec.moe.FP8InferenceMoE` is differentiable in ``x``).

    State dict (ModelOpt's NVFP4 layout, stacked over the experts): ``w1`` uint8 ``[E, 2F, H / 2]``
    (two E2M1 codes per byte, element ``2i`` in the low nibble), ``w1_scale`` float8_e4m3fn
    ``[E, 2F, H / 16]``, ``w1_scale_2`` FP32 ``[E]``, the same for ``w2`` (``[E, H, F / 2]``), and
    the ``router``'s weight. In memory the weights are held once, in the kernel's layout.
    Arguments as :class:`~lowprec.moe.MoE`'s (no ``recipe``); H and F multiples of 16.
    """

    _quantized = ("w1_packed", "w1_scale_2", "w2_packed", "w2_scale_2")
    _derived = ("_packed_views",)

    def __init__(self, hidden_size: int, ffn_size: int, num_experts: int, top_k: int,
                 capacity_factor: float | None = None, activation: str = "swiglu", score_func: str = "softmax",
                 renormalize: bool = True, drop_policy: str = "probs", device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        from .layer import _set_config

        super().__init__()
        for name, size in (("hidden_size", hidden_size), ("ffn_size", ffn_size)):  # before _set_config's FP8 wording
            if isinstance(size, int) and size > 0 and size % 16:
                raise ValueError(f"{name}: must be a multiple of 16 for NVFP4 experts (16-value scale blocks), "
                                 f"got {size}")
        _set_config(self, hidden_size, ffn_size, num_experts, top_k, capacity_factor, activation, "fp8_block",
                    score_func, renormalize, drop_policy)
        self.router = nn.Linear(hidden_size, num_experts, bias=False, device=device, dtype=dtype)
        for name, (rows, cols) in zip(_PROJECTIONS, self._shapes()):
            grid = PackedNVFP4(torch.empty(0), torch.empty(0), rows, cols)
            packed_rows = num_experts * grid.n_tiles * grid.k_chunks * CHUNK_BYTES // ROW_BYTES
            # zero weights: zero codes under zero scales (state_dict() rebuilds the ModelOpt tensors)
            self.register_buffer(f"{name}_packed", torch.zeros(packed_rows, ROW_BYTES, dtype=torch.uint8,
                                                               device=device), persistent=False)
            self.register_buffer(f"{name}_scale_2", torch.ones(num_experts, dtype=torch.float32, device=device))

    def _shapes(self) -> tuple[tuple[int, int], tuple[int, int]]:
        return (2 * self.ffn_size, self.hidden_size), (self.hidden_size, self.ffn_size)

    @classmethod
    def from_moe(cls, moe: nn.Module) -> NVFP4InferenceMoE:
        """Quantize ``moe``'s expert weights to NVFP4 once (a :class:`~lowprec.moe.MoE`); the router
        is copied. A meta-device ``moe`` gives a meta-device layer (values to come from
        ``load_state_dict(..., assign=True)``)."""
        from .layer import MoE

        if not isinstance(moe, MoE):
            raise TypeError(f"moe: expected a lowprec.moe.MoE, got {type(moe).__name__}")
        layer = cls(moe.hidden_size, moe.ffn_size, moe.num_experts, moe.top_k, moe.capacity_factor, moe.activation,
                    moe.score_func, moe.renormalize, moe.drop_policy, moe.router.weight.device,
                    moe.router.weight.dtype)
        if moe.w1.is_meta or moe.w2.is_meta:  # a skeleton: no values to quantize
            return layer
        with torch.no_grad():
            layer.router.weight.copy_(moe.router.weight)
            for name in _PROJECTIONS:
                layer.set_weights(name, *quantize_nvfp4_experts(getattr(moe, name)))
        return layer

    @classmethod
    def from_modelopt(cls, router_weight: torch.Tensor, gate: Sequence[Sequence[torch.Tensor]],
                      up: Sequence[Sequence[torch.Tensor]], down: Sequence[Sequence[torch.Tensor]], top_k: int,
                      **options) -> NVFP4InferenceMoE:
        """A layer of a ModelOpt NVFP4 checkpoint's experts, taken as they are (no requantization).

        ``gate``, ``up``, ``down``: per expert, that projection's ``(weight, weight_scale,
        weight_scale_2)`` as ModelOpt exports each linear (uint8 ``[out, in / 2]``, float8_e4m3fn
        ``[out, in / 16]``, an FP32 scalar or ``[1]``); e.g. Mixtral's ``w1`` / ``w3`` / ``w2``, or
        DeepSeek's and Qwen's ``gate_proj`` / ``up_proj`` / ``down_proj``. ``router_weight``:
        ``[E, H]`` (the gate's weight, any float dtype; the router's dtype). The layer keeps one
        global scale per expert's ``W1 = [gate; up]``: where a checkpoint's gate and up have
        different ``weight_scale_2`` (ModelOpt usually exports one per pair, but published
        checkpoints exist with both), the larger is kept and the other half's E4M3 block scales are
        multiplied by ``its / larger`` (<= 1) and rounded once to E4M3 (a warning says so), the
        larger kept as TensorRT-LLM's loader does (NVIDIA/TensorRT-LLM#18772). ``options``: the
        other :class:`NVFP4InferenceMoE` arguments (``capacity_factor``, ``activation``,
        ``score_func``, ``renormalize``, ``drop_policy``), and ``device`` (default: the weights') and
        ``dtype`` (the router's; default: ``router_weight``'s).
        """
        experts = len(gate)
        if not (len(up) == len(down) == experts) or experts == 0:
            raise ValueError(f"gate, up, down: expected one (weight, weight_scale, weight_scale_2) per expert for the "
                             f"same experts, got {len(gate)}, {len(up)} and {len(down)}")
        if not isinstance(router_weight, torch.Tensor) or router_weight.dim() != 2 \
                or router_weight.shape[0] != experts:
            raise ValueError(f"router_weight: expected [E={experts}, H], got "
                             f"{tuple(getattr(router_weight, 'shape', ()))}")
        for name, parts in (("gate", gate), ("up", up), ("down", down)):
            for e, p in enumerate(parts):
                if len(p) != 3:
                    raise ValueError(f"{name}[{e}]: expected (weight, weight_scale, weight_scale_2), got {len(p)} "
                                     f"tensors")
                # stacked below: torch's stack / reshape errors would name no expert
                shapes = [tuple(getattr(t, "shape", ())) for t in p]
                first = [tuple(getattr(t, "shape", ())) for t in parts[0][:2]]
                if shapes[:2] != first or math.prod(shapes[2]) != 1:
                    raise ValueError(f"{name}[{e}]: expected a weight {first[0]}, a weight_scale {first[1]} (as "
                                     f"{name}[0]'s) and a one-element weight_scale_2, got shapes {shapes}")
        gate, up, differ = list(gate), list(up), []
        for e, (g, u) in enumerate(zip(gate, up)):
            gs, us = g[2].reshape(()).float(), u[2].reshape(()).float().to(g[2].device)
            if not torch.equal(gs, us):  # one global scale per [gate; up]: rescale the smaller half's blocks
                differ.append(e)
                top = torch.maximum(gs, us)
                gate[e] = (g[0], (g[1].float() * (gs / top)).to(torch.float8_e4m3fn), top)
                up[e] = (u[0], (u[1].float() * (us / top).to(u[1].device)).to(torch.float8_e4m3fn), top)
        if differ:
            warnings.warn(f"NVFP4InferenceMoE.from_modelopt: {len(differ)} of {experts} experts have a gate and an "
                          "up with different weight_scale_2; the smaller one's block scales were rescaled to the "
                          "larger global scale (one E4M3 rounding)", stacklevel=2)
        hidden, ffn = router_weight.shape[1], gate[0][0].shape[0]
        options = {"device": gate[0][0].device, "dtype": router_weight.dtype, **options}
        layer = cls(hidden, ffn, experts, top_k, **options)
        with torch.no_grad():
            layer.router.weight.copy_(router_weight)
        w1 = [torch.cat([g[i], u[i]]) for g, u in zip(gate, up) for i in (0, 1)]
        layer.set_weights("w1", torch.stack(w1[0::2]), torch.stack(w1[1::2]),
                          torch.stack([g[2].reshape(()).float() for g in gate]))
        layer.set_weights("w2", torch.stack([d[0] for d in down]), torch.stack([d[1] for d in down]),
                          torch.stack([d[2].reshape(()).float() for d in down]))
        return layer

    def set_weights(self, name: str, weight: torch.Tensor, weight_scale: torch.Tensor,
                    weight_scale_2: torch.Tensor) -> None:
        """Take projection ``name``'s (``"w1"`` or ``"w2"``) NVFP4 tensors in ModelOpt's layout,
        stacked over the experts (validated by the packing), on the layer's device."""
        self._set_weights(name, weight, weight_scale, weight_scale_2, self.w1_packed.device)

    def _set_weights(self, name, weight, weight_scale, weight_scale_2, device, assign: bool = False) -> None:
        if name not in _PROJECTIONS:
            raise ValueError(f"name: expected one of {_PROJECTIONS}, got {name!r}")
        rows, cols = self._shapes()[_PROJECTIONS.index(name)]
        e = self.num_experts
        for key, t, dtype, shape in ((name, weight, torch.uint8, (e, rows, cols // 2)),
                                     (f"{name}_scale", weight_scale, torch.float8_e4m3fn, (e, rows, cols // 16)),
                                     (f"{name}_scale_2", weight_scale_2, torch.float32, (e,))):
            if not isinstance(t, torch.Tensor) or t.dtype != dtype or tuple(t.shape) != shape:
                raise ValueError(f"{key}: expected {dtype} {shape}, got {getattr(t, 'dtype', type(t))} "
                                 f"{tuple(getattr(t, 'shape', ()))}")
        packed = pack_nvfp4_experts(weight.to(device), weight_scale.to(device), weight_scale_2.to(device))
        self._store(f"{name}_packed", packed.data, assign)
        self._store(f"{name}_scale_2", packed.global_scale, assign)

    def packed_weights(self) -> tuple[PackedNVFP4Experts, PackedNVFP4Experts]:
        """``(W1, W2)`` in the grouped kernel's layout (views of the buffers, made again only when a
        buffer is replaced or its ``.data`` assigned anew)."""
        key = tuple(getattr(self, f"{name}_{part}") for name in _PROJECTIONS for part in ("packed", "scale_2"))
        return self._views_of("_packed_views", key, lambda: tuple(
            PackedNVFP4Experts(key[2 * i], key[2 * i + 1], *shape) for i, shape in enumerate(self._shapes())))

    def forward(self, x: torch.Tensor, return_routing: bool = False) -> torch.Tensor | tuple[torch.Tensor, Routing]:
        """``x [..., H]`` to ``[..., H]`` in ``x``'s dtype (the autocast dtype inside
        ``torch.autocast``); with ``return_routing`` also the :class:`Routing`."""
        if not isinstance(x, torch.Tensor) or x.dtype not in _X_DTYPES or x.dim() < 1 \
                or x.shape[-1] != self.hidden_size:
            raise ValueError(f"x: expected a float32/bfloat16/float16 tensor [..., H={self.hidden_size}], got "
                             f"{getattr(x, 'dtype', type(x))} {tuple(getattr(x, 'shape', ()))}")
        if torch.is_grad_enabled() and x.requires_grad:
            raise RuntimeError("x: NVFP4InferenceMoE is not differentiable in x; call it under torch.no_grad() "
                               "or torch.inference_mode(), or use FP8InferenceMoE, which is")
        tokens, autocast_off = follow_autocast(x.reshape(-1, self.hidden_size))
        router_weight = self.router.weight.detach()  # the router is a constant here, as the experts
        with autocast_off:
            if torch.compiler.is_compiling() and not return_routing:
                return nvfp4_moe_layer(tokens, router_weight, self.w1_packed, self.w1_scale_2, self.w2_packed,
                                       self.w2_scale_2, self.ffn_size, *self._config()).reshape(x.shape)
            y, routing = _nvfp4_experts(tokens, router_weight, *self.packed_weights(), *self._config())
        y = y.reshape(x.shape)
        return (y, routing) if return_routing else y

    def _config(self) -> tuple:
        return (self.top_k, self.score_func, self.renormalize, self.capacity_factor, self.drop_policy,
                self.activation)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        for name, packed in zip(_PROJECTIONS, self.packed_weights()):
            weight, weight_scale = _unpacked(packed)
            destination[prefix + name] = weight
            destination[prefix + f"{name}_scale"] = weight_scale
        super()._save_to_state_dict(destination, prefix, keep_vars)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        keys = [f"{name}{part}" for name in _PROJECTIONS for part in ("", "_scale")]
        taken = {key: state_dict.pop(prefix + key, None) for key in keys}
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        for key, t in taken.items():
            if t is not None:
                state_dict[prefix + key] = t
        for name in _PROJECTIONS:
            weight, weight_scale = taken[name], taken[f"{name}_scale"]
            if weight is None or weight_scale is None:
                if strict:
                    missing_keys.extend(prefix + k for k, t in ((name, weight), (f"{name}_scale", weight_scale))
                                        if t is None)
                continue
            global_scale = state_dict.get(prefix + f"{name}_scale_2", getattr(self, f"{name}_scale_2"))
            assign = local_metadata.get("assign_to_params_buffers", False)
            if assign:  # the checkpoint's device
                device = weight.device
            elif self.w1_packed.is_meta:  # as torch's load into a meta module without assign: nothing to copy into
                continue
            else:
                device = self.w1_packed.device
            try:
                self._set_weights(name, weight, weight_scale, global_scale.float(), device, assign)
            except ValueError as err:
                error_msgs.append(f"{prefix}{err}")

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, ffn_size={self.ffn_size}, num_experts={self.num_experts}, "
                f"top_k={self.top_k}, capacity_factor={self.capacity_factor}, drop_policy={self.drop_policy!r}, "
                f"activation={self.activation!r}, score_func={self.score_func!r}, renormalize={self.renormalize}, "
                "nvfp4")


def quantize_nvfp4_experts(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each expert's matrix of ``w`` ``[E, N, K]`` quantized to NVFP4, as ModelOpt's tensors stacked
    over the experts: ``(weight, weight_scale, weight_scale_2)`` (what ``set_weights`` and
    ``pack_nvfp4_experts`` take)."""
    if not isinstance(w, torch.Tensor) or not w.is_floating_point() or w.dim() != 3:
        raise ValueError(f"w: expected a float tensor [E, N, K], got {getattr(w, 'dtype', type(w))} "
                         f"{tuple(getattr(w, 'shape', ()))}")
    recipe = get_recipe("nvfp4")
    with torch.no_grad():
        qs = [quantize(m, recipe) for m in w.detach()]
    return (torch.stack([q.data for q in qs]), torch.stack([q.scale for q in qs]),
            torch.stack([q.global_scale.reshape(()) for q in qs]).float())


def _unpacked(packed: PackedNVFP4Experts) -> tuple[torch.Tensor, torch.Tensor]:
    """ModelOpt-layout ``(weight, weight_scale)`` stacked over the experts."""
    parts = [unpack_nvfp4(packed.expert(e)) for e in range(packed.experts)]
    return torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts])


@eager_under_compile
@on_operand_device
def _nvfp4_experts(tokens: torch.Tensor, router_weight: torch.Tensor, w1: PackedNVFP4Experts,
                   w2: PackedNVFP4Experts, top_k: int, score_func: str, renormalize: bool,
                   capacity_factor: float | None, drop_policy: str, activation: str) -> tuple[torch.Tensor, Routing]:
    """Route ``tokens`` ``[T, H]`` and apply the NVFP4 experts: ``(y [T, H], routing)``."""
    logits = F.linear(tokens.float(), router_weight.float())
    routing = route(logits, top_k, score_func=score_func, renormalize=renormalize, capacity_factor=capacity_factor,
                    drop_policy=drop_policy)
    return nvfp4_apply(tokens, routing, w1, w2, activation), routing


def nvfp4_apply(tokens: torch.Tensor, routing: Routing, w1: PackedNVFP4Experts, w2: PackedNVFP4Experts,
                activation: str) -> torch.Tensor:
    """The NVFP4 experts on routed ``tokens`` ``[T, H]`` -> ``[T, H]`` in their dtype (no autograd)."""
    dt = tokens.dtype
    ends = routing.group_ends
    # packed row -> its token. Padding rows (slot -1, all after the routed rows) read the last token
    # and are left unwritten by the GEMMs: only the combine could read them, and it selects past them.
    x_rows = tokens[routing.row_slots // routing.top_k]
    h = grouped_weight_only(x_rows, w1, ends, zero_tail=False)
    y_rows = grouped_weight_only(gated_activation(activation, h), w2, ends, zero_tail=False)
    # the combine weights in the combine (FP32, each product rounded before its add), not in the activation:
    # two fewer elementwise passes at decode sizes
    return unpack(y_rows, routing, routing.topk_weights.detach(), out_dtype=dt)


@torch.library.custom_op("lowprec::nvfp4_moe_layer", mutates_args=())
def nvfp4_moe_layer(tokens: torch.Tensor, router_weight: torch.Tensor, w1_packed: torch.Tensor,
                    w1_scale_2: torch.Tensor, w2_packed: torch.Tensor, w2_scale_2: torch.Tensor, ffn_size: int,
                    top_k: int, score_func: str, renormalize: bool, capacity_factor: float | None, drop_policy: str,
                    activation: str) -> torch.Tensor:
    """:class:`NVFP4InferenceMoE`'s forward on its buffers (``tokens`` ``[T, H]`` -> ``[T, H]``)."""
    hidden = tokens.shape[1]
    w1 = PackedNVFP4Experts(w1_packed, w1_scale_2, 2 * ffn_size, hidden)
    w2 = PackedNVFP4Experts(w2_packed, w2_scale_2, hidden, ffn_size)
    with torch.no_grad():
        return _nvfp4_experts(tokens, router_weight, w1, w2, top_k, score_func, renormalize, capacity_factor,
                              drop_policy, activation)[0]


@nvfp4_moe_layer.register_fake
def _(tokens, router_weight, w1_packed, w1_scale_2, w2_packed, w2_scale_2, ffn_size, top_k, score_func, renormalize,
      capacity_factor, drop_policy, activation):
    return tokens.new_empty(tokens.shape)  # contiguous, as the combine writes it (tokens may be a transposed view)
