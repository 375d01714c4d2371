"""What the sm_90a FP8 attention forward kernel supports, stated once (no cutlass import: the host
wiring and the tests read this without compiling anything)."""

from __future__ import annotations

from dataclasses import dataclass

from ...runtime.arch import GRID_YZ_MAX, INT32_OFFSET_MAX

HEAD_DIMS = (64, 128, 256)  # head dims with a shipped kernel (all pass the GPU tests, H100)
TILE_M = 128  # query rows per q_scale (and per CTA of two consumer warpgroups; three take 192)
TILE_N = 128  # keys per KV block; one k_scale per block; the online softmax steps by this
P_SCALE = 448.0  # static scale of P (row max -> 448) before it is cast to E4M3
# lazy rescaling: a row's running max (and O's scale) moves only when a block's max passes it by
# more than this many powers of two; P is scaled by P_SCALE / 2**RESCALE_SLACK so it stays <= 448
RESCALE_SLACK = 2
OUT_DTYPES = ("bfloat16", "float16")
V_PAD = 16  # v_t's key dimension is padded to a multiple of this (16-byte TMA strides)
# optional v_t layout: stored key position p of each aligned 16 holds key V_KEY_PERM[p]
V_KEY_PERM = (0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15)
# intra-warpgroup overlap keeps S, the block accumulator, O and the in-flight P live at once: that
# fits the 240 registers of a consumer thread at D = 64 only (D = 128 spills; NOTES.md); without
# the block accumulator (P.V accumulated in the wgmma) at D <= 128
OVERLAP_MAX_D = 64
OVERLAP_MAX_D_IN_MMA = 128


