"""Hopper (sm_90a) NVFP4 weight -> bf16, for ``x · dequant(W)ᵀ`` at prefill sizes.

From ~1000 tokens on, the weight-only kernel runs well below bf16 cuBLAS (its decode chains, with
two consumer warps per scheduler, keep the tensor pipe ~57% busy: gemm NOTES, session 48); the
weight decoded once to bf16 and a cuBLAS GEMM beat it there. This
kernel writes that weight from the packed layout (``lowprec.gemm.weight_only``) with the
weight-only kernel's own decode: ``code * scale * 2^-DECODE_EXP`` (exact in bf16, without the
global scale, which the GEMM applies as its FP32 alpha).

One CTA of 128 threads per 64 x 128 chunk: thread ``t`` loads its two 16-byte code records and
the scale words of its quad (coalesced) and decodes its 64 weights into the wgmma A-fragment words
it would build in the GEMM. Those land in shared memory at their (row, column), rows padded by 4
words (the 8 rows of a store meet 32 distinct banks), and go out as 16-byte row segments: a warp
writes two rows' 256 contiguous bytes (pair by pair, each of a warp's 4-byte stores touched 8
rows: 0.6 TB/s). Grid: (k-chunks, n-tiles of the slice).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass.memory import SmemAllocator

from ..weight_only import CHUNK_BYTES, CODE_BYTES, TILE_N
from .weight_only import decode_nvfp4

_THREADS = 128
_CHUNK_WORDS = CHUNK_BYTES // 4
_HALF_WORDS = CODE_BYTES // 8  # one half of the chunk's k-steps: 128 records of 4 words
_ROW_WORDS = 64 + 4  # a chunk row's 64 words of bf16 pairs in shared memory, padded


class NVFP4DequantSm90:
    """The packed tiles ``[tile0, tile0 + grid y)`` of an NVFP4 weight -> bf16 rows ``64 tile``
    on (relative to ``tile0``), as int32 words of bf16 pairs."""

    @cute.jit
    def __call__(
        self,
        mWords: cute.Tensor,  # (n_tiles * k_chunks * CHUNK_BYTES / 4,) int32: the packed weight
        mOut: cute.Tensor,  # (rows, K / 2) int32: bf16 pairs, rows = the slice's weight rows
        tile0: cutlass.Int32,
        k_chunks: cutlass.Int32,
        stream,
    ):
        @cute.struct
        class SharedStorage:
            tile: cute.struct.Align[cute.struct.MemRange[cutlass.Int32, TILE_N * _ROW_WORDS], 16]

        self.shared_storage = SharedStorage
        tiles = (cute.size(mOut, mode=[0]) + TILE_N - 1) // TILE_N
        self.kernel(mWords, mOut, tile0, k_chunks).launch(grid=(k_chunks, tiles, 1), block=[_THREADS, 1, 1],
                                                          stream=stream)

    @cute.kernel
    def kernel(self, mWords: cute.Tensor, mOut: cute.Tensor, tile0: cutlass.Int32, k_chunks: cutlass.Int32):
        kc, tile, _ = cute.arch.block_idx()
        t, _, _ = cute.arch.thread_idx()
        storage = SmemAllocator().allocate(self.shared_storage)
        sTile = storage.tile.get_tensor(cute.make_layout((TILE_N, _ROW_WORDS), stride=(_ROW_WORDS, 1)))
        base = ((tile0 + tile) * k_chunks + kc) * _CHUNK_WORDS
        words = mWords.iterator
        # thread t's code words of k-steps 4h + j at h * 512 + 4t + j; its quad's scale words
        # (k-steps 2i, 2i + 1 in word i) at 1024 + 4 (t // 4) + i
        codes_at = cute.make_ptr(cutlass.Int32, (words + base + 4 * t).toint(), cute.AddressSpace.gmem,
                                 assumed_align=16)
        scales_at = cute.make_ptr(cutlass.Int32, (words + base + 2 * _HALF_WORDS + 4 * (t // 4)).toint(),
                                  cute.AddressSpace.gmem, assumed_align=16)
        codes = cute.make_rmem_tensor((4, 2), cutlass.Int32)
        cute.autovec_copy(cute.make_tensor(codes_at, cute.make_layout((4, 2), stride=(1, _HALF_WORDS))), codes)
        scw = cute.make_rmem_tensor((4,), cutlass.Int32)
        cute.autovec_copy(cute.make_tensor(scales_at, cute.make_layout((4,))), scw)
        a_words = cute.make_rmem_tensor((32,), cutlass.Int32)
        for s in cutlass.range_constexpr(8):
            decode_nvfp4(codes[s % 4, s // 4], scw[s // 2], s % 2, a_words, s)
        # pair q of k-step s: row r0 (q even) or r0 + 8, columns 16 s + 2 (lane % 4) (+ 8 for q >= 2)
        warp, lane = t // 32, t % 32
        r0 = 16 * warp + lane // 4
        for s in cutlass.range_constexpr(8):
            for q in cutlass.range_constexpr(4):
                sTile[r0 + 8 * (q % 2), 8 * s + lane % 4 + 4 * (q // 2)] = a_words[4 * s + q]
        cute.arch.sync_threads()
        # 16 threads per row, 4 words (16 bytes) each; 8 rows per pass. K is a multiple of 16, so a
        # row's words end on a 4-word boundary
        rows, k_words = cute.size(mOut, mode=[0]), cute.size(mOut, mode=[1])
        row_stride = mOut.layout.stride[0]
        seg = t % 16
        col = kc * 64 + 4 * seg
        for p in cutlass.range_constexpr(TILE_N * 16 // _THREADS):
            r = 8 * p + t // 16
            row = tile * TILE_N + r
            if row < rows and col < k_words:
                dst_at = cute.make_ptr(cutlass.Int32, (mOut.iterator + row * row_stride + col).toint(),
                                       cute.AddressSpace.gmem, assumed_align=16)
                src_at = cute.make_ptr(cutlass.Int32, (sTile.iterator + r * _ROW_WORDS + 4 * seg).toint(),
                                       cute.AddressSpace.smem, assumed_align=16)
                cute.autovec_copy(cute.make_tensor(src_at, cute.make_layout((4,))),
                                  cute.make_tensor(dst_at, cute.make_layout((4,))))
