"""Hopper (sm_90a) FP8 FlashAttention forward in CuTe DSL.

    S = (Q_codes . K_codesᵀ) * q_scale[m-block] * k_scale[n-block] * softmax_scale
    online softmax over KV blocks of 128 (FP32, exp2 with the scale folded into one FFMA),
    P8 = E4M3(448 / 2**slack * exp(S - m_running)) (slack 2 with the lazy running max of in-MMA
    kernels, else 0),  blk = P8 . V_codes (fresh FP32 wgmma accumulator, or O's own in-MMA),
    O_acc = O_acc * alpha + blk,  O = O_acc * v_scale[ch] / rowsum(P8 before the cast),  LSE in FP32 (ln).

Layouts (see CONTRACT.md): Q [Sq, D, B*H], K [Sk, D, B*Hkv] (K-major along D), Vᵀ [D, Sk_pad,
B*Hkv] (K-major along keys) as uint8 views of E4M3; scales q [B*H, ceil(Sq/128)],
k [B*Hkv, ceil(Sk/128)], v [B*Hkv, D]; O [Sq, D, B*H] bf16/fp16; LSE [Sq, B*H] fp32.

Structure (one CTA per 64 x consumer_wgs query rows of one head; grid (m-blocks, H, B), longest
causal rows first):
* warpgroup 0, warp 0: TMA producer. Q once, then per KV block its K tile and Vᵀ tile into a
  ``stages``-deep ring (two ``PipelineTmaAsync``: K and V have their own full/empty barriers,
  so the S wgmma of a block can start before its V has landed).
* warpgroups 1..consumer_wgs (2 or 3): consumers, 64 query rows each. Per KV block: S wgmma (Q
  and K from shared memory), mask (tail / causal blocks only), row max (quad shuffles), exp2 of one FFMA per score,
  P to E4M3 *in registers* as the A operand of the P.V wgmma: the FP32 accumulator layout (pairs
  of adjacent keys per thread) is permuted into the FP8 A-fragment layout (4 adjacent keys per
  thread) with two shuffles and two byte permutes per 32 keys and row (``_p_to_frag_a``), then
  P.V per N chunk of <= 128 columns, either into a fresh accumulator (ACCUMULATE off on its
  first k-step) and ``O_acc = O_acc * alpha + blk`` (two-level accumulation), or into O itself
  after ``O_acc *= alpha`` (in-MMA: the default with three warpgroups, whose 160 registers do
  not hold a block accumulator).
* epilogue: quad-reduced row sums, O scaled by v_scale / rowsum (the V scales loaded into shared
  memory when the tile starts) and cast, staged in shared memory and stored by TMA (dense 16-bit
  outputs at D <= 128; else stored from registers); LSE from the lanes that own a row.

The GEMM core (``lowprec.gemm.sm90.blockscaled_gemm``) is the model for the TMA ring, the two
MMA objects with ACCUMULATE fixed and the register budget split; once the shared building blocks
(``lowprec/cute``) land, the producer loop and the promotion should come from there (NOTES.md).
"""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass._mlir.dialects import llvm
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.cutlass_dsl import T, dsl_user_op
from cutlass.memory import SmemAllocator
from cutlass.pipeline import pipeline_init_arrive, pipeline_init_wait
from cutlass.tensor_utils import LayoutEnum

from ...cute.fp8_block import scale_and_inverse
from ...cute.fp8_tile import group_max
from ...cute.sm90.epilogue import TmaStoreEpilogue
from .config import P_SCALE, RESCALE_SLACK, TILE_M, TILE_N, AttnConfig

_LOG2E = math.log2(math.e)
_LN2 = math.log(2.0)
_LOG2_PSCALE = math.log2(P_SCALE)
_SCHED_BAR = 2  # named barriers 2, 3: ping-pong turns of consumer warpgroups 0, 1
_QUANT_BAR = 4  # named barriers 4..6: consumer warpgroup w's Q quantization (quantize_q)
_QUANT_PAIR_BAR = 7  # quantize_q with two consumer warpgroups: both, whose rows are one Q-scale block
_VSCALE_BAR = 8  # named barriers 8..10: consumer warpgroup w's V scales in shared memory
_EPI_BAR = 11  # every consumer thread: O staged in shared memory for its TMA store
_EPI_N = 32  # columns of O per TMA store slice (64-byte rows: the GEMM core's epilogue slices)
Q_VEC = 8  # Q values per 16-byte load of the in-kernel Q quantization
_C_MIN = 1e-30  # floor of the score scale: a zero scale (all-zero block) must not make -inf * 0
_NACC = 4  # independent accumulation chains of the row max / row sum (8: 2-4% slower, NOTES.md)


# ----------------------------------------------------------------------------- PTX helpers
@dsl_user_op
def _ex2(x, *, loc=None, ip=None):
    """2^x (MUFU.EX2, flush-to-zero; -inf -> 0). No side effects: the compiler may schedule it."""
    return cutlass.Float32(
        llvm.inline_asm(T.f32(), [cutlass.Float32(x).ir_value(loc=loc, ip=ip)],
                        "ex2.approx.ftz.f32 $0, $1;", "=f,f", loc=loc, ip=ip)
    )


@dsl_user_op
def _cvt_e4m3x4(x0, x1, x2, x3, *, loc=None, ip=None):
    """Four FP32 values to one 32-bit word of E4M3 (byte i = x_i; RN, saturating to +-448)."""
    args = [cutlass.Float32(v).ir_value(loc=loc, ip=ip) for v in (x0, x1, x2, x3)]
    return cutlass.Int32(
        llvm.inline_asm(
            T.i32(), args,
            "{\n.reg .b16 lo, hi;\n"
            "cvt.rn.satfinite.e4m3x2.f32 lo, $2, $1;\n"
            "cvt.rn.satfinite.e4m3x2.f32 hi, $4, $3;\n"
            "mov.b32 $0, {lo, hi};\n}",
            "=r,f,f,f,f", loc=loc, ip=ip,
        )
    )


@dsl_user_op
def _pin_f32(x, *, loc=None, ip=None):
    """Empty volatile asm on one fp32 value: reads of it may not move across (operand fence)."""
    return cutlass.Float32(
        llvm.inline_asm(cutlass.Float32.mlir_type, [cutlass.Float32(x).ir_value(loc=loc, ip=ip)],
                        "", "=f,0", has_side_effects=True, loc=loc, ip=ip)
    )


@cute.jit
def _fence_operand(t: cute.Tensor):
    for i in cutlass.range_constexpr(cute.size(t)):
        t[i] = _pin_f32(t[i])


