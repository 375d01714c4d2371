"""Quantize each master weight once per optimizer step instead of once per forward.

With gradient accumulation a step runs forward + backward on several micro-batches while the
weights stay the same, yet :class:`~lowprec.nn.FP8Linear` and :class:`~lowprec.moe.MoE` quantize
their weights (and the transposed copy the input gradient needs) in every forward: for an MoE
layer that is a full pass over all expert weights per micro-batch. Inside
:func:`reuse_quantized_weights` the first forward quantizes and the FP8 copies are reused until
the weight changes or the block ends.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import weakref
from collections.abc import Iterator

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from ..quant import quantize, quantize_with_transpose
from ..recipes import get_recipe
from ..runtime import version_of
from ..tensor import QuantizedTensor
from .fsdp import GATHER_RECIPE, FP8AllGatherWeight, FP8GatheredWeight

__all__ = ["reuse_quantized_weights", "quantize_weight"]

_state = threading.local()


def _forget_after_step(optimizer, args, kwargs) -> None:
    """Any optimizer step inside a block: drop the FP8 copies. The version counter does not see
    every update: FSDP2 all-gathers the stepped shards into the same unsharded parameter and keeps
    its version counter as it was (``_unsafe_preserve_version_counter``)."""
    cache = getattr(_state, "cache", None)
    if cache:
        cache.clear()


register_optimizer_step_post_hook(_forget_after_step)


class _Entry:
    __slots__ = ("ref", "storage", "version", "dtype", "device", "w_q", "w_t", "inference")

    def __init__(self, cache: dict, weight: torch.Tensor, recipe: str, w_q: QuantizedTensor,
                 w_t: QuantizedTensor | None):
        # a weight or storage freed (a weight made per forward, a cast, model.cpu()) drops the FP8
        # copies at once, not at the block's end
        forget = functools.partial(_forget, cache, (id(weight), recipe))
        self.ref = weakref.ref(weight, forget)
        self.version = version_of(weight)
        # module casts and moves (model.half(), .to(device)) and ``weight.data = t`` swap param.data
        # without a version bump: a new storage, in the old dtype after a cast back (.half().float())
        storage = _storage(weight)
        self.storage = None if storage is None else weakref.ref(storage, forget)
        self.dtype, self.device = weight.dtype, weight.device
        self.w_q, self.w_t = w_q, w_t
        # copies made under torch.inference_mode are inference tensors, which autograd cannot save
        self.inference = torch.is_inference_mode_enabled()


def _storage(weight: torch.Tensor):
    """``weight``'s storage; None for a wrapper subclass (DTensor, ...), which has none."""
    return None if is_traceable_wrapper_subclass(weight) else weight.untyped_storage()


def _forget(cache: dict, key: tuple[int, str], ref: weakref.ref) -> None:
    entry = cache.get(key)
    if entry is not None and (entry.ref is ref or entry.storage is ref):
        cache.pop(key, None)  # freed in another thread: the owner may have dropped it meanwhile


@contextlib.contextmanager
def reuse_quantized_weights() -> Iterator[None]:
    """Within the block, each weight is quantized once and its FP8 copies are reused.

    For gradient accumulation::

        with lowprec.nn.reuse_quantized_weights():
            for batch in micro_batches:
                model(batch).loss.backward()
        optimizer.step()

    A weight modified in place inside the block (``optimizer.step()``, ``weight.copy_(...)``
    under ``no_grad``: anything that bumps the tensor's version counter) or given new storage
    (``model.half()``, ``model.to(device)``, ``weight.data = t``) is quantized again at its next
    use; an optimizer step drops every FP8 copy (under FSDP2 the unsharded weights are refilled
    without a version bump). In-place writes through ``weight.data`` bypass the version counter,
    as they bypass autograd, and so do in-place writes to FSDP2's sharded parameters other than
    an optimizer step (their unsharded weight is refilled at the next all-gather): make them
    outside the block. So do in-place writes to inference tensors (weights made under
    ``torch.inference_mode``, which track no version). Copies made under ``torch.inference_mode``
    (an evaluation inside the block) serve only forwards under it; training forwards quantize
    again (autograd cannot save inference tensors). The FP8 copies (weight and, for training, its
    transpose: about two bytes per parameter) stay alive until the block ends or the weight or its
    storage is freed. Blocks nest; the outermost one owns the cache. Per thread; ignored while
    ``torch.compile`` traces.
    """
    outer = getattr(_state, "cache", None)
    if outer is not None:
        yield
        return
    _state.cache = {}
    try:
        yield
    finally:
        _state.cache.clear()  # the entries' weakref callbacks hold the dict: no cycle left for the gc
        _state.cache = None


def quantize_weight(weight: torch.Tensor, recipe: str, with_transpose: bool
                    ) -> tuple[QuantizedTensor, QuantizedTensor | None]:
    """``(quantize(weight), quantize(weightᵀ) or None)`` for a layer's forward, from the cache
    of the enclosing :func:`reuse_quantized_weights` block where there is one.

    ``with_transpose``: also the transposed copy (the input-gradient GEMM's operand): from the
    same pass for transposable recipes (128x128 blocks, tensorwise), else quantized along the
    other dim. Leading dims of ``weight`` are a batch of matrices (experts).
    """
    if isinstance(weight, FP8GatheredWeight) and recipe == GATHER_RECIPE:  # gathered in FP8 by FSDP2
        w_q = weight.quantized()
        return w_q, w_q.transpose() if with_transpose else None
    if isinstance(weight, FP8AllGatherWeight):  # the master weight itself: the kernels read a plain tensor
        weight = weight.hp
    # traced graphs take the plain path: no thread-local state read under torch.compile
    cache = None if torch.compiler.is_compiling() else getattr(_state, "cache", None)
    if cache is None:
        return _quantize(weight, recipe, with_transpose)
    key = (id(weight), recipe)  # a weight two layers share under two recipes keeps both copies
    entry = cache.get(key)
    if (entry is not None and entry.ref() is weight and entry.version == version_of(weight)
            and (entry.storage is None or entry.storage() is _storage(weight))
            and entry.dtype == weight.dtype and entry.device == weight.device
            and (entry.w_t is not None or not with_transpose)
            and (not entry.inference or torch.is_inference_mode_enabled())):
        return entry.w_q, entry.w_t if with_transpose else None
    w_q, w_t = _quantize(weight, recipe, with_transpose)
    cache[key] = _Entry(cache, weight, recipe, w_q, w_t)
    return w_q, w_t


def _quantize(weight: torch.Tensor, recipe: str, with_transpose: bool
              ) -> tuple[QuantizedTensor, QuantizedTensor | None]:
    if not with_transpose:
        return quantize(weight, recipe, check_finite=False), None
    if get_recipe(recipe).transposable:  # both orientations from one pass on a kernel
        return quantize_with_transpose(weight, recipe)
    # contiguous: the quantize kernels read rows
    return (quantize(weight, recipe, check_finite=False),
            quantize(weight.transpose(-1, -2).contiguous(), recipe, check_finite=False))
