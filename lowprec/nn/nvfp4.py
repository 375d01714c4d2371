"""NVFP4 weights for inference: 4.5 bits per weight, activations kept in their dtype (weight-only).

The state dict is named and laid out as NVIDIA ModelOpt exports NVFP4 checkpoints, so a converted
model's ``load_state_dict`` takes those tensors as they are published, with no requantization:

- ``weight``: uint8 ``[out, in / 2]``, two E2M1 codes per byte, element ``2i`` in the low nibble
  (sign in bit 3, magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6);
- ``weight_scale``: float8_e4m3fn ``[out, in / 16]``, one scale per 16 weights of a row
  (``[out / 16, in / 16]`` with ``weight_2d=True``: 16x16 blocks);
- ``weight_scale_2``: FP32 scalar, the global scale: ``W = e2m1 · weight_scale · weight_scale_2``;
- ``input_scale``: FP32 scalar of the activations for W4A4 engines; kept so that checkpoints
  load strictly, unused by this weight-only layer (optional on load: ModelOpt's weight-only
  ``W4A16_NVFP4`` exports none);
- ``k_scale`` / ``v_scale`` (on ``k_proj`` / ``v_proj``): ModelOpt's FP8 KV-cache scales; taken on
  load and dropped (this layer does not quantize the KV cache).

In memory the layer holds the codes and scales once, re-arranged for the weight-only kernel
(the ``packed`` buffer, ``lowprec.gemm.weight_only``: the same 4.5 bits per weight); ``weight``
and ``weight_scale`` are rebuilt from it for the state dict and the dequantized paths (exact,
except that codes under a zero scale read back as zeros: the same weight).

The product is ``x · dequant(W)ᵀ`` in ``x``'s dtype (NVFP4 -> bf16 is exact: an E2M1 value
times an E4M3 scale fits bf16's mantissa). On Hopper, a bf16 ``x`` without gradient runs the
weight-only kernel (``lowprec.gemm.sm90.weight_only``: the 4.5-bit weights read once, decoded in
registers, bf16 tensor cores, FP32 accumulation, the global scale applied to the FP32 sums);
under ``torch.compile`` through the ``lowprec::weight_only`` op. Otherwise (CPU, fp16 / fp32
``x``, a gradient through ``x``) the weight is dequantized to ``x``'s dtype and multiplied by
``F.linear``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..gemm.ops import weight_only
from ..gemm.weight_only import CHUNK_BYTES, ROW_BYTES, PackedNVFP4, pack_nvfp4, unpack_nvfp4
from ..quant import dequantize
from ..recipes import get_recipe
from ..tensor import QuantizedTensor
from .buffers import QuantizedBuffersModule, check_out_dtype
from .functional import _FLOAT_DTYPES, follow_autocast, quantize_linear_weight

__all__ = ["NVFP4InferenceLinear"]

_BLOCK = 16
_SCALARS = ("weight_scale_2", "input_scale")
_KV_SCALES = ("k_scale", "v_scale")


class NVFP4InferenceLinear(QuantizedBuffersModule):
    """Inference linear with NVFP4 weights (about 0.28x the bytes of bf16) and ``x`` in its dtype;
    differentiable in ``x`` (the weight is a constant).

    Build it with :meth:`from_linear` (quantizes a float weight), :meth:`from_modelopt` (tensors
    of a ModelOpt NVFP4 checkpoint, taken as they are) or ``lowprec.convert(model, "nvfp4",
    inference=True)`` followed by ``model.load_state_dict(...)`` of such a checkpoint. Module
    casts move the NVFP4 buffers between devices but keep their dtypes (see
    :class:`QuantizedBuffersModule`); ``out_dtype`` is the dtype of a dequantized weight
    outside ``forward`` and of the bias (a module cast changes both).
    """

    _quantized = ("packed", *_SCALARS)
    _derived = ("_packed_view",)

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None,
                 out_dtype: torch.dtype = torch.bfloat16, weight_2d: bool = False) -> None:
        super().__init__()
        for name, value, multiple in (("in_features", in_features, _BLOCK),
                                      ("out_features", out_features, _BLOCK if weight_2d else 1)):
            if not isinstance(value, int) or value <= 0 or value % multiple:
                raise ValueError(f"{name}: must be a positive multiple of {multiple} for NVFP4 blocks of "
                                 f"{_BLOCK}{'x16' if weight_2d else ''}, got {value!r}")
        check_out_dtype(out_dtype)
        self.in_features, self.out_features = in_features, out_features
        self.out_dtype, self.weight_2d = out_dtype, weight_2d
        grid = PackedNVFP4(torch.empty(0), torch.empty(0), out_features, in_features)
        rows = grid.n_tiles * grid.k_chunks * CHUNK_BYTES // ROW_BYTES
        # a zero weight: zero codes under zero scales (state_dict() rebuilds weight / weight_scale)
        self.register_buffer("packed", torch.zeros(rows, ROW_BYTES, dtype=torch.uint8, device=device),
                             persistent=False)
        self.register_buffer("weight_scale_2", torch.ones((), dtype=torch.float32, device=device))
        self.register_buffer("input_scale", torch.ones((), dtype=torch.float32, device=device))
        self.register_buffer("bias", torch.zeros(out_features, dtype=out_dtype, device=device) if bias else None)

    @property
    def recipe(self):
        return get_recipe("nvfp4", weight_2d=self.weight_2d)

    @property
    def weight(self) -> torch.Tensor:
        """The codes in ModelOpt's layout (uint8 ``[out, in / 2]``), rebuilt from ``packed``."""
        return unpack_nvfp4(self.packed_weight(), self.weight_2d)[0]

    @property
    def weight_scale(self) -> torch.Tensor:
        """The E4M3 block scales in ModelOpt's layout, rebuilt from ``packed``."""
        return unpack_nvfp4(self.packed_weight(), self.weight_2d)[1]

    def set_weight(self, weight: torch.Tensor, weight_scale: torch.Tensor, weight_scale_2: torch.Tensor) -> None:
        """Take NVFP4 tensors in ModelOpt's layout (validated by the packing) as the layer's weight,
        on the layer's device."""
        self._set_weight(weight, weight_scale, weight_scale_2, self.packed.device)

    def _set_weight(self, weight: torch.Tensor, weight_scale: torch.Tensor, weight_scale_2: torch.Tensor,
                    device: torch.device, assign: bool = False) -> None:
        if not isinstance(weight, torch.Tensor) or tuple(weight.shape) != (self.out_features, self.in_features // 2):
            raise ValueError(f"weight: expected [{self.out_features}, {self.in_features // 2}] packed codes, got "
                             f"{tuple(getattr(weight, 'shape', ()))}")
        packed = pack_nvfp4(weight.to(device), weight_scale.to(device), weight_scale_2.to(device), self.weight_2d)
        self._store("packed", packed.data, assign)
        self._store("weight_scale_2", packed.global_scale.reshape(()), assign)

    @classmethod
    def from_linear(cls, linear: torch.nn.Module, weight_2d: bool = False) -> NVFP4InferenceLinear:
        """Quantize ``linear``'s weight (an ``nn.Linear`` or a trained ``FP8Linear``) once; a
        meta-device ``linear`` gives a meta-device layer (values to come from ``load_state_dict(...,
        assign=True)``)."""
        dtype = linear.weight.dtype if linear.weight.dtype in (torch.bfloat16, torch.float16) else torch.float32
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None, linear.weight.device, dtype,
                    weight_2d)
        if linear.weight.is_meta:  # a skeleton: no values to quantize
            return layer
        w = quantize_linear_weight(linear, layer.recipe)
        layer.set_weight(w.data, w.scale, w.global_scale)
        if linear.bias is not None:
            layer.bias = linear.bias.detach().to(dtype).clone()
        return layer

    @classmethod
    def from_modelopt(cls, weight: torch.Tensor, weight_scale: torch.Tensor, weight_scale_2: torch.Tensor,
                      bias: torch.Tensor | None = None, input_scale: torch.Tensor | None = None,
                      out_dtype: torch.dtype = torch.bfloat16) -> NVFP4InferenceLinear:
        """A layer of one linear's tensors from a ModelOpt NVFP4 checkpoint, taken as they are
        (``weight`` uint8 ``[out, in / 2]``, ``weight_scale`` float8_e4m3fn ``[out, in / 16]``,
        ``weight_scale_2`` and ``input_scale`` FP32 scalars or ``[1]``)."""
        if not isinstance(weight, torch.Tensor) or weight.dtype != torch.uint8 or weight.dim() != 2:
            raise ValueError(f"weight: expected a uint8 [out, in / 2] tensor of packed E2M1 codes, got "
                             f"{getattr(weight, 'dtype', type(weight))} {tuple(getattr(weight, 'shape', ()))}")
        out_features, in_features = weight.shape[0], 2 * weight.shape[1]
        layer = cls(in_features, out_features, bias is not None, weight.device, out_dtype)
        state = {"weight": weight, "weight_scale": weight_scale, "weight_scale_2": weight_scale_2,
                 "input_scale": layer.input_scale if input_scale is None else input_scale}
        if bias is not None:
            state["bias"] = bias
        layer.load_state_dict(state)
        return layer

    def quantized_weight(self) -> QuantizedTensor:
        """The weight as a QuantizedTensor in the recipe's layout (rebuilt from ``packed``)."""
        weight, weight_scale = unpack_nvfp4(self.packed_weight(), self.weight_2d)
        return QuantizedTensor(weight, weight_scale, self.recipe, (self.out_features, self.in_features),
                               self.out_dtype, self.weight_scale_2)

    def packed_weight(self) -> PackedNVFP4:
        """The weight in the weight-only kernel's layout (``lowprec.gemm.weight_only``): views of
        the buffers, made again only when a buffer is replaced (load, device move) or its
        ``.data`` assigned anew; in-place updates show through the views."""
        packed, scale = self.packed, self.weight_scale_2
        return self._views_of("_packed_view", (packed, scale), lambda: PackedNVFP4(
            packed, scale.reshape(1), self.out_features, self.in_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x · Wᵀ + b`` in ``x``'s dtype (the autocast dtype inside ``torch.autocast``)."""
        if not isinstance(x, torch.Tensor) or x.dtype not in _FLOAT_DTYPES:
            raise TypeError(f"x: expected a float32/bfloat16/float16 tensor, got {getattr(x, 'dtype', type(x))}")
        if x.dim() == 0 or x.shape[-1] != self.in_features:
            raise ValueError(f"x: last dim must be in_features={self.in_features}, got shape {tuple(x.shape)}")
        if x.device != self.packed.device:
            raise ValueError(f"x: on {x.device}, but the layer is on {self.packed.device}")
        x, autocast_off = follow_autocast(x)
        with autocast_off:
            x2 = x if x.dim() == 2 else x.reshape(-1, self.in_features)
            bias = None if self.bias is None else self.bias.to(x.dtype)
            if torch.is_grad_enabled() and x2.requires_grad:
                y = F.linear(x2, dequantize(self.quantized_weight(), x.dtype), bias)
            else:
                y = weight_only(x2, self.packed_weight(), self.quantized_weight, bias)
            return y if x.dim() == 2 else y.reshape(*x.shape[:-1], self.out_features)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        weight, weight_scale = unpack_nvfp4(self.packed_weight(), self.weight_2d)
        destination[prefix + "weight"] = weight
        destination[prefix + "weight_scale"] = weight_scale
        super()._save_to_state_dict(destination, prefix, keep_vars)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        for name in _SCALARS:  # ModelOpt writes the scalars as [] or [1]
            t = state_dict.get(prefix + name)
            if isinstance(t, torch.Tensor) and t.dim() == 1 and t.numel() == 1:
                state_dict[prefix + name] = t.reshape(())
        taken = {name: state_dict.pop(prefix + name, None) for name in ("weight", "weight_scale")}
        # ModelOpt writes the KV-cache scales under k_proj / v_proj: not this layer's, not unexpected
        kv_scales = {name: state_dict.pop(prefix + name, None) for name in _KV_SCALES}
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        if prefix + "input_scale" not in state_dict:  # weight-only checkpoints have none; unused here
            if prefix + "input_scale" in missing_keys:
                missing_keys.remove(prefix + "input_scale")
            if self.input_scale.is_meta and local_metadata.get("assign_to_params_buffers", False) \
                    and taken["weight"] is not None:
                self.input_scale = torch.ones((), dtype=torch.float32, device=taken["weight"].device)
        for name, t in (*taken.items(), *kv_scales.items()):
            if t is not None:
                state_dict[prefix + name] = t
        expected = {"weight": torch.uint8, "weight_scale": torch.float8_e4m3fn}
        missing = [name for name, t in taken.items() if t is None]
        if missing:
            if strict:
                missing_keys.extend(prefix + name for name in missing)
            return
        wrong = [name for name, t in taken.items() if not isinstance(t, torch.Tensor) or t.dtype != expected[name]]
        for name in wrong:
            error_msgs.append(f"{prefix}{name}: expected {expected[name]}, as state_dict() saves it, got "
                              f"{getattr(taken[name], 'dtype', type(taken[name]))} (float weights are quantized by "
                              "from_linear or lowprec.convert)")
        if wrong:
            return
        global_scale = state_dict.get(prefix + "weight_scale_2", self.weight_scale_2)
        if not isinstance(global_scale, torch.Tensor) or global_scale.numel() != 1:
            return  # the base load reported its shape (size mismatch)
        assign = local_metadata.get("assign_to_params_buffers", False)
        if assign:  # the checkpoint's device
            device = taken["weight"].device
        elif self.packed.is_meta:  # as torch's load into a meta module without assign: nothing to copy into
            return
        else:
            device = self.packed.device
        try:
            self._set_weight(taken["weight"], taken["weight_scale"], global_scale.reshape(()).float(), device, assign)
        except ValueError as err:
            error_msgs.append(f"{prefix}weight: {err}")

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"nvfp4{' 16x16' if self.weight_2d else ''}")