class FP8AttentionFwdSm90:
    """FP8 attention forward for sm_90a: (64 x 2 or 3) x 128 tiles, 2 or 3 consumer warpgroups, TMA producer."""

    def __init__(self, config: AttnConfig):
        self.config = config
        self.head_dim = config.head_dim
        self.causal = config.causal
        self.out_dtype = {"bfloat16": cutlass.BFloat16, "float16": cutlass.Float16}[config.out_dtype]
        self.tile_m, self.tile_n = config.tile_m, TILE_N
        self.stages = config.stages()
        self.ab_dtype = cutlass.Float8E4M3FN
        self.acc_dtype = cutlass.Float32
        self.num_mma_wg = config.consumer_wgs
        self.threads_per_wg = 128
        self.threads_per_cta = (1 + self.num_mma_wg) * self.threads_per_wg
        self.load_regs = 24
        self.mma_regs = 160 if self.num_mma_wg == 3 else 240
        # P.V in N chunks of at most 128 columns: one fresh 64-register block accumulator
        self.pv_n = min(self.head_dim, 128)
        self.pv_chunks = self.head_dim // self.pv_n
        # intra-warpgroup overlap (D <= OVERLAP_MAX_D, AttnConfig normalizes the flag); ping-pong
        # between the consumer warpgroups (FA3): wgmma batches issued in turns, so one
        # warpgroup's softmax runs under the other's products (overlapped loop only)
        self.overlap = config.overlap
        self.pingpong = config.pingpong
        # GQA with short Sq (decode): the r query heads of a KV head share the CTA's rows
        # (row = head_in_group * Sq + query); per-row q scales, causal index = row mod Sq
        self.pack_gqa = config.pack_gqa
        # split-KV (decode): grid z = splits x batch; split i takes KV blocks [i*per, (i+1)*per)
        # and writes FP32 partials (O normalized over its keys, its LSE); the host combines them
        self.split_kv = config.split_kv
        # persistent: grid = min(tiles, SMs), each CTA walks one tile per round in zigzag order
        # (_round_tile; longest causal rows first within a head); the next tile's Q/K/V loads
        # run under this tile's last P.V and epilogue
        self.persistent = config.persistent
        # v_t stored with its keys permuted within each 16 (interface.permute_v_keys): P goes to
        # the A fragment without shuffles
        self.v_perm = config.v_keys_permuted
        # P.V accumulation: two-level (a fresh block accumulator added into O in FP32, as the
        # GEMM core promotes) or in the wgmma accumulator (O rescaled, FlashAttention-3's way:
        # 64 registers fewer, which lets D = 128 overlap; NOTES.md measures both)
        self.two_level = config.two_level_pv
        self.num_sms = config.num_sms
        self.skip_unit_rescale = config.skip_unit_rescale  # AttnConfig keeps it to in-MMA kernels
        # in-MMA, plain serial loop: O *= alpha right after the softmax (its FMULs under the
        # exponentials' latency) with v_t permuted, else just before the P.V (NOTES.md, session 23:
        # 1.28 vs 1.32 ms and 1.34 vs 1.32 at d128)
        self.rescale_early = self.v_perm
        # lazy rescaling (FlashAttention-4's): the running max moves only when a block's max passes
        # it by more than RESCALE_SLACK powers of two, so P is scaled by 448 / 2**RESCALE_SLACK
        self.lazy_rescale = config.lazy_rescale
        self.log2_pscale = _LOG2_PSCALE - (RESCALE_SLACK if self.lazy_rescale else 0)
        # packed variable-length sequences (``lowprec.attention.packed``): grid (query blocks of the
        # longest sequence, heads, sequences), one row of the sequence plan per sequence; Q, K, Vᵀ
        # and their scales in the padded layout (each sequence from a multiple of 128 rows), O and
        # the LSE packed as FlashAttention's varlen
        self.varlen = config.varlen
        # Q arrives in its float dtype (q's dtype is the output's) and each consumer warpgroup
        # quantizes its own 64 rows into sQ with the Q pre-pass's recipe (one scale per 128 rows,
        # written to q_scale): no Q pre-pass. Else Q comes in E4M3 by TMA.
        self.quantize_q = config.quantize_q
        self.kv_lengths = config.kv_lengths
        if self.split_kv:
            self.out_dtype = cutlass.Float32
        # O (16-bit, D <= 128, dense rows) through shared memory and TMA stores, the GEMM core's
        # epilogue: 32 4-byte stores per thread queued on the LSU and drained at exit before (ncu,
        # session 37); varlen rows end inside the tensor (a box would write the next sequence's),
        # split-KV writes FP32 partials, D = 256 has no shared memory left for a 64 KB tile, packed
        # GQA (decode: few rows per head) spilled 5 registers with it
        self.tma_store_o = not (self.varlen or self.split_kv or self.pack_gqa) and self.pv_chunks == 1

    # ------------------------------------------------------------------ host side
    def _mma_qk(self):
        return sm90_utils.make_trivial_tiled_mma(
            self.ab_dtype, self.ab_dtype, cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.K,
            self.acc_dtype, (self.num_mma_wg, 1, 1), tiler_mn=(64, self.tile_n),
        )

    def _mma_pv(self):
        return sm90_utils.make_trivial_tiled_mma(
            self.ab_dtype, self.ab_dtype, cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.K,
            self.acc_dtype, (self.num_mma_wg, 1, 1), tiler_mn=(64, self.pv_n),
            a_source=warpgroup.OperandSource.RMEM,
        )

    def _smem_layout(self, rows: int, cols: int, stages: int | None):
        """K-major (cols contiguous) FP8 tile, 128-byte swizzle, optionally staged."""
        atom = warpgroup.make_smem_layout_atom(
            sm90_utils.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, self.ab_dtype, cols), self.ab_dtype
        )
        if stages is None:
            return cute.tile_to_shape(atom, (rows, cols), order=(0, 1))
        return cute.tile_to_shape(atom, (rows, cols, stages), order=(0, 1, 2))

    @cute.jit
    def __call__(
        self,
        mQ_u8: cute.Tensor,  # (Sq, D, B*H) uint8 view of E4M3; quantize_q: Q in the output dtype
        mK_u8: cute.Tensor,  # (Sk, D, B*Hkv)
        mVt_u8: cute.Tensor,  # (D, Sk_pad, B*Hkv)
        mQS: cute.Tensor,  # (B*H, ceil(Sq/128)) fp32 (quantize_q: written)
        mKS: cute.Tensor,  # (B*Hkv, ceil(Sk/128)) fp32
        mVS: cute.Tensor,  # (B*Hkv, D) fp32
        mO: cute.Tensor,  # (Sq, D, B*H) out dtype
        mLSE: cute.Tensor,  # (Sq, B*H) fp32
        softmax_scale_log2: cutlass.Float32,
        heads: cutlass.Int32,
        heads_per_kv: cutlass.Int32,
        pack_r: cutlass.Int32,  # pack_gqa: query heads per KV head packed into the rows; else 1
        pack_sq: cutlass.Int32,  # pack_gqa: the query rows of one head (Sq); varlen: the longest Sq; else Sq
        mPlan,  # varlen: (B, 8) int32, packed.SEQUENCE_FIELDS; else unread
        stream,
    ):
        f8 = self.ab_dtype
        mQ = mQ_u8 if self.quantize_q else cute.make_tensor(cute.recast_ptr(mQ_u8.iterator, dtype=f8), mQ_u8.layout)
        mK = cute.make_tensor(cute.recast_ptr(mK_u8.iterator, dtype=f8), mK_u8.layout)
        mVt = cute.make_tensor(cute.recast_ptr(mVt_u8.iterator, dtype=f8), mVt_u8.layout)
        d = self.head_dim
        sQ_layout = self._smem_layout(self.tile_m, d, None)
        sK_layout = self._smem_layout(self.tile_n, d, self.stages)
        sV_layout = self._smem_layout(d, self.tile_n, self.stages)
        g2s = cpasync.CopyBulkTensorTileG2SOp()
        tma_k, tma_tensor_k = cpasync.make_tiled_tma_atom(
            g2s, mK, cute.slice_(sK_layout, (None, None, 0)), (self.tile_n, d))
        if cutlass.const_expr(self.quantize_q):  # no Q load by TMA: K's atom stands in, unused
            tma_q, tma_tensor_q = tma_k, mQ
        else:
            tma_q, tma_tensor_q = cpasync.make_tiled_tma_atom(g2s, mQ, sQ_layout, (self.tile_m, d))
        tma_v, tma_tensor_v = cpasync.make_tiled_tma_atom(
            g2s, mVt, cute.slice_(sV_layout, (None, None, 0)), (d, self.tile_n))
        epi_tile = (self.tile_m, _EPI_N)
        sO_layout = sm90_utils.make_smem_layout_epi(self.out_dtype, LayoutEnum.ROW_MAJOR, epi_tile, d // _EPI_N)
        if cutlass.const_expr(self.tma_store_o):
            tma_o, tma_tensor_o = cpasync.make_tiled_tma_atom(
                cpasync.CopyBulkTensorTileS2GOp(), mO, cute.slice_(sO_layout, (None, None, 0)), epi_tile)
        else:  # O stored from registers: K's atom stands in, unused
            tma_o, tma_tensor_o = tma_k, mO
        o_elems = cute.cosize(sO_layout) if self.tma_store_o else 8

        @cute.struct
        class SharedStorage:
            mbar_q: cute.struct.MemRange[cutlass.Int64, 2]
            mbar_k: cute.struct.MemRange[cutlass.Int64, self.stages * 2]
            mbar_v: cute.struct.MemRange[cutlass.Int64, self.stages * 2]
            sQ: cute.struct.Align[cute.struct.MemRange[f8, cute.cosize(sQ_layout)], 1024]
            q_amax: cute.struct.MemRange[cutlass.Float32, 4 * self.num_mma_wg]  # quantize_q: per warp
            v_scales: cute.struct.MemRange[cutlass.Float32, self.num_mma_wg * self.head_dim]  # per warpgroup
            sK: cute.struct.Align[cute.struct.MemRange[f8, cute.cosize(sK_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[f8, cute.cosize(sV_layout)], 1024]
            sO: cute.struct.Align[cute.struct.MemRange[self.out_dtype, o_elems], 1024]

        self.shared_storage = SharedStorage
        seqlen_q = cute.size(mQ, mode=[0])
        batch_heads = cute.size(mO, mode=[2])  # x splits for split-KV partials
        m_blocks = (seqlen_q + self.tile_m - 1) // self.tile_m
        self.kernel(
            tma_q, tma_tensor_q, tma_k, tma_tensor_k, tma_v, tma_tensor_v, tma_o, tma_tensor_o,
            mQS, mKS, mVS, mO, mLSE, softmax_scale_log2, heads, heads_per_kv, pack_r, pack_sq, mPlan,
            sQ_layout, sK_layout, sV_layout, sO_layout, self._mma_qk(), self._mma_pv(),
        ).launch(
            grid=self._grid(m_blocks, heads, batch_heads, mPlan, pack_sq),
            block=[self.threads_per_cta, 1, 1],
            min_blocks_per_mp=1,
            stream=stream,
        )

    def _grid(self, m_blocks, heads, batch_heads, mPlan, pack_sq):
        if cutlass.const_expr(self.varlen):
            return ((pack_sq + self.tile_m - 1) // self.tile_m, heads, cute.size(mPlan, mode=[0]))
        if cutlass.const_expr(self.persistent):
            return (cutlass.min(m_blocks * batch_heads, self.num_sms), 1, 1)
        return (m_blocks, heads, batch_heads // heads)

    # ------------------------------------------------------------------ device side
    @cute.kernel
    def kernel(
        self,
        tma_q: cute.CopyAtom, mQ: cute.Tensor,
        tma_k: cute.CopyAtom, mK: cute.Tensor,
        tma_v: cute.CopyAtom, mVt: cute.Tensor,
        tma_o: cute.CopyAtom, mO_tma: cute.Tensor,
        mQS: cute.Tensor, mKS: cute.Tensor, mVS: cute.Tensor,
        mO: cute.Tensor, mLSE: cute.Tensor,
        softmax_scale_log2: cutlass.Float32,
        heads: cutlass.Int32,
        heads_per_kv: cutlass.Int32,
        pack_r: cutlass.Int32,
        pack_sq: cutlass.Int32,
        mPlan,
        sQ_layout: cute.ComposedLayout,
        sK_layout: cute.ComposedLayout,
        sV_layout: cute.ComposedLayout,
        sO_layout: cute.ComposedLayout,
        mma_qk: cute.TiledMma,
        mma_pv: cute.TiledMma,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        seqlen_q = cute.size(mQ, mode=[0])
        seqlen_k = cute.size(mK, mode=[0])
        d = self.head_dim
        # the tile space: (m-block, head, zz) with zz = batch, or split * B + batch (split-KV)
        m_blocks = (seqlen_q + self.tile_m - 1) // self.tile_m
        zdim = cute.size(mO, mode=[2]) // heads
        dims = (m_blocks, heads, zdim, heads_per_kv, pack_sq, seqlen_q, seqlen_k,
                cute.size(mQ, mode=[2]) // heads, mPlan)

        if warp_idx == 0:
            if cutlass.const_expr(not self.quantize_q):
                cpasync.prefetch_descriptor(tma_q)
            cpasync.prefetch_descriptor(tma_k)
            cpasync.prefetch_descriptor(tma_v)
            if cutlass.const_expr(self.tma_store_o):
                cpasync.prefetch_descriptor(tma_o)

        smem = SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        producer = pipeline.CooperativeGroup(pipeline.Agent.Thread)
        consumers = pipeline.CooperativeGroup(pipeline.Agent.Thread, self.num_mma_wg * 4)
        q_bytes = self.tile_m * d
        kv_bytes = self.tile_n * d
        pipe_q = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar_q.data_ptr(), num_stages=1, producer_group=producer,
            consumer_group=consumers, tx_count=q_bytes, defer_sync=True)
        pipe_k = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar_k.data_ptr(), num_stages=self.stages, producer_group=producer,
            consumer_group=consumers, tx_count=kv_bytes, defer_sync=True)
        pipe_v = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar_v.data_ptr(), num_stages=self.stages, producer_group=producer,
            consumer_group=consumers, tx_count=kv_bytes, defer_sync=True)
        pipeline_init_arrive(cluster_shape_mn=(1, 1), is_relaxed=True)

        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sV = storage.sV.get_tensor(sV_layout.outer, swizzle=sV_layout.inner)

        warp_group_idx = cute.arch.make_warp_uniform(tidx // self.threads_per_wg)
        pipeline_init_wait(cluster_shape_mn=(1, 1))

        if warp_group_idx == 0:
            cute.arch.setmaxregister_decrease(self.load_regs)
            if warp_idx == 0:
                q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
                state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
                loads = (tma_q, tma_k, tma_v, mQ, mK, mVt, sQ, sK, sV, pipe_q, pipe_k, pipe_v)
                if cutlass.const_expr(self.persistent):
                    for r in cutlass.range(self._rounds(dims), unroll=1):
                        tile = self._round_tile(r, dims)
                        if tile < m_blocks * heads * zdim:
                            q_state, state = self._produce_tile(
                                loads, self._tile_info(self._linear_tile(tile, dims), dims), q_state, state)
                else:
                    q_state, state = self._produce_tile(
                        loads, self._tile_info(self._grid_tile(dims), dims), q_state, state)
                # producer_tail advances the state it is given: one copy per pipeline
                pipe_k.producer_tail(state.clone())
                pipe_v.producer_tail(state)
        else:
            cute.arch.setmaxregister_increase(self.mma_regs)
            self._consumer(
                tidx - self.threads_per_wg, mma_qk, mma_pv, sQ, sK, sV, pipe_q, pipe_k, pipe_v,
                mQS, mKS, mVS, mO, mLSE, softmax_scale_log2, pack_r, dims, (mQ, storage.q_amax.get_tensor(
                    cute.make_layout(4 * self.num_mma_wg))),
                storage.v_scales.get_tensor(cute.make_layout((self.head_dim, self.num_mma_wg))),
                (tma_o, mO_tma, storage.sO.get_tensor(sO_layout.outer, swizzle=sO_layout.inner), warp_idx),
            )

    # ------------------------------------------------------------------ tiles
    @cute.jit
    def _grid_tile(self, dims):
        """(m_block, head, zz) of this CTA (one tile per CTA): longest causal rows first."""
        m_blocks = dims[0]
        bidx, head, zz = cute.arch.block_idx()
        if cutlass.const_expr(self.varlen):  # blocks past the sequence's end are empty
            return (cute.arch.grid_dim()[0] - 1 - bidx, head, zz)
        return (m_blocks - 1 - bidx, head, zz)

    @cute.jit
    def _rounds(self, dims):
        """Persistent: rounds of ``grid`` tiles that cover the tile space."""
        grid = cute.arch.grid_dim()[0]
        return (dims[0] * dims[1] * dims[2] + grid - 1) // grid

    @cute.jit
    def _round_tile(self, r, dims):
        """Persistent: this CTA's linear tile in round ``r``, CTAs in zigzag order (reversed in odd
        rounds): a CTA that took one of the round's longest causal tiles takes one of the next
        round's shortest (walking t, t + grid, ... gave a CTA the same m-block in every head
        whenever the grid is a multiple of the m-blocks: 132 = 6 x 22 at S = 4096). Past the
        last tile in the last round: no tile."""
        grid = cute.arch.grid_dim()[0]
        bid = cute.arch.block_idx()[0]
        return r * grid + cutlass.select_(r % 2 == 0, bid, grid - 1 - bid)

    @cute.jit
    def _linear_tile(self, t, dims):
        """(m_block, head, zz) of linear tile t (persistent): head-major, each head's m-blocks
        longest causal rows first, so the CTAs in flight share the K/V of a few heads in L2
        (m-block-major, every CTA streamed its own head's K/V from HBM: 17% slower, NOTES.md)."""
        m_blocks, heads = dims[0], dims[1]
        hz = t // m_blocks
        return (m_blocks - 1 - t % m_blocks, hz % heads, hz // heads)

    @cute.jit
    def _tile_info(self, tile, dims):
        """Everything both roles need about one tile: indices, the KV blocks [n_lo, n_max)
        it visits, of which those from n_full on need a mask (the tail of Sk, or keys right of
        the bottom-right causal diagonal of some row), and its sequence: ``seq`` = (Sq, Sk,
        first padded Q row, first K block, first O / LSE row, V-scale row) (dense: the tensors'
        S, offsets 0)."""
        m_block, head, zz = tile
        _, heads, zdim, heads_per_kv, pack_sq, seqlen_q, seqlen_k, nb, mPlan = dims
        if cutlass.const_expr(self.varlen):
            bh = head
            bh_out = head
            bh_kv = head // heads_per_kv
            seqlen_q, seqlen_k, seq = self._varlen_fields(zz, bh_kv, dims)
        else:
            batch = zz
            if cutlass.const_expr(self.split_kv):
                batch = zz % nb
            bh = batch * heads + head
            bh_out = bh  # index of O / LSE (split-KV: split-major partials)
            if cutlass.const_expr(self.split_kv):
                bh_out = (zz // nb) * (nb * heads) + bh
            bh_kv = batch * (heads // heads_per_kv) + head // heads_per_kv
            if cutlass.const_expr(self.kv_lengths):  # this row's live cache length, within the buffer
                seqlen_k = cutlass.min(mPlan[(batch, 5)], seqlen_k)
            seq = (seqlen_q, seqlen_k, 0, 0, 0, bh_kv)
        n_blocks_k = (seqlen_k + self.tile_n - 1) // self.tile_n
        m0 = m_block * self.tile_m
        n_max = n_blocks_k
        n_full = seqlen_k // self.tile_n
        if cutlass.const_expr(self.causal and self.pack_gqa):
            # packed rows: the tile may hold query 0 of a head (sees the fewest keys) and query
            # Sq - 1 (sees all Sk)
            n_full = cutlass.min(n_full, cutlass.max(seqlen_k - pack_sq + 1, 0) // self.tile_n)
        if cutlass.const_expr(self.causal and not self.pack_gqa):
            # last key any row of the tile sees: m0 + 127 + Sk - Sq
            reach = m0 + self.tile_m + seqlen_k - seqlen_q  # exclusive
            n_max = cutlass.min(n_blocks_k, cutlass.max((reach + self.tile_n - 1) // self.tile_n, 0))
            # all keys of block n visible to the tile's first row: (n+1)*128 - 1 <= m0 + Sk - Sq
            first = m0 + 1 + seqlen_k - seqlen_q
            n_full = cutlass.min(n_full, cutlass.max(first, 0) // self.tile_n)
        n_lo = 0
        if cutlass.const_expr(self.split_kv):
            splits = zdim // nb
            per = (n_blocks_k + splits - 1) // splits
            n_lo = (zz // nb) * per
            n_max = cutlass.min(n_max, n_lo + per)
        if cutlass.const_expr(self.varlen):  # a block past the sequence's end: no keys, no rows
            n_max = cutlass.select_(m0 < seqlen_q, n_max, 0)
        return (m_block, bh, bh_kv, bh_out, m0, n_lo, n_max, n_full, seq)

    @cute.jit
    def _varlen_fields(self, batch, bh_kv, dims):
        """Row ``batch`` of the plan (its rows may be reordered: the V scales' row comes from its
        ``batch`` field): (Sq, Sk, seq) as :meth:`_tile_info` returns them."""
        heads, heads_per_kv, mPlan = dims[1], dims[3], dims[8]
        fields = cute.make_rmem_tensor((8,), cutlass.Int32)
        cute.autovec_copy(mPlan[(batch, None)], fields)
        seq = (fields[1], fields[5], fields[2], fields[6] // self.tile_n, fields[0],
               fields[3] * (heads // heads_per_kv) + bh_kv)
        return fields[1], fields[5], seq

    @cute.jit
    def _produce_tile(self, loads, info, q_state, state):
        """TMA producer (one warp) of one tile: Q, then K and Vᵀ of its KV blocks. Returns the
        advanced states: the DSL rebinds a state advanced in a dynamic loop to a new object, so
        the caller's must be replaced (else the producer tail and the next tile start over)."""
        tma_q, tma_k, tma_v, mQ, mK, mVt, sQ, sK, sV, pipe_q, pipe_k, pipe_v = loads
        m_block, bh, bh_kv, bh_out, m0, n_lo, n_max, n_full, seq = info
        d = self.head_dim
        q_src, k_src, v_src = mQ[None, None, bh], mK[None, None, bh_kv], mVt[None, None, bh_kv]
        if cutlass.const_expr(self.varlen):  # the sequence's rows of the padded layout
            q_src = cute.domain_offset((seq[2], 0), q_src)
            k_src = cute.domain_offset((seq[3] * self.tile_n, 0), k_src)
            v_src = cute.domain_offset((0, seq[3] * self.tile_n), v_src)
        gK = cute.local_tile(k_src, (self.tile_n, d), (None, 0))
        gV = cute.local_tile(v_src, (d, self.tile_n), (0, None))
        tKsK, tKgK = cpasync.tma_partition(
            tma_k, 0, cute.make_layout(1), cute.group_modes(sK, 0, 2), cute.group_modes(gK, 0, 2))
        tVsV, tVgV = cpasync.tma_partition(
            tma_v, 0, cute.make_layout(1), cute.group_modes(sV, 0, 2), cute.group_modes(gV, 0, 2))
        if cutlass.const_expr(not self.quantize_q):
            gQ = cute.local_tile(q_src, (self.tile_m, d), (m_block, 0))
            tQsQ, tQgQ = cpasync.tma_partition(
                tma_q, 0, cute.make_layout(1), cute.group_modes(sQ, 0, 2), cute.group_modes(gQ, 0, 2))
            pipe_q.producer_acquire(q_state)
            cute.copy(tma_q, tQgQ, tQsQ, tma_bar_ptr=pipe_q.producer_get_barrier(q_state))
            q_state.advance()
        for n in cutlass.range(n_lo, n_max, unroll=1):
            pipe_k.producer_acquire(state)
            cute.copy(tma_k, tKgK[(None, n)], tKsK[(None, state.index)],
                      tma_bar_ptr=pipe_k.producer_get_barrier(state))
            pipe_v.producer_acquire(state)
            cute.copy(tma_v, tVgV[(None, n)], tVsV[(None, state.index)],
                      tma_bar_ptr=pipe_v.producer_get_barrier(state))
            state.advance()
        return q_state, state

    # ------------------------------------------------------------------ consumers
    @cute.jit
    def _consumer(
        self, mtidx, mma_qk: cute.TiledMma, mma_pv: cute.TiledMma, sQ, sK, sV,
        pipe_q, pipe_k, pipe_v, mQS, mKS, mVS, mO, mLSE, softmax_scale_log2, pack_r, dims, q_in, sVS, o_store,
    ):
        wg = cute.arch.make_warp_uniform(mtidx // self.threads_per_wg)
        # --- S = Q Kᵀ: operands from shared memory
        thr_qk_wg = mma_qk.get_slice(wg * self.threads_per_wg)
        tSrQ = mma_qk.make_fragment_A(thr_qk_wg.partition_A(sQ))
        tSrK = mma_qk.make_fragment_B(thr_qk_wg.partition_B(sK))
        qk_zero = self._mma_qk()
        qk_zero.set(warpgroup.Field.ACCUMULATE, False)
        qk_acc = self._mma_qk()
        qk_acc.set(warpgroup.Field.ACCUMULATE, True)
        thr_qk = mma_qk.get_slice(mtidx)
        tScS = thr_qk.partition_C(cute.make_identity_tensor((self.tile_m, self.tile_n)))
        acc_s = cute.make_rmem_tensor(tScS.shape, self.acc_dtype)
        # --- blk = P Vᵀᵀ: A (P) from registers, B (Vᵀ) from shared memory
        thr_pv = mma_pv.get_slice(mtidx)
        thr_pv_wg = mma_pv.get_slice(wg * self.threads_per_wg)
        # per N chunk of <= 128 output columns: (atom, 1, k-steps, stages)
        tOrV = [
            mma_pv.make_fragment_B(thr_pv_wg.partition_B(
                cute.local_tile(sV, (self.pv_n, self.tile_n, self.stages), (ch, 0, 0))))
            for ch in range(self.pv_chunks)
        ]
        tOrP = thr_pv.make_fragment_A(thr_pv.partition_shape_A((self.tile_m, self.tile_n)))
        p_words = cute.make_rmem_tensor((cute.size(tOrP) // 4,), cutlass.Int32)
        tOrP_w = cute.make_tensor(cute.recast_ptr(p_words.iterator, dtype=self.ab_dtype), tOrP.layout)
        pv_zero = self._mma_pv()
        pv_zero.set(warpgroup.Field.ACCUMULATE, False)
        pv_acc = self._mma_pv()
        pv_acc.set(warpgroup.Field.ACCUMULATE, True)
        tOcO = thr_pv.partition_C(cute.make_identity_tensor((self.tile_m, self.pv_n)))
        # O per N chunk; two-level: a fresh block accumulator the P.V wgmma writes, else the
        # P.V wgmma accumulates into O itself (rescaled by alpha first)
        acc_o = [cute.make_rmem_tensor(tOcO.shape, self.acc_dtype) for _ in range(self.pv_chunks)]
        blk = cute.make_rmem_tensor(tOcO.shape, self.acc_dtype) if self.two_level else None
        pv_dst = [blk] * self.pv_chunks if self.two_level else acc_o

        # accumulator value v = c + 2 r + 4 j sits at (row_l[r], col_l + 8 j + c)
        row_l = [tScS[0][0], tScS[2][0]]
        col_l = tScS[0][1]
        lane = mtidx % 32
        quad = lane % 4
        # P -> A fragment: which lane of the quad to read, and how to order the two words
        src_a = (lane - quad) + (((quad & 1) << 1) | (quad >> 1))
        src_b = src_a ^ 1
        sender_odd = (quad & 1) == 1
        hi_recv = quad >= 2
        sel0 = cutlass.select_(hi_recv, cutlass.Int32(0x1054), cutlass.Int32(0x5410))
        sel1 = cutlass.select_(hi_recv, cutlass.Int32(0x3276), cutlass.Int32(0x7632))
        shuf = (src_a, src_b, sender_odd, sel0, sel1)

        regs = (acc_s, blk, acc_o, p_words, row_l, col_l, quad, tOcO[0][1], shuf)
        qk = (qk_zero, qk_acc, acc_s, tSrQ, tSrK)
        pv = (pv_zero if self.two_level else pv_acc, pv_acc, pv_dst, tOrP_w, tOrV)
        epi = None
        if cutlass.const_expr(self.tma_store_o):
            tma_o, mO_tma, sO, warp_idx = o_store
            epi = TmaStoreEpilogue.create(
                mma_pv, acc_o, sO, tma_o, mtidx, warp_idx, self.out_dtype, LayoutEnum.ROW_MAJOR,
                (self.tile_m, _EPI_N), self.head_dim // _EPI_N, self.threads_per_wg // 32,
                pipeline.NamedBarrier(barrier_id=_EPI_BAR, num_threads=self.num_mma_wg * self.threads_per_wg),
                self.num_mma_wg * self.threads_per_wg)
            mO = mO_tma
        gm = (mQS, mKS, mVS, mO, mLSE, softmax_scale_log2, pack_r, (*q_in, sQ, mtidx % self.threads_per_wg),
              sVS[(None, wg)], epi)
        pipes = (pipe_q, pipe_k, pipe_v)
        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
        k_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        v_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        if cutlass.const_expr(self.pingpong):
            if wg == 0:  # the first warpgroup issues first
                cute.arch.barrier_arrive(barrier_id=_SCHED_BAR, number_of_threads=2 * self.threads_per_wg)
        if cutlass.const_expr(self.persistent):
            for r in cutlass.range(self._rounds(dims), unroll=1):
                tile = self._round_tile(r, dims)
                if tile < dims[0] * dims[1] * dims[2]:
                    q_state, k_state, v_state = self._consume_tile(
                        self._tile_info(self._linear_tile(tile, dims), dims), dims, wg, regs, qk, pv, gm, pipes,
                        q_state, k_state, v_state)
        else:
            self._consume_tile(self._tile_info(self._grid_tile(dims), dims), dims, wg, regs,
                               qk, pv, gm, pipes, q_state, k_state, v_state)
        if cutlass.const_expr(self.tma_store_o):
            epi.tail()

    @cute.jit
    def _consume_tile(self, info, dims, wg, regs, qk, pv, gm, pipes, q_state, k_state, v_state):
        """One tile of one consumer warpgroup: the KV-block loop and the epilogue. Returns the
        advanced pipeline states (see _produce_tile)."""
        m_block, bh, bh_kv, bh_out, m0, n_lo, n_max, n_full, seq = info
        pack_sq = dims[4]
        seqlen_q, seqlen_k, q_row0, kb0, o_row0, vs_row = seq
        acc_s, blk, acc_o, p_words, row_l, col_l, quad, ocol_l, shuf = regs
        src_a, src_b, sender_odd, sel0, sel1 = shuf
        mQS, mKS, mVS, mO, mLSE, softmax_scale_log2, pack_r, q_in, sVS, epi = gm
        pipe_q, pipe_k, pipe_v = pipes
        # this tile's V scales, loaded now and kept in shared memory for the epilogue: loaded there,
        # their global latency sat between the last P.V and the first store (ncu, session 37)
        vs_t = q_in[3]
        vs_vals = self._load_v_scales(mVS, vs_row, vs_t)
        n_blk = cute.size(acc_o[0])
        for ch in cutlass.range_constexpr(self.pv_chunks):
            acc_o[ch].fill(0.0)
        row_max = cute.make_rmem_tensor((2,), cutlass.Float32)
        row_sum = cute.make_rmem_tensor((2,), cutlass.Float32)
        row_max.fill(cutlass.Float32(-math.inf))
        row_sum.fill(0.0)
        # per-row score scale q_scale * softmax_scale * log2e (k_scale joins per block) and the
        # row's query index within its head (causal mask)
        qsc = cute.make_rmem_tensor((2,), cutlass.Float32)
        c = cute.make_rmem_tensor((2,), cutlass.Float32)
        if cutlass.const_expr(self.pack_gqa):
            row_pos = []
            for r in cutlass.range_constexpr(2):
                rr = m0 + row_l[r]
                hh = cutlass.min(rr // pack_sq, pack_r - 1)
                qsc[r] = mQS[(bh * pack_r + hh, 0)] * softmax_scale_log2
                row_pos.append(rr - hh * pack_sq)
            causal_off = seqlen_k - pack_sq
        elif cutlass.const_expr(self.quantize_q):
            qs = self._quantize_q_rows(q_in, mQS, bh, m0, wg, seqlen_q) * softmax_scale_log2
            qsc[0] = qs
            qsc[1] = qs
            row_pos = [m0 + row_l[0], m0 + row_l[1]]
            causal_off = seqlen_k - seqlen_q
        else:
            # q scales per TILE_M rows: a warpgroup's 64 rows never straddle two
            q_blk = (m0 + 64 * wg) // TILE_M
            if cutlass.const_expr(self.varlen):  # rows past the last sequence: any scale, in bounds
                q_blk = cutlass.min(q_row0 // TILE_M + q_blk, cute.size(mQS, mode=[1]) - 1)
            qs = mQS[(bh, q_blk)] * softmax_scale_log2
            qsc[0] = qs
            qsc[1] = qs
            row_pos = [m0 + row_l[0], m0 + row_l[1]]
            causal_off = seqlen_k - seqlen_q

        if cutlass.const_expr(not self.quantize_q):
            pipe_q.consumer_wait(q_state)
        self._store_v_scales(sVS, vs_vals, vs_t, wg)
        mask_args = (col_l, row_pos, seqlen_k, causal_off)
        alpha = cute.make_rmem_tensor((2,), cutlass.Float32)
        plain_serial = self.pv_chunks > 1 or (self.num_mma_wg == 3 and self.head_dim > 64)
        if cutlass.const_expr(not self.overlap and plain_serial):
            # D = 256 (O is 128 registers) or 3 warpgroups at D = 128 (160 registers: the S-ahead
            # loop spills): S, softmax, P.V one after the other
            for n in cutlass.range(n_lo, n_max, unroll=1):
                self._s_block(qk, c, qsc, mKS[(bh_kv, kb0 + n)], pipe_k, k_state)
                if n >= n_full:
                    self._mask(acc_s, n, mask_args)
                self._softmax(acc_s, c, row_max, row_sum, alpha)
                if cutlass.const_expr(self.rescale_early):
                    for ch in cutlass.range_constexpr(self.pv_chunks):
                        self._rescale(acc_o, alpha, ch)
                self._p_to_frag_a(acc_s, p_words, src_a, src_b, sender_odd, sel0, sel1)
                pipe_v.consumer_wait(v_state)
                for ch in cutlass.range_constexpr(self.pv_chunks):
                    if cutlass.const_expr(not self.rescale_early):
                        self._rescale(acc_o, alpha, ch)
                    self._issue_pv(pv, ch, v_state.index)
                    if cutlass.const_expr(self.two_level):  # one block accumulator: a chunk at a time
                        warpgroup.wait_group(0)
                        self._accumulate(acc_o, blk, alpha, ch)
                if cutlass.const_expr(not self.two_level):
                    warpgroup.wait_group(0)
                    for ch in cutlass.range_constexpr(self.pv_chunks):
                        self._accumulate(acc_o, blk, alpha, ch)
                pipe_v.consumer_release(v_state)
                k_state.advance()
                v_state.advance()
        elif cutlass.const_expr(not self.overlap):
            # S of block n+1 goes out right behind block n's P.V, so the two-level accumulation
            # of block n runs while it is in flight (acc_s is free once P is in its FP8
            # fragment; the registers are those of the P.V step of the plain serial loop)
            if n_max > n_lo:
                self._s_block(qk, c, qsc, mKS[(bh_kv, kb0 + n_lo)], pipe_k, k_state)
            for n in cutlass.range(n_lo, n_max, unroll=1):
                if n >= n_full:
                    self._mask(acc_s, n, mask_args)
                self._softmax(acc_s, c, row_max, row_sum, alpha)
                self._p_to_frag_a(acc_s, p_words, src_a, src_b, sender_odd, sel0, sel1)
                k_next = k_state.clone()
                k_next.advance()
                pipe_v.consumer_wait(v_state)
                self._rescale(acc_o, alpha, 0)
                self._issue_pv(pv, 0, v_state.index)
                if n + 1 < n_max:
                    self._block_scale(c, qsc, mKS[(bh_kv, kb0 + n + 1)])
                    pipe_k.consumer_wait(k_next)
                    self._issue_qk(qk, k_next.index)
                    warpgroup.wait_group(1)
                else:
                    warpgroup.wait_group(0)
                self._accumulate(acc_o, blk, alpha, 0)
                pipe_v.consumer_release(v_state)
                # unconditional: ptxas serializes every wgmma if any path could read acc_s with
                # its S still in flight
                warpgroup.wait_group(0)
                _fence_operand(acc_s)
                if n + 1 < n_max:
                    pipe_k.consumer_release(k_next)
                k_state.advance()
                v_state.advance()
        else:
            # intra-warpgroup overlap: the S wgmma of block n and the P.V wgmma of block n-1 run
            # while this warpgroup does block n's softmax
            alpha_prev = cute.make_rmem_tensor((2,), cutlass.Float32)
            if n_max > n_lo:
                self._s_block(qk, c, qsc, mKS[(bh_kv, kb0 + n_lo)], pipe_k, k_state)
                if n_full <= n_lo:
                    self._mask(acc_s, n_lo, mask_args)
                self._softmax(acc_s, c, row_max, row_sum, alpha_prev)
                self._p_to_frag_a(acc_s, p_words, src_a, src_b, sender_odd, sel0, sel1)
                k_state.advance()
                for n in cutlass.range(n_lo + 1, n_max, unroll=1):
                    self._block_scale(c, qsc, mKS[(bh_kv, kb0 + n)])
                    pipe_k.consumer_wait(k_state)
                    pipe_v.consumer_wait(v_state)
                    self._sched_sync(wg)
                    self._issue_qk(qk, k_state.index)
                    self._rescale(acc_o, alpha_prev, 0)
                    self._issue_pv(pv, 0, v_state.index)
                    self._sched_arrive(wg)
                    warpgroup.wait_group(1)
                    _fence_operand(acc_s)
                    pipe_k.consumer_release(k_state)
                    if n >= n_full:
                        self._mask(acc_s, n, mask_args)
                    self._softmax(acc_s, c, row_max, row_sum, alpha)
                    self._wait_pv_after(row_sum)
                    pipe_v.consumer_release(v_state)
                    self._accumulate(acc_o, blk, alpha_prev, 0)
                    alpha_prev[0] = alpha[0]
                    alpha_prev[1] = alpha[1]
                    self._p_to_frag_a(acc_s, p_words, src_a, src_b, sender_odd, sel0, sel1)
                    k_state.advance()
                    v_state.advance()
                self._release_q(pipe_q, q_state)  # every S of the tile is done: Q may be reloaded
                pipe_v.consumer_wait(v_state)
                self._rescale(acc_o, alpha_prev, 0)
                self._issue_pv(pv, 0, v_state.index)
                warpgroup.wait_group(0)
                pipe_v.consumer_release(v_state)
                self._accumulate(acc_o, blk, alpha_prev, 0)
                v_state.advance()
            else:
                self._release_q(pipe_q, q_state)
        if cutlass.const_expr(not self.overlap):
            self._release_q(pipe_q, q_state)
        q_state.advance()

        # ---- epilogue: O = O_acc * v_scale / rowsum, LSE
        if cutlass.const_expr(self.varlen):
            # the sequence's fields read again: held through the KV loop they spill at D = 256
            _, _, seq = self._varlen_fields(cute.arch.block_idx()[2], bh_kv, dims)
            seqlen_q, o_row0 = seq[0], seq[4]
        inv = cute.make_rmem_tensor((2,), cutlass.Float32)
        for r in cutlass.range_constexpr(2):
            s = row_sum[r]
            s = s + cute.arch.shuffle_sync_bfly(s, offset=1)
            s = s + cute.arch.shuffle_sync_bfly(s, offset=2)
            empty = s == cutlass.Float32(0.0)
            s_safe = cutlass.select_(empty, cutlass.Float32(1.0), s)
            inv[r] = cutlass.select_(empty, cutlass.Float32(0.0), cutlass.Float32(1.0) / s_safe)
            row = m0 + row_l[r]
            lse = (row_max[r] + cute.math.log2(s_safe, fastmath=False)
                   - cutlass.Float32(self.log2_pscale)) * cutlass.Float32(_LN2)
            lse = cutlass.select_(empty, cutlass.Float32(-math.inf), lse)
            if quad == 0:
                if row < seqlen_q:
                    mLSE[(o_row0 + row, bh_out)] = lse
        # every V scale this lane needs (its columns 8j + {0,1}) is read from the warpgroup's shared
        # copy before the first store (loads after stores to a maybe-aliasing pointer would each
        # wait out the store: 16% of the kernel's warp time when they were global loads)
        v_scales = cute.make_rmem_tensor((self.pv_chunks * n_blk // 2,), cutlass.Float32)
        cute.arch.barrier(barrier_id=_VSCALE_BAR + wg, number_of_threads=self.threads_per_wg)
        for ch in cutlass.range_constexpr(self.pv_chunks):
            for j in cutlass.range_constexpr(n_blk // 4):
                col = ch * self.pv_n + ocol_l + 8 * j
                pair = cute.make_rmem_tensor((2,), cutlass.Float32)
                cute.autovec_copy(cute.local_tile(sVS, (2,), (col // 2,)), pair)
                for e in cutlass.range_constexpr(2):
                    v_scales[ch * n_blk // 2 + 2 * j + e] = pair[e]
        # O in place: each value times its channel's V scale over its row's sum
        for ch in cutlass.range_constexpr(self.pv_chunks):
            for j in cutlass.range_constexpr(n_blk // 4):
                for r in cutlass.range_constexpr(2):
                    for e in cutlass.range_constexpr(2):
                        v = e + 2 * r + 4 * j
                        acc_o[ch][v] = acc_o[ch][v] * (v_scales[ch * n_blk // 2 + 2 * j + e] * inv[r])
        o_head = mO[(None, None, bh_out)]
        if cutlass.const_expr(self.varlen):
            # a run-time row stride (H * D): one row view per row, each store a constant offset
            for r in cutlass.range_constexpr(2):
                row = m0 + row_l[r]
                o_row = o_head[(o_row0 + row, None)]
                if row < seqlen_q:
                    for ch in cutlass.range_constexpr(self.pv_chunks):
                        for j in cutlass.range_constexpr(n_blk // 4):
                            col = ch * self.pv_n + ocol_l + 8 * j
                            o_pair = cute.make_rmem_tensor((2,), self.out_dtype)
                            for e in cutlass.range_constexpr(2):
                                o_pair[e] = acc_o[ch][e + 2 * r + 4 * j].to(self.out_dtype)
                            cute.autovec_copy(o_pair, cute.local_tile(o_row, (2,), (col // 2,)))
            return q_state, k_state, v_state
        if cutlass.const_expr(self.tma_store_o):
            # every warpgroup's rows staged and stored by TMA (rows past the tensor's end are
            # clipped by the TMA unit)
            epi.store([cute.local_tile(o_head, (self.tile_m, self.head_dim), (m_block, 0))], 0)
            return q_state, k_state, v_state
        for ch in cutlass.range_constexpr(self.pv_chunks):
            for j in cutlass.range_constexpr(n_blk // 4):
                col = ch * self.pv_n + ocol_l + 8 * j
                for r in cutlass.range_constexpr(2):
                    pair = cute.make_rmem_tensor((1, 2), self.out_dtype)
                    for e in cutlass.range_constexpr(2):
                        pair[e] = acc_o[ch][e + 2 * r + 4 * j].to(self.out_dtype)
                    row = m0 + row_l[r]
                    if row < seqlen_q:
                        cute.autovec_copy(pair, cute.local_tile(o_head, (1, 2), (row, col // 2)))
        return q_state, k_state, v_state

    @cute.jit
    def _load_v_scales(self, mVS, vs_row, t):
        """The V scales of row ``vs_row``, column t + 128 i for thread t (i < ceil(D / 128))."""
        vals = cute.make_rmem_tensor(((self.head_dim + 127) // 128,), cutlass.Float32)
        for i in cutlass.range_constexpr(cute.size(vals)):
            col = t + self.threads_per_wg * i
            if cutlass.const_expr(self.head_dim % self.threads_per_wg == 0):
                vals[i] = mVS[(vs_row, col)]
            else:
                vals[i] = cutlass.Float32(0.0)
                if col < self.head_dim:
                    vals[i] = mVS[(vs_row, col)]
        return vals

    @cute.jit
    def _store_v_scales(self, sVS, vals, t, wg):
        """Thread t's V scales into this warpgroup's shared copy (read after the barrier of the
        epilogue). Persistent: first wait until the whole warpgroup has read the previous tile's."""
        if cutlass.const_expr(self.persistent):
            cute.arch.barrier(barrier_id=_VSCALE_BAR + wg, number_of_threads=self.threads_per_wg)
        for i in cutlass.range_constexpr(cute.size(vals)):
            col = t + self.threads_per_wg * i
            if cutlass.const_expr(self.head_dim % self.threads_per_wg == 0):
                sVS[col] = vals[i]
            else:
                if col < self.head_dim:
                    sVS[col] = vals[i]

    @cute.jit
    def _release_q(self, pipe_q, q_state):
        if cutlass.const_expr(not self.quantize_q):  # else no producer fills sQ
            pipe_q.consumer_release(q_state)

    @cute.jit
    def _quantize_q_rows(self, q_in, mQS, bh, m0, wg, seqlen_q):
        """quantize_q: warpgroup ``wg``'s 64 query rows (from ``r0 = m0 + 64 wg``) of head ``bh`` from
        the float Q into sQ as E4M3, with the scale the Q pre-pass gives their 128-row block (its
        amax over 448, ``scale_and_inverse``; rows past Sq count as zeros, as the recipe's partial
        last block). With two consumer warpgroups the CTA's 128 rows are that block: the two take
        the amax together (8 warps, one barrier) and read only their own rows. With three (192-row
        tiles) the block's other 64 rows may belong to another CTA: each warpgroup reads them for
        the amax only (from L2 mostly: their warpgroup reads them too). Returns the scale (the
        block's first half also writes it to ``mQS``). Threads move 16-byte runs of 8 values; the
        codes are fenced to the async proxy before the warpgroup's wgmma read them."""
        mQ, q_amax, sQ, t = q_in
        paired = cutlass.const_expr(self.num_mma_wg == 2)
        runs = self.head_dim // Q_VEC  # per row
        per_thread = 64 * runs // self.threads_per_wg
        r0 = m0 + 64 * wg
        other = r0 ^ 64  # the block's other half
        q_head = mQ[None, None, bh]
        # the runs read for the amax: the own half (paired), else both (three warpgroups: D <= 128);
        # held at once at D <= 128, else 8 at a time (D = 256: O alone is 128 registers; 16 spilled)
        assert paired or per_thread <= 8
        reads = cutlass.const_expr(per_thread if paired else 2 * per_thread)
        held = cutlass.const_expr(reads if per_thread <= 8 else 8)
        amax = cutlass.Float32(0.0)
        for c in cutlass.range_constexpr(reads // held):
            vals = self._load_q_runs(q_head, r0, other, t, c * held, held, per_thread, seqlen_q)
            for i in cutlass.range_constexpr(held):
                amax = cute.arch.fmax(amax, abs(vals[i].load().to(cutlass.Float32)).reduce(
                    cute.ReductionOp.MAX, cutlass.Float32(0.0), 0))
        if cutlass.const_expr(paired):
            amax = group_max(amax, cute.make_tensor(q_amax.iterator, cute.make_layout(8)),
                             wg * self.threads_per_wg + t, 8, _QUANT_PAIR_BAR)
        else:
            amax = group_max(amax, cute.make_tensor(q_amax.iterator + 4 * wg, cute.make_layout(4)), t, 4,
                             _QUANT_BAR + wg)
        scale, inv = scale_and_inverse(amax)
        # the own half: all in registers, or (D = 256) ``held`` runs at a time, the last chunk read
        # for the amax first (still in registers)
        step = cutlass.const_expr(min(held, per_thread))
        for c in cutlass.range_constexpr(per_thread // step - 1, -1, -1):
            if cutlass.const_expr(c < per_thread // step - 1):
                vals = self._load_q_runs(q_head, r0, other, t, c * step, step, per_thread, seqlen_q)
            for i in cutlass.range_constexpr(step):
                u = t + (c * step + i) * self.threads_per_wg
                codes = cute.make_rmem_tensor((1, Q_VEC), self.ab_dtype)
                codes.store((vals[i].load().to(cutlass.Float32) * inv).to(self.ab_dtype))
                cute.autovec_copy(codes, cute.local_tile(sQ, (1, Q_VEC), (64 * wg + u // runs, u % runs)))
        cute.arch.fence_proxy("async.shared", space="cta")
        if cutlass.const_expr(paired):  # also: both have read q_amax before either writes it again
            cute.arch.barrier(barrier_id=_QUANT_PAIR_BAR, number_of_threads=2 * self.threads_per_wg)
        else:
            cute.arch.barrier(barrier_id=_QUANT_BAR + wg, number_of_threads=self.threads_per_wg)
        if t == 0 and r0 % TILE_M == 0 and r0 < seqlen_q:
            mQS[(bh, r0 // TILE_M)] = scale
        return scale

    @cute.jit
    def _load_q_runs(self, q_head, r0, other, t, first: cutlass.Constexpr, count: cutlass.Constexpr,
                     per_thread: cutlass.Constexpr, seqlen_q):
        """Runs ``first .. first + count`` of the thread's ``2 per_thread`` (the own half's, then the
        other half's), zeros past Sq."""
        runs = self.head_dim // Q_VEC
        vals = [cute.make_rmem_tensor((1, Q_VEC), q_head.element_type) for _ in range(count)]
        for i in cutlass.range_constexpr(count):
            j = first + i
            u = t + (j % per_thread) * self.threads_per_wg
            row = (r0 if j < per_thread else other) + u // runs
            vals[i].fill(0)
            if row < seqlen_q:
                cute.autovec_copy(cute.local_tile(q_head, (1, Q_VEC), (row, u % runs)), vals[i])
        return vals

    @cute.jit
    def _wait_pv_after(self, row_sum):
        """Wait for the P.V wgmma in flight, placed after the softmax that computed ``row_sum``.

        ptxas treats a wgmma's A registers (P) as free once it is issued: left alone it lifts the
        wait to the top of the softmax's basic block and reuses P's registers there, so the
        softmax never overlaps the P.V (measured: the whole intra-warpgroup overlap lost). The
        wait sits in its own basic blocks behind a branch on the row sum (both sides wait);
        ptxas does not move it across them and allocates the softmax around P's registers. The
        wait is warp-collective (``.aligned``), so the branch must never split a warp: its
        condition holds for every row sum (never negative) and for NaN, which one query row's
        NaN (or a tile row past the data) gives (``>= 0`` split such warps: session 58)."""
        if not (row_sum[0] < cutlass.Float32(0.0)):
            warpgroup.wait_group(0)
        else:
            warpgroup.wait_group(0)

    @cute.jit
    def _sched_sync(self, wg):
        """Ping-pong: wait for this warpgroup's turn to issue its wgmma batch."""
        if cutlass.const_expr(self.pingpong):
            cute.arch.barrier(barrier_id=_SCHED_BAR + wg, number_of_threads=2 * self.threads_per_wg)

    @cute.jit
    def _sched_arrive(self, wg):
        """Ping-pong: hand the turn to the other warpgroup."""
        if cutlass.const_expr(self.pingpong):
            cute.arch.barrier_arrive(barrier_id=_SCHED_BAR + 1 - wg, number_of_threads=2 * self.threads_per_wg)

    @cute.jit
    def _s_block(self, qk, c, qsc, k_scale, pipe_k, k_state):
        """S of one KV block, complete: the block's score scale, the K stage, the wgmma and its
        wait; the stage is released (the state is not advanced: the caller does)."""
        self._block_scale(c, qsc, k_scale)
        pipe_k.consumer_wait(k_state)
        self._issue_qk(qk, k_state.index)
        warpgroup.wait_group(0)
        _fence_operand(qk[2])
        pipe_k.consumer_release(k_state)

    @cute.jit
    def _issue_qk(self, qk, stage):
        qk_zero, qk_acc, acc_s, tSrQ, tSrK = qk
        warpgroup.fence()
        for kb in cutlass.range_constexpr(cute.size(tSrQ, mode=[2])):
            cute.gemm(qk_zero if kb == 0 else qk_acc, acc_s, tSrQ[(None, None, kb)],
                      tSrK[(None, None, kb, stage)], acc_s)
        warpgroup.commit_group()

    @cute.jit
    def _issue_pv(self, pv, ch: cutlass.Constexpr, stage):
        pv_first, pv_acc, pv_dst, tOrP_w, tOrV = pv
        warpgroup.fence()
        for kb in cutlass.range_constexpr(cute.size(tOrP_w, mode=[2])):
            cute.gemm(pv_first if kb == 0 else pv_acc, pv_dst[ch], tOrP_w[(None, None, kb)],
                      tOrV[ch][(None, None, kb, stage)], pv_dst[ch])
        warpgroup.commit_group()

    @cute.jit
    def _accumulate(self, acc_o, blk, alpha, ch: cutlass.Constexpr):
        """Chunk ch of O after a P.V: two-level, O = O * alpha[row] + blk (the block accumulator
        the wgmma wrote); in-MMA, nothing (the wgmma accumulated into the rescaled O)."""
        if cutlass.const_expr(self.two_level):
            _fence_operand(blk)
            for j in cutlass.range_constexpr(cute.size(blk) // 4):
                for r in cutlass.range_constexpr(2):
                    for e in cutlass.range_constexpr(2):
                        v = e + 2 * r + 4 * j
                        acc_o[ch][v] = acc_o[ch][v] * alpha[r] + blk[v]
        else:
            _fence_operand(acc_o[ch])

    @cute.jit
    def _rescale(self, acc_o, alpha, ch: cutlass.Constexpr):
        """In-MMA: O *= alpha[row] before the P.V wgmma accumulates the block into it."""
        if cutlass.const_expr(self.skip_unit_rescale):
            # once the row maxima settle most blocks leave every alpha of a warp at exactly 1
            if cute.arch.vote_any_sync((alpha[0] != cutlass.Float32(1.0)) | (alpha[1] != cutlass.Float32(1.0))):
                self._scale_rows(acc_o[ch], alpha)
        elif cutlass.const_expr(not self.two_level):
            self._scale_rows(acc_o[ch], alpha)

    @cute.jit
    def _scale_rows(self, acc, alpha):
        for j in cutlass.range_constexpr(cute.size(acc) // 4):
            for r in cutlass.range_constexpr(2):
                for e in cutlass.range_constexpr(2):
                    v = e + 2 * r + 4 * j
                    acc[v] = acc[v] * alpha[r]

    @cute.jit
    def _block_scale(self, c, qsc, k_scale):
        """c[r] = q_scale[row r] * k_scale * softmax_scale * log2e, floored at _C_MIN (> 0)."""
        for r in cutlass.range_constexpr(2):
            c[r] = cutlass.max(qsc[r] * k_scale, cutlass.Float32(_C_MIN))

    @cute.jit
    def _mask(self, acc_s, n, mask_args):
        """-inf where key >= Sk or (causal) key > row + Sk - Sq."""
        col_l, row_pos, seqlen_k, causal_off = mask_args
        col0 = n * self.tile_n + col_l
        for r in cutlass.range_constexpr(2):
            limit = seqlen_k
            if cutlass.const_expr(self.causal):
                limit = cutlass.min(seqlen_k, row_pos[r] + causal_off + 1)
            for j in cutlass.range_constexpr(cute.size(acc_s) // 4):
                for e in cutlass.range_constexpr(2):
                    v = e + 2 * r + 4 * j
                    acc_s[v] = cutlass.select_(
                        col0 + 8 * j + e >= limit, cutlass.Float32(-math.inf), acc_s[v])

    @cute.jit
    def _softmax(self, acc_s, c, row_max, row_sum, alpha):
        """Online softmax step in the log2 domain: acc_s (raw scores) becomes 448 * p with
        p = exp2(acc_s * c - m_new) (one FFMA and one MUFU.EX2 per score); alpha = exp2(m_old -
        m_new); row_sum (this lane's partial) = row_sum * alpha + sum(448 p)."""
        n_groups = cute.size(acc_s) // 4
        neg = cute.make_rmem_tensor((2,), cutlass.Float32)
        # reductions over a row's 2 * n_groups values in _NACC independent chains (latency: the
        # row max gates every exponential); the max is exact in any order, the sum's order only
        # changes FP32 rounding
        idx = [[e + 2 * r + 4 * j for j in range(n_groups) for e in range(2)] for r in range(2)]
        for r in cutlass.range_constexpr(2):
            part = [acc_s[v] for v in idx[r][:_NACC]]
            for i in cutlass.range_constexpr(_NACC, len(idx[r])):
                part[i % _NACC] = cute.arch.fmax(part[i % _NACC], acc_s[idx[r][i]])
            mx = cute.arch.fmax(cute.arch.fmax(part[0], part[1]), cute.arch.fmax(part[2], part[3]))
            mx = cute.arch.fmax(mx, cute.arch.shuffle_sync_bfly(mx, offset=1))
            mx = cute.arch.fmax(mx, cute.arch.shuffle_sync_bfly(mx, offset=2))
            m_new = cute.arch.fmax(row_max[r], mx * c[r])
            if cutlass.const_expr(self.lazy_rescale):
                m_new = cutlass.select_(m_new > row_max[r] + cutlass.Float32(RESCALE_SLACK), m_new, row_max[r])
            m_safe = cutlass.select_(m_new == cutlass.Float32(-math.inf), cutlass.Float32(0.0), m_new)
            alpha[r] = _ex2(row_max[r] - m_safe)
            neg[r] = cutlass.Float32(self.log2_pscale) - m_safe
            row_max[r] = m_new
        for r in cutlass.range_constexpr(2):
            part = [None] * _NACC
            for i in cutlass.range_constexpr(len(idx[r])):
                v = idx[r][i]
                p = _ex2(acc_s[v] * c[r] + neg[r])
                acc_s[v] = p
                part[i % _NACC] = p if i < _NACC else part[i % _NACC] + p
            s = (part[0] + part[1]) + (part[2] + part[3])
            row_sum[r] = row_sum[r] * alpha[r] + s

    @cute.jit
    def _p_to_frag_a(self, acc_s, p_words, src_a, src_b, sender_odd, sel0, sel1):
        """P (FP32, wgmma accumulator layout: this lane holds keys 8j + 2q + {0,1} of rows g, g+8)
        to E4M3 words of the FP8 A fragment (this lane needs keys 16h + 4q + {0..3}).

        Per 32 keys (k-step kb) and row r: the lane packs W_lo = keys of groups 4kb, 4kb+2 and
        W_hi = groups 4kb+1, 4kb+3 (one byte pair each); lane q of the quad needs W_{q>>1} of
        lanes 2(q&1) (bytes 0-1) and 2(q&1)+1 (bytes 2-3). Two shuffles serve all four lanes when
        odd senders send W_hi first (W_lo second); two byte permutes assemble h = 0 and h = 1.
        A-fragment word index = r + 2 h + 4 kb (value order (4 bytes, 2 rows, 2 halves), k-steps).
        """
        if cutlass.const_expr(self.v_perm):
            # Vᵀ's keys permuted within each 16 (0,1,8,9,2,3,10,11,...): the A fragment's bytes
            # 4q..4q+3 of half h are this lane's own pairs of groups 4kb+2h and 4kb+2h+1
            for kb in cutlass.range_constexpr(cute.size(acc_s) // 16):
                for r in cutlass.range_constexpr(2):
                    for h in cutlass.range_constexpr(2):
                        j0 = 4 * kb + 2 * h
                        p_words[r + 2 * h + 4 * kb] = _cvt_e4m3x4(
                            acc_s[2 * r + 4 * j0], acc_s[1 + 2 * r + 4 * j0],
                            acc_s[2 * r + 4 * (j0 + 1)], acc_s[1 + 2 * r + 4 * (j0 + 1)])
            return
        for kb in cutlass.range_constexpr(cute.size(acc_s) // 16):
            for r in cutlass.range_constexpr(2):
                g = [4 * kb + i for i in range(4)]
                v = [[2 * r + 4 * gi, 1 + 2 * r + 4 * gi] for gi in g]
                w_lo = _cvt_e4m3x4(acc_s[v[0][0]], acc_s[v[0][1]], acc_s[v[2][0]], acc_s[v[2][1]])
                w_hi = _cvt_e4m3x4(acc_s[v[1][0]], acc_s[v[1][1]], acc_s[v[3][0]], acc_s[v[3][1]])
                send_a = cutlass.select_(sender_odd, w_hi, w_lo)
                send_b = cutlass.select_(sender_odd, w_lo, w_hi)
                got_a = cute.arch.shuffle_sync(send_a, src_a)
                got_b = cute.arch.shuffle_sync(send_b, src_b)
                p_words[r + 4 * kb] = cutlass.Int32(cute.arch.prmt(got_a, got_b, sel0))
                p_words[r + 2 + 4 * kb] = cutlass.Int32(cute.arch.prmt(got_a, got_b, sel1))
