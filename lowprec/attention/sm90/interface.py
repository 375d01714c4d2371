"""Host wiring of the sm_90a FP8 attention forward: validation, compile cache, launch.

Public:
    fp8_attention_forward(q, q_scale, k, k_scale, v_t, v_scale, *, causal, softmax_scale,
                          out_dtype, out=None) -> (out [B, H, Sq, D], lse [B, H, Sq] fp32)
    compile_only(config, arch="sm_90a") -> compiled kernel (no GPU needed)
The contract (shapes, scales, math) is CONTRACT.md; what is supported is config.py.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import math

import torch

from ...runtime import ffi_entry, on_device
from ..quantize import v_keys_at_positions
from .config import (
    PERSISTENT_HEAD_DIMS,
    PREPASS_MAX_CLUSTER,
    TILE_M,
    TILE_N,
    V_PAD,
    AttnConfig,
    head_stride,
    k_blocks_unsupported,
    kv_append_tokens_unsupported,
    operands_unsupported,
    packed_prepass_cluster,
    packed_prepass_unsupported,
    packed_wgs,
    prepass_cluster,
    prepass_k_fold,
    prepass_ring_stages,
    q_blocks_unsupported,
    unpacked_one_wg,
)

_ARCH_DEFAULT = "sm_90a"
_OUT = {torch.bfloat16: "bfloat16", torch.float16: "float16"}
OVERLAP = True  # AttnConfig.overlap of launched kernels (benchmarks flip it to time the serial kernel)
PINGPONG = False  # AttnConfig.pingpong of launched kernels (unmeasured: benchmarks flip it)
PACK_GQA = True  # pack the query heads of a KV head into the rows when H > Hkv and Sq <= 128 (decode: 3.4x)
SPLIT_KV = False  # split the KV blocks over more CTAs when the grid is under a wave, at any Sq
# ... and at decode sizes (Sq <= DECODE_MAX_SQ) always: 1.35-5.7x at B1-8 decode, eager and graphed,
# with the one-launch combine (NOTES.md, session 28); prefill grids under a wave are unmeasured
SPLIT_KV_DECODE = True
DECODE_MAX_SQ = 16
# persistent CTAs, a tile per round in zigzag order. None: on dense grids (no pack-GQA, no split-KV)
# at the head dims of PERSISTENT_HEAD_DIMS, where the fused call measured -0.9% to -1.9% (d256:
# +1.6%; NOTES, session 38); True / False: everywhere / nowhere.
PERSISTENT: bool | None = None
TWO_LEVEL_PV = True  # AttnConfig.two_level_pv of launched kernels
# AttnConfig.consumer_wgs of launched kernels (3 where it applies: D <= 128); packed GQA decode
# launches fewer, config.packed_wgs (NOTES, sessions 40 and 41) ...
CONSUMER_WGS = 3
# ... and unpacked decode one (config.unpacked_one_wg; NOTES, session 41)
UNPACKED_DECODE_ONE_WG = True
SKIP_UNIT_RESCALE = True  # AttnConfig.skip_unit_rescale of launched kernels
LAZY_RESCALE = True  # AttnConfig.lazy_rescale of launched kernels
# lowprec.attention(q, k, v, quant="fp8") on float q: the forward quantizes Q itself (the Q
# pre-pass's bits) where its grid is dense (no pack-GQA, no split-KV), instead of a Q pre-pass kernel
QUANTIZE_Q_IN_KERNEL = True
# programmatic dependent launch of the combine, K / V pre-pass and KV append kernels: each may
# start while the previous kernel on the stream drains. Not the forward: its early CTAs made some
# split-KV decode grids 4-13% slower (NOTES, session 52)
PDL = True
_NUM_SMS = 132


@functools.cache
def _num_sms(device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else _NUM_SMS


def num_splits(ctas: int, n_blocks: int, num_sms: int = _NUM_SMS) -> int:
    """KV splits for a grid of ``ctas`` CTAs over ``n_blocks`` KV blocks: enough CTAs for about two
    waves, at least 4 KV blocks per split, at most 32 splits (1: no split)."""
    if ctas >= num_sms or n_blocks < 8:
        return 1
    return max(1, min(-(-2 * num_sms // ctas), n_blocks // 4, 32))


def kv_splits(B: int, H: int, Hkv: int, Sq: int, Sk: int, num_sms: int = _NUM_SMS) -> int:
    """How many KV ranges the dense forward splits ``Sk`` into for this shape (1: no split). Split
    ``i`` takes KV blocks ``[i·per, (i+1)·per)``, ``per = ceil(blocks / splits)``, each with its own
    online softmax (so its own running max for P's E4M3 scale), then one combine."""
    if not (SPLIT_KV or (SPLIT_KV_DECODE and Sq <= DECODE_MAX_SQ)):
        return 1
    r = H // Hkv
    qh, rows = (Hkv, r * Sq) if _packs_gqa(r, Sq) else (H, Sq)
    return num_splits(-(-rows // TILE_M) * qh * B, -(-Sk // TILE_N), num_sms)


def _packs_gqa(r: int, Sq: int) -> bool:
    return PACK_GQA and r > 1 and Sq <= TILE_M


__all__ = ["fp8_attention_forward", "fp8_attention_varlen_forward", "attention_fp8_varlen_op", "packed_prepass",
           "attention_fp8_forward_op", "attention_fp8_qkv_op", "attention_fp8_q_op", "permute_v_keys",
           "compile_only", "build_kernel", "attention_prepass_k_op", "attention_prepass_v_op",
           "build_prepass_kernel", "build_combine_kernel", "CacheAttention", "cache_attention_op", "CacheAppend",
           "cache_append_op"]


def _use_tvm_ffi() -> bool:
    return importlib.util.find_spec("tvm_ffi") is not None


def build_kernel(config: AttnConfig, arch: str = _ARCH_DEFAULT, tvm_ffi: bool | None = None):
    """Compile one configuration on fake tensors (no GPU needed), uncached; keeps PTX and cubin."""
    import cutlass
    import cutlass.cute as cute

    from ...runtime import compile_for_arch
    from .fwd_fp8 import FP8AttentionFwdSm90

    if tvm_ffi is None:
        tvm_ffi = _use_tvm_ffi()
    kernel = FP8AttentionFwdSm90(config)
    d = config.head_dim
    out_c = {"bfloat16": cutlass.BFloat16, "float16": cutlass.Float16}[config.out_dtype]
    if config.split_kv:  # FP32 partials
        out_c = cutlass.Float32
    fake = cute.runtime.make_fake_tensor
    sq, sk, skp = cute.sym_int(), cute.sym_int(), cute.sym_int(divisibility=V_PAD)
    bh, bhkv = cute.sym_int(), cute.sym_int()
    i64 = cute.sym_int64
    q = fake(cutlass.Uint8, (sq, d, bh), stride=(d, 1, i64(divisibility=16)), assumed_align=16)
    if config.quantize_q:  # Q in the output dtype, quantized by the kernel
        q = fake({"bfloat16": cutlass.BFloat16, "float16": cutlass.Float16}[config.out_dtype], (sq, d, bh),
                 stride=(d, 1, i64(divisibility=8)), assumed_align=16)
    k = fake(cutlass.Uint8, (sk, d, bhkv), stride=(d, 1, i64(divisibility=16)), assumed_align=16)
    vt = fake(cutlass.Uint8, (d, skp, bhkv), stride=(i64(divisibility=16), 1, i64(divisibility=16)),
              assumed_align=16)
    # pack-GQA views q as [B*Hkv] packed heads but keeps q_scale per query head [B*H]
    qs = fake(cutlass.Float32, (cute.sym_int() if config.pack_gqa else bh, cute.sym_int()), stride=(i64(), 1),
              assumed_align=4)
    ks = fake(cutlass.Float32, (bhkv, cute.sym_int()), stride=(i64(), 1), assumed_align=4)
    # varlen: one V scale row per (sequence, KV head)
    vs = fake(cutlass.Float32, (cute.sym_int() if config.varlen else bhkv, d), stride=(d, 1), assumed_align=4)
    obh = cute.sym_int() if config.split_kv else bh  # split-KV: splits x B*H partials
    if config.varlen:  # O packed [total_q, H, D]
        o = fake(out_c, (cute.sym_int(), d, bh), stride=(i64(divisibility=8), 1, cute.sym_int(divisibility=8)),
                 assumed_align=16)
    else:
        o = fake(out_c, (sq, d, obh), stride=(d, 1, i64(divisibility=8)), assumed_align=16)
    lse = fake(cutlass.Float32, (cute.sym_int() if config.varlen else sq, obh), stride=(1, i64()), assumed_align=4)
    plan = fake(cutlass.Int32, (cute.sym_int(), 8), stride=(8, 1), assumed_align=16)
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=tvm_ffi)
    one = cutlass.Int32(1)
    return compile_for_arch(kernel, q, k, vt, qs, ks, vs, o, lse, cutlass.Float32(1.0), one, one, one, one,
                            plan, stream, arch=arch, tvm_ffi=tvm_ffi)


@functools.cache
def _get_compiled(config: AttnConfig, arch: str = _ARCH_DEFAULT):
    from ...runtime import kernel_cache

    key = dict(dataclasses.asdict(config), tvm_ffi=_use_tvm_ffi())
    return kernel_cache.get("attention_fp8_sm90", key, arch,
                            lambda: build_kernel(config, arch))


@functools.cache
def _kernel(d: int, causal: bool, out_dtype: torch.dtype, pack: bool, split: bool, v_keys_permuted: bool,
            overlap: bool, pingpong: bool, persistent_sms: int, two_level_pv: bool, consumer_wgs: int,
            skip_unit_rescale: bool, varlen: bool = False, quantize_q: bool = False, lazy_rescale: bool = True,
            kv_lengths: bool = False):
    """The launched kernel of one call's parameters (and the interface flags; ``persistent_sms``
    0: not persistent): a lookup on plain values, no config object built per call."""
    return ffi_entry(_get_compiled(AttnConfig(d, causal, _OUT[out_dtype], overlap, pingpong, pack, split,
                                              persistent=persistent_sms > 0, num_sms=persistent_sms or _NUM_SMS,
                                              v_keys_permuted=v_keys_permuted, two_level_pv=two_level_pv,
                                              consumer_wgs=consumer_wgs, skip_unit_rescale=skip_unit_rescale,
                                              varlen=varlen, quantize_q=quantize_q, lazy_rescale=lazy_rescale,
                                              kv_lengths=kv_lengths)))


def compile_only(config: AttnConfig | None = None, arch: str = _ARCH_DEFAULT):
    """Compile one configuration on fake tensors (cached; keeps ``__ptx__`` / ``__cubin__``)."""
    return _get_compiled(config or AttnConfig(), arch)


def attention_fp8_forward_op(q, q_scale, k, k_scale, v_t, v_scale, causal: bool, scale: float,
                            out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The registry's implementation (``lowprec.attention.sm90``): :func:`fp8_attention_forward`
    with the arguments of ``lowprec::attention_fp8_forward``."""
    return fp8_attention_forward(q, q_scale, k, k_scale, v_t, v_scale, causal=causal, softmax_scale=scale,
                                 out_dtype=out_dtype)


def _check(cond: bool, msg: str):
    if not cond:
        raise ValueError(f"fp8_attention_forward: {msg}")


def _validate(q, q_scale, k, k_scale, v_t, v_scale, out_dtype, out):
    why = operands_unsupported(q, q_scale, k, k_scale, v_t, v_scale)
    _check(why is None, why)
    _check(out_dtype in _OUT, f"out_dtype must be one of {tuple(_OUT)}")
    if out is not None:
        B, H, Sq, D = q.shape
        _check(tuple(out.shape) == (B, H, Sq, D) and out.dtype == out_dtype and out.is_contiguous()
               and out.device == q.device, "out must be a contiguous [B, H, Sq, D] tensor of out_dtype")


def permute_v_keys(v_t: torch.Tensor) -> torch.Tensor:
    """v_t [..., Sk_pad] with its keys permuted within each aligned 16 as V_KEY_PERM (the layout
    ``fp8_attention_forward(..., v_keys_permuted=True)`` reads). Contiguous copy."""
    return v_t.index_select(-1, v_keys_at_positions(torch.arange(v_t.shape[-1], device=v_t.device)))


def fp8_attention_forward(q, q_scale, k, k_scale, v_t, v_scale, *, causal: bool, softmax_scale: float,
                          out_dtype: torch.dtype, out: torch.Tensor | None = None,
                          v_keys_permuted: bool = False):
    """FP8 attention forward on sm_90a; see CONTRACT.md. Returns ``(out, lse)``.
    ``v_keys_permuted``: v_t is stored as :func:`permute_v_keys` makes it (no P shuffles)."""
    _validate(q, q_scale, k, k_scale, v_t, v_scale, out_dtype, out)
    u8 = torch.uint8
    with on_device(q.device):
        return _forward(q.view(u8), q_scale, k.view(u8), k_scale, v_t.view(u8), v_scale, bool(causal),
                        float(softmax_scale), out_dtype, out, bool(v_keys_permuted))


def _forward(q, q_scale, k, k_scale, v_t, v_scale, causal: bool, softmax_scale: float, out_dtype: torch.dtype,
             out: torch.Tensor | None = None, v_keys_permuted: bool = False, quantize_q: bool = False,
             kv_lengths: torch.Tensor | None = None):
    """The launch of :func:`fp8_attention_forward` on valid operands, FP8 codes as uint8, on the
    current device. ``quantize_q``: ``q`` is the float Q (the output dtype), quantized by the kernel
    as the Q pre-pass would (it writes ``q_scale``); the caller has checked :func:`quantizes_q`.
    ``kv_lengths``: an FP8 KV cache's ``[B, 8]`` int32 plan whose field 5 is each batch row's live
    length on the device (K, Vᵀ and K's scales are the whole buffers; the host picks the splits
    from their extent): no host value of the length, so CUDA graphs replay it at any length."""
    B, H, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    if out is None:
        out = torch.empty(B, H, Sq, D, dtype=out_dtype, device=q.device)
    lse = torch.empty(B, H, Sq, dtype=torch.float32, device=q.device)
    if B * H * Sq == 0:
        return out, lse
    if Sk == 0:
        out.zero_()
        lse.fill_(-math.inf)
        return out, lse
    launch = _Launch(B, H, Hkv, Sq, Sk, D, causal, out_dtype, v_keys_permuted, quantize_q, kv_lengths is not None,
                     q.device)
    o_dst, l_dst = out, lse
    if launch.splits > 1:
        o_dst, l_dst = launch.partials(q.device)
    args = (*launch.operands(q, k, v_t, q_scale, k_scale, v_scale), *launch.outputs(o_dst, l_dst))
    plan = _no_plan(q.device) if kv_lengths is None else kv_lengths
    _launch(launch.fn, args, softmax_scale, launch.ints, plan)
    if launch.splits > 1:
        launch.combine(o_dst, l_dst, out, lse)
    return out, lse


class _Launch:
    """The forward's launch choices for one call's shape: the kernel, its KV splits (``splits``:
    given, else :func:`kv_splits` of ``Sk``), packing, grid ints, and the kernel's views of
    operands and outputs."""

    def __init__(self, B: int, H: int, Hkv: int, Sq: int, Sk: int, D: int, causal: bool, out_dtype: torch.dtype,
                 v_keys_permuted: bool, quantize_q: bool, kv_lengths: bool, device: torch.device,
                 splits: int | None = None):
        r = H // Hkv
        pack = _packs_gqa(r, Sq) and not quantize_q
        # packed: q, out, lse of the r query heads of a KV head are one contiguous run of r * Sq rows
        self.qh, self.rows = (Hkv, r * Sq) if pack else (H, Sq)
        if splits is None:
            splits = 1 if quantize_q else kv_splits(B, H, Hkv, Sq, Sk)
        self.splits, self.B, self.H, self.D, self.out_dtype = splits, B, H, D, out_dtype
        two_level = TWO_LEVEL_PV
        if pack:
            packed = packed_wgs(r, Sq)
            wgs = CONSUMER_WGS if packed is None else min(CONSUMER_WGS, packed)
        elif UNPACKED_DECODE_ONE_WG and not quantize_q and unpacked_one_wg(D, Sq):
            # P.V accumulated as the head dim's default kernel does: the reference's rescale slack
            wgs, two_level = 1, AttnConfig(D).two_level_pv
        else:
            wgs = CONSUMER_WGS
        persistent = PERSISTENT
        if persistent is None:
            persistent = D in PERSISTENT_HEAD_DIMS and not pack and splits == 1 and wgs > 1
        if kv_lengths:
            persistent = False
        self.fn = _kernel(D, causal, out_dtype, pack, splits > 1, v_keys_permuted, OVERLAP, PINGPONG,
                          _num_sms(device) if persistent else 0, two_level, wgs, SKIP_UNIT_RESCALE,
                          False, quantize_q, LAZY_RESCALE, kv_lengths)
        self.ints = (Hkv, 1, r, Sq) if pack else (H, r, 1, Sq)

    def operands(self, q, k, v_t, q_scale, k_scale, v_scale) -> tuple:
        """The kernel's views of Q, K, Vᵀ and their scales: ``[rows, D, heads]`` of ``[heads, rows,
        D]`` buffers, one op each (K, Vᵀ and K's scales may be views of a longer cache: their head
        strides as given)."""
        B, D, rows = self.B, self.D, self.rows
        Sk, skp = k.shape[2], v_t.shape[-1]
        Hkv = k.shape[1]
        return (
            q.as_strided((rows, D, B * self.qh), (D, 1, rows * D)),
            k.as_strided((Sk, D, B * Hkv), (D, 1, head_stride(k))),
            v_t.as_strided((D, skp, B * Hkv), (v_t.stride(2), 1, head_stride(v_t))),
            q_scale.view(B * self.H, -1),
            k_scale.as_strided((B * Hkv, k_scale.shape[-1]), (head_stride(k_scale), 1)),
            v_scale.view(B * Hkv, D),
        )

    def outputs(self, o_dst, l_dst) -> tuple:
        """The kernel's views of O and the LSE (or of the split partials)."""
        rows, D = self.rows, self.D
        return (o_dst.as_strided((rows, D, o_dst.numel() // (rows * D)), (D, 1, rows * D)),
                l_dst.as_strided((rows, l_dst.numel() // rows), (1, rows)))

    def partials(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        """FP32 buffers of the splits' partial O and LSE."""
        n = self.splits * self.B * self.qh
        return (torch.empty(n, self.rows, self.D, dtype=torch.float32, device=device),
                torch.empty(n, self.rows, dtype=torch.float32, device=device))

    def combine(self, o_parts, l_parts, out, lse) -> None:
        """lse = logsumexp_i lse_i, O = sum_i exp(lse_i - lse) O_i: one launch."""
        _combine_entry(self.D, self.out_dtype, PDL)(o_parts.view(self.splits, -1, self.D),
                                                    l_parts.view(self.splits, -1), out.view(-1, self.D), lse.view(-1),
                                                    self.splits)


def build_combine_kernel(head_dim: int, out_dtype: torch.dtype, arch: str = _ARCH_DEFAULT, pdl: bool = True):
    """Compile the split-KV combine (``combine.combine_splits``) on fake tensors (no GPU needed)."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_stream, make_fake_tensor

    from ...runtime import compile_for_arch
    from .combine import combine_splits

    out_c = {"bfloat16": cutlass.BFloat16, "float16": cutlass.Float16}[_OUT[out_dtype]]
    rows, d = cute.sym_int(), head_dim
    parts = make_fake_tensor(cutlass.Float32, (cute.sym_int(), rows, d), stride=(cute.sym_int64(divisibility=4), d, 1),
                             assumed_align=16)
    lses = make_fake_tensor(cutlass.Float32, (cute.sym_int(), rows), stride=(cute.sym_int64(), 1), assumed_align=4)
    out = make_fake_tensor(out_c, (rows, d), stride=(d, 1), assumed_align=8)
    lse = make_fake_tensor(cutlass.Float32, (rows,), stride=(1,), assumed_align=4)
    return compile_for_arch(combine_splits, parts, lses, out, lse, cutlass.Int32(2), head_dim, pdl,
                            make_fake_stream(use_tvm_ffi_env_stream=True), arch=arch, tvm_ffi=True)


@functools.cache
def _combine_entry(head_dim: int, out_dtype: torch.dtype, pdl: bool):
    from ...runtime import kernel_cache

    key = {"head_dim": head_dim, "out": _OUT[out_dtype], "pdl": pdl}
    return ffi_entry(kernel_cache.get("attention_split_combine", key, _ARCH_DEFAULT,
                                      lambda: build_combine_kernel(head_dim, out_dtype, pdl=pdl)))


def build_kv_append_kernel(dtype: torch.dtype, head_dim: int, arch: str = _ARCH_DEFAULT, pdl: bool = True,
                           with_q: bool = False):
    """Compile the FP8 KV cache's append (``kv_append.kv_append``; with ``with_q`` a decode step's,
    ``kv_append.kv_append_with_q``, which quantizes the query too) on fake tensors (no GPU needed)."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_stream, make_fake_tensor

    from ...quant.sm90.interface import cutlass_dtype
    from ...runtime import compile_for_arch
    from .kv_append import kv_append, kv_append_with_q

    b, hkv, d = cute.sym_int(), cute.sym_int(), head_dim
    i64 = cute.sym_int64

    def heads(elem, inner: tuple, inner_stride: tuple, align: int, div: int = 1):
        return make_fake_tensor(elem, (b, hkv, *inner), stride=(i64(divisibility=div), i64(divisibility=div),
                                                                 *inner_stride), assumed_align=align)

    x = cutlass_dtype(dtype)
    new_k = heads(x, (cute.sym_int(), d), (i64(divisibility=2), 1), 4, 2)
    new_v = heads(x, (cute.sym_int(), d), (i64(divisibility=2), 1), 4, 2)
    tail = heads(x, (128, d), (d, 1), 16, 2)
    amax = make_fake_tensor(cutlass.Float32, (b, hkv), stride=(i64(), i64()), assumed_align=4)
    k = heads(cutlass.Uint8, (cute.sym_int(), d), (d, 1), 16, 16)
    k_scale = heads(cutlass.Float32, (cute.sym_int(),), (1,), 4)
    v_t = heads(cutlass.Uint8, (d, cute.sym_int()), (i64(divisibility=16), 1), 16, 16)
    v_inv = heads(cutlass.Float32, (d,), (1,), 8, 2)
    counts = make_fake_tensor(cutlass.Int64, (2,), stride=(1,), assumed_align=16)
    plan = make_fake_tensor(cutlass.Int32, (b, 8), stride=(8, 1), assumed_align=16)
    stream = make_fake_stream(use_tvm_ffi_env_stream=True)
    if not with_q:
        return compile_for_arch(kv_append, new_k, new_v, tail, amax, k, k_scale, v_t, v_inv, counts, plan,
                                cutlass.Int32(1), head_dim, pdl, stream, arch=arch, tvm_ffi=True)
    h = cute.sym_int()  # the query [B, H, 1, D] and its codes [B, H, 1, D], scales [B, H, 1], as given
    q = make_fake_tensor(x, (b, h, 1, d), stride=(i64(divisibility=d), d, i64(), 1), assumed_align=16)
    q_codes = make_fake_tensor(cutlass.Uint8, (b, h, 1, d), stride=(i64(divisibility=d), d, i64(), 1),
                               assumed_align=16)
    q_scale = make_fake_tensor(cutlass.Float32, (b, h, 1), stride=(i64(), 1, i64()), assumed_align=4)
    return compile_for_arch(kv_append_with_q, new_k, new_v, tail, amax, k, k_scale, v_t, v_inv, counts, plan, q,
                            q_codes, q_scale, cutlass.Int32(1), head_dim, pdl, stream, arch=arch, tvm_ffi=True)


@functools.cache
def _kv_append_entry(dtype: torch.dtype, head_dim: int, pdl: bool, with_q: bool = False):
    from ...runtime import kernel_cache

    key = {"dtype": str(dtype).removeprefix("torch."), "head_dim": head_dim, "pdl": pdl, "with_q": with_q}
    return ffi_entry(kernel_cache.get("attention_kv_append", key, _ARCH_DEFAULT,
                                      lambda: build_kv_append_kernel(dtype, head_dim, pdl=pdl, with_q=with_q)))


@functools.cache
def _no_plan(device: torch.device) -> torch.Tensor:
    """The sequence-plan argument of the dense kernels (unread): empty, so nothing is allocated."""
    return torch.empty(0, 8, dtype=torch.int32, device=device)


def _launch(fn, args, softmax_scale: float, ints, plan):
    scale_log2 = softmax_scale * math.log2(math.e)
    if _use_tvm_ffi():
        fn(*args, scale_log2, *ints, plan)
    else:  # pragma: no cover - slow path
        import cuda.bindings.driver as cuda
        from cutlass.cute.runtime import from_dlpack

        targs = [from_dlpack(t, assumed_align=16 if i < 3 or i == 6 else 4) for i, t in enumerate(args)]
        fn(*targs, scale_log2, *ints, from_dlpack(plan, assumed_align=16),
           cuda.CUstream(torch.cuda.current_stream().cuda_stream))


# ----------------------------------------------------------------------------- packed sequences
def fp8_attention_varlen_forward(q, q_scale, k, k_scale, v_t, v_scale, plan, total_q: int, max_q: int, *,
                                 causal: bool, softmax_scale: float, out_dtype: torch.dtype,
                                 v_keys_permuted: bool = False):
    """The FP8 forward over packed sequences, on the padded-layout operands of
    :func:`lowprec.attention.packed.quantize_packed` (E4M3 as float8 or uint8) and the sequence plan
    of :func:`~lowprec.attention.packed.sequence_plan` (rows in any order: the grid walks them in
    that order, :func:`~lowprec.attention.packed.longest_first` balances it); ``max_q`` bounds the
    query lengths (the grid). Returns ``(out [total_q, H, D] out_dtype, lse [H, total_q] FP32 of the smoothed
    scores)`` (FlashAttention's varlen layouts): every row of a sequence is written; no host sync."""
    h, rq, d = q.shape
    hkv, rk = k.shape[:2]
    out = torch.empty(total_q, h, d, dtype=out_dtype, device=q.device)
    lse = torch.empty(h, total_q, dtype=torch.float32, device=q.device)
    if total_q == 0:
        return out, lse
    u8 = torch.uint8
    fn = _kernel(d, causal, out_dtype, False, False, v_keys_permuted, OVERLAP, PINGPONG, 0, TWO_LEVEL_PV,
                 CONSUMER_WGS, SKIP_UNIT_RESCALE, True, False, LAZY_RESCALE)
    args = (
        q.view(u8).as_strided((rq, d, h), (d, 1, rq * d)),
        k.view(u8).as_strided((rk, d, hkv), (d, 1, rk * d)),
        v_t.view(u8).as_strided((d, rk, hkv), (rk, 1, d * rk)),
        q_scale,
        k_scale,
        v_scale.view(-1, d),
        out.as_strided((total_q, d, h), (h * d, 1, d)),
        lse.as_strided((total_q, h), (1, total_q)),
    )
    with on_device(q.device):
        _launch(fn, args, softmax_scale, (h, h // hkv, 1, max(int(max_q), 1)), plan)
    return out, lse


def attention_fp8_varlen_op(q, k, v, cu_q, cu_k, max_q: int, max_k: int, causal: bool, scale: float,
                            incoherent: bool):
    """``lowprec.attention_varlen(..., quant="fp8")`` on sm_90a: the sequence plan, the packed
    pre-pass kernels (:func:`packed_prepass`; with ``incoherent`` on Q and K rotated in FP32 by one
    matmul each, as the torch pre-pass rotates them; in torch ops,
    :func:`lowprec.attention.packed.quantize_packed`, for inputs the kernels cannot read; Vᵀ's keys
    in the kernel's order) and the varlen kernel; no host sync. Returns ``(out [total_q, H, D],
    lse [H, total_q] of the smoothed scores, k_mean [B, Hkv, D])``."""
    from ..packed import longest_first, quantize_packed, sequence_plan
    from ..quantize import _rotate

    plan = sequence_plan(cu_q, cu_k, q.shape[0], k.shape[0])
    qr, kr = (_rotate(q, True), _rotate(k, True)) if incoherent else (q, k)
    if packed_prepass_unsupported(qr, kr, v):
        x = quantize_packed(q, k, v, cu_q, cu_k, incoherent=incoherent, permute_v_keys=True)
    else:
        x = packed_prepass(qr, kr, v, plan, max_q, max_k)
    out, lse = fp8_attention_varlen_forward(x.q, x.q_scale, x.k, x.k_scale, x.v_t, x.v_scale, longest_first(plan),
                                            q.shape[0], max_q, causal=causal, softmax_scale=scale, out_dtype=q.dtype,
                                            v_keys_permuted=True)
    return out, lse, x.k_mean


# ----------------------------------------------------------------------------- the whole FP8 call
def attention_fp8_qkv_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``lowprec.attention(q, k, v, quant="fp8")`` on sm_90a in one lean host pass: the pre-pass
    (K smoothed and quantized, V quantized and transposed, Q quantized per 128-token block by the
    forward itself where :func:`quantizes_q`, else by a pre-pass kernel) and the forward: the same
    bits as :func:`~lowprec.attention.quantize.quantize_qkv` followed by
    :func:`fp8_attention_forward` on :func:`permute_v_keys` of its ``v_t`` (Vᵀ is written in that
    order: P needs no shuffles), without their per-step dispatch, validation and float8 views (the
    registry's constraints, ``config.qkv_unsupported``, hold). Returns ``(out in q's dtype, lse
    FP32 of the smoothed scores, k_mean [B, Hkv, D] FP32)``."""
    out, lse, k_mean, _ = _attention_fp8_qkv(q, k, v, causal, scale)
    return out, lse, k_mean


def quantizes_q(b: int, h: int, hkv: int, sq: int, sk: int) -> bool:
    """Whether :func:`attention_fp8_qkv_op`'s forward quantizes Q itself (``QUANTIZE_Q_IN_KERNEL``
    and a dense grid: no pack-GQA, no split-KV) instead of a Q pre-pass kernel."""
    return QUANTIZE_Q_IN_KERNEL and not _packs_gqa(h // hkv, sq) and kv_splits(b, h, hkv, sq, sk) == 1


def _attention_fp8_qkv(q, k, v, causal: bool, scale: float):
    """:func:`attention_fp8_qkv_op`, also returning the Q scales (``[B, H, Sq/128]``, or ``[B, H, 1]``
    for Sq < 128)."""
    b, h, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    if (why := k_blocks_unsupported(sk) or (q_blocks_unsupported(sq) if sq else None)) is not None:
        raise ValueError(f"attention_fp8_qkv_op: {why}; the scale buffers are sized for these "
                         "(config.qkv_unsupported says which inputs it takes)")
    dev = q.device
    u8, f32 = torch.uint8, torch.float32
    quantize_q = quantizes_q(b, h, hkv, sq, sk)
    q_block = TILE_M if sq % TILE_M == 0 else sq
    sk_pad = -(-sk // V_PAD) * V_PAD
    # the codes of Q, K and Vᵀ in one buffer, their scales in another (fewer host ops per call)
    nq, nk, nv = 0 if quantize_q else b * h * sq * d, b * hkv * sk * d, b * hkv * d * sk_pad
    codes = torch.empty(nq + nk + nv, dtype=u8, device=dev)
    # the FP32 outputs and workspaces in one buffer, those the kernels read or write by 16 bytes
    # first: Vᵀ's scales, K's mean, the partials of K and of V, then the Q and K scales
    q_scales = sq // q_block
    nvs, nqs, nks = b * hkv * d, b * h * q_scales, b * hkv * (sk // TILE_N)
    npart = prepass_partials_numel(b * hkv, d)
    scales = torch.empty(2 * nvs + 2 * npart + nqs + nks, dtype=f32, device=dev)
    q_off = 2 * nvs + 2 * npart
    # each kernel is launched as soon as its views exist: the GPU starts on K while the host
    # prepares the rest (in a lone call, the host time before the first launch is exposed)
    with on_device(dev):
        k_codes = codes.as_strided((b, hkv, sk, d), (hkv * sk * d, sk * d, d, 1), nq)
        k_scale = scales.as_strided((b, hkv, sk // TILE_N), (hkv * (sk // TILE_N), sk // TILE_N, 1), q_off + nqs)
        k_mean = scales.as_strided((b, hkv, d), (hkv * d, d, 1), nvs)
        _launch_prepass_k(k, k_codes, k_scale.view(-1, 1), k_mean.view(-1, d), scales[2 * nvs:2 * nvs + npart])
        v_t = codes.as_strided((b, hkv, d, sk_pad), (hkv * d * sk_pad, d * sk_pad, sk_pad, 1), nq + nk)
        v_scale = scales.as_strided((b, hkv, d), (hkv * d, d, 1))
        _launch_prepass_v("v_perm", v, v_t.view(-1, sk_pad), v_scale.view(-1, d),
                          scales[2 * nvs + npart:2 * nvs + 2 * npart])
        q_scale = scales.as_strided((b, h, q_scales), (h * q_scales, q_scales, 1), q_off)
        if not quantize_q:
            q_codes = codes.as_strided((b, h, sq, d), (h * sq * d, sq * d, d, 1))
            _q_prepass_kernel(q.dtype, q_block * d)(q.view(-1, q_block * d), q_codes.view(-1, q_block * d),
                                                    q_scale.view(-1, 1))
        out, lse = _forward(q if quantize_q else q_codes, q_scale, k_codes, k_scale, v_t, v_scale, causal, scale,
                            q.dtype, v_keys_permuted=True, quantize_q=quantize_q)
    return out, lse, k_mean, q_scale


def attention_fp8_q_op(q: torch.Tensor, k: torch.Tensor, k_scale: torch.Tensor, v_t: torch.Tensor,
                       v_scale: torch.Tensor, causal: bool, scale: float, kv_lengths: torch.Tensor | None = None,
                       v_keys_permuted: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``lowprec.attention(q, k_cache, v_cache, quant="fp8")`` on sm_90a in one lean host pass: float
    Q quantized per call (the Q pre-pass kernel, the bits of
    :func:`~lowprec.attention.quantize.quantize_q`) and the forward on the FP8 cache's operands
    (``k`` [B, Hkv, Sk, D] E4M3 with ``k_scale`` [B, Hkv, ceil(Sk/128)], ``v_t`` [B, Hkv, D,
    round_up(Sk, 16)] E4M3 with ``v_scale`` [B, Hkv, D]: CONTRACT.md). The registry's constraints
    (``config.q_unsupported``) hold. ``kv_lengths``: the cache's plan of device-side lengths (the
    operands are then its whole buffers; see :func:`_forward`). ``v_keys_permuted``: ``v_t`` in
    :func:`permute_v_keys`'s layout (the cache's). Returns ``(out in q's dtype, lse FP32)``."""
    b, h, sq, d = q.shape
    q_block = TILE_M if sq % TILE_M == 0 else sq
    q_kernel = _q_prepass_kernel(q.dtype, q_block * d)
    u8 = torch.uint8
    q_codes = torch.empty(b, h, sq, d, dtype=u8, device=q.device)
    q_scale = torch.empty(b, h, sq // q_block, dtype=torch.float32, device=q.device)
    with on_device(q.device):
        q_kernel(q.view(-1, q_block * d), q_codes.view(-1, q_block * d), q_scale.view(-1, 1))
        return _forward(q_codes, q_scale, k.view(u8), k_scale, v_t.view(u8), v_scale, causal, scale, q.dtype,
                        v_keys_permuted=v_keys_permuted, kv_lengths=kv_lengths)


class CacheAttention:
    """:func:`attention_fp8_q_op` over one FP8 KV cache's whole buffers at its device-side lengths
    (``kv_lengths``), prepared for one query shape: a call is the Q pre-pass (none with
    ``q_quantized``), the forward and (keys split) the combine, into one fresh output. The kernels,
    the buffers' views and the workspaces (Q's codes and scales, the splits' partials) are made
    once per split count; the workspaces are reused call after call in stream order, as the
    cache's own buffers are.
    ``length``: the tokens a call's splits are chosen for (the cache's host length; its ``max_len``
    where the length lives only on the device, as in a CUDA graph). ``v_keys_permuted``: ``v_t`` in
    :func:`permute_v_keys`'s layout."""

    def __init__(self, q, k, k_scale, v_t, v_scale, plan, scale: float, v_keys_permuted: bool):
        b, h, sq, d = q.shape
        self.out_shape, self.lse_shape, self.dtype, self.device = (b, h, sq, d), (b, h, sq), q.dtype, q.device
        self.hkv, self.scale_log2, self.plan = k.shape[1], scale * math.log2(math.e), plan
        self.v_keys_permuted = v_keys_permuted
        u8 = torch.uint8
        self.k, self.k_scale, self.v_t, self.v_scale = k.view(u8), k_scale, v_t.view(u8), v_scale
        self.q_row = sq * d  # Sq <= 16: one Q block per (batch, head)
        self.q_kernel = _q_prepass_kernel(q.dtype, self.q_row)
        self.q_codes = torch.empty(b, h, sq, d, dtype=u8, device=q.device)
        self.q_scale = torch.empty(b, h, 1, dtype=torch.float32, device=q.device)
        self.q_dst = (self.q_codes.view(-1, self.q_row), self.q_scale.view(-1, 1))
        self.lse_scratch = torch.empty(self.lse_shape, dtype=torch.float32, device=q.device)
        self._by_splits: dict[int, tuple] = {}

    def _prepare(self, splits: int) -> tuple:
        b, h, sq, d = self.out_shape
        launch = _Launch(b, h, self.hkv, sq, self.k.shape[2], d, False, self.dtype, self.v_keys_permuted, False, True,
                         self.device, splits)
        front = launch.operands(self.q_codes, self.k, self.v_t, self.q_scale, self.k_scale, self.v_scale)
        back = parts = None
        if splits > 1:
            o_parts, l_parts = launch.partials(self.device)
            back = launch.outputs(o_parts, l_parts)
            parts = (o_parts.view(splits, -1, d), l_parts.view(splits, -1))
        self._by_splits[splits] = prepared = (launch, front, back, parts)
        return prepared

    def reads(self, q: torch.Tensor) -> bool:
        """Whether the Q pre-pass reads ``q`` (contiguous and 16-byte aligned)."""
        return q.is_contiguous() and q.data_ptr() % 16 == 0

    def q_destination(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Where a call reads Q's codes ``[B, H, Sq, D]`` (uint8) and scales ``[B, H, 1]`` from: what
        the append kernel of a decode step writes when it quantizes the query (``q_quantized``)."""
        return self.q_codes, self.q_scale

    def __call__(self, q: torch.Tensor, length: int, want_lse: bool = True, q_quantized: bool = False
                 ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(out, lse)`` of ``q`` (shaped as the prepared query), or None where the Q pre-pass cannot
        read it (not :meth:`reads`: the cache's general path takes it). Without ``want_lse`` the
        LSE returned is a workspace the next call overwrites. ``q_quantized``: Q's codes and scales
        are already in :meth:`q_destination` (no Q pre-pass launch)."""
        if not self.reads(q):
            return None
        b, h, sq, d = self.out_shape
        splits = kv_splits(b, h, self.hkv, sq, length)
        launch, front, back, parts = self._by_splits.get(splits) or self._prepare(splits)
        out = torch.empty(self.out_shape, dtype=self.dtype, device=self.device)
        lse = torch.empty(self.lse_shape, dtype=torch.float32, device=self.device) if want_lse else self.lse_scratch
        with on_device(self.device):
            if not q_quantized:
                self.q_kernel(q.view(-1, self.q_row), *self.q_dst)
            launch.fn(*front, *(back or launch.outputs(out, lse)), self.scale_log2, *launch.ints, self.plan)
            if parts:
                _combine_entry(d, self.dtype, PDL)(*parts, out.view(-1, d), lse.view(-1), splits)
        return out, lse


def cache_attention_op(q, k, k_scale, v_t, v_scale, scale: float, plan, v_keys_permuted: bool = False
                       ) -> CacheAttention:
    """The registry's implementation of ``attention_fp8_cache_attend``: a :class:`CacheAttention` for
    queries shaped as ``q`` over an FP8 KV cache's buffers and its ``[B, 8]`` plan of device-side
    lengths (``config.cache_attention_unsupported`` holds)."""
    return CacheAttention(q, k, k_scale, v_t, v_scale, plan, scale, v_keys_permuted)


class CacheAppend:
    """The FP8 KV cache's append kernel (``kv_append.py``) bound to one cache's buffers: a call checks
    the new tokens (``config.kv_append_tokens_unsupported``) and launches one append at the lengths in the
    plan's field 5, which it advances (``start``: their host value where known, else None); it returns
    None, or why the kernel cannot take them (nothing written: the cache then appends in torch ops)."""

    def __init__(self, dtype: torch.dtype, head_dim: int, buffers: tuple):
        self.dtype, self.head_dim = dtype, head_dim
        self.entry, self.buffers, self.device = _kv_append_entry(dtype, head_dim, PDL), buffers, buffers[0].device
        self.entry_with_q = None  # compiled at the first decode step

    def __call__(self, k, v, start: int | None, q: torch.Tensor | None = None,
                 q_destination: tuple[torch.Tensor, torch.Tensor] | None = None) -> str | None:
        """Append ``k``, ``v`` (the cache's dtype and head dim, which it checks). With ``q`` (a
        decode step's query ``[B, H, 1, D]`` in the cache's dtype, contiguous, 16-byte aligned) the
        same launch quantizes it rowwise into ``q_destination`` (codes ``[B, H, 1, D]`` uint8, scales
        ``[B, H, 1]``: :meth:`CacheAttention.q_destination`)."""
        if (why := kv_append_tokens_unsupported(k, v, start)) is not None:
            return why
        with on_device(self.device):
            if q is None:
                self.entry(k, v, *self.buffers, k.shape[2])
            else:
                if self.entry_with_q is None:
                    self.entry_with_q = _kv_append_entry(self.dtype, self.head_dim, PDL, True)
                self.entry_with_q(k, v, *self.buffers, q, *q_destination, k.shape[2])
        return None


def cache_append_op(k, v, tail, amax, k_codes, k_scale, v_t, v_inv, counts, plan, start: int | None) -> CacheAppend:
    """The registry's implementation of ``attention_fp8_cache_append``: a :class:`CacheAppend` for
    new tokens of ``k``'s dtype and head dim over these buffers (``config.kv_append_unsupported``
    holds for the tokens given)."""
    return CacheAppend(k.dtype, k.shape[-1], (tail, amax, k_codes, k_scale, v_t, v_inv, counts, plan))


@functools.cache
def _q_prepass_kernel(dtype: torch.dtype, q_row: int):
    """The Q pre-pass kernel: rowwise over [B·H·S/128, 128·D] rows of ``q_row`` values."""
    from ...quant.sm90.fp8_quant import ROWWISE_SHORT_COLS
    from ...quant.sm90.interface import compile_kernel

    return compile_kernel("rowwise" if q_row <= ROWWISE_SHORT_COLS else "rowwise_staged", dtype)


def _prepass_entry(kind: str, dtype: torch.dtype, head_dim: int, cluster: int):
    """The launchable K / V pre-pass kernel (TVM-FFI entry)."""
    return _prepass_ffi(kind, dtype, head_dim, cluster, PDL)


@functools.cache
def _prepass_ffi(kind: str, dtype: torch.dtype, head_dim: int, cluster: int, pdl: bool):
    return ffi_entry(_prepass_kernel(kind, dtype, head_dim, cluster, pdl=pdl))


# ----------------------------------------------------------------------------- pre-pass kernels
PREPASS_KINDS = ("k", "v", "v_perm", "q_packed", "k_packed", "v_packed", "v_perm_packed")


def build_prepass_kernel(kind: str, dtype: torch.dtype, head_dim: int, cluster: int = PREPASS_MAX_CLUSTER,
                         arch: str = _ARCH_DEFAULT, pdl: bool = True):
    """Compile one pre-pass kernel (``"k"``: smooth + quantize, ``"v"``: quantize + transpose,
    ``"v_perm"``: the same with the keys in :func:`permute_v_keys`'s order; ``*_packed``: packed
    sequences into the padded layout, ``"q_packed"`` the K kernel without smoothing) for
    ``dtype`` inputs of ``head_dim`` columns, ``cluster`` CTAs per head, on fake tensors (no GPU
    needed), uncached."""
    if kind not in PREPASS_KINDS:
        raise ValueError(f"kind: expected one of {PREPASS_KINDS}, got {kind!r}")
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_stream, make_fake_tensor

    from ...quant.sm90.interface import cutlass_dtype, fake_rows, fake_scales
    from ...runtime import compile_for_arch
    from . import prepass

    def vec(elem):
        return make_fake_tensor(elem, (cute.sym_int(), head_dim), stride=(head_dim, 1), assumed_align=16)

    x = make_fake_tensor(cutlass_dtype(dtype), (cute.sym_int(), head_dim), stride=(head_dim, 1), assumed_align=16)
    stream = make_fake_stream(use_tvm_ffi_env_stream=True)
    one = cutlass.Int32(1)
    stages = prepass_ring_stages(head_dim, dtype.itemsize)
    if not stages:
        raise ValueError(f"{dtype} rows of {head_dim} values do not fit the pre-pass kernels' shared-memory ring")
    if kind == "k":
        width = head_dim * prepass_k_fold(head_dim)
        rows = make_fake_tensor(cutlass_dtype(dtype), (cute.sym_int(), width), stride=(width, 1), assumed_align=16)
        args = (rows, fake_rows(cutlass.Uint8), fake_scales(), vec(cutlass.Float32), vec(cutlass.Float32), one, one,
                head_dim, stages, cluster, pdl, prepass_k_fold(head_dim), stream)
        return compile_for_arch(prepass.k_smooth_quant, *args, arch=arch, tvm_ffi=True)
    if kind.endswith("_packed"):
        # the query or key half of a sequence plan
        seq = make_fake_tensor(cutlass.Int32, (cute.sym_int(), 4), stride=(8, 1), assumed_align=16)
        if kind in ("q_packed", "k_packed"):
            args = (x, fake_rows(cutlass.Uint8), fake_scales(), vec(cutlass.Float32), vec(cutlass.Float32), seq, one,
                    one, head_dim, stages, cluster, kind == "k_packed", pdl, stream)
            return compile_for_arch(prepass.packed_quant, *args, arch=arch, tvm_ffi=True)
        return compile_for_arch(prepass.packed_v_quant_t, x, fake_rows(cutlass.Uint8), vec(cutlass.Float32),
                                vec(cutlass.Float32), seq, one, head_dim, stages, cluster, kind == "v_perm_packed",
                                pdl, stream, arch=arch, tvm_ffi=True)
    return compile_for_arch(prepass.v_quant_t, x, fake_rows(cutlass.Uint8), vec(cutlass.Float32), vec(cutlass.Float32),
                            one, one, head_dim, stages, cluster, kind == "v_perm", pdl, stream, arch=arch,
                            tvm_ffi=True)


@functools.cache
def _prepass_kernel(kind: str, dtype: torch.dtype, head_dim: int, cluster: int, arch: str = _ARCH_DEFAULT,
                    pdl: bool = True):
    from ...runtime import kernel_cache

    key = {"dtype": dtype, "head_dim": head_dim, "cluster": cluster,
           "stages": prepass_ring_stages(head_dim, dtype.itemsize), "pdl": pdl}
    return kernel_cache.get(f"attention_prepass_{kind}", key, arch,
                            lambda: build_prepass_kernel(kind, dtype, head_dim, cluster, arch, pdl))


def _launch_prepass_k(k, codes, scales, k_mean, partials):
    """``k`` [B, H, S, D] -> codes, scales [B·H·S/128, 1], k_mean [B·H, D], on flat views;
    ``partials``: FP32 workspace of ``prepass_partials_numel`` values."""
    b, h, s, d = k.shape
    kernel = _prepass_entry("k", k.dtype, d, prepass_cluster(b * h, s, d * k.element_size()))
    width = d * prepass_k_fold(d)  # the kernel's rows: whole 128-column rows where D < 128
    kernel(k.view(-1, width), codes.view(-1, width), scales, k_mean, partials.view(-1, d), s, b * h)


def _launch_prepass_v(kind, v, v_t, scale, partials):
    """``v`` [B, H, S, D] -> ``v_t`` [B·H·D, S_pad] codes, ``scale`` [B·H, D], on flat views (``kind``
    ``"v"`` or ``"v_perm"``)."""
    b, h, s, d = v.shape
    kernel = _prepass_entry(kind, v.dtype, d, prepass_cluster(b * h, s, d * v.element_size()))
    kernel(v.view(-1, d), v_t, scale, partials.view(-1, d), s, b * h)


def packed_prepass(q, k, v, plan, max_q: int, max_k: int, permute_v_keys: bool = True):
    """:func:`lowprec.attention.packed.quantize_packed` (not incoherent) in three launches that read
    Q, K and V once each: contiguous packed ``[total, heads, D]`` bf16/fp16 inputs
    (``config.packed_prepass_unsupported`` holds), ``plan`` from
    :func:`~lowprec.attention.packed.sequence_plan`; ``max_q``, ``max_k`` bound the lengths (they
    size the grids). Returns a ``PackedFP8Inputs`` (codes as float8)."""
    from ..packed import PackedFP8Inputs, padded_rows

    b = plan.shape[0]
    (tq, h, d), (tk, hkv) = q.shape, k.shape[:2]
    rq, rk = padded_rows(tq, b), padded_rows(tk, b)
    dev, f32 = q.device, torch.float32
    codes = torch.empty(h * rq * d + 2 * hkv * rk * d, dtype=torch.uint8, device=dev)
    q_codes = codes[:h * rq * d].view(h, rq, d)
    k_codes = codes[h * rq * d:h * rq * d + hkv * rk * d].view(hkv, rk, d)
    v_t = codes[h * rq * d + hkv * rk * d:].view(hkv, d, rk)
    nstat, npart = b * hkv * d, prepass_partials_numel(b * h, d)
    stats = torch.empty(2 * nstat + 3 * npart + (h * rq + hkv * rk) // TILE_N, dtype=f32, device=dev)
    v_scale, k_mean = stats[:nstat].view(b, hkv, d), stats[nstat:2 * nstat].view(b, hkv, d)
    parts = stats[2 * nstat:2 * nstat + 3 * npart].view(3, -1, d)
    q_scale = stats[2 * nstat + 3 * npart:2 * nstat + 3 * npart + h * rq // TILE_N].view(h, rq // TILE_N)
    k_scale = stats[2 * nstat + 3 * npart + h * rq // TILE_N:].view(hkv, rk // TILE_N)
    seq_q, seq_k = plan[:, :4], plan[:, 4:]
    k_cluster = packed_prepass_cluster(max_k)
    with on_device(dev):
        if b:
            # Q: no statistic, CTAs of about two blocks each; K, V: one cluster per (sequence, head)
            _prepass_entry("q_packed", q.dtype, d, 1)(
                q.view(-1, d), q_codes.view(-1, d), q_scale.view(-1, 1), k_mean.view(-1, d), parts[0], seq_q, h,
                max(1, -(-max_q // (2 * TILE_N))))
            _prepass_entry("k_packed", k.dtype, d, k_cluster)(
                k.view(-1, d), k_codes.view(-1, d), k_scale.view(-1, 1), k_mean.view(-1, d), parts[1], seq_k, hkv,
                k_cluster)
            _prepass_entry("v_perm_packed" if permute_v_keys else "v_packed", v.dtype, d, k_cluster)(
                v.view(-1, d), v_t.view(-1, rk), v_scale.view(-1, d), parts[2], seq_k, hkv)
    f8 = torch.float8_e4m3fn
    return PackedFP8Inputs(q_codes.view(f8), q_scale, k_codes.view(f8), k_scale, v_t.view(f8), v_scale, k_mean)


def prepass_partials_numel(heads: int, head_dim: int) -> int:
    """FP32 values of one pre-pass kernel's workspace (a partial per head per CTA of its cluster)."""
    return heads * PREPASS_MAX_CLUSTER * head_dim


def attention_prepass_k_op(k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``k`` [B, H, S, D] (S % 128 == 0) -> E4M3 codes of ``k - k_mean`` [B, H, S, D], their scales
    [B, H, S/128] and ``k_mean`` [B, H, 1, D] FP32 (the FP32 token sum / S): one launch, K read
    once from HBM."""
    b, h, s, d = k.shape
    codes = torch.empty(b, h, s, d, dtype=torch.float8_e4m3fn, device=k.device)
    scales = torch.empty(b * h * s // TILE_N, 1, dtype=torch.float32, device=k.device)
    stats = torch.empty(b * h * d + prepass_partials_numel(b * h, d), dtype=torch.float32, device=k.device)
    k_mean = stats[:b * h * d]
    with on_device(k.device):
        _launch_prepass_k(k, codes.view(torch.uint8), scales, k_mean.view(-1, d),
                          stats[b * h * d:])
    return codes, scales.view(b, h, s // TILE_N), k_mean.view(b, h, 1, d)


def attention_prepass_v_op(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``v`` [B, H, S, Dv] -> ``(v_t [B, H, Dv, round_up(S, 16)] E4M3, v_scale [B, H, Dv])``: one scale
    per channel (its amax over the sequence; the quantizer's arithmetic), quantized and transposed
    in one launch that reads V once from HBM."""
    b, h, s, d = v.shape
    s_pad = -(-s // V_PAD) * V_PAD
    v_t = torch.empty(b, h, d, s_pad, dtype=torch.float8_e4m3fn, device=v.device)
    stats = torch.empty(b * h * d + prepass_partials_numel(b * h, d), dtype=torch.float32, device=v.device)
    with on_device(v.device):
        _launch_prepass_v("v", v, v_t.view(torch.uint8).view(-1, s_pad),
                          stats[:b * h * d].view(-1, d), stats[b * h * d:])
    return v_t, stats[:b * h * d].view(b, h, d)