@dataclass(frozen=True)
class AttnConfig:
    """One compiled kernel (everything that changes the generated code)."""

    head_dim: int = 128
    causal: bool = False
    out_dtype: str = "bfloat16"
    overlap: bool = True  # intra-warpgroup overlap of softmax with the next S / the last P.V (D <= OVERLAP_MAX_D)
    # the measured effect of each flag is in NOTES.md (H100, B4 H32 S4096)
    pingpong: bool = False  # consumer warpgroups issue their wgmma in turns (needs overlap); no gain
    pack_gqa: bool = False  # rows = (query head in its KV group, query) for Sq <= 128; decode 3.4x
    split_kv: bool = False  # KV blocks split over grid z; FP32 partials combined on the host; untimed
    persistent: bool = False  # grid = min(tiles, num_sms), a tile per round in zigzag order (NOTES)
    num_sms: int = 132  # persistent grid size (H100 SXM)
    v_keys_permuted: bool = False  # v_t keys permuted within each 16 (V_KEY_PERM): no P shuffles; +1-4%
    two_level_pv: bool = True  # P.V into a fresh block accumulator added into O (else into O in the wgmma)
    # consumer warpgroups of 64 query rows: 3 (a 192-row tile) hides more latency with 160 registers
    # per thread, which only fits in-MMA accumulation and the plain serial loop at D <= 128 (D = 256: 2)
    consumer_wgs: int = 3
    skip_unit_rescale: bool = True  # in-MMA: a warp skips O *= alpha when every alpha of its rows is 1
    # in-MMA: the running max moves only past RESCALE_SLACK, so most blocks skip O *= alpha (+2-3%
    # at d128); two-level kernels add O * alpha in one FFMA anyway
    lazy_rescale: bool = True
    # packed variable-length sequences (``lowprec.attention.packed``): a sequence plan drives the grid
    varlen: bool = False
    # Q given in the output dtype, quantized by each consumer warpgroup (its 64 rows, with the
    # scale of their 128-row block): no Q pre-pass; dense grids only (no pack-GQA, split-KV, varlen)
    quantize_q: bool = False
    # an FP8 KV cache's live lengths on the device: each batch row's Sk from field 5 of the plan
    # argument (varlen's Sk field), at most the K buffer's extent (CUDA graphs across decode steps)
    kv_lengths: bool = False

    def __post_init__(self):
        if self.quantize_q and (self.pack_gqa or self.split_kv or self.varlen):
            raise ValueError("quantize_q: dense grids only (no pack_gqa, split_kv or varlen)")
        if self.kv_lengths and (self.varlen or self.quantize_q or self.persistent):
            raise ValueError("kv_lengths: dense grids with a Q pre-pass only (no varlen, quantize_q or persistent)")
        # one key per generated kernel: overlap (and ping-pong, which needs it) only where it fits
        overlap = self.overlap and self.head_dim <= (OVERLAP_MAX_D if self.two_level_pv else OVERLAP_MAX_D_IN_MMA)
        # one warpgroup (a 64-row tile): decode, where the rows fit it (not with Q quantized inside,
        # whose 128-row scale blocks span two warpgroups)
        wgs = 1 if self.consumer_wgs == 1 and not self.quantize_q else (
            3 if self.consumer_wgs == 3 and self.head_dim <= 128 else 2)
        if wgs == 3:
            object.__setattr__(self, "two_level_pv", False)
            overlap = overlap and self.head_dim <= 64  # at D = 128 three overlapped warpgroups spill
        object.__setattr__(self, "consumer_wgs", wgs)
        if self.varlen:  # one tile per (sequence, query block, head): no packing, splits or persistence
            for flag in ("pack_gqa", "split_kv", "persistent"):
                object.__setattr__(self, flag, False)
        object.__setattr__(self, "skip_unit_rescale", self.skip_unit_rescale and not self.two_level_pv)
        object.__setattr__(self, "lazy_rescale", self.lazy_rescale and not self.two_level_pv)
        object.__setattr__(self, "overlap", overlap)
        object.__setattr__(self, "pingpong", self.pingpong and overlap and wgs == 2)  # its barriers pair two

    @property
    def tile_m(self) -> int:
        """Query rows per CTA (64 per consumer warpgroup); q scales stay per TILE_M rows."""
        return 64 * self.consumer_wgs

    def stages(self) -> int:
        """K/V shared-memory ring depth (each stage holds one K tile and one Vᵀ tile)."""
        return {64: 4, 128: 3, 256: 2}[self.head_dim]

    def __str__(self) -> str:
        tags = [("serial", not self.overlap), ("pp", self.pingpong), ("pack", self.pack_gqa),
                ("split", self.split_kv), ("persist", self.persistent), ("vperm", self.v_keys_permuted),
                ("inmma", not self.two_level_pv), ("wg3", self.consumer_wgs == 3), ("wg1", self.consumer_wgs == 1),
                ("skip1", self.skip_unit_rescale), ("lazy", self.lazy_rescale), ("varlen", self.varlen),
                ("qk", self.quantize_q), ("kvlen", self.kv_lengths)]
        return f"d{self.head_dim}{'_causal' if self.causal else ''}_{self.out_dtype}" + "".join(
            f"_{t}" for t, on in tags if on)


# packed GQA rows of a KV head up to this many (decode): the interface launches two warpgroups, a
# 128-row tile, since a 192-row tile would leave a warpgroup without rows (NOTES, session 40) ...
PACKED_TWO_WGS_MAX_ROWS = 128
# ... and up to this many one warpgroup, a 64-row tile: half the softmax per KV block again
# (B64 H32/8 decode -25%, B1-B8 -11..-18%; NOTES, session 41)
PACKED_ONE_WG_MAX_ROWS = 64


def packed_wgs(group: int, sq: int) -> int | None:
    """Consumer warpgroups the interface launches for packed GQA (``group`` query heads of ``sq``
    queries per KV head): 1 up to :data:`PACKED_ONE_WG_MAX_ROWS` packed rows, 2 up to
    :data:`PACKED_TWO_WGS_MAX_ROWS`; None past them (the shipped default)."""
    if not packed_two_wgs(group, sq):
        return None
    return 1 if group * sq <= PACKED_ONE_WG_MAX_ROWS else 2


# unpacked decode (MHA, or GQA with packing off): up to this many queries per head run one
# warpgroup, their 64-row tile otherwise a third of a 192-row one (half of a 128-row one at D = 256);
# P.V accumulated as the head dim's dense kernel does (in the wgmma at D <= 128, two-level at 256),
# so the same lazy-rescaling slack
UNPACKED_ONE_WG_MAX_SQ = 16


