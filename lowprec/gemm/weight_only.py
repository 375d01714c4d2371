"""Weight-only GEMM for decode sizes: ``y = x · dequant(W)ᵀ`` with ``x`` bf16 and ``W`` NVFP4 or FP8.

NVFP4 weights (E2M1 codes, an E4M3 scale per 16 weights of a row or per 16x16 block, an FP32
global scale) are read at 4.5 bits per weight, FP8 weights (E4M3, an FP32 scale per 128x128
block) at 8, and decoded to bf16 in registers, where they feed Hopper's bf16 tensor cores; at
M = 1..a few hundred tokens the weight bytes set the time.

The kernel (``lowprec.gemm.sm90.weight_only``) does not read ModelOpt's layout: the weight is
re-arranged once (:func:`pack_nvfp4`) so that each thread of the kernel finds its wgmma
A-fragment codes in one 32-bit word per 16-wide k-step, bit-placed for a cheap decode, and the
scales of its two rows next to them. This module states that layout (the packing and an exact
emulation of the kernel's decode, both plain torch, tested on the CPU) and the reference.

Layout of the packed weight (``PackedNVFP4.data``, uint8 ``[chunks * 18, 256]``): the weight,
zero-padded to multiples of ``TILE_N`` rows and ``CHUNK_K`` columns, is cut into chunks of
``TILE_N x CHUNK_K`` (n-tile major, then k-chunk), ``CHUNK_BYTES`` each:

* bytes ``[0, 4096)``: codes, 32-bit words at ``((s // 4) * 128 + t) * 4 + s % 4`` for thread
  ``t`` (0..127, the consumer warpgroup) and k-step ``s`` (0..7, 16 columns each). A word holds
  the thread's 8 A-fragment codes of the k-step: rows ``r0 = 16 warp + lane // 4`` and
  ``r1 = r0 + 8``, columns
  ``c = 16 s + 2 (lane % 4) + {0, 1}`` and ``c + 8``: pairs ``a0 = (r0, c..c+1)``, ``a1 = (r1,
  c..c+1)``, ``a2 = (r0, c+8..c+9)``, ``a3 = (r1, c+8..c+9)``. A code's magnitude bits
  ``(m, e0, e1)`` and sign sit where the decode wants them: pairs 0, 1, 2 at bits ``{6, 7, 8, 15}``
  rotated right by 0, 4 and 10 (first column) and 16 further, mod 32 (second column): one rotate
  and one mask put a pair's two codes in bf16 position; pair 3 in the 8 bits left, ``{0, 1, 26,
  9}`` and 16 further, put in place by two rotates and two masks (``_PAIR_BITS``; no four
  rotations of the target bits tile a word, so one pair must be assembled from two).
* bytes ``[4096, 4608)``: scales, one 16-byte record per quad of lanes (they share their rows):
  E4M3 bytes at ``4096 + 16 (t // 4) + 4 i + {0, 1, 2, 3}`` = the scales of (k-step ``2i``, row
  ``r0``), (``2i``, ``r1``), (``2i + 1``, ``r0``), (``2i + 1``, ``r1``).

Codes of blocks whose scale is zero are stored as zeros (the same dequantized weight; the
decode relies on it). Scales must be finite and non-negative.

FP8 (:func:`pack_fp8`, ``PackedFP8.data`` uint8 ``[chunks * 32, 256]``): chunks of the same
``TILE_N x CHUNK_K``, 8192 bytes of E4M3 codes each: thread ``t``'s 32 bytes of warpgroup
``g``'s k-steps ``4g .. 4g + 3`` at byte ``32 (128 g + t)``, per k-step two words: bytes
``(r0, c), (r0, c+1), (r1, c), (r1, c+1)`` then the same at ``c + 8``. A word's four codes are
bit-placed for the decode (``_fp8_words``): codes 0 and 1 (pair ``(r0, c..c+1)``) sit in bf16
position, magnitude at bits 4-10 and sign at 15 of each half, so one mask makes their bf16x2
as ``value * 2^-120``; codes 2 and 3 fill the other 16 bits, put in place by a shift left and a
shift right by 4 and two masks. A multiply by 2^120 (exact, E4M3 subnormals included) finishes
both. The block scales stay in their ``[ceil(N / 128), ceil(K / 128)]`` FP32 grid: the kernel
applies a chunk's scale to that chunk's FP32 products (promotion).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ..formats import E4M3, pack_fp4, unpack_fp4
from ..formats import decode as decode_format
from ..runtime import autocast_off, on_operand_device

__all__ = ["TILE_N", "TILE_MS", "SPLITS", "CHUNK_K", "CHUNK_BYTES", "FP8_CHUNK_BYTES", "PackedNVFP4", "PackedFP8",
           "PackedNVFP4Experts", "pack_nvfp4", "pack_nvfp4_experts", "pack_fp8", "unpack_nvfp4", "unpack_fp8",
           "unpack_codes_emulated", "unpack_fp8_emulated", "decoded_tile_emulated", "weight_only_reference",
           "grouped_weight_only_reference"]

TILE_N = 64  # rows of W per CTA (one consumer warpgroup)
TILE_MS = (8, 16, 32, 64, 128)  # tokens per CTA (the wgmma N); larger M takes several M tiles
SPLITS = (1, 2, 4, 8)  # split-K over the CTAs of a cluster (8: the portable cluster limit)
CHUNK_K = 128  # columns of W per pipeline stage (8 wgmma k-steps of 16)
CODE_BYTES = TILE_N * CHUNK_K // 2
SCALE_BYTES = TILE_N * CHUNK_K // 16
CHUNK_BYTES = CODE_BYTES + SCALE_BYTES  # 4608 = 18 rows of 256 bytes (one TMA box)
ROW_BYTES = 256
FP8_CHUNK_BYTES = TILE_N * CHUNK_K  # 8192 = 32 rows of 256 bytes
FP8_SCALE_BLOCK = 128
_THREADS = TILE_N * 2  # one consumer warpgroup
_KSTEPS = CHUNK_K // 16
# bit positions of one pair's (m, e0, e1, sign) for its first code; the second code is 16 further
# (mod 32). Pairs 0, 1, 2 are the decode's target bits rotated right by 0, 4 and 10 (one rotate
# and one mask each); pair 3 takes the 8 bits left: rotated by 6 (m, e0, sign) and by 14 (e1)
_PAIR_BITS = ((6, 7, 8, 15), (2, 3, 4, 11), (28, 29, 30, 5), (0, 1, 26, 9))
# the decode of a packed word w (32 bits): pair j = rotl(w, PAIR_ROT[j]) & PAIR_MASK, pair 3 =
# (rotl(w, 6) & PAIR3_MASKS[0]) | (rotl(w, 14) & PAIR3_MASKS[1])
PAIR_ROT = (0, 4, 10)
PAIR_MASK = 0x81C081C0
PAIR3_ROT = (6, 14)
PAIR3_MASKS = (0x80C080C0, 0x01000100)
# where the decode puts them: a bf16 with exponent e1 e0 and mantissa msb m (value code * 2^-126)
_BF16_BITS = (6, 7, 8, 15)
# the decoded pair times the scale times 2^116 is code * scale * 2^-10: the epilogue multiplies
# by the global scale times 2^10
DECODE_EXP = 10
# FP8 word decode (see the module docstring): codes 0, 1 = w & FP8_DIRECT_MASK; codes 2, 3 =
# ((w << FP8_SHIFT) & FP8_SPLIT_MASKS[0]) | ((w >> FP8_SHIFT) & FP8_SPLIT_MASKS[1]); each half
# s0000eeeemmm0000 is the bf16 of the code's value * 2^-FP8_DECODE_EXP
FP8_DIRECT_MASK = 0x87F087F0
FP8_SHIFT = 4
FP8_SPLIT_MASKS = (0x80F080F0, 0x07000700)
FP8_DECODE_EXP = 120


class _Tiled:
    """The (n-tile, k-chunk) grid of a packed weight of ``n`` rows and ``k`` columns."""

    n: int
    k: int

    @property
    def n_tiles(self) -> int:
        return -(-self.n // TILE_N)

    @property
    def k_chunks(self) -> int:
        return -(-self.k // CHUNK_K)

    @property
    def device(self) -> torch.device:
        return self.data.device

    @functools.cached_property
    def tiles(self) -> torch.Tensor:
        """``data`` as the kernel reads it: ``[n_tiles, rows of the tile's chunks, ROW_BYTES]``
        (a view, made once per packed weight: the eager launch path does not rebuild it)."""
        return self.data.view(self.n_tiles, -1, ROW_BYTES)


@dataclass(frozen=True)
class PackedNVFP4(_Tiled):
    """An NVFP4 weight in the kernel's layout (see the module docstring)."""

    data: torch.Tensor  # uint8 [n_tiles * k_chunks * 18, 256]
    global_scale: torch.Tensor  # float32 [1]
    n: int
    k: int


@dataclass(frozen=True)
class PackedNVFP4Experts(_Tiled):
    """The NVFP4 weights of ``E`` experts of one shape ``[n, k]``, each in the kernel's layout,
    stacked: expert ``e``'s :class:`PackedNVFP4` is rows ``[e, e + 1) * rows per expert`` of
    ``data`` with global scale ``global_scale[e]`` (:meth:`expert`)."""

    data: torch.Tensor  # uint8 [E * n_tiles * k_chunks * 18, 256]
    global_scale: torch.Tensor  # float32 [E]
    n: int
    k: int

    @property
    def experts(self) -> int:
        return self.global_scale.shape[0]

    @functools.cached_property
    def tiles(self) -> torch.Tensor:
        """``data`` as the grouped kernel reads it: ``[E * n_tiles, rows of a tile's chunks, ROW_BYTES]``."""
        return self.data.view(self.experts * self.n_tiles, -1, ROW_BYTES)

    def expert(self, e: int) -> PackedNVFP4:
        """Expert ``e``'s weight (views)."""
        rows = self.data.shape[0] // self.experts
        return PackedNVFP4(self.data[e * rows:(e + 1) * rows], self.global_scale[e:e + 1], self.n, self.k)


def pack_nvfp4_experts(weight: torch.Tensor, weight_scale: torch.Tensor, weight_scale_2: torch.Tensor,
                       weight_2d: bool = False) -> PackedNVFP4Experts:
    """:func:`pack_nvfp4` for ``E`` experts at once: ``weight`` uint8 ``[E, N, K / 2]``,
    ``weight_scale`` float8_e4m3fn ``[E, N, K / 16]`` (``[E, N / 16, K / 16]`` with ``weight_2d``),
    ``weight_scale_2`` FP32 ``[E]`` (each checked as :func:`pack_nvfp4` checks one)."""
    for name, t, dims in (("weight", weight, 3), ("weight_scale", weight_scale, 3),
                          ("weight_scale_2", weight_scale_2, 1)):
        if not isinstance(t, torch.Tensor) or t.dim() != dims or t.shape[0] != weight.shape[0]:
            raise ValueError(f"{name}: expected a {dims}-d tensor with one entry per expert along dim 0 "
                             f"(E = {getattr(weight, 'shape', (None,))[0]}), got "
                             f"{getattr(t, 'dtype', type(t))} {tuple(getattr(t, 'shape', ()))}")
    if weight.shape[0] == 0:
        raise ValueError("weight: no experts (E = 0)")
    packs = [pack_nvfp4(weight[e], weight_scale[e], weight_scale_2[e], weight_2d) for e in range(weight.shape[0])]
    return PackedNVFP4Experts(torch.cat([p.data for p in packs]), torch.cat([p.global_scale for p in packs]),
                              packs[0].n, packs[0].k)


def _thread_coords(device):
    """Per thread t (128) and k-step s (8): rows r0, r1 within the tile and the first column of
    pairs a0 / a1 within the chunk (a2 / a3 are 8 columns right)."""
    t = torch.arange(_THREADS, device=device)
    wg, warp, lane = t // 128, (t % 128) // 32, t % 32
    r0 = 64 * wg + 16 * warp + lane // 4
    col = 2 * (lane % 4)
    s = torch.arange(_KSTEPS, device=device)
    return r0, col, s


@on_operand_device
def pack_nvfp4(weight: torch.Tensor, weight_scale: torch.Tensor, weight_scale_2: torch.Tensor,
               weight_2d: bool = False) -> PackedNVFP4:
    """ModelOpt-layout NVFP4 tensors -> the kernel's layout (any device; done once per weight).

    Args:
        weight: uint8 ``[N, K / 2]``, two E2M1 codes per byte, element ``2i`` in the low nibble.
        weight_scale: float8_e4m3fn ``[N, K / 16]`` (``[N / 16, K / 16]`` with ``weight_2d``).
        weight_scale_2: FP32 global scale (scalar or ``[1]``).
    """
    if not isinstance(weight, torch.Tensor) or weight.dtype != torch.uint8 or weight.dim() != 2:
        raise ValueError(f"weight: expected a uint8 [N, K / 2] tensor of packed E2M1 codes, got "
                         f"{getattr(weight, 'dtype', type(weight))} {tuple(getattr(weight, 'shape', ()))}")
    n, k = weight.shape[0], 2 * weight.shape[1]
    if k % 16:
        raise ValueError(f"weight: K = {k} is not a multiple of 16 (one E4M3 scale per 16 weights)")
    expect = (n // 16 if weight_2d else n, k // 16)
    if weight_2d and n % 16:
        raise ValueError(f"weight: N = {n} is not a multiple of 16, needed for 16x16 scale blocks")
    if not isinstance(weight_scale, torch.Tensor) or weight_scale.dtype != torch.float8_e4m3fn \
            or tuple(weight_scale.shape) != expect:
        raise ValueError(f"weight_scale: expected float8_e4m3fn {expect}, got "
                         f"{getattr(weight_scale, 'dtype', type(weight_scale))} "
                         f"{tuple(getattr(weight_scale, 'shape', ()))}")
    if not isinstance(weight_scale_2, torch.Tensor) or weight_scale_2.numel() != 1 \
            or weight_scale_2.dtype != torch.float32:
        raise ValueError(f"weight_scale_2: expected one FP32 value, got "
                         f"{getattr(weight_scale_2, 'dtype', type(weight_scale_2))} "
                         f"{tuple(getattr(weight_scale_2, 'shape', ()))}")
    scale_bits = weight_scale.view(torch.uint8)
    if weight_2d:
        scale_bits = scale_bits.repeat_interleave(16, dim=0)
    if bool(((scale_bits & 0x7F) == 0x7F).any()) or bool(((scale_bits & 0x80) != 0).any()):
        raise ValueError("weight_scale: scales must be finite and non-negative (NaN or negative E4M3 found)")
    # as the block scales: a NaN / Inf global scale makes every output NaN, a negative one flips the weight
    if not bool(torch.isfinite(weight_scale_2).all()) or bool((weight_scale_2 < 0).any()):
        raise ValueError(f"weight_scale_2: the global scale must be finite and non-negative, got "
                         f"{weight_scale_2.reshape(()).item()}")
    device = weight.device
    n_tiles, k_chunks = -(-n // TILE_N), -(-k // CHUNK_K)
    n_pad, k_pad = n_tiles * TILE_N, k_chunks * CHUNK_K
    codes = torch.zeros(n_pad, k_pad, dtype=torch.int32, device=device)
    codes[:n, :k] = unpack_fp4(weight).to(torch.int32)
    scales = torch.zeros(n_pad, k_pad // 16, dtype=torch.int32, device=device)
    scales[:n, : k // 16] = scale_bits.to(torch.int32)
    # a zero scale dequantizes its block to zeros whatever the codes: store zero codes
    codes *= (scales != 0).repeat_interleave(16, dim=1).to(torch.int32)
    codes = codes.view(n_tiles, TILE_N, k_chunks, CHUNK_K).permute(0, 2, 1, 3)  # [nt, kc, TILE_N, CHUNK_K]
    scales = scales.view(n_tiles, TILE_N, k_chunks, _KSTEPS).permute(0, 2, 1, 3)  # [nt, kc, TILE_N, 8]

    r0, col, s = _thread_coords(device)
    rows = (r0, r0 + 8)
    words = torch.zeros(n_tiles, k_chunks, _THREADS, _KSTEPS, dtype=torch.int64, device=device)
    lut = _pair_luts(device)
    for j in range(len(_PAIR_BITS)):
        row = rows[j % 2][:, None]  # [threads, 1]
        c = (16 * s)[None, :] + col[:, None] + 8 * (j // 2)  # [threads, 8]
        pair = codes[:, :, row, c] | (codes[:, :, row, c + 1] << 4)  # [nt, kc, threads, 8]: first code low
        words |= lut[j][pair.long()]
    # codes region: [group (2), thread, word (4)] with k-step = 4 group + word
    code_words = words.view(n_tiles, k_chunks, _THREADS, 2, 4).permute(0, 1, 3, 2, 4)
    code_bytes = _words_to_bytes(code_words.reshape(n_tiles, k_chunks, _THREADS * _KSTEPS))
    # the four lanes of a quad share their rows: one 16-byte record per quad
    quad_rows = r0[::4]
    sc = torch.stack([scales[:, :, quad_rows + 8 * h, :] for h in range(2)], dim=-1)  # [nt, kc, quads, 8 steps, 2 rows]
    scale_bytes = sc.reshape(n_tiles, k_chunks, _THREADS // 4, 16).to(torch.uint8)
    data = torch.cat([code_bytes, scale_bytes.reshape(n_tiles, k_chunks, SCALE_BYTES)], dim=-1)
    data = data.reshape(-1, ROW_BYTES).contiguous()
    # the global scale with the codes (a checkpoint's 0-d weight_scale_2 may still be on the host)
    return PackedNVFP4(data, weight_scale_2.detach().reshape(1).to(device=data.device, dtype=torch.float32).clone(),
                       n, k)


@on_operand_device
def unpack_nvfp4(packed: PackedNVFP4, weight_2d: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`pack_nvfp4` (ModelOpt layout, on the packed weight's device): ``weight``
    uint8 ``[N, K / 2]`` and ``weight_scale`` float8_e4m3fn ``[N, K / 16]`` (``[N / 16, K / 16]``
    with ``weight_2d``). Exact, except that codes under a zero scale come back as zeros (the
    same dequantized weight)."""
    n_tiles, k_chunks, device = packed.n_tiles, packed.k_chunks, packed.data.device
    chunks = packed.data.view(n_tiles, k_chunks, CHUNK_BYTES)
    words = _bytes_to_words(chunks[..., :CODE_BYTES]).view(n_tiles, k_chunks, 2, _THREADS, 4)
    words = words.permute(0, 1, 3, 2, 4).reshape(n_tiles, k_chunks, _THREADS, _KSTEPS)
    codes = torch.zeros(n_tiles, k_chunks, TILE_N, CHUNK_K, dtype=torch.uint8, device=device)
    r0, col, s = _thread_coords(device)
    rows = (r0, r0 + 8)
    for j, bits in enumerate(_PAIR_BITS):
        row = rows[j % 2][:, None]
        c = (16 * s)[None, :] + col[:, None] + 8 * (j // 2)
        for half in range(2):
            code = torch.zeros_like(words)
            for bit, pos in enumerate(bits):
                code |= ((words >> ((pos + 16 * half) % 32)) & 1) << bit
            codes[:, :, row, c + half] = code.to(torch.uint8)
    records = chunks[..., CODE_BYTES:].reshape(n_tiles, k_chunks, _THREADS // 4, _KSTEPS, 2)
    scales = torch.zeros(n_tiles, k_chunks, TILE_N, _KSTEPS, dtype=torch.uint8, device=device)
    for h in range(2):
        scales[:, :, r0[::4] + 8 * h, :] = records[..., h]
    n, k = packed.n, packed.k
    codes = codes.permute(0, 2, 1, 3).reshape(n_tiles * TILE_N, k_chunks * CHUNK_K)[:n, :k]
    scales = scales.permute(0, 2, 1, 3).reshape(n_tiles * TILE_N, k_chunks * _KSTEPS)[:n, : k // 16]
    if weight_2d:
        scales = scales[::16]
    return pack_fp4(codes.contiguous(), check_range=False), scales.contiguous().view(torch.float8_e4m3fn)


def _pair_luts(device) -> torch.Tensor:
    """[4, 256] int64: pair j's bits in the code word for each byte (first code in the low nibble)."""
    byte = torch.arange(256)
    luts = torch.zeros(len(_PAIR_BITS), 256, dtype=torch.int64)
    for j, bits in enumerate(_PAIR_BITS):
        for half in range(2):
            code = (byte >> (4 * half)) & 0xF
            for bit, pos in enumerate(bits):
                luts[j] |= ((code >> bit) & 1) << ((pos + 16 * half) % 32)
    return luts.to(device)


def _words_to_bytes(words: torch.Tensor) -> torch.Tensor:
    """int64 holding uint32 words [..., W] -> uint8 little-endian [..., 4 W]."""
    shifts = torch.arange(0, 32, 8, device=words.device)
    return ((words[..., None] >> shifts) & 0xFF).to(torch.uint8).reshape(*words.shape[:-1], 4 * words.shape[-1])


def _bytes_to_words(b: torch.Tensor) -> torch.Tensor:
    """uint8 [..., 4 W] -> int64 uint32 words [..., W]."""
    b = b.reshape(*b.shape[:-1], b.shape[-1] // 4, 4).to(torch.int64)  # sizes given: no -1 on an empty tensor
    return b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16) | (b[..., 3] << 24)


def _rotl32(words: torch.Tensor, r: int) -> torch.Tensor:
    """int64 holding uint32 words, rotated left by ``r`` bits within 32."""
    return ((words << r) | (words >> (32 - r))) & 0xFFFFFFFF if r else words


def _bf16_of_bits(bits: torch.Tensor) -> torch.Tensor:
    """uint16 values (int64) -> float64 of those bf16 bit patterns."""
    return (bits.to(torch.int32) << 16).view(torch.float32).to(torch.float64)


def decoded_tile_emulated(packed: PackedNVFP4, n_tile: int, k_chunk: int) -> torch.Tensor:
    """The bf16 A operand the kernel builds for one chunk, as float64 ``[TILE_N, CHUNK_K]``:
    the same integer decode, bit for bit (shifts and masks of the packed words, the scale's
    E4M3 -> f16 -> bf16 * 2^116 bit trick), then the exact product of the two bf16 values
    (``mul.rn.bf16x2``, exact here: a test checks it against the weight times 2^-10)."""
    # on the host, as the rest of the emulation (its index tensors are CPU ones): a CUDA weight failed
    chunk = packed.data.view(packed.n_tiles, packed.k_chunks, CHUNK_BYTES)[n_tile, k_chunk].cpu()
    words = _bytes_to_words(chunk[:CODE_BYTES]).view(2, _THREADS, 4).permute(1, 0, 2).reshape(_THREADS, _KSTEPS)
    scw = _bytes_to_words(chunk[CODE_BYTES:]).view(_THREADS // 4, 4).repeat_interleave(4, dim=0)
    pairs = [_rotl32(words, r) & PAIR_MASK for r in PAIR_ROT]
    pairs.append((_rotl32(words, PAIR3_ROT[0]) & PAIR3_MASKS[0]) | (_rotl32(words, PAIR3_ROT[1]) & PAIR3_MASKS[1]))
    # scale word i: bytes (2i, r0), (2i, r1), (2i+1, r0), (2i+1, r1); k-step s takes half s % 2
    s = torch.arange(_KSTEPS)
    half16 = (scw[:, s // 2] >> (16 * (s % 2))) & 0xFFFF  # [threads, 8]: bytes (r0, r1)
    out = torch.zeros(TILE_N, CHUNK_K, dtype=torch.float64)
    r0, col, s = _thread_coords("cpu")
    for row_i, row in enumerate((r0, r0 + 8)):
        e4m3 = (half16 >> (8 * row_i)) & 0xFF
        f16 = decode_format(e4m3.to(torch.uint8), E4M3).to(torch.float16)
        f16_bits = f16.view(torch.int16).to(torch.int64) & 0xFFFF
        scale_bf16 = _bf16_of_bits(((f16_bits >> 3) & 0x1FFF) + 0x7200)  # scale * 2^116
        for j in (row_i, row_i + 2):
            c = (16 * s)[None, :] + col[:, None] + 8 * (j // 2)
            for half in range(2):
                code = _bf16_of_bits((pairs[j] >> (16 * half)) & 0xFFFF)
                out[row[:, None], c + half] = code * scale_bf16
    return out


def unpack_codes_emulated(packed: PackedNVFP4) -> torch.Tensor:
    """The dequantized weight ``[N, K]`` (float64) as the kernel computes it: the emulated
    decode of every chunk, times 2^10 and the global scale."""
    if packed.n == 0 or packed.k == 0:  # no chunks to decode
        return torch.zeros(packed.n, packed.k, dtype=torch.float64)
    packed = PackedNVFP4(packed.data.cpu(), packed.global_scale, packed.n, packed.k)  # one copy, not one per tile
    tiles = [[decoded_tile_emulated(packed, nt, kc) for kc in range(packed.k_chunks)] for nt in range(packed.n_tiles)]
    w = torch.cat([torch.cat(row, dim=1) for row in tiles], dim=0)
    return w[: packed.n, : packed.k] * (2.0 ** DECODE_EXP) * packed.global_scale.double().cpu()


@dataclass(frozen=True)
class PackedFP8(_Tiled):
    """An FP8 weight (128x128 block scales) in the kernel's layout (see the module docstring)."""

    data: torch.Tensor  # uint8 [n_tiles * k_chunks * 32, 256]
    scale: torch.Tensor  # float32 [ceil(N / 128), k_chunks], contiguous
    n: int
    k: int

    def __post_init__(self):
        # built by hand too: the kernel reads data and scale as raw grids of these shapes and dtypes
        # (the emulation silently sliced a larger scale grid)
        for name, value in (("n", self.n), ("k", self.k)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name}: expected an int ≥ 0, got {value!r}")
        rows = (self.n_tiles * self.k_chunks * FP8_CHUNK_BYTES // ROW_BYTES, ROW_BYTES)
        if not isinstance(self.data, torch.Tensor) or self.data.dtype != torch.uint8 or tuple(self.data.shape) != rows:
            raise ValueError(f"data: expected uint8 {rows} (pack_fp8's layout for N={self.n}, K={self.k}), got "
                             f"{getattr(self.data, 'dtype', type(self.data))} {tuple(getattr(self.data, 'shape', ()))}")
        grid = (-(-self.n // FP8_SCALE_BLOCK), -(-self.k // FP8_SCALE_BLOCK))
        if not isinstance(self.scale, torch.Tensor) or self.scale.dtype != torch.float32 \
                or tuple(self.scale.shape) != grid or not self.scale.is_contiguous():
            raise ValueError(f"scale: expected a contiguous float32 {grid} tensor (one per 128x128 block), got "
                             f"{getattr(self.scale, 'dtype', type(self.scale))} "
                             f"{tuple(getattr(self.scale, 'shape', ()))}")
        if self.scale.device != self.data.device:
            raise ValueError(f"scale: on {self.scale.device}, but data is on {self.data.device}")


@on_operand_device
def pack_fp8(weight: torch.Tensor, scale: torch.Tensor) -> PackedFP8:
    """FP8 weight ``[N, K]`` (float8_e4m3fn) and its FP32 128x128 block scales
    ``[ceil(N / 128), ceil(K / 128)]`` -> the kernel's layout (done once per weight)."""
    if not isinstance(weight, torch.Tensor) or weight.dtype != torch.float8_e4m3fn or weight.dim() != 2:
        raise ValueError(f"weight: expected a float8_e4m3fn [N, K] tensor, got "
                         f"{getattr(weight, 'dtype', type(weight))} {tuple(getattr(weight, 'shape', ()))}")
    n, k = weight.shape
    expect = (-(-n // FP8_SCALE_BLOCK), -(-k // FP8_SCALE_BLOCK))
    if not isinstance(scale, torch.Tensor) or scale.dtype != torch.float32 or tuple(scale.shape) != expect:
        raise ValueError(f"scale: expected float32 {expect} (one per 128x128 block), got "
                         f"{getattr(scale, 'dtype', type(scale))} {tuple(getattr(scale, 'shape', ()))}")
    if bool(((weight.view(torch.uint8) & 0x7F) == 0x7F).any()):  # the decode has no NaN: it would read 480
        raise ValueError("weight: NaN E4M3 codes found; the weight must be finite")
    device = weight.device
    n_tiles, k_chunks = -(-n // TILE_N), -(-k // CHUNK_K)
    codes = torch.zeros(n_tiles * TILE_N, k_chunks * CHUNK_K, dtype=torch.uint8, device=device)
    codes[:n, :k] = weight.view(torch.uint8)
    codes = codes.view(n_tiles, TILE_N, k_chunks, CHUNK_K).permute(0, 2, 1, 3)  # [nt, kc, TILE_N, CHUNK_K]
    r0, col, s = _thread_coords(device)
    # [nt, kc, thread, k-step, 2 words x (row r0 pair, row r1 pair)]
    parts = []
    for dc in (0, 8):
        for row in (r0, r0 + 8):
            c = (16 * s)[None, :] + col[:, None] + dc
            parts.append(torch.stack([codes[:, :, row[:, None], c], codes[:, :, row[:, None], c + 1]], dim=-1))
    per_step = torch.cat(parts, dim=-1)  # [nt, kc, 128, 8 steps, 8 bytes]
    per_step = _fp8_words(per_step.view(n_tiles, k_chunks, _THREADS, _KSTEPS, 2, 4))
    data = per_step.view(n_tiles, k_chunks, _THREADS, 2, 4, 8).permute(0, 1, 3, 2, 4, 5)  # [.., group, thread, ..]
    data = data.reshape(-1, ROW_BYTES).contiguous()
    return PackedFP8(data, scale.detach().to(device, torch.float32).contiguous().clone(), n, k)


def _fp8_half(code: torch.Tensor) -> torch.Tensor:
    """E4M3 bytes -> the 16-bit half s0000eeeemmm0000 (int32): the bf16 of ``value * 2^-120``."""
    code = code.to(torch.int32)
    return ((code & 0x80) << 8) | ((code & 0x7F) << FP8_SHIFT)


# no bit of the decode's masks and shifts crosses a word's 16-bit halves, so the packer and the
# emulation work per half in int32 (a quarter of the temporaries of whole int64 words)
_HALF = 0xFFFF


def _fp8_words(codes: torch.Tensor) -> torch.Tensor:
    """uint8 ``[..., 4]`` E4M3 codes -> the packed word's 4 bytes (little-endian): codes 0, 1 in
    place under ``FP8_DIRECT_MASK``, codes 2, 3 in the other bits (the inverse of the two shifts)."""
    direct, split = _fp8_half(codes[..., :2]), _fp8_half(codes[..., 2:])  # [..., 2]: low half, high half
    halves = (direct | ((split & (FP8_SPLIT_MASKS[0] & _HALF)) >> FP8_SHIFT)
              | ((split & (FP8_SPLIT_MASKS[1] & _HALF)) << FP8_SHIFT))
    return torch.stack([halves & 0xFF, halves >> 8], dim=-1).flatten(-2).to(torch.uint8)


def _fp8_decoded_halves(packed: PackedFP8) -> torch.Tensor:
    """The kernel's decode of every packed word: int32 ``[nt, kc, thread, k-step, 8]`` halves
    (bf16 bits of ``value * 2^-120``) in ``pack_fp8``'s code order."""
    b = packed.data.view(packed.n_tiles, packed.k_chunks, 2, _THREADS, 4, 8).permute(0, 1, 3, 2, 4, 5)
    b = b.reshape(packed.n_tiles, packed.k_chunks, _THREADS, _KSTEPS, 2, 2, 2).to(torch.int32)  # word, half, byte
    h = b[..., 0] | (b[..., 1] << 8)  # [.., word, half]
    direct = h & (FP8_DIRECT_MASK & _HALF)
    split = ((h << FP8_SHIFT) & (FP8_SPLIT_MASKS[0] & _HALF)) | ((h >> FP8_SHIFT) & (FP8_SPLIT_MASKS[1] & _HALF))
    return torch.cat([direct, split], dim=-1).reshape(*b.shape[:4], 8)


def _fp8_unpermuted(packed: PackedFP8, per_code: torch.Tensor) -> torch.Tensor:
    """``per_code`` ``[nt, kc, thread, k-step, 8]`` in ``pack_fp8``'s code order -> ``[N, K]``."""
    n_tiles, k_chunks = packed.n_tiles, packed.k_chunks
    out = torch.zeros(n_tiles, k_chunks, TILE_N, CHUNK_K, dtype=per_code.dtype, device=per_code.device)
    r0, col, s = _thread_coords(per_code.device)
    i = 0
    for dc in (0, 8):
        for row in (r0, r0 + 8):
            c = (16 * s)[None, :] + col[:, None] + dc
            out[:, :, row[:, None], c] = per_code[..., i]
            out[:, :, row[:, None], c + 1] = per_code[..., i + 1]
            i += 2
    return out.permute(0, 2, 1, 3).reshape(n_tiles * TILE_N, k_chunks * CHUNK_K)[: packed.n, : packed.k]


def unpack_fp8(packed: PackedFP8) -> torch.Tensor:
    """Inverse of :func:`pack_fp8`: the float8_e4m3fn weight ``[N, K]`` (exact; the scales are
    ``packed.scale`` as given)."""
    h = _fp8_decoded_halves(packed)
    codes = (((h >> 8) & 0x80) | ((h >> FP8_SHIFT) & 0x7F)).to(torch.uint8)
    return _fp8_unpermuted(packed, codes).contiguous().view(torch.float8_e4m3fn)


def unpack_fp8_emulated(packed: PackedFP8) -> torch.Tensor:
    """The dequantized weight ``[N, K]`` (float64) as the kernel computes it: each packed word
    through the kernel's masks and shifts to bf16 bits (``value * 2^-120``), times 2^120, times
    the block scales."""
    h = _fp8_decoded_halves(packed).cpu()
    w = _fp8_unpermuted(packed, _bf16_of_bits(h) * 2.0 ** FP8_DECODE_EXP)
    scale = packed.scale.double().cpu().repeat_interleave(FP8_SCALE_BLOCK, 0).repeat_interleave(FP8_SCALE_BLOCK, 1)
    return w * scale[: packed.n, : packed.k]


def grouped_weight_only_reference(x: torch.Tensor, packed: PackedNVFP4Experts, group_ends: torch.Tensor
                                  ) -> torch.Tensor:
    """Expert ``e``'s rows of ``x`` (``group_ends[e-1]:group_ends[e]``) times its dequantized
    weight, in FP32, cast to ``x``'s dtype; rows after ``group_ends[-1]`` are zero."""
    y = torch.zeros(x.shape[0], packed.n, dtype=x.dtype, device=x.device)
    ends = [0] + [int(v) for v in group_ends.tolist()]
    if any(b < a for a, b in zip(ends, ends[1:])) or ends[-1] > x.shape[0]:
        raise ValueError(f"group_ends: expected non-decreasing cumulative row counts at most R={x.shape[0]}, "
                         f"got {ends[1:]}")
    for e in range(packed.experts):
        if ends[e + 1] > ends[e]:
            y[ends[e]:ends[e + 1]] = weight_only_reference(x[ends[e]:ends[e + 1]], packed.expert(e))
    return y


def weight_only_reference(x: torch.Tensor, packed: PackedNVFP4 | PackedFP8, bias: torch.Tensor | None = None
                          ) -> torch.Tensor:
    """``x · dequant(W)ᵀ (+ bias)`` in FP32 from the packed weight, cast to ``x``'s dtype."""
    unpack = unpack_fp8_emulated if isinstance(packed, PackedFP8) else unpack_codes_emulated
    w = unpack(packed).to(device=x.device, dtype=torch.float32)
    with autocast_off(x.device):
        y = x.float() @ w.t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)
