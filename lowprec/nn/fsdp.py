"""FP8 all-gather under FSDP2 (``fully_shard``) of the weights lowprec quantizes in 128x128 blocks
(:class:`~lowprec.nn.FP8Linear`'s, the MoE's expert weights, :class:`~lowprec.nn.FP8SwiGLUMLP`'s layers).

FSDP2 shards each weight along its rows and all-gathers the full weight before every forward
and backward, in the weight's dtype. The layer then quantizes the gathered weight to E4M3 with
128x128 block scales (``fp8_block``). :func:`~lowprec.nn.enable_fp8_all_gather` makes each rank quantize its
own shard instead and the ranks gather the E4M3 codes and the FP32 block scales: one byte per
weight plus 4 bytes per 128x128 block, against 2 (bf16) or 4 (FP32) bytes, and no per-rank
quantization of the whole weight. A shard whose rows are a multiple of 128 holds whole blocks,
so its codes and scales are exactly those of the full weight's: the layers compute the same bits
as with the plain all-gather (tested). A stack of expert matrices is sharded along the experts,
so its shards always hold whole matrices. Layers whose shards would split a block keep the plain
all-gather.

How (this module holds the tensor subclasses; :func:`~lowprec.nn.enable_fp8_all_gather`, beside
``FP8Linear``, swaps them in): the weight parameter becomes an :class:`FP8AllGatherWeight`, a
tensor subclass wrapping the master weight that behaves as the master weight for every op
(optimizers, state dicts, DTensor) and implements FSDP2's all-gather extension
(``fsdp_pre_all_gather`` / ``fsdp_post_all_gather``); the gathered weight is an
:class:`FP8GatheredWeight`, which :func:`~lowprec.nn.fp8_linear` takes as its quantized form
(``quantize_weight`` returns its codes and scales).
"""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_map_only

from ..recipes import get_recipe
from ..tensor import QuantizedTensor

__all__ = ["FP8AllGatherWeight", "FP8GatheredWeight", "GATHER_RECIPE"]

_BLOCK = 128
GATHER_RECIPE = "fp8_block128x128"  # the weights' recipe the FP8 all-gather sends
_aten = torch.ops.aten
# ops FSDP2 applies to a parameter while sharding it, padding it and moving it (and detach, which
# nn.Parameter applies): their outputs stay FP8AllGatherWeight, so the shard keeps the extension
_KEEPS_SUBCLASS = {
    _aten.detach.default, _aten.alias.default, _aten.view.default, _aten.slice.Tensor, _aten.split.Tensor,
    _aten.split_with_sizes.default, _aten.chunk.default, _aten.as_strided.default, _aten.clone.default,
    _aten.copy_.default, _aten.empty_like.default, _aten.new_zeros.default, _aten.new_empty.default,
    _aten._to_copy.default, _aten._pin_memory.default, _aten.narrow.default,
}


class FP8AllGatherWeight(torch.Tensor):
    """A master weight (any float dtype) whose FSDP2 all-gather sends 128x128-block E4M3 codes and
    FP32 scales (module docstring). Every other op sees the wrapped tensor ``hp``."""

    hp: torch.Tensor

    @staticmethod
    def __new__(cls, hp: torch.Tensor):
        return torch.Tensor._make_wrapper_subclass(cls, hp.size(), strides=hp.stride(),
                                                   storage_offset=hp.storage_offset(), dtype=hp.dtype,
                                                   device=hp.device, layout=hp.layout,
                                                   requires_grad=hp.requires_grad)

    def __init__(self, hp: torch.Tensor):
        self.hp = hp

    __torch_function__ = torch._C._disabled_torch_function_impl

    @property
    def data(self) -> torch.Tensor:
        return torch.Tensor.data.__get__(self)

    @data.setter
    def data(self, value: torch.Tensor) -> None:
        # torch's own set_data would swap the wrapper's metadata only: every op would still read the old hp
        hp = (value.hp if isinstance(value, FP8AllGatherWeight) else value).detach()
        torch.Tensor.data.__set__(self, FP8AllGatherWeight(hp))
        self.hp = hp

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        out = func(*tree_map_only(cls, lambda t: t.hp, args), **tree_map_only(cls, lambda t: t.hp, kwargs or {}))
        if func._schema.is_mutable:  # below autograd: bump the master weight's version ourselves (weight cache)
            tree_map_only(cls, lambda t: torch.autograd.graph.increment_version(t.hp), (args, kwargs or {}))
        if func in _KEEPS_SUBCLASS:
            return tree_map_only(torch.Tensor, cls, out)
        return out

    def __tensor_flatten__(self):
        return ["hp"], None

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        return FP8AllGatherWeight(inner["hp"])

    def __repr__(self) -> str:
        return f"FP8AllGatherWeight({self.hp!r})"

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        """This rank's shard as E4M3 codes (uint8) and FP32 128x128 block scales, when every
        shard holds whole blocks (:func:`_whole_blocks`: an even split along the first dim, a
        matrix's shards in rows of multiples of 128); else the shard as it is, padded as FSDP
        pads uneven shards (the plain all-gather)."""
        from ..quant import quantize

        # one rank: FSDP2 skips the all-gather and hands on only the first input (the codes
        # without their scales, torch PR 197999), and there is nothing to save on the wire
        if mesh.size() == 1 or not _whole_blocks(self.hp, tuple(outer_size), mesh.size()):
            # every rank takes the same path (decided from the full shape), and a shard shorter
            # than the others (uneven sharding) is padded to their size as FSDP pads its own
            # the plain all-gather: cast before it, as FSDP does for a plain parameter, so that the
            # gathered tensor is the unsharded weight itself (FSDP refills it in place at every
            # later all-gather: a copy made after it would keep the first all-gather's values)
            param_dtype = getattr(mp_policy, "param_dtype", None)
            shard = self.hp if param_dtype is None else self.hp.to(param_dtype)
            return (_padded_shard(shard, tuple(outer_size), mesh.size()),), None
        q = quantize(self.hp, GATHER_RECIPE, check_finite=False)
        return (q.data.view(torch.uint8), q.scale), tuple(outer_size)

    def fsdp_post_all_gather(self, outputs, metadata, param_dtype, *, out=None):
        """The gathered weight: an :class:`FP8GatheredWeight` of the full codes and scales (or,
        after a plain all-gather, the full weight)."""
        if metadata is None:  # the plain all-gather
            (full,) = outputs
            if out is not None:  # FSDP refilled full: out views it
                return None
            return full, (full,)  # already in param_dtype (cast before the all-gather)
        codes, scales = outputs
        if out is not None:  # FSDP refilled the same buffers: out already views them
            return None
        dtype = param_dtype if param_dtype is not None else self.dtype
        return FP8GatheredWeight(codes, scales, torch.Size(metadata), dtype), (codes, scales)