def unpacked_one_wg(head_dim: int, sq: int) -> bool:
    """Whether the interface launches one consumer warpgroup for an unpacked grid of ``sq`` queries
    per head whose Q it does not quantize itself."""
    return sq <= UNPACKED_ONE_WG_MAX_SQ


def packed_two_wgs(group: int, sq: int) -> bool:
    """Whether a call whose KV heads each serve ``group`` query heads of ``sq`` queries packs them
    into at most :data:`PACKED_TWO_WGS_MAX_ROWS` rows (the interface's default launch)."""
    return group > 1 and sq <= TILE_M and group * sq <= PACKED_TWO_WGS_MAX_ROWS


def rescale_slack(head_dim: int, group: int = 1, sq: int | None = None) -> int:
    """The shipped kernel's lazy-rescaling slack (its P scale is 448 / 2**slack): RESCALE_SLACK
    where it accumulates P.V in the wgmma (D <= 128, three warpgroups), 0 for the two-level kernels
    (D = 256; packed GQA decode, :func:`packed_two_wgs` of ``group`` query heads per KV head and
    ``sq`` queries, which runs one or two warpgroups)."""
    if sq is not None and packed_two_wgs(group, sq):
        return 0
    return RESCALE_SLACK if AttnConfig(head_dim).lazy_rescale else 0


# head dims whose dense grids walk persistently by default (interface.PERSISTENT): the fused
# call measured -0.9% to -1.9% there (the kernel to -6%), +0.5-1.6% at d256 (NOTES, session 38)
PERSISTENT_HEAD_DIMS = (128,)


def shipped_configs() -> tuple[AttnConfig, ...]:
    return tuple(AttnConfig(d, c, o) for d in HEAD_DIMS for c in (False, True) for o in OUT_DTYPES)


def kv_lengths_configs() -> tuple[AttnConfig, ...]:
    """What ``FP8KVCache.decode_step`` launches (device-side lengths; one query per row, so not
    causal; Vᵀ as the cache stores it, keys permuted): packed GQA rows on one or two warpgroups and unpacked rows
    on one, each with and without split keys."""
    out = []
    for d in HEAD_DIMS:
        for o in OUT_DTYPES:
            for split in (False, True):
                for wgs in (1, 2):
                    out.append(AttnConfig(d, False, o, pack_gqa=True, split_kv=split, consumer_wgs=wgs,
                                          v_keys_permuted=True, kv_lengths=True))
                out.append(AttnConfig(d, False, o, split_kv=split, consumer_wgs=1, v_keys_permuted=True,
                                      two_level_pv=AttnConfig(d).two_level_pv, kv_lengths=True))
    return tuple(out)


