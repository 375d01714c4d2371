"""Configurations of the sm_100a block-scaled GEMM (no cutlass import: importing ``lowprec`` stays
cutlass-free)."""

from __future__ import annotations

from dataclasses import dataclass

# element format -> (K elements per scale factor, K of one MMA instruction)
_FORMATS = {
    "mxf8": (32, 32),  # E4M3 x E4M3, E8M0 scales: kind::mxf8f6f4.block32
    "mxf4": (32, 64),  # E2M1 x E2M1, E8M0 scales: kind::mxf4.block32
    "nvf4": (16, 64),  # E2M1 x E2M1, E4M3 scales: kind::mxf4nvf4.block16
}
OUT_DTYPES = ("bfloat16", "float16", "float32")
TILE_M = 128  # one CTA-group-1 MMA covers 128 rows (one per TMEM lane)
MMAS_PER_K_TILE = 4  # K tile = 4 instructions: 128 bytes of A/B per row and stage (one 128B swizzle atom)


@dataclass(frozen=True)
class GemmConfig:
    """One kernel configuration (everything that changes the generated code)."""

    element_format: str = "mxf8"  # "mxf8", "mxf4" or "nvf4"
    tile_n: int = 128  # 128 or 256
    stages: int = 4  # smem stages of A, B, SFA, SFB
    out_dtype: str = "bfloat16"  # D's dtype: one of OUT_DTYPES
    has_bias: bool = False  # the epilogue adds an FP32 bias per column
    # 2: a cluster of two CTAs runs one 256-row MMA (``cta_group::2``): each CTA loads its 128 rows of
    # A and half the tile's B, the pair's leader issues the MMAs (B read once per 256 rows)
    cta_group: int = 1
    # with cta_group=2: pairs per cluster along M; 2: the two pairs' B tiles travel once, multicast
    cluster_pairs: int = 1
    # grouped masked launches: batch l has counts[l] valid rows; M tiles past them skip their K loop
    # and store nothing (the rows past each count are zeroed after the launch)
    masked: bool = False

    def __post_init__(self):
        if self.element_format not in _FORMATS:
            raise ValueError(f"element_format: expected one of {sorted(_FORMATS)}, got {self.element_format!r}")
        if self.out_dtype not in OUT_DTYPES:
            raise ValueError(f"out_dtype: expected one of {OUT_DTYPES}, got {self.out_dtype!r}")
        if self.tile_n not in (128, 256):
            raise ValueError(f"tile_n: expected 128 or 256, got {self.tile_n}")
        if self.stages < 2:
            raise ValueError(f"stages: expected at least 2, got {self.stages}")
        if self.cta_group not in (1, 2):
            raise ValueError(f"cta_group: expected 1 or 2, got {self.cta_group}")
        if self.cluster_pairs not in (1, 2) or (self.cluster_pairs == 2 and self.cta_group != 2):
            raise ValueError(f"cluster_pairs: expected 1, or 2 with cta_group=2, got {self.cluster_pairs}")
        if self.masked and self.cta_group == 2:
            raise ValueError("masked: grouped launches run on one CTA (cta_group=1)")

    @property
    def tile_m(self) -> int:
        """Rows of one MMA tile (of the CTA pair with ``cta_group=2``)."""
        return TILE_M * self.cta_group

    @property
    def cluster_rows(self) -> int:
        """Rows one cluster computes per output tile."""
        return self.tile_m * self.cluster_pairs

    @property
    def sf_vec_size(self) -> int:
        return _FORMATS[self.element_format][0]

    @property
    def mma_k(self) -> int:
        return _FORMATS[self.element_format][1]

    @property
    def tile_k(self) -> int:
        return self.mma_k * MMAS_PER_K_TILE

    def __str__(self) -> str:
        out = "" if self.out_dtype == "bfloat16" else f"_{self.out_dtype}"
        pair = ("_2cta" if self.cta_group == 2 else "") + ("_x2" if self.cluster_pairs == 2 else "")
        return (f"{self.element_format}_{self.tile_m}x{self.tile_n}{pair}_s{self.stages}{out}"
                f"{'_bias' if self.has_bias else ''}{'_masked' if self.masked else ''}")


