"""Tile configurations of the sm_90a block-scaled GEMM (no cutlass import: the heuristic and
the host wiring use this without compiling anything)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

SCALE_BLOCK = 128  # K (and N for 128x128 weight scales) granularity of the scales


@dataclass(frozen=True)
class TileConfig:
    """One kernel configuration (everything that changes the generated code)."""

    tile_m: int = 128  # 64 (one consumer warpgroup), 128 (two) or 256 (two, each 2 x 64 rows)
    tile_n: int = 128  # multiple of 16, see ``valid_tile_n``
    cluster_m: int = 1  # CTAs of a cluster along M (they share the B tile: multicast B)
    cluster_n: int = 1  # CTAs of a cluster along N (they share the A tile: multicast A)
    raster_along_m: bool = True
    swizzle: int = 1
    split_k: int = 1  # >1: K split over CTAs, fp32 partials [M, N, split_k] reduced on the host side
    mma_overlap: bool = True  # 2 block accumulators: wgmma of block k+1 runs during promotion of k
    # programmatic dependent launch: CTAs start (barrier init, descriptor prefetch) while the
    # previous kernel on the stream drains, and wait for it before touching global memory
    pdl: bool = True

    def __str__(self) -> str:
        return (
            f"{self.tile_m}x{self.tile_n}_c{self.cluster_m}x{self.cluster_n}"
            f"_{'m' if self.raster_along_m else 'n'}{self.swizzle}"
            + (f"_s{self.split_k}" if self.split_k > 1 else "")
            + ("" if self.pdl else "_nopdl")
            + ("" if self.mma_overlap else "_noov")
        )


def scale_blocks_spanned(tile_n: int) -> int:
    """Most 128-wide weight-scale blocks one tile's columns can touch (tiles start at multiples
    of tile_n, so at offsets that are multiples of gcd(tile_n, 128) within a block)."""
    worst_offset = SCALE_BLOCK - math.gcd(tile_n, SCALE_BLOCK)
    return (worst_offset + tile_n - 1) // SCALE_BLOCK + 1


def group_box_rows(tile_n: int, col_group: int) -> int:
    """Rows of a tile's TMA box of column-group B scales (16x128 blocks): its tile_n / col_group
    scales, padded to 16 bytes (TMA's smallest box row)."""
    return -(-(tile_n // col_group) // 4) * 4


def valid_tile_n(tile_n: int) -> bool:
    """Tile N values the kernel supports.

    Multiple of 16, at most 192 (accumulator + per-block accumulator must fit in 232 registers),
    and a tile touches at most three 128-wide weight-scale blocks (176 does: 2112 = 12 x 176).
    """
    return tile_n % 16 == 0 and 16 <= tile_n <= 192 and scale_blocks_spanned(tile_n) <= 3


# ----------------------------------------------------------------------------- what the kernels take
# Stated once: the registry asks these (``why_not``), the launchers in interface.py check the
# same constants on raw tensors.
MN_MULTIPLE = 16  # N and K (GEMM), N, P and K (K-grouped): TMA rows of 16 bytes
WGRAD_N_MULTIPLE = 64  # K-grouped GEMM: a tile never straddles two groups' outputs
OUT_DTYPES = ("bfloat16", "float16", "float32")
BIAS_DTYPES = ("float32", "bfloat16")
# FP8 recipes with FP32 scales: rowwise and tensorwise scales repeat per 128-wide K block
_OUT_TORCH_DTYPES = tuple(getattr(torch, name) for name in OUT_DTYPES)
A_RECIPES = ("fp8_block1x128", "fp8_rowwise", "fp8_tensorwise")
B_RECIPES = ("fp8_block1x128", "fp8_block16x128", "fp8_block128x128", "fp8_rowwise", "fp8_tensorwise")
B_BLOCK_N = (1, 16, 128)  # B's scale block rows the kernel takes (1x128, 16x128, 128x128 blocks)


def _dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _mn_unsupported(**dims: int) -> str | None:
    if any(v % MN_MULTIPLE for v in dims.values()):
        return " and ".join(f"{k}={v}" for k, v in dims.items()) + f" must be multiples of {MN_MULTIPLE}"
    return None


def gemm_unsupported(a, b, out_dtype, bias) -> str | None:
    """Why the dense kernel cannot take QuantizedTensors ``a`` [M, K], ``b`` [N, K] (None: it can)."""
    if a.recipe.name not in A_RECIPES:
        return f"a's recipe is {a.recipe.name}; the kernel takes {A_RECIPES} activations"
    if b.recipe.name not in B_RECIPES:
        return f"b's recipe is {b.recipe.name}; the kernel takes {B_RECIPES} weights"
    return _dense_unsupported(a.shape[0], *b.shape, out_dtype, bias)


def _dense_unsupported(m: int, n: int, k: int, out_dtype, bias) -> str | None:
    """The dense kernel's limits on the problem itself (any operand recipes)."""
    if m == 0 or n == 0 or k == 0:
        return f"M={m}, N={n}, K={k}: an empty dimension (the kernel's K loop needs at least one block)"
    if out_dtype not in _OUT_TORCH_DTYPES:
        return f"out_dtype {out_dtype}"
    if bias is not None and _dtype_name(bias.dtype) not in BIAS_DTYPES:
        return f"bias dtype {bias.dtype} (the kernel takes {BIAS_DTYPES})"
    return _mn_unsupported(N=n, K=k)


def linear_inference_unsupported(x, weight, weight_scale, weight_recipe: str, activation_recipe: str, bias,
                                 out_dtype) -> str | None:
    """Why ``interface.linear_inference`` (``FP8InferenceLinear``'s eager forward in one host pass: the
    1x128 quantize kernel on ``x`` [M, K], then the dense kernel on the FP8 weight [N, K]) cannot
    take these arguments (None: it can); the layer then runs ``quantize`` and ``gemm``."""
    from ...quant.sm90.config import rows_unsupported

    if activation_recipe != "fp8_block1x128" or weight_recipe != "fp8_block128x128":
        return f"recipes {activation_recipe} x {weight_recipe} (the one-pass path takes fp8_block)"
    if x.shape[0] == 0:
        return "M=0: nothing to compute"
    if weight.dtype != torch.float8_e4m3fn or weight.dim() != 2 or x.dim() != 2 or x.shape[-1] != weight.shape[1]:
        return f"weight {weight.dtype} {tuple(weight.shape)} for x {tuple(x.shape)} (expected float8_e4m3fn [N, K])"
    # the kernel's B scales have their own row count (build_kernel: sym_sb_rows): a grid of fewer rows
    # than N's 128-row blocks would be read past its end by TMA (zeros: silently zero output columns)
    n, k = weight.shape
    if weight_scale.dtype != torch.float32 or tuple(weight_scale.shape) != (-(-n // SCALE_BLOCK), -(-k // SCALE_BLOCK)):
        return (f"weight_scale {weight_scale.dtype} {tuple(weight_scale.shape)} (expected float32 "
                f"[{-(-n // SCALE_BLOCK)}, {-(-k // SCALE_BLOCK)}]: the weight's 128x128 blocks)")
    why = rows_unsupported(x)
    return f"x: {why}" if why else _dense_unsupported(x.shape[0], *weight.shape, out_dtype, bias)


def grouped_unsupported(a, b, out_dtype, group_ends, masked_counts) -> str | None:
    """Why the grouped kernel cannot take ``a`` (1x128) and ``b`` [E, N, K] (128x128) (None: it can)."""
    if a.recipe.name != "fp8_block1x128" or b.recipe.name != "fp8_block128x128":
        return (f"recipes {a.recipe.name} x {b.recipe.name}; the grouped kernel takes fp8_block1x128 activations "
                "and fp8_block128x128 weights")
    if _dtype_name(out_dtype) not in OUT_DTYPES:
        return f"out_dtype {out_dtype}"
    e, n, k = b.shape
    if e == 0 or n == 0 or k == 0:  # the launcher refuses them (interface._validate_grouped), E = 0 divides by zero
        return f"E={e}, N={n}, K={k}: an empty dimension"
    return _mn_unsupported(N=n, K=k)


def wgrad_unsupported(a, b, group_ends, out_dtype) -> str | None:
    """Why the K-grouped kernel cannot take ``a`` [N, K], ``b`` [P, K] (1x128 along K) (None: it can)."""
    if a.recipe.name != "fp8_block1x128" or b.recipe.name != "fp8_block1x128":
        return f"recipes {a.recipe.name} x {b.recipe.name}; the kernel takes fp8_block1x128 operands"
    if a.shape[0] % WGRAD_N_MULTIPLE:
        return f"a rows {a.shape[0]} must be a multiple of {WGRAD_N_MULTIPLE}"
    if a.shape[0] == 0 or b.shape[0] == 0 or a.shape[1] == 0 or group_ends.numel() == 0:
        # the launcher refuses them (interface.grouped_gemm_wgrad_fp8: positive N, P, K and a group)
        return (f"N={a.shape[0]}, P={b.shape[0]}, K={a.shape[1]}, E={group_ends.numel()}: "
                "an empty dimension")
    if _dtype_name(out_dtype) not in OUT_DTYPES:
        return f"out_dtype {out_dtype}"
    return _mn_unsupported(P=b.shape[0], K=a.shape[1])


WEIGHT_ONLY_FP8_MAX_M = 64  # the FP8 kernel's widest token tile (two chunk accumulators besides the sum)


def _weight_only_x_unsupported(x, packed, rows: str) -> str | None:
    """The checks of ``x`` [rows, K] that the dense and the grouped weight-only kernels share."""
    if x.dtype != torch.bfloat16:
        return f"x dtype {x.dtype} (the kernel decodes the weight to bf16: it takes bfloat16 activations)"
    if x.dim() != 2 or x.shape[1] != packed.k:
        return f"x shape {tuple(x.shape)} (expected [{rows}, {packed.k}])"
    if x.shape[0] == 0 or packed.k == 0:
        return f"{rows}={x.shape[0]}, K={packed.k}: nothing to compute (the kernel's loop needs a chunk)"
    if packed.k % 8:  # the kernels are compiled for x's K in multiples of 8 (16-byte rows)
        return f"K={packed.k}: the kernel takes K in multiples of 8"
    if x.stride(1) != 1 or x.stride(0) % 8 or x.data_ptr() % 16:
        return "x: the kernel's TMA needs unit stride along K and 16-byte aligned rows"
    return None


def weight_only_unsupported(x, packed, bias) -> str | None:
    """Why the weight-only kernel (``weight_only_interface``: ``packed`` a ``PackedNVFP4`` or a
    ``PackedFP8``) cannot take ``x`` [M, K] (None: it can)."""
    why = _weight_only_x_unsupported(x, packed, "M")
    if why is not None:
        return why
    if type(packed).__name__ == "PackedFP8" and x.shape[0] > WEIGHT_ONLY_FP8_MAX_M:
        return f"M={x.shape[0]} > {WEIGHT_ONLY_FP8_MAX_M} (the FP8 weight-only kernel's widest tile)"
    if packed.data.device != x.device:
        return f"the packed weight is on {packed.data.device}, x on {x.device}"
    if bias is not None and (bias.dtype != torch.bfloat16 or bias.shape != (packed.n,) or bias.stride(0) != 1):
        return f"bias: expected bfloat16 [{packed.n}] contiguous, got {bias.dtype} {tuple(bias.shape)}"
    return None


def grouped_weight_only_unsupported(x, packed, group_ends, zero_tail=True) -> str | None:
    """Why the grouped weight-only kernel (``packed`` a ``PackedNVFP4Experts``) cannot take ``x``
    [R, K] with ``group_ends`` (None: it can)."""
    why = _weight_only_x_unsupported(x, packed, "R")
    if why is not None:
        return why
    if packed.data.device != x.device or group_ends.device != x.device:
        return (f"the packed weights ({packed.data.device}) and group_ends ({group_ends.device}) must be on x's "
                f"{x.device}")
    if group_ends.dtype != torch.int32 or tuple(group_ends.shape) != (packed.experts,):
        return f"group_ends: expected int32 [E={packed.experts}] (the kernel reads one global scale per entry)"
    return None