class FP8GatheredWeight(torch.Tensor):
    """A full weight as FP8AllGatherWeight's all-gather delivers it: E4M3 codes ``[out, in]`` and
    FP32 scales per 128x128 block. It reports the master weight's shape and dtype;
    :func:`~lowprec.nn.fp8_linear` multiplies by its codes directly (:meth:`quantized`), other ops
    see its dequantized value."""

    codes: torch.Tensor
    scales: torch.Tensor

    @staticmethod
    def __new__(cls, codes: torch.Tensor, scales: torch.Tensor, shape: torch.Size, dtype: torch.dtype):
        return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=codes.device)

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, shape: torch.Size, dtype: torch.dtype):
        self.codes, self.scales = codes, scales

    __torch_function__ = torch._C._disabled_torch_function_impl

    def quantized(self) -> QuantizedTensor:
        """The weight as the ``fp8_block128x128`` QuantizedTensor it was gathered as."""
        return QuantizedTensor(self.codes.view(torch.float8_e4m3fn), self.scales, get_recipe(GATHER_RECIPE),
                               tuple(self.shape), self.dtype)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func in (_aten.detach.default, _aten.alias.default) or (
                func in (_aten.view.default, _aten.as_strided.default) and _whole(args)):
            # nn.Parameter(...), .data, FSDP's as_strided to the full shape: the same codes
            self = args[0]
            return cls(self.codes, self.scales, self.shape, self.dtype)
        unwrap = tree_map_only(cls, lambda t: t.quantized().dequantize(t.dtype), (args, kwargs or {}))
        return func(*unwrap[0], **unwrap[1])

    def __tensor_flatten__(self):
        return ["codes", "scales"], (tuple(self.shape), self.dtype)

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        return FP8GatheredWeight(inner["codes"], inner["scales"], torch.Size(meta[0]), meta[1])

    def __repr__(self) -> str:
        return f"FP8GatheredWeight(shape={tuple(self.shape)}, dtype={self.dtype}, codes on {self.codes.device})"


def _whole_blocks(shard: torch.Tensor, full: tuple, world: int) -> bool:
    """Whether every rank's shard of ``full`` holds whole 128x128 blocks: FSDP split it evenly
    along its first dim (``shard`` has the full's other dims) into whole matrices (a stack of
    experts) or rows in multiples of 128 (a matrix). Decided from the full shape, alike on every
    rank (a shard may be empty or shorter under uneven sharding, or split along another dim)."""
    if shard.dim() not in (2, 3) or tuple(shard.shape[1:]) != full[1:] or not full[0] or full[0] % world:
        return False
    return shard.dim() == 3 or (full[0] // world) % _BLOCK == 0


def _padded_shard(shard: torch.Tensor, full: tuple, world: int) -> torch.Tensor:
    """``shard`` zero-padded along its sharded dim to the size of the first (largest) shard,
    which FSDP requires of every all-gather input of an unevenly sharded parameter."""
    dims = [d for d in range(shard.dim()) if shard.shape[d] != full[d]]
    if not dims:
        return shard
    d = dims[0]
    size = -(-full[d] // world)
    if shard.shape[d] == size:
        return shard
    padded = shard.new_zeros(*shard.shape[:d], size, *shard.shape[d + 1:])
    padded.narrow(d, 0, shard.shape[d]).copy_(shard)
    return padded


def _whole(args) -> bool:
    """``view(t, size)`` / ``as_strided(t, size, stride, offset)`` of ``t`` as it is."""
    t, size = args[0], tuple(args[1])
    if size != tuple(t.shape):
        return False
    return len(args) < 3 or (tuple(args[2]) == t.stride() and (len(args) < 4 or not args[3]))
