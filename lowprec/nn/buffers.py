"""A module base for FP8 codes and FP32 scales kept as buffers (the inference layers)."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["QuantizedBuffersModule"]

_OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)  # a QuantizedTensor's dtypes


def check_out_dtype(out_dtype: torch.dtype) -> None:
    """At construction: an int dtype (or a typo) would fail only at the first forward."""
    if out_dtype not in _OUT_DTYPES:
        raise TypeError(f"out_dtype: expected one of {[str(d) for d in _OUT_DTYPES]}, got {out_dtype!r}")


class QuantizedBuffersModule(nn.Module):
    """Base of modules keeping FP8 codes and FP32 scales as buffers (their names in
    ``_quantized``): module casts (``.half()``, ``.to(dtype)``, ...) move them between devices
    but keep their dtypes (a cast would double their memory and flush small scales to zero), and
    ``load_state_dict`` takes them only in those dtypes (a float weight copied into the codes
    would be cast to FP8 under scales that do not belong to it). A float ``out_dtype`` attribute
    (the inference linears': the dtype of the bias and of a dequantized weight) follows the cast
    as the bias does.

    Assigning a tensor of another dtype to one of those buffers (or a tensor to a read-only
    property such as :class:`~lowprec.nn.NVFP4InferenceLinear`'s ``weight``) raises a
    ``TypeError``: transformers' ``tie_weights()`` (called by ``resize_token_embeddings`` and
    ``init_weights``) would set a tied ``lm_head``'s weight to the float input embedding, which
    the layer cannot read as its codes. Tie or resize before ``lowprec.convert`` (which quantizes
    the tied weight into the layer), or keep the layer out of it with ``filter_fn``."""

    _quantized: tuple[str, ...] = ()
    # what a subclass derives from those buffers and keeps in __dict__ (packed weights, views of the
    # buffers): dropped by a module cast or move, which would leave them holding the old device's
    # tensors (model.cpu() would not free the GPU copies)
    _derived: tuple[str, ...] = ()

    def __setattr__(self, name: str, value) -> None:
        if isinstance(value, torch.Tensor):
            own = self.__dict__.get("_buffers", {}).get(name) if name in self._quantized else None
            read_only = isinstance(getattr(type(self), name, None), property)
            if read_only or (own is not None and value.dtype != own.dtype):
                held = "is read-only, rebuilt from the packed codes" if read_only else f"holds {own.dtype} values"
                raise TypeError(
                    f"{type(self).__name__}({self.extra_repr()}).{name}: cannot take a {value.dtype} tensor, it "
                    f"{held} under the layer's own scales. A tied weight (transformers' tie_weights(), also called by "
                    f"resize_token_embeddings and init_weights, ties lm_head to the input embedding) must be tied "
                    f"or resized before lowprec.convert, which quantizes it into the layer; or keep the layer out "
                    f"with convert(..., filter_fn=lambda name, module: name != 'lm_head')")
        super().__setattr__(name, value)

    def _views_of(self, slot: str, tensors: tuple[torch.Tensor, ...], build):
        """``build()`` (views of ``tensors``, the buffers), kept in ``__dict__[slot]`` (one of
        ``_derived``) and made again when a buffer is replaced or given new storage: ``buffer.data =
        ...`` keeps the tensor, but the views would read the old storage. Traced by
        ``torch.compile``, made each time (dynamo cannot trace the storage check)."""
        if torch.compiler.is_compiling():
            return build()
        where = tuple((t.get_device(), t.data_ptr()) for t in tensors)
        cached = self.__dict__.get(slot)
        if cached is None or any(a is not b for a, b in zip(cached[0], tensors)) or cached[1] != where:
            cached = self.__dict__[slot] = (tensors, where, build())
        return cached[2]

    def _store(self, name: str, value: torch.Tensor, assign: bool) -> None:
        """``self.name = value``, or ``value`` copied into the buffer ``name`` holds where it can
        take it (same shape, dtype and device; not a meta or an inference tensor) and ``assign`` is
        False, as torch's ``load_state_dict`` copies parameters: CUDA graphs captured before a
        reload, and the views made of the buffer, keep reading it."""
        own = self._buffers.get(name)
        if (not assign and own is not None and not own.is_meta and not own.is_inference()
                and (own.shape, own.dtype, own.device) == (value.shape, value.dtype, value.device)):
            with torch.no_grad():
                own.copy_(value)
        else:
            setattr(self, name, value)

    def _apply(self, fn, recurse=True):
        kept = [self._buffers[name] for name in self._quantized]
        out_dtype = getattr(self, "out_dtype", None)
        if out_dtype in _OUT_DTYPES and kept:  # where fn puts a float tensor of out_dtype (the bias, if any)
            target = fn(torch.empty(0, dtype=out_dtype, device=kept[0].device)).dtype
            if target in _OUT_DTYPES:
                self.out_dtype = target

        def apply(t: torch.Tensor) -> torch.Tensor:
            if not any(t is k for k in kept):
                return fn(t)
            target = fn(t.new_empty(0))  # where and in what dtype fn puts a tensor of t's kind
            return fn(t) if target.dtype == t.dtype else t.to(target.device)

        for name in self._derived:
            if name in self.__dict__:
                self.__dict__[name] = None  # made again from the buffers at the next use
        return super()._apply(apply, recurse)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        wrong = {}
        for name in self._quantized:
            key, own = prefix + name, self._buffers[name]
            t = state_dict.get(key)
            if isinstance(t, torch.Tensor) and t.dtype != own.dtype:
                wrong[key] = state_dict.pop(key)
                error_msgs.append(f"{key}: expected {own.dtype}, as state_dict() saves it, got {t.dtype} (float "
                                  f"weights are quantized by from_linear / from_moe or lowprec.convert)")
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        state_dict.update(wrong)
        missing_keys[:] = [k for k in missing_keys if k not in wrong]
        # load_state_dict(..., assign=True) takes the state dict's bias as it is: out_dtype (the bias's
        # dtype, as after a module cast) follows it
        bias = self._buffers.get("bias")
        if bias is not None and getattr(self, "out_dtype", None) in _OUT_DTYPES and bias.dtype in _OUT_DTYPES:
            self.out_dtype = bias.dtype