def shipped_configs() -> tuple[GemmConfig, ...]:
    """The configurations the compile tests build: every format and tile at bf16 without bias, and
    each other output dtype and the bias once (the epilogue variants)."""
    plain = tuple(GemmConfig(fmt, tile_n) for fmt in _FORMATS for tile_n in (128, 256))
    pairs = tuple(GemmConfig(fmt, 256, cta_group=2, cluster_pairs=c) for fmt in _FORMATS for c in (1, 2))
    masked = tuple(GemmConfig(fmt, tile_n, masked=True) for fmt in _FORMATS for tile_n in (128, 256))
    return plain + pairs + masked + (GemmConfig("mxf8", 128, out_dtype="float32", has_bias=True),
                            GemmConfig("nvf4", 256, out_dtype="float16", has_bias=True, cta_group=2))


# ----------------------------------------------------------------------------- what the kernel takes
# Stated once: the registry asks ``gemm_unsupported`` / ``grouped_unsupported`` (why_not), the
# self-check ``check_config``.
# (a's recipe, b's recipe) -> element format. DeepSeek's FP8 recipes run as MXFP8 when their FP32
# scales are powers of two (``pow2_scale=True``): each becomes the E8M0 scale of its 32-wide blocks.
PAIR_FORMATS = {("mxfp8", "mxfp8"): "mxf8", ("mxfp4", "mxfp4"): "mxf4", ("nvfp4", "nvfp4"): "nvf4",
                ("fp8_block1x128", "fp8_block128x128"): "mxf8"}
DEEPSEEK_PAIR = ("fp8_block1x128", "fp8_block128x128")
_SCALE_BLOCKS = {"mxfp8": (1, 32), "mxfp4": (1, 32), "nvfp4": (1, 16), "fp8_block1x128": (1, 128),
                 "fp8_block128x128": (128, 128)}
N_MULTIPLE = 16  # the epilogue stores 16 columns at a time


def pair_of(a, b) -> tuple[str, str]:
    return a.recipe.name, b.recipe.name


def gemm_unsupported(a, b, out_dtype, bias) -> str | None:
    """Why the sm_100a kernel cannot take QuantizedTensors ``a`` [M, K], ``b`` [N, K] (None: it can)."""
    if a.dim() != 2 or b.dim() != 2:
        return "operands are not 2-D"
    return _problem_unsupported(a, b, out_dtype, bias)


def grouped_unsupported(a, b, out_dtype, group_ends, masked_counts) -> str | None:
    """Why the sm_100a kernel cannot run ``lowprec.grouped_gemm`` on these operands (None: it can):
    the masked layout (``a`` [E, M_max, K], ``b`` [E, N, K]) runs as one batched launch; the
    contiguous one (``a`` [M, K]) too, its groups' rows copied into a masked buffer and back."""
    if group_ends is not None:
        if a.dim() != 2 or b.dim() != 3:
            return "contiguous operands are not [M, K] x [E, N, K]"
    elif a.dim() != 3 or b.dim() != 3 or a.shape[0] != b.shape[0]:
        return "masked operands are not [E, M_max, K] x [E, N, K]"
    return _problem_unsupported(a, b, out_dtype, None)


