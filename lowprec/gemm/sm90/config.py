"""Tile configurations of the sm_90a block-scaled GEMM (no cutlass import: the heuristic and
the host wiring use this without compiling anything)."""

from __future__ import annotations

import math
from dataclasses import dataclass

SCALE_BLOCK = 128  # K (and N for 128x128 weight scales) granularity of the scales


@dataclass(frozen=True)
class TileConfig:
    """One kernel configuration (everything that changes the generated code)."""

    tile_m: int = 128  # 64 (one consumer warpgroup) or 128 (two)
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


def valid_tile_n(tile_n: int) -> bool:
    """Tile N values the kernel supports.

    Multiple of 16, at most 192 (accumulator + per-block accumulator must fit in 232 registers),
    and a tile touches at most three 128-wide weight-scale blocks (176 does: 2112 = 12 x 176).
    """
    return tile_n % 16 == 0 and 16 <= tile_n <= 192 and scale_blocks_spanned(tile_n) <= 3