def variant_configs() -> tuple[AttnConfig, ...]:
    """Configs behind interface flags and arguments (v_t keys permuted: the fused call's;
    PACK_GQA, SPLIT_KV, PERSISTENT, SKIP_UNIT_RESCALE; the two-warpgroup kernels with PINGPONG,
    TWO_LEVEL_PV, the serial loop): compiled and SASS-checked like the shipped ones."""
    out = []
    for d in HEAD_DIMS:
        for c in (False, True):
            out.append(AttnConfig(d, c, v_keys_permuted=True))
            for o in OUT_DTYPES:
                out.append(AttnConfig(d, c, o, v_keys_permuted=True, quantize_q=True))
            out.append(AttnConfig(d, c, v_keys_permuted=True, varlen=True))
            out.append(AttnConfig(d, c, split_kv=True))
            out.append(AttnConfig(d, c, pack_gqa=True))
            out.append(AttnConfig(d, c, pack_gqa=True, split_kv=True))
            out.append(AttnConfig(d, c, persistent=True))
            if d in PERSISTENT_HEAD_DIMS:  # what the interface launches there by default
                for o in OUT_DTYPES:
                    out.append(AttnConfig(d, c, o, persistent=True))
                    out.append(AttnConfig(d, c, o, v_keys_permuted=True, persistent=True))
                    out.append(AttnConfig(d, c, o, v_keys_permuted=True, quantize_q=True, persistent=True))
            out.append(AttnConfig(d, c, two_level_pv=False))
            if d <= 128:
                out.append(AttnConfig(d, c, skip_unit_rescale=False))
                out.append(AttnConfig(d, c, v_keys_permuted=True, lazy_rescale=False))
                out.append(AttnConfig(d, c, consumer_wgs=2))
                out.append(AttnConfig(d, c, consumer_wgs=2, two_level_pv=False))
                out.append(AttnConfig(d, c, consumer_wgs=2, pack_gqa=True))
                # what the interface launches for packed GQA rows up to 64 / 128 (decode), and for
                # unpacked decode
                for o in OUT_DTYPES:
                    for split in (False, True):
                        for vperm in (False, True):
                            for wgs in (1, 2):
                                out.append(AttnConfig(d, c, o, pack_gqa=True, split_kv=split, v_keys_permuted=vperm,
                                                      consumer_wgs=wgs))
                            out.append(AttnConfig(d, c, o, split_kv=split, v_keys_permuted=vperm, consumer_wgs=1,
                                                  two_level_pv=False))
            else:  # D = 256: unpacked decode on one warpgroup, two-level as its dense kernel
                for o in OUT_DTYPES:
                    for split in (False, True):
                        for vperm in (False, True):
                            out.append(AttnConfig(d, c, o, split_kv=split, v_keys_permuted=vperm, consumer_wgs=1))
            if d <= OVERLAP_MAX_D:
                out.append(AttnConfig(d, c, consumer_wgs=2, pingpong=True))
                out.append(AttnConfig(d, c, consumer_wgs=2, pingpong=True, persistent=True))
                out.append(AttnConfig(d, c, consumer_wgs=2, overlap=False))
    return tuple(dict.fromkeys(out))


def head_stride(t) -> int | None:
    """The stride between consecutive (batch, head) pairs of a ``[B, H, ...]`` tensor, as the
    kernels index them (one mode of ``B * H``); None when it is not one stride."""
    b, h = t.shape[:2]
    if h == 1:
        return t.stride(0) if b > 1 else t.stride(1)
    return t.stride(1) if b == 1 or t.stride(0) == h * t.stride(1) else None