def _problem_unsupported(a, b, out_dtype, bias) -> str | None:
    import torch

    pair = pair_of(a, b)
    if pair not in PAIR_FORMATS:
        return (f"recipes {pair[0]} x {pair[1]}; the sm_100a kernel takes "
                f"{', '.join(f'{x} x {y}' for x, y in PAIR_FORMATS)}")
    if pair == DEEPSEEK_PAIR and not (a.recipe.scale_rounding == b.recipe.scale_rounding == "pow2"):
        return "fp8_block scales that are not powers of two (quantize with pow2_scale=True; cuBLASLt takes the others)"
    if tuple(a.recipe.block) != _SCALE_BLOCKS[pair[0]] or tuple(b.recipe.block) != _SCALE_BLOCKS[pair[1]]:
        return f"scale blocks {a.recipe.block} x {b.recipe.block}"
    if str(out_dtype).removeprefix("torch.") not in OUT_DTYPES:
        return f"out_dtype {out_dtype} (the epilogue writes {', '.join(OUT_DTYPES)})"
    if bias is not None and (bias.dim() != 1 or bias.dtype not in (torch.float32, torch.bfloat16)):
        return f"bias {bias.dtype} {tuple(bias.shape)} (the epilogue adds an FP32 or bf16 [N] bias)"
    m, k = a.shape[-2:]
    n = b.shape[-2]
    if m == 0 or n == 0 or k == 0:  # K = 0: no K tile for the kernel's loop; the reference gives zeros (+ bias)
        return "an empty problem"
    tile_k = GemmConfig(PAIR_FORMATS[pair]).tile_k
    if k % tile_k:
        return f"K={k} is not a multiple of the K tile {tile_k}"
    if n % N_MULTIPLE:
        return f"N={n} is not a multiple of {N_MULTIPLE}"
    return None


def config_for(a, b, out_dtype, bias, grouped: bool = False) -> GemmConfig:
    """The kernel configuration these (supported) arguments run. Grouped calls (the masked launch)
    run on one CTA with per-batch row counts: their rows per launch are known only after a host
    read (contiguous layout), so the configuration their self-check proves must not depend on them."""
    wide = b.shape[-2] >= 256
    # a CTA pair (256-row MMA, B read once per 256 rows) where both dims fill its 256x256 tile
    pair = not grouped and wide and a.shape[-2] >= 2 * TILE_M
    # two pairs per cluster (B multicast) once M fills both
    two_pairs = pair and a.shape[-2] >= 4 * TILE_M
    return GemmConfig(PAIR_FORMATS[pair_of(a, b)], tile_n=256 if wide else 128,
                      out_dtype=str(out_dtype).removeprefix("torch."), has_bias=bias is not None,
                      cta_group=2 if pair else 1, cluster_pairs=2 if two_pairs else 1, masked=grouped)


def check_config(a, b, out_dtype, bias) -> tuple[tuple[str, str], GemmConfig]:
    """What the first-use self-check proves: the operand pair (its scale preparation) and the kernel
    configuration."""
    return pair_of(a, b), config_for(a, b, out_dtype, bias)


GROUPED_LAYOUTS = ("masked", "contiguous")


def grouped_check_config(a, b, out_dtype, group_ends, masked_counts) -> tuple[str, tuple[str, str], GemmConfig]:
    """The self-check configuration of a grouped call (no bias): its layout (the contiguous one
    also proves the copies into and out of the masked buffer), the operand pair, the kernel's."""
    return ("masked" if group_ends is None else "contiguous", pair_of(a, b),
            config_for(a, b, out_dtype, None, grouped=True))


def grouped_check_configs() -> tuple[tuple[str, tuple[str, str], GemmConfig], ...]:
    """Every grouped self-check configuration (``LOWPREC_SELF_CHECK=always``)."""
    return tuple((layout, pair, cfg) for layout in GROUPED_LAYOUTS for pair, cfg in _pairs_of(shipped_configs())
                 if cfg.masked and not cfg.has_bias)  # grouped calls: the masked kernel, no bias


def check_configs() -> tuple[tuple[tuple[str, str], GemmConfig], ...]:
    """Every shipped dense kernel configuration with every operand pair of its format."""
    return tuple((pair, cfg) for pair, cfg in _pairs_of(shipped_configs()) if not cfg.masked)


def _pairs_of(configs) -> tuple[tuple[tuple[str, str], GemmConfig], ...]:
    return tuple((pair, cfg) for cfg in configs for pair, fmt in PAIR_FORMATS.items() if fmt == cfg.element_format)