def operands_unsupported(q, q_scale, k, k_scale, v_t, v_scale) -> str | None:
    """What is wrong with the forward's operands (CONTRACT.md), None if nothing: the message
    ``interface.fp8_attention_forward`` raises. ``q_scale=None``: Q is a float tensor the caller
    quantizes (its dtype and scales are not checked here)."""
    import torch

    f8 = torch.float8_e4m3fn
    if q.dim() != 4 or k.dim() != 4 or v_t.dim() != 4:
        return "q, k, v_t must be 4-D"
    if (q_scale is not None and q.dtype != f8) or k.dtype != f8 or v_t.dtype != f8:
        return "q, k, v_t must be float8_e4m3fn"
    b, h, sq, d = q.shape
    bk, hkv, sk, dk = k.shape
    if d not in HEAD_DIMS:
        return f"head dim {d} is not supported (supported: {HEAD_DIMS})"
    if bk != b or dk != d:
        return f"k {tuple(k.shape)} does not match q {tuple(q.shape)}"
    if hkv < 1 or h % hkv:
        return f"H={h} must be a multiple of Hkv={hkv}"
    sk_pad = -(-sk // V_PAD) * V_PAD
    if tuple(v_t.shape) != (b, hkv, d, sk_pad):
        return (f"v_t and k do not match: v_t must be [B, Hkv, D, round_up(Sk, {V_PAD})]={(b, hkv, d, sk_pad)}, "
                f"got {tuple(v_t.shape)}")
    if not q.is_contiguous():
        return "q must be contiguous"
    # K, Vᵀ and K's scales may be length-Sk views of longer buffers (a growing KV cache): rows
    # contiguous, 16-byte aligned, one stride between consecutive (batch, KV head) pairs (no keys:
    # nothing is read, and an empty tensor's strides are arbitrary)
    if sk and (k.stride(3) != 1 or k.stride(2) != d or head_stride(k) is None or head_stride(k) % 16
            or k.data_ptr() % 16):
        return "k must be contiguous, or a view of [B, Hkv, >= Sk, D] rows (16-byte aligned heads)"
    if sk and (v_t.stride(3) != 1 or v_t.stride(2) % 16 or head_stride(v_t) is None or head_stride(v_t) % 16
               or v_t.data_ptr() % 16):
        return "v_t must be contiguous, or a view of [B, Hkv, D, >= round_up(Sk, 16)] rows (16-byte aligned)"
    scales = [("k_scale", k_scale, (b, hkv, -(-sk // TILE_N)), "[B, Hkv, ceil(Sk/128)]"),
              ("v_scale", v_scale, (b, hkv, d), "[B, Hkv, D]")]
    if q_scale is not None:
        scales.insert(0, ("q_scale", q_scale, (b, h, -(-sq // TILE_M)), "[B, H, ceil(Sq/128)]"))
    for name, t, shape, what in scales:
        if tuple(t.shape) != shape:
            return f"{name} must be {what}"
    for name, t, _, _ in scales:
        if t.dtype != torch.float32:
            return f"{name} must be float32"
        views = name == "k_scale" and t.stride(2) == 1 and head_stride(t) is not None
        if not (t.is_contiguous() or views):
            views_note = " or a view of [B, Hkv, >= ceil(Sk/128)]" if name == "k_scale" else ""
            return f"{name} must be contiguous{views_note}"
    if any(t.device != q.device for t in (k, v_t, *(t for _, t, _, _ in scales))):
        return "all tensors must be on q's device"
    return None


KV_APPEND_DTYPES = ("bfloat16", "float16", "float32")
KV_APPEND_MAX_D = 256  # D / 2 threads per row (one per column pair) in a CTA of 256


def kv_append_unsupported(k, v, tail, amax, k_codes, k_scale, v_t, v_inv, counts, plan,
                          start: int | None) -> str | None:
    """Why ``interface.CacheAppend`` (one launch of an FP8 KV cache's append) cannot take these
    inputs (None: it can); the cache then appends in torch ops. The cache's own buffers are
    contiguous by construction."""
    d = k.shape[-1]
    if str(k.dtype).removeprefix("torch.") not in KV_APPEND_DTYPES or v.dtype != k.dtype:
        return f"dtype {k.dtype} (the append kernel reads {', '.join(KV_APPEND_DTYPES)})"
    if d > KV_APPEND_MAX_D or 256 % d:
        return f"head dim {d} (the append kernel takes D dividing {KV_APPEND_MAX_D})"
    if k.shape[0] > GRID_YZ_MAX:  # the append grid is (Hkv, B, 1)
        return f"B={k.shape[0]} batch rows (the append grid's y dimension, at most {GRID_YZ_MAX})"
    return kv_append_tokens_unsupported(k, v, start)


def kv_append_tokens_unsupported(k, v, start: int | None) -> str | None:
    """The part of :func:`kv_append_unsupported` that depends on the new tokens beyond their dtype and
    head dim (the cache's own; checked once per cache): how many, where, and their rows (any view
    with contiguous, 4-byte aligned rows)."""
    if start is None and k.shape[2] != 1:
        return "several tokens at a length known only on the device (the append kernel fills one block)"
    if start is not None and start % 128 + k.shape[2] > 128:
        return "the new tokens cross a 128-token block (the append kernel fills one block)"
    item = k.element_size()
    for t in (k, v):
        # the kernel's operands declare leading strides even in elements (any dtype) and 4-byte rows
        if t.stride(-1) != 1 or any(s % 2 or s * item % 4 for s in t.stride()[:-1]) or t.data_ptr() % 4:
            return "new tokens whose rows are not contiguous, 4-byte aligned and an even number of values apart"
    return None


def attention_unsupported(q, q_scale, k, k_scale, v_t, v_scale, causal: bool, scale: float, out_dtype) -> str | None:
    """Why the kernel cannot take the FP8 forward's operands (None: it can); the registry asks
    this with the arguments of ``interface.attention_fp8_forward_op``."""
    d, dv = q.shape[-1], v_t.shape[-2]
    if d not in HEAD_DIMS or dv != d:
        return f"head dims D={d}, Dv={dv}; the kernel serves D = Dv in {HEAD_DIMS}"
    if str(out_dtype).removeprefix("torch.") not in OUT_DTYPES:
        return f"output dtype {out_dtype} (the kernel writes {' or '.join(OUT_DTYPES)})"
    if q.shape[-2] == 0 or k.shape[-2] == 0:
        return "an empty sequence (nothing to compute)"
    return _forward_grid_unsupported(q.shape[0], q.shape[1]) or _head_rows_unsupported(q.shape[-2], d)


def _head_rows_unsupported(sq: int, d: int) -> str | None:
    """A head's [Sq, D] rows of the static stride D: the forward's direct Q loads (Q quantized in the
    kernel) and O stores (D = 256) compute row·D + col in Int32, which wraps past 2^31."""
    if sq * d > INT32_OFFSET_MAX:
        return f"Sq·D={sq * d} values per head (the forward addresses a head's rows with 32-bit offsets: at most 2^31)"
    return None


def _forward_grid_unsupported(batch: int, heads: int) -> str | None:
    """The forward's grid (m-blocks, heads, batch · splits) (varlen: sequences for batch): gridDim.y
    and gridDim.z are at most GRID_YZ_MAX."""
    if batch > GRID_YZ_MAX or heads > GRID_YZ_MAX:
        return f"B={batch}, H={heads} (the forward's grid takes at most {GRID_YZ_MAX} of each)"
    return None


PREPASS_MAX_D = 256  # K: a block's D columns in at most two 128-column register tiles
PREPASS_MAX_CLUSTER = 8  # CTAs per head of the K / V pre-pass kernels (the portable cluster size)
# CTAs a pre-pass launch aims for (about two per SM: measured on the H200, B16..B1 x H8..H32 x
# S1k..16k): rows of up to 256 bytes (four-block ring) / longer rows (two-block ring)
PREPASS_TARGET_CTAS = (256, 128)
PREPASS_RING_BYTES = 128 * 1024  # a CTA's shared-memory ring of 128-token blocks (measured: 96-192 KB alike)
PREPASS_MAX_RING_STAGES = 4


def prepass_ring_stages(head_dim: int, elem_bytes: int) -> int:
    """Stages of a pre-pass kernel's ring for rows of ``head_dim`` values of ``elem_bytes`` (0: not
    even two blocks fit, no kernel)."""
    stages = min(PREPASS_MAX_RING_STAGES, PREPASS_RING_BYTES // (TILE_N * head_dim * elem_bytes))
    return stages if stages >= 2 else 0


PREPASS_K_FOLD_DIMS = (32, 64)  # the head dims whose folded K pre-pass ran on the GPU (NOTES, session 60)


def prepass_k_fold(head_dim: int) -> int:
    """Tokens per 128-column row of the K pre-pass kernel's view of dense K: ``128 / D`` at
    :data:`PREPASS_K_FOLD_DIMS` (else most of each row's 16 lanes would idle), else 1."""
    return TILE_N // head_dim if head_dim in PREPASS_K_FOLD_DIMS else 1


def prepass_cluster(heads: int, seqlen: int, row_bytes: int) -> int:
    """CTAs per head of the pre-pass kernels over ``heads`` heads of ``seqlen`` tokens of
    ``row_bytes``: a power of two, the smallest that gives the launch PREPASS_TARGET_CTAS, at most
    PREPASS_MAX_CLUSTER and the head's 128-token blocks. Fewer CTAs per head amortize a CTA's fixed
    costs (its ring's first loads, the cluster barrier) over more blocks."""
    target = PREPASS_TARGET_CTAS[row_bytes > 256]
    cluster, blocks = 1, -(-seqlen // TILE_N)
    while cluster < PREPASS_MAX_CLUSTER and 2 * cluster <= blocks and heads * cluster < target:
        cluster *= 2
    return cluster


def _prepass_unsupported(x) -> str | None:
    """The pre-pass kernels read ``x`` [B, H, S, D] as the quantize kernels read rows: the same
    dtypes, 16-column multiples and alignment (``quant.sm90.config.rows_unsupported``)."""
    if x.dim() != 4 or not x.is_contiguous():
        return "a contiguous [B, H, S, D] tensor"
    if not x.numel():
        return "an empty tensor"
    if x.shape[0] * x.shape[1] > GRID_YZ_MAX:  # the dense pre-pass grids are (cluster, B·H, 1)
        return f"B·H={x.shape[0] * x.shape[1]} heads (the pre-pass grid's y dimension, at most {GRID_YZ_MAX})"
    return _prepass_rows_unsupported(x)


def _prepass_rows_unsupported(x) -> str | None:
    """Rows of ``x``'s head dim the pre-pass kernels can stream (any leading dims)."""
    from ...quant.sm90.config import rows_unsupported

    if x.shape[-1] > PREPASS_MAX_D:
        return f"head dim {x.shape[-1]} (at most {PREPASS_MAX_D})"
    # [rows, D] of the static stride D and an Int32 row count (``interface.build_prepass_kernel``)
    if x.numel() > INT32_OFFSET_MAX:
        return f"{x.numel()} values (the pre-pass kernels address their input with 32-bit offsets: at most 2^31)"
    if not prepass_ring_stages(x.shape[-1], x.element_size()):
        return f"{x.dtype} rows of {x.shape[-1]} values (two 128-token blocks must fit the kernels' " \
               f"{PREPASS_RING_BYTES // 1024} KB ring)"
    return rows_unsupported(x.view(-1, x.shape[-1]))


def prepass_k_unsupported(k) -> str | None:
    """Why ``interface.attention_prepass_k_op`` cannot smooth and quantize ``k`` (None: it can)."""
    return _prepass_unsupported(k) or k_blocks_unsupported(k.shape[-2])


def k_blocks_unsupported(sk: int) -> str | None:
    """The K pre-pass's sequence rule (its scales: one per whole 128-token block)."""
    return f"Sk={sk} (the kernel takes whole 128-token blocks)" if sk % TILE_N else None


def q_blocks_unsupported(sq: int, ndim: int = 4) -> str | None:
    """The Q pre-pass's sequence rule (its scales: one per 128-token block, or one shorter block;
    ``ndim``: Q's, [B, H, S, D])."""
    if ndim != 4 or sq == 0 or (sq > TILE_M and sq % TILE_M):
        return f"Sq={sq} (the Q pre-pass takes whole {TILE_M}-token blocks or one shorter block)"
    return None


def prepass_v_unsupported(v) -> str | None:
    """Why ``interface.attention_prepass_v_op`` cannot quantize and transpose ``v`` (None: it can)."""
    return _prepass_unsupported(v)


def _q_prepass_unsupported(q) -> str | None:
    """Why the Q pre-pass kernel of the one-pass host functions cannot quantize ``q``."""
    sq = q.shape[-2]
    if str(q.dtype).removeprefix("torch.") not in OUT_DTYPES:
        return f"q dtype {q.dtype} (the one-pass path takes {' or '.join(OUT_DTYPES)})"
    if (why := q_blocks_unsupported(sq, q.dim())) is not None:
        return why
    if not q.numel():  # B·H = 0: a Q pre-pass grid of no CTA is a launch error (the composed path returns it)
        return "an empty tensor"
    if not q.is_contiguous() or q.data_ptr() % 16:
        return "q must be contiguous and 16-byte aligned"
    return None


KV_LENGTHS_MAX_SQ = 16  # device-side cache lengths: decode grids only (the compiled configurations)


def q_unsupported(q, k, k_scale, v_t, v_scale, causal: bool, scale: float, kv_lengths=None,
                  v_keys_permuted: bool = False) -> str | None:
    """Why ``interface.attention_fp8_q_op`` (float Q quantized per call over an FP8 K / Vᵀ cache, in
    one host pass) cannot take these inputs (None: it can); the caller then composes the steps.
    ``kv_lengths``: the cache's ``[B, 8]`` int32 plan of device-side lengths (decode only); Vᵀ in
    either key layout."""
    if kv_lengths is not None and q.shape[2] > KV_LENGTHS_MAX_SQ:
        return f"device-side cache lengths serve decode (Sq <= {KV_LENGTHS_MAX_SQ}), got Sq={q.shape[2]}"
    if kv_lengths is not None and causal:
        return "device-side cache lengths with causal queries (their decode grids are not causal)"
    return (_q_prepass_unsupported(q) or attention_unsupported(q, None, k, None, v_t, None, causal, scale, q.dtype)
            or operands_unsupported(q, None, k, k_scale, v_t, v_scale))


def cache_attention_unsupported(q, k, k_scale, v_t, v_scale, scale: float, plan,
                                v_keys_permuted: bool = False) -> str | None:
    """Why ``interface.cache_attention_op`` (FP8 attention over a KV cache's whole buffers at its
    device-side lengths, ``plan`` field 5) cannot serve queries shaped as ``q`` (None: it can)."""
    return q_unsupported(q, k, k_scale, v_t, v_scale, False, scale, plan)


def qkv_unsupported(q, k, v, causal: bool, scale: float) -> str | None:
    """Why ``interface.attention_fp8_qkv_op`` (the pre-pass and forward of float Q, K, V in one
    host pass) cannot take these inputs (None: it can); the caller then composes the steps, each
    on its kernel or reference."""
    return (_float_qkv_unsupported(q, k, v) or _q_prepass_unsupported(q) or prepass_k_unsupported(k)
            or prepass_v_unsupported(v) or _head_rows_unsupported(q.shape[-2], q.shape[-1]))


def varlen_unsupported(q, k, v, cu_q, cu_k, max_q: int, max_k: int, causal: bool, scale: float,
                       incoherent: bool) -> str | None:
    """Why ``interface.attention_fp8_varlen_op`` (packed sequences: the packed pre-pass and the
    varlen kernel) cannot take these inputs (None: it can)."""
    # the pre-pass and forward grids are (.., heads, sequences)
    return _float_qkv_unsupported(q, k, v) or _forward_grid_unsupported(cu_q.shape[0] - 1, q.shape[1])


def _float_qkv_unsupported(q, k, v) -> str | None:
    """Float Q, K, V the one-pass paths quantize themselves: one kernel dtype, a kernel head dim."""
    d = q.shape[-1]
    if q.dtype != k.dtype or q.dtype != v.dtype or str(q.dtype).removeprefix("torch.") not in OUT_DTYPES:
        return f"dtypes {q.dtype}, {k.dtype}, {v.dtype} (the one-pass path takes one of {' or '.join(OUT_DTYPES)})"
    if d not in HEAD_DIMS or v.shape[-1] != d:
        return f"head dims D={d}, Dv={v.shape[-1]}; the kernel serves D = Dv in {HEAD_DIMS}"
    return None


def packed_prepass_unsupported(q, k, v) -> str | None:
    """Why ``interface.packed_prepass`` (the pre-pass kernels over packed sequences) cannot read
    these inputs (None: it can): contiguous ``[total, heads, D]`` rows as the quantize kernels read
    them, with a shared-memory ring that fits."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.dim() != 3 or not x.is_contiguous():
            return f"{name}: a contiguous [total, heads, D] tensor"
        why = _prepass_rows_unsupported(x) if x.numel() else None
        if why:
            return f"{name}: {why}"
    return None


def packed_prepass_cluster(max_len: int) -> int:
    """CTAs per (sequence, head) of the packed K / V pre-pass kernels: a power of two, at most
    PREPASS_MAX_CLUSTER, enough that the longest sequence's CTAs take at most 4 blocks each (the
    sequences differ in length: the longest one's heads set the kernel's time)."""
    cluster, blocks = 1, -(-max_len // TILE_N)
    while cluster < PREPASS_MAX_CLUSTER and -(-blocks // cluster) > 4:
        cluster *= 2
    return cluster
