"""Tests of the sm_90a FP8 attention forward kernel (lowprec.attention.sm90).

(a) compile tests (CPU, CI): every shipped config compiles for sm_90a; its SASS has QGMMA for
    both products (S and P.V) and no local memory (LDL/STL).
(b) GPU tests (``-m gpu``): the kernel vs an emulation of the FP8 scheme built from the same codes
    and scales (the math of ``lowprec.attention.reference._fp8``), both measured against FP64 exact
    attention of the unquantized inputs: kernel error <= 2 x the emulation's + atol (as
    FlashAttention's tests do); the LSE vs the logsumexp of the dequantized scores in FP64;
    fresh random data, poisoned outputs, tails, causal bottom-right with Sq != Sk, GQA, head dims
    64/128/256, decode shapes, Sk = 0, determinism.

The inputs are quantized here (plain torch) so the test depends on nothing but the kernel's
contract (CONTRACT.md).
"""

from __future__ import annotations

import dataclasses
import math
import re

import pytest
import torch

import lowprec
from lowprec.attention.sm90 import config as sm90_config
from lowprec.attention.sm90 import interface as sm90_interface
from lowprec.attention.sm90.config import TILE_M, TILE_N, rescale_slack
from lowprec.runtime.arch import GRID_YZ_MAX

from ..hopper import gpu, needs_cutlass, needs_gpu

F8 = torch.float8_e4m3fn
F8_MAX = 448.0
BLOCK = 128


def _cfgs():
    from lowprec.attention.sm90.config import shipped_configs, variant_configs

    return shipped_configs() + variant_configs()


# ----------------------------------------------------------------------------- compile (CPU)
@needs_cutlass
@pytest.mark.parametrize("config", _cfgs(), ids=str)
def test_compiles_sm90a(config):
    from lowprec.attention.sm90.interface import build_kernel
    from lowprec.runtime.compile import local_memory_ops, nvdisasm_path, sass_of

    compiled = build_kernel(config, "sm_90a", tvm_ffi=False)
    if nvdisasm_path() is None:
        pytest.skip("nvdisasm not found")
    sass = sass_of(compiled)
    qk_steps = config.head_dim // 32
    pv_steps = 4 * (config.head_dim // min(config.head_dim, 128))
    n = len(re.findall(r"\bQGMMA\.", sass))
    # the overlapped loop peels the first block and the last P.V (each product twice); the
    # S-ahead loop (serial, D <= 128) peels the first S
    assert n in (qk_steps + pv_steps, 2 * qk_steps + pv_steps, 2 * (qk_steps + pv_steps)), n
    # pipelined: ptxas did not serialize the wgmma (C7514: a wait after every product)
    assert len(re.findall(r"WARPGROUP\.DEPBAR", sass)) <= n // 2
    assert local_memory_ops(sass) == 0
    if config.overlap:
        assert_softmax_under_pv(sass)
        assert_pv_wait_branch_is_warp_uniform(sass)
    if config.quantize_q:  # Q by 16-byte loads, its codes into sQ by 8-byte stores, fenced; no Q TMA
        runs = 64 * config.head_dim // 8 // 128  # per thread and half block
        # three warpgroups read the block's other half too; two hold the block between them
        halves = 2 if config.consumer_wgs == 3 else 1
        assert sass.count("LDG.E.128") >= halves * runs and sass.count("STS.64") >= runs
        assert "FENCE.VIEW.ASYNC.S" in sass
        tma_q = sass_of(build_kernel(dataclasses.replace(config, quantize_q=False), "sm_90a", tvm_ffi=False))
        assert sass.count("UTMALDG.3D") < tma_q.count("UTMALDG.3D")  # no Q box (d256: two)


def assert_softmax_under_pv(sass: str):
    """The overlapped loop's softmax runs while its P.V is in flight: after the wait for S (at most
    one wgmma group left) come the block's exponentials, then the wait for the P.V. ptxas may
    lift that wait above the softmax (fwd_fp8._wait_pv_after)."""
    ops = re.findall(r"WARPGROUP\.DEPBAR\.LE gsb0, 0x1|WARPGROUP\.DEPBAR\.LE gsb0, 0x0|MUFU\.EX2", sass)
    i = ops.index("WARPGROUP.DEPBAR.LE gsb0, 0x1")
    j = ops.index("WARPGROUP.DEPBAR.LE gsb0, 0x0", i)
    assert j - i - 1 >= TILE_M * TILE_N // 256, f"{j - i - 1} exponentials between the S and the P.V waits"


def assert_pv_wait_branch_is_warp_uniform(sass: str):
    """The branch around the P.V wait (fwd_fp8._wait_pv_after, a warp-collective wait on each side)
    tests its row sum with a comparison that is true for NaN (FSETP.GEU): a NaN query row, or a
    tile row past the data, must not split a warp there."""
    lines = sass.splitlines()
    branches = [i for i, line in enumerate(lines) if " BRA " in line
                and any("WARPGROUP.DEPBAR.LE gsb0, 0x0" in x for x in lines[i + 1:i + 4])
                and any("WARPSYNC.ALL" in x for x in lines[i + 1:i + 4])]
    assert branches, "no branch around the P.V wait"
    for i in branches:
        pred = re.search(r"@!?(P\d) BRA", lines[i]).group(1)
        setp = next(x for x in reversed(lines[:i]) if re.search(rf"FSETP\.\w+\.AND {pred},", x))
        assert "FSETP.GEU." in setp, setp


@needs_cutlass
@pytest.mark.parametrize("kind", ["k", "v", "v_perm", "q_packed", "k_packed", "v_perm_packed"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_prepass_compiles_sm90a(kind, head_dim, dtype):
    """The pre-pass kernels (K smoothed + quantized; V quantized + transposed) compile for sm_90a,
    convert with F2FP (E4M3 codes) and use no local memory."""
    from lowprec.attention.sm90.interface import build_prepass_kernel
    from lowprec.runtime.compile import local_memory_ops, nvdisasm_path, sass_of

    if dtype == torch.float32 and head_dim == 256:  # config.prepass_ring_stages: two blocks do not fit
        with pytest.raises(ValueError, match="do not fit"):
            build_prepass_kernel(kind, dtype, head_dim, arch="sm_90a")
        return
    compiled = build_prepass_kernel(kind, dtype, head_dim, arch="sm_90a")
    if nvdisasm_path() is None:
        pytest.skip("nvdisasm not found")
    sass = sass_of(compiled)
    assert "F2FP" in sass and local_memory_ops(sass) == 0
    assert "ACQBULK" in sass  # griddepcontrol.wait: safe under programmatic dependent launch


@needs_cutlass
@pytest.mark.parametrize("kind", ["k", "v_perm", "q_packed", "k_packed", "v_perm_packed"])
@pytest.mark.parametrize("cluster", [1, 2, 4])
def test_prepass_smaller_clusters_compile_sm90a(kind, cluster):
    """The pre-pass kernels for shorter sequences (fewer CTAs per head) compile too, with one
    cluster barrier and no local memory."""
    from lowprec.attention.sm90.interface import build_prepass_kernel
    from lowprec.runtime.compile import local_memory_ops, nvdisasm_path, sass_of

    compiled = build_prepass_kernel(kind, torch.bfloat16, 128, cluster, arch="sm_90a")
    if nvdisasm_path() is None:
        pytest.skip("nvdisasm not found")
    sass = sass_of(compiled)
    # the packed Q kernel computes no statistic: no cluster barrier
    assert sass.count("UCGABAR_WAIT") == (kind != "q_packed") and local_memory_ops(sass) == 0


@needs_cutlass
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_split_combine_compiles_sm90a(head_dim):
    """The split-KV combine kernel compiles: 16-byte partial loads, exp and log on MUFU, no local memory."""
    from lowprec.attention.sm90.interface import build_combine_kernel
    from lowprec.runtime.compile import local_memory_ops, nvdisasm_path, sass_of

    compiled = build_combine_kernel(head_dim, torch.bfloat16, arch="sm_90a")
    if nvdisasm_path() is None:
        pytest.skip("nvdisasm not found")
    sass = sass_of(compiled)
    assert "LDG.E.128" in sass and "MUFU.EX2" in sass and local_memory_ops(sass) == 0
    assert "ACQBULK" in sass  # griddepcontrol.wait: safe under programmatic dependent launch


def test_quantize_q_configs():
    from lowprec.attention.sm90.config import AttnConfig

    assert str(AttnConfig(128, quantize_q=True)).endswith("_qk")
    for flag in ("pack_gqa", "split_kv", "varlen"):
        with pytest.raises(ValueError, match="quantize_q: dense grids only"):
            AttnConfig(128, quantize_q=True, **{flag: True})


@pytest.mark.parametrize("b,h,hkv,sq,sk,d,quantize_q,expected", [
    (64, 32, 8, 1, 8192, 128, False, (True, 1, True)),  # packed GQA decode, 32 rows: one warpgroup
    (4, 32, 8, 32, 8192, 128, False, (True, 2, True)),  # 128 packed rows: two
    (4, 32, 8, 64, 8192, 128, False, (True, 3, False)),  # 256 packed rows: the default (in-MMA)
    (2, 32, 32, 1, 16384, 128, False, (False, 1, False)),  # MHA decode: one warpgroup, P.V in the wgmma
    (2, 32, 32, 16, 16384, 64, False, (False, 1, False)),
    (2, 32, 32, 17, 16384, 128, False, (False, 3, False)),  # past decode sizes
    (2, 16, 16, 1, 4096, 256, False, (False, 1, True)),  # D = 256: one warpgroup, two-level as its default
    (64, 32, 32, 1, 8192, 128, True, (False, 3, False)),  # Q quantized inside: its 128-row blocks
])
def test_launched_warpgroups(b, h, hkv, sq, sk, d, quantize_q, expected, monkeypatch):
    """Which kernel ``_forward`` launches per shape: (packed, consumer warpgroups, two-level P.V)."""
    from lowprec.attention.sm90 import interface
    from lowprec.attention.sm90.config import RESCALE_SLACK, AttnConfig, rescale_slack

    launched = []
    monkeypatch.setattr(interface, "_kernel", lambda *args: launched.append(args))
    monkeypatch.setattr(interface, "_launch", lambda *args: None)
    monkeypatch.setattr(interface, "_combine_entry", lambda *args: lambda *a: None)
    u8 = torch.uint8
    q = torch.empty(b, h, sq, d, dtype=torch.bfloat16 if quantize_q else u8, device="meta")
    k = torch.empty(b, hkv, sk, d, dtype=u8, device="meta")
    v_t = torch.empty(b, hkv, d, sk, dtype=u8, device="meta")
    scales = torch.empty(b * h, device="meta"), torch.empty(b, hkv, sk // 128, device="meta")
    interface._forward(q, scales[0], k, scales[1], v_t, torch.empty(b * hkv * d, device="meta"), True, 0.1,
                       torch.bfloat16, quantize_q=quantize_q)
    (args,) = launched
    pack, persistent_sms = args[3], args[8]
    config = AttnConfig(d, pack_gqa=pack, two_level_pv=args[9], consumer_wgs=args[10], quantize_q=args[13])
    assert (pack, config.consumer_wgs, config.two_level_pv) == expected
    assert not (persistent_sms and config.consumer_wgs == 1)
    # the slack the reference and the emulation take is the launched kernel's
    assert rescale_slack(d, h // hkv, sq) == (RESCALE_SLACK if config.lazy_rescale else 0)


def test_prepass_cluster_sizes():
    from lowprec.attention.sm90.config import prepass_cluster

    assert prepass_cluster(512, 1024, 256) == 1  # B16 H32 S1k d128 bf16: a CTA per head
    assert prepass_cluster(128, 4096, 256) == 2
    assert prepass_cluster(64, 4096, 512) == 2  # d256: the target is 128 CTAs
    assert prepass_cluster(32, 16384, 256) == 8
    assert prepass_cluster(8, 4096, 128) == 8  # at most the portable cluster size
    assert prepass_cluster(8, 300, 256) == 2  # at most the head's 128-token blocks (3)
    assert prepass_cluster(1, 100, 256) == 1


def test_prepass_k_fold():
    from lowprec.attention.sm90.config import prepass_k_fold

    assert [prepass_k_fold(d) for d in (16, 32, 64, 96, 128, 256)] == [1, 4, 2, 1, 1, 1]


# ----------------------------------------------------------------------------- helpers
def quantize_inputs(q, k, v):
    """The kernel's operands from float q [B,H,Sq,D], k/v [B,Hkv,Sk,D] (contract of CONTRACT.md)."""
    def blocks(x):
        b, h, s, d = x.shape
        nb = -(-s // BLOCK)
        xp = torch.zeros(b, h, nb * BLOCK, d, dtype=torch.float32, device=x.device)
        xp[:, :, :s] = x
        amax = xp.view(b, h, nb, BLOCK * d).abs().amax(-1)
        sc = torch.where(amax > 0, amax / F8_MAX, torch.ones_like(amax))
        codes = (xp.view(b, h, nb, BLOCK, d) / sc[..., None, None]).clamp(-F8_MAX, F8_MAX).to(F8)
        return codes.view(b, h, nb * BLOCK, d)[:, :, :s].contiguous(), sc.contiguous()

    qc, qs = blocks(q.float())
    km = k.float().mean(dim=-2, keepdim=True) if k.shape[-2] else k.float()[..., :1, :] * 0
    kc, ks = blocks(k.float() - km)
    b, hkv, sk, d = v.shape
    amax = v.float().abs().amax(dim=-2) if sk else torch.zeros(b, hkv, d, device=v.device)
    vs = torch.where(amax > 0, amax / F8_MAX, torch.ones_like(amax)).contiguous()
    skp = -(-sk // 16) * 16
    vt = torch.zeros(b, hkv, d, skp, dtype=F8, device=v.device)
    vt[..., :sk] = (v.float() / vs[:, :, None, :]).clamp(-F8_MAX, F8_MAX).to(F8).transpose(-1, -2)
    return qc, qs, kc, ks, vt, vs


def emulate(qc, qs, kc, ks, vt, vs, causal, scale, splits=1):
    """The FP8 scheme from the codes (FP64 except the E4M3 cast of P; the running max lazy at the
    shipped kernel's slack), as reference.fp8_forward_reference; with
    ``splits`` > 1 as the split-KV kernel runs it: each range of KV blocks its own online softmax
    (P's E4M3 scale follows that range's running max), then the combine."""
    B, H, Sq, D = qc.shape
    Hkv, Sk = kc.shape[1], kc.shape[2]
    rep = H // Hkv
    qh = qc.double() * qs.double().repeat_interleave(BLOCK, -1)[..., :Sq, None]
    kh = kc.double() * ks.double().repeat_interleave(BLOCK, -1)[..., :Sk, None]
    kh = kh.repeat_interleave(rep, 1)
    vcodes = vt[..., :Sk].double().transpose(-1, -2).repeat_interleave(rep, 1)
    vsc = vs.double().repeat_interleave(rep, 1)[:, :, None, :]
    s_all = (qh @ kh.transpose(-1, -2)) * scale
    if causal:
        i = torch.arange(Sq, device=qc.device)[:, None]
        j = torch.arange(Sk, device=qc.device)[None, :]
        s_all = s_all.masked_fill(j > i + Sk - Sq, -math.inf)
    slack = rescale_slack(D, H // Hkv, Sq)
    p_scale = F8_MAX / 2.0 ** slack
    blocks = max(1, -(-Sk // BLOCK))
    per = -(-blocks // splits) * BLOCK  # keys per split
    outs, lses = [], []
    for lo in range(0, per * splits, per):
        m = torch.full((B, H, Sq), -math.inf, dtype=torch.float64, device=qc.device)
        rs = torch.zeros_like(m)
        acc = torch.zeros(B, H, Sq, D, dtype=torch.float64, device=qc.device)
        for st in range(lo, min(lo + per, Sk), BLOCK):
            s = s_all[..., st:st + BLOCK]
            m_new = torch.maximum(m, s.amax(-1))
            m_new = torch.where(m_new > m + slack * math.log(2.0), m_new, m)  # lazy rescaling
            m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
            p = torch.exp(s - m_safe[..., None])
            alpha = torch.exp(m - m_safe)
            rs = rs * alpha + p.sum(-1)
            pq = (p * p_scale).float().to(F8).double()
            acc = acc * alpha[..., None] + (pq @ vcodes[..., st:st + BLOCK, :]) * (vsc / p_scale)
            m = m_new
        empty = rs == 0
        outs.append(torch.where(empty[..., None], 0.0, acc / torch.where(empty, 1.0, rs)[..., None]))
        lses.append(torch.where(empty, -math.inf, m + torch.log(torch.where(empty, 1.0, rs))))
    lse = torch.logsumexp(s_all, dim=-1)
    if splits == 1:
        return outs[0], lse
    part_lse = torch.stack(lses)
    weights = torch.exp(part_lse - torch.where(torch.isinf(lse), 0.0, lse))
    return (weights[..., None] * torch.stack(outs)).sum(0), lse


def exact(q, k, v, causal, scale):
    H, Hkv = q.shape[1], k.shape[1]
    qd, kd, vd = q.double(), k.double().repeat_interleave(H // Hkv, 1), v.double().repeat_interleave(H // Hkv, 1)
    s = (qd @ kd.transpose(-1, -2)) * scale
    Sq, Sk = q.shape[2], k.shape[2]
    if causal:
        i = torch.arange(Sq, device=q.device)[:, None]
        j = torch.arange(Sk, device=q.device)[None, :]
        s = s.masked_fill(j > i + Sk - Sq, -math.inf)
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse)[..., None])
    return p @ vd


def _run(B, H, Hkv, Sq, Sk, D, causal, out_dtype=torch.bfloat16, seed=0, v_perm=False):
    from lowprec.attention.sm90.interface import fp8_attention_forward, kv_splits, permute_v_keys

    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(B, H, Sq, D, device="cuda", generator=g)
    k = torch.randn(B, Hkv, Sk, D, device="cuda", generator=g) + 0.5  # a bias the smoothing removes
    v = torch.randn(B, Hkv, Sk, D, device="cuda", generator=g)
    scale = D ** -0.5
    qc, qs, kc, ks, vt, vs = quantize_inputs(q, k, v)
    out = torch.full((B, H, Sq, D), float("nan"), dtype=out_dtype, device="cuda")  # poisoned
    o, lse = fp8_attention_forward(qc, qs, kc, ks, permute_v_keys(vt) if v_perm else vt, vs, causal=causal,
                                   softmax_scale=scale, out_dtype=out_dtype, out=out, v_keys_permuted=v_perm)
    torch.cuda.synchronize()
    assert o.data_ptr() == out.data_ptr()
    emu, emu_lse = emulate(qc, qs, kc, ks, vt, vs, causal, scale, splits=kv_splits(B, H, Hkv, Sq, Sk))
    ref = exact(q, k, v, causal, scale)
    return o, lse, emu, emu_lse, ref, (qc, qs, kc, ks, vt, vs, scale)


CASES = [
    # B, H, Hkv, Sq, Sk, D, causal
    (1, 2, 2, 256, 256, 128, False),
    (1, 2, 2, 256, 256, 128, True),
    (2, 4, 4, 512, 512, 128, True),
    (1, 2, 1, 200, 333, 128, False),  # tails, MQA
    (1, 2, 1, 200, 333, 128, True),
    (1, 2, 2, 100, 300, 64, True),  # causal bottom-right, Sq < Sk
    (1, 2, 2, 300, 100, 128, True),  # Sq > Sk: the first 200 rows see nothing
    (2, 8, 2, 384, 384, 128, True),  # GQA
    (1, 2, 2, 256, 384, 64, False),
    (1, 2, 2, 257, 255, 256, False),
    (1, 2, 1, 384, 384, 256, True),
    (2, 4, 2, 1, 1000, 128, False),  # decode
    (2, 4, 2, 16, 1000, 128, True),
    (2, 4, 4, 1, 1000, 128, False),  # MHA decode: one warpgroup, split keys
    (1, 4, 4, 16, 3000, 64, True),
    (64, 8, 8, 3, 700, 128, True),  # MHA decode on a grid of a wave or more: one warpgroup, no split
    (2, 4, 4, 1, 3000, 256, False),  # MHA decode at D = 256: one warpgroup, two-level, split keys
    (1, 4, 4, 16, 1500, 256, True),
    (1, 2, 2, 5, 3, 64, True),
]


@gpu
@needs_gpu
@pytest.mark.parametrize("case", CASES, ids=lambda c: "B{}H{}kv{}q{}k{}d{}{}".format(*c[:6], "c" if c[6] else ""))
def test_matches_emulation(case):
    B, H, Hkv, Sq, Sk, D, causal = case
    o, lse, emu, emu_lse, ref, _ = _run(*case)
    assert torch.isfinite(o).all()
    err = (o.double() - ref).abs()
    err_emu = (emu - ref).abs()
    assert err.max() <= 2 * err_emu.max() + 2e-3, (err.max().item(), err_emu.max().item())
    assert err.mean() <= 1.1 * err_emu.mean() + 1e-4, (err.mean().item(), err_emu.mean().item())
    # the kernel against its own spec: FP32 rounding (ex2.approx) may move 448·p across an E4M3
    # rounding boundary; one code step is at most 32/448 = 7% of a P entry, so the max allows that
    # in a row of few keys (H100: 2e-2 failed once at GQA B2 S384 causal) and the mean stays tight
    diff = (o.double() - emu).abs()
    assert diff.max() <= 0.08 * emu.abs().max() + 1e-3, (diff.max().item(), emu.abs().max().item())
    assert diff.mean() <= 1e-2 * emu.abs().mean() + 1e-4, (diff.mean().item(), emu.abs().mean().item())
    dead = torch.isinf(emu_lse)
    assert torch.equal(torch.isinf(lse), dead) and (lse[dead] < 0).all()
    assert (o[dead] == 0).all()
    live = ~dead
    # not FP32-exact: the FP8 wgmma sums a score's D products at reduced precision (H100, first
    # run: max |lse - emu| 1.7e-4 (d64/d128) .. 6.4e-4 (d256))
    assert (lse[live].double() - emu_lse[live]).abs().max() <= 2e-3


# Variants behind interface flags (each flipped from its default): each runs a few cases.
VARIANT_CASES = [
    (2, 8, 2, 1, 1000, 128, False),
    (2, 8, 2, 16, 1000, 128, True),
    (1, 8, 1, 5, 300, 64, True),
    (1, 4, 2, 100, 700, 128, True),  # packed rows span 2 heads per tile, tail
    (1, 4, 4, 384, 384, 128, True),
    (1, 4, 2, 16, 4000, 128, True),  # split-KV: 8 splits of 4 blocks
    (1, 2, 2, 3, 2500, 256, False),
    (2, 4, 4, 2, 3000, 128, False),  # MHA decode
]


@gpu
@needs_gpu
@pytest.mark.parametrize("flags", [("CONSUMER_WGS",), ("CONSUMER_WGS", "PINGPONG"), ("PACK_GQA",), ("SPLIT_KV",),
                                   ("PACK_GQA", "SPLIT_KV"), ("PERSISTENT",),
                                   ("CONSUMER_WGS", "PINGPONG", "PERSISTENT"),
                                   ("CONSUMER_WGS", "OVERLAP"), ("V_KEY_PERM",), ("TWO_LEVEL_PV",),
                                   ("CONSUMER_WGS", "TWO_LEVEL_PV"), ("CONSUMER_WGS", "TWO_LEVEL_PV", "PINGPONG"),
                                   ("CONSUMER_WGS", "PACK_GQA"), ("UNPACKED_DECODE_ONE_WG",)],
                         ids="+".join)
@pytest.mark.parametrize("case", VARIANT_CASES,
                         ids=lambda c: "B{}H{}kv{}q{}k{}d{}{}".format(*c[:6], "c" if c[6] else ""))
def test_variants_match_emulation(flags, case, monkeypatch):
    from lowprec.attention.sm90 import interface

    for flag in flags:  # each flag flipped from its default (OVERLAP: the serial kernel, PACK_GQA: unpacked
        if flag == "CONSUMER_WGS":  # GQA decode, CONSUMER_WGS: 3 <-> 2); V_KEY_PERM: an argument
            monkeypatch.setattr(interface, flag, 5 - interface.CONSUMER_WGS)
        elif flag != "V_KEY_PERM":
            monkeypatch.setattr(interface, flag, not getattr(interface, flag))
    o, lse, emu, emu_lse, ref, _ = _run(*case, v_perm="V_KEY_PERM" in flags)
    err, err_emu = (o.double() - ref).abs(), (emu - ref).abs()
    assert err.max() <= 2 * err_emu.max() + 2e-3, (err.max().item(), err_emu.max().item())
    dead = torch.isinf(emu_lse)
    assert torch.equal(torch.isinf(lse), dead) and (o[dead] == 0).all()
    assert (lse[~dead].double() - emu_lse[~dead]).abs().max() <= 2e-3


NAN_ROW_CASES = [
    # (B, H, Hkv, Sq, Sk, D, causal), consumer warpgroups
    ((2, 4, 4, 1, 1000, 128, False), 3),  # MHA decode: one warpgroup, overlapped
    ((2, 32, 8, 8, 3000, 128, False), 3),  # GQA decode, 32 packed rows per tile
    ((1, 32, 8, 32, 2000, 128, True), 3),  # 128 packed rows: two warpgroups, overlapped
    ((1, 4, 2, 384, 640, 64, True), 3),  # three warpgroups at D = 64
    ((1, 4, 2, 384, 640, 128, False), 3),
    ((1, 4, 2, 384, 640, 128, True), 2),  # two warpgroups, overlapped and ping-pong
]


@gpu
@needs_gpu
@pytest.mark.parametrize("case,wgs", NAN_ROW_CASES, ids=lambda c: "x".join(map(str, c)) if isinstance(c, tuple)
                         else f"wg{c}")
def test_a_nan_query_row_stays_in_its_row(case, wgs, monkeypatch):
    """A NaN in one query row makes that row's output NaN and leaves the others as they were: its NaN
    row sum must not split a warp at the warp-collective P.V wait (it hung the GPU once)."""
    from lowprec.attention.sm90 import interface

    monkeypatch.setattr(interface, "CONSUMER_WGS", wgs)
    B, H, Hkv, Sq, Sk, D, causal = case
    *_, (qc, qs, kc, ks, vt, vs, scale) = _run(*case)
    clean, _ = interface.fp8_attention_forward(qc, qs, kc, ks, vt, vs, causal=causal, softmax_scale=scale,
                                              out_dtype=torch.bfloat16)
    poisoned = qc.clone()
    row = (B - 1, H // 2, Sq // 2)
    poisoned[row] = float("nan")
    o, lse = interface.fp8_attention_forward(poisoned, qs, kc, ks, vt, vs, causal=causal, softmax_scale=scale,
                                             out_dtype=torch.bfloat16)
    torch.cuda.synchronize()
    assert torch.isnan(o[row]).all() and torch.isnan(lse[row])
    others = torch.ones(o.shape[:-1], dtype=torch.bool, device=o.device)
    others[row] = False
    assert torch.isfinite(o[others]).all()
    assert (o[others].float() - clean[others].float()).abs().max() <= 1e-2 * clean.float().abs().max()


@gpu
@needs_gpu
@pytest.mark.parametrize("s,d", [(256, 128), (300, 64), (1, 256)])
def test_prepass_v_permuted_is_the_plain_one_permuted(s, d):
    """The V pre-pass kernel's permuted variant writes permute_v_keys of the plain one's v_t."""
    from lowprec.attention.sm90.interface import (
        _launch_prepass_v,
        attention_prepass_v_op,
        permute_v_keys,
        prepass_partials_numel,
    )

    v = torch.randn(2, 3, s, d, device="cuda", dtype=torch.bfloat16)
    v_t, scale = attention_prepass_v_op(v)
    perm = torch.empty_like(v_t)
    scale_p = torch.empty_like(scale)
    partials = torch.empty(prepass_partials_numel(6, d), device="cuda")
    _launch_prepass_v("v_perm", v, perm.view(torch.uint8).view(-1, v_t.shape[-1]),
                      scale_p.view(-1, d), partials)
    assert torch.equal(perm.view(torch.uint8), permute_v_keys(v_t).view(torch.uint8))
    assert torch.equal(scale_p, scale)


@gpu
@needs_gpu
@pytest.mark.parametrize("s,d,dtype", [(4096, 128, torch.bfloat16), (1280, 256, torch.float16),
                                       (384, 64, torch.float32), (128, 128, torch.bfloat16),
                                       (4096, 64, torch.bfloat16), (256, 32, torch.bfloat16)])
def test_prepass_kernels_are_deterministic_and_the_torch_arithmetic(s, d, dtype):
    """The K and V pre-pass kernels (a cluster of CTAs per head, statistics exchanged at a cluster
    barrier) give the same bits on every run, equal to the torch arithmetic on the kernel's own K
    mean (its FP32 sum in its own order); V's tail tokens are zeros. D = 64 and 32: the K kernel
    reads 2 and 4 tokens per 128-column row."""
    from lowprec.attention.sm90.interface import attention_prepass_k_op, attention_prepass_v_op

    g = torch.Generator(device="cuda").manual_seed(3)
    k = (torch.randn(3, 5, s, d, device="cuda", generator=g) * 2 + torch.randn(d, device="cuda", generator=g)
         ).to(dtype)
    v = (torch.randn(3, 5, s + 37, d, device="cuda", generator=g) * torch.rand(d, device="cuda", generator=g)).to(dtype)
    outs = [(*attention_prepass_k_op(k), *attention_prepass_v_op(v)) for _ in range(3)]
    for other in outs[1:]:
        for a, b in zip(outs[0], other):
            assert torch.equal(a.view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a,
                               b.view(torch.uint8) if b.dtype == torch.float8_e4m3fn else b)
    codes, scales, k_mean, v_t, v_scale = outs[0]
    torch.testing.assert_close(k_mean.squeeze(-2), k.sum(-2, dtype=torch.float32) / s, rtol=1e-6, atol=1e-6)
    ref_k = lowprec.quantize((k.float() - k_mean).reshape(-1, 128 * d), "fp8_rowwise")
    assert torch.equal(codes.view(torch.uint8).view(-1, 128 * d), ref_k.data.view(torch.uint8))
    assert torch.equal(scales.view(-1), ref_k.scale.view(-1))
    sv = s + 37
    ref_v = lowprec.quantize(v.float().transpose(-1, -2).reshape(-1, sv), "fp8_rowwise")
    assert torch.equal(v_t[..., :sv].reshape(-1, sv).view(torch.uint8), ref_v.data.view(torch.uint8))
    assert torch.equal(v_scale.view(-1), ref_v.scale.view(-1))
    assert (v_t[..., sv:].view(torch.uint8) == 0).all()


def test_permute_v_keys():
    from lowprec.attention.sm90.config import V_KEY_PERM
    from lowprec.attention.sm90.interface import permute_v_keys

    v = torch.arange(2 * 3 * 48, dtype=torch.float32).view(2, 3, 48)
    p = permute_v_keys(v)
    for g in range(3):
        assert torch.equal(p[..., 16 * g:16 * g + 16], v[..., [16 * g + i for i in V_KEY_PERM]])


def test_num_splits():
    from lowprec.attention.sm90.interface import num_splits

    assert num_splits(512, 64) == 1  # decode B64 H32/8 packed: 512 CTAs, no split
    assert num_splits(4, 32) == 8  # at least 4 KV blocks per split
    assert num_splits(16, 1000) == 17  # about two waves of 132 SMs
    assert num_splits(1, 7) == 1


def test_the_registry_serves_fp8_attention_on_hopper_only():
    from lowprec.runtime import registry

    kernel = registry.registered("attention_fp8")["sm_90a"]
    assert kernel.load().__name__ == "attention_fp8_forward_op"
    q = torch.zeros(1, 1, 8, 96, dtype=F8)
    assert "serves D = Dv in (64, 128, 256)" in kernel.why_not(q, None, q, None, torch.zeros(1, 1, 96, 16, dtype=F8),
                                                                 None, False, 1.0, torch.bfloat16)


@gpu
@needs_gpu
def test_fp16_out_and_determinism():
    o1, l1, emu, _, ref, ops = _run(1, 4, 2, 300, 700, 128, True, out_dtype=torch.float16, seed=3)
    from lowprec.attention.sm90.interface import fp8_attention_forward

    qc, qs, kc, ks, vt, vs, scale = ops
    o2, l2 = fp8_attention_forward(qc, qs, kc, ks, vt, vs, causal=True, softmax_scale=scale,
                                   out_dtype=torch.float16)
    assert torch.equal(o1, o2) and torch.equal(l1, l2)
    assert (o1.double() - ref).abs().max() <= 2 * (emu - ref).abs().max() + 2e-3


@gpu
@needs_gpu
def test_empty_keys():
    from lowprec.attention.sm90.interface import fp8_attention_forward

    o, lse, *_ = _run(1, 2, 2, 10, 0, 128, False)
    assert (o == 0).all() and torch.isinf(lse).all() and (lse < 0).all()
    q = torch.zeros(1, 2, 0, 128, dtype=F8, device="cuda")
    o, lse = fp8_attention_forward(q, torch.ones(1, 2, 0, device="cuda"), *quantize_inputs(
        torch.zeros(1, 2, 1, 128, device="cuda"), torch.randn(1, 2, 7, 128, device="cuda"),
        torch.randn(1, 2, 7, 128, device="cuda"))[2:], causal=False, softmax_scale=0.1,
        out_dtype=torch.bfloat16)
    assert o.shape == (1, 2, 0, 128) and lse.shape == (1, 2, 0)


def test_bad_head_dim():
    from lowprec.attention.sm90.interface import fp8_attention_forward

    q = torch.zeros(1, 1, 8, 96, dtype=F8)
    with pytest.raises(ValueError, match=r"supported: \(64, 128, 256\)"):
        fp8_attention_forward(q, torch.ones(1, 1, 1), q, torch.ones(1, 1, 1), torch.zeros(1, 1, 96, 16, dtype=F8),
                              torch.ones(1, 1, 96), causal=False, softmax_scale=1.0, out_dtype=torch.bfloat16)


def test_fused_call_constraints():
    from lowprec.attention.sm90.config import qkv_unsupported

    def qkv(sq=256, sk=256, d=128, dtype=torch.bfloat16, hkv=2):
        return (torch.zeros(1, 4, sq, d, dtype=dtype), torch.zeros(1, hkv, sk, d, dtype=dtype),
                torch.zeros(1, hkv, sk, d, dtype=dtype))

    assert qkv_unsupported(*qkv(), True, 0.1) is None
    assert qkv_unsupported(*qkv(sq=77), False, 0.1) is None  # one short Q block
    assert "Sq=200" in qkv_unsupported(*qkv(sq=200), False, 0.1)
    assert "Sk=200" in qkv_unsupported(*qkv(sk=200), False, 0.1)
    assert "head dims D=96" in qkv_unsupported(*qkv(d=96), False, 0.1)
    assert "dtypes" in qkv_unsupported(*qkv(dtype=torch.float32), False, 0.1)
    q, k, v = qkv()
    assert "contiguous" in qkv_unsupported(q.transpose(1, 2), k, v, False, 0.1)
    # called directly (not through the registry), the op refuses the shapes its buffers do not fit
    # before any allocation or launch
    from lowprec.attention.sm90.interface import attention_fp8_qkv_op

    for bad, name in ((qkv(sk=200), "Sk=200"), (qkv(sq=200), "Sq=200")):
        with pytest.raises(ValueError, match=name):
            attention_fp8_qkv_op(*bad, False, 0.1)


def test_kv_cache_call_constraints():
    from lowprec.attention.sm90.config import q_unsupported

    def args(sq=256, sk=300, d=128, dtype=torch.bfloat16, hkv=2):
        skp = -(-sk // 16) * 16
        return (torch.zeros(1, 4, sq, d, dtype=dtype), torch.zeros(1, hkv, sk, d, dtype=F8),
                torch.ones(1, hkv, -(-sk // 128)), torch.zeros(1, hkv, d, skp, dtype=F8), torch.ones(1, hkv, d),
                True, 0.1)

    assert q_unsupported(*args()) is None
    assert q_unsupported(*args(sq=1, hkv=1)) is None  # decode, MQA
    assert "Sq=200" in q_unsupported(*args(sq=200))
    assert "q dtype" in q_unsupported(*args(dtype=torch.float32))
    assert "head dims D=96" in q_unsupported(*args(d=96))
    a = list(args())
    a[2] = torch.ones(1, 2, 2)
    assert "k_scale" in q_unsupported(*a)
    a = list(args())
    a[3] = a[3][..., :300]
    assert "do not match" in q_unsupported(*a)


def _call_case_id(c) -> str:
    return "B{}H{}kv{}q{}k{}d{}{}-{}".format(*c[:6], "c" if c[6] else "", str(c[7])[6:])


@gpu
@needs_gpu
@pytest.mark.parametrize("case", [(2, 4, 2, 256, 384, 128, True, torch.bfloat16),
                                  (3, 8, 8, 1, 8192, 128, True, torch.bfloat16),
                                  (1, 4, 1, 77, 300, 64, False, torch.float16),
                                  (2, 4, 4, 200, 256, 128, True, torch.bfloat16)],
                         ids=_call_case_id)
def test_kv_cache_call_is_the_composed_steps(case):
    """lowprec.attention on an FP8 KV cache in eager: the registry serves the one-pass host path
    (Q pre-pass + forward) where it applies (Sq=200: the composed steps run), and the result is
    bit for bit the composed steps'."""
    import lowprec
    from lowprec.attention import ops, quantize_kv_cache
    from lowprec.attention.quantize import qk_from_quantized, quantize_q, v_from_quantized
    from lowprec.runtime import registry

    b, h, hkv, sq, sk, d, causal, dtype = case
    g = torch.Generator(device="cuda").manual_seed(5)
    q, k, v = (torch.randn(b, n, s, d, device="cuda", generator=g).to(dtype)
               for n, s in ((h, sq), (hkv, sk), (hkv, sk)))
    k_q, v_q = quantize_kv_cache(k, v)
    kc, ks = qk_from_quantized(k_q, "k")
    vt, vs = v_from_quantized(v_q)
    served = registry.why_no_kernel("attention_fp8_q", q.device, q, kc, ks, vt, vs, causal, d ** -0.5)
    assert (served is None) == (sq != 200), served
    out = lowprec.attention(q, k_q, v_q, causal=causal, quant="fp8")
    qc, qs = quantize_q(q)
    out_c, _ = ops.forward_dispatch(qc, qs, kc, ks, vt, vs, causal, d ** -0.5, dtype)
    assert torch.equal(out, out_c)


@gpu
@needs_gpu
@pytest.mark.parametrize("q_in_kernel", [True, False], ids=["q-in-kernel", "q-prepass"])
@pytest.mark.parametrize("case", [(2, 16, 16, 2048, 2048, 128, True), (1, 32, 8, 1536, 1536, 64, True),
                                  (1, 20, 20, 1024, 1024, 256, False), (3, 16, 16, 768, 896, 128, False)],
                         ids=lambda c: "B{}H{}kv{}q{}k{}d{}{}".format(*c[:6], "c" if c[6] else ""))
def test_persistent_walk_gives_the_grid_bits(monkeypatch, case, q_in_kernel):
    """PERSISTENT: the fused call with CTAs walking the tiles in zigzag rounds (several rounds, the
    last one partial: 352 / 256 / 160 / 192 tiles over 132 CTAs) writes the one-tile-per-CTA
    grid's bits, Q quantized by the forward or by its pre-pass (shapes the fused call takes:
    whole 128-token blocks)."""
    from lowprec.attention.sm90 import interface

    monkeypatch.setattr(interface, "QUANTIZE_Q_IN_KERNEL", q_in_kernel)
    b, h, hkv, sq, sk, d, causal = case
    g = torch.Generator(device="cuda").manual_seed(3)
    q, k, v = (torch.randn(b, n, s, d, device="cuda", generator=g).to(torch.bfloat16)
               for n, s in ((h, sq), (hkv, sk), (hkv, sk)))
    outs = []
    for persistent in (False, True):
        monkeypatch.setattr(interface, "PERSISTENT", persistent)
        outs.append(interface._attention_fp8_qkv(q, k, v, causal, d ** -0.5))
    for grid_t, persistent_t in zip(*outs):
        assert torch.equal(grid_t, persistent_t)


@gpu
@needs_gpu
@pytest.mark.parametrize("q_in_kernel", [True, False], ids=["q-in-kernel", "q-prepass"])
@pytest.mark.parametrize("case", [(2, 4, 4, 256, 384, 128, False, torch.bfloat16),
                                  (1, 8, 2, 100, 256, 64, True, torch.float16),
                                  (2, 4, 1, 128, 128, 256, True, torch.bfloat16),
                                  (3, 8, 8, 1, 512, 128, True, torch.bfloat16),
                                  (1, 8, 8, 100, 256, 64, True, torch.float16),
                                  (2, 4, 4, 384, 256, 256, True, torch.bfloat16),
                                  (1, 8, 2, 640, 512, 128, True, torch.bfloat16)],
                         ids=_call_case_id)
def test_fused_call_is_the_composed_steps(monkeypatch, case, q_in_kernel):
    """The one-pass host path of lowprec.attention (pre-pass + forward) gives the same bits as
    quantize_qkv followed by the forward kernel on Vᵀ with its keys permuted (which the fused
    V pre-pass writes directly), and is what lowprec.attention runs; with the forward quantizing
    Q itself (dense grids; a 128-row block's scale from both its halves, held by two warpgroups of
    a CTA at d256, by warpgroups of two CTAs at 192-row tiles) as with the Q pre-pass kernel."""
    import lowprec
    from lowprec.attention.quantize import quantize_qkv
    from lowprec.attention.sm90 import interface
    from lowprec.runtime import registry

    monkeypatch.setattr(interface, "QUANTIZE_Q_IN_KERNEL", q_in_kernel)
    b, h, hkv, sq, sk, d, causal, dtype = case
    g = torch.Generator(device="cuda").manual_seed(7)
    q, k, v = (torch.randn(b, n, s, d, device="cuda", generator=g).to(dtype) + 0.5
               for n, s in ((h, sq), (hkv, sk), (hkv, sk)))
    # outliers in some 64-row halves: a half's scale must come from its whole 128-row block
    q[..., ::3 * 64, :] *= 8
    assert registry.why_no_kernel("attention_fp8_qkv", q.device, q, k, v, causal, 0.1) is None
    dense_grid = not (h > hkv and sq <= 128) and interface.kv_splits(b, h, hkv, sq, sk) == 1  # no pack, no split
    assert interface.quantizes_q(b, h, hkv, sq, sk) == (q_in_kernel and dense_grid)
    out, lse, k_mean, q_scale = interface._attention_fp8_qkv(q, k, v, causal, 0.1)
    x = quantize_qkv(q, k, v)
    out_c, lse_c = interface.fp8_attention_forward(x.q, x.q_scale, x.k, x.k_scale, interface.permute_v_keys(x.v_t),
                                                   x.v_scale, causal=causal, softmax_scale=0.1, out_dtype=dtype,
                                                   v_keys_permuted=True)
    assert torch.equal(q_scale, x.q_scale)
    assert torch.equal(out, out_c) and torch.equal(lse, lse_c) and torch.equal(k_mean, x.k_mean)
    assert torch.equal(lowprec.attention(q, k, v, causal=causal, scale=0.1, quant="fp8"), out)
    assert torch.equal(interface.attention_fp8_qkv_op(q, k, v, causal, 0.1)[0], out)


def _meta(*shape, dtype=torch.bfloat16):
    return torch.empty(*shape, dtype=dtype, device="meta")


def test_prepass_refuses_more_than_2_31_values():
    """The pre-pass kernels read [rows, D] of a static stride D and an Int32 row count: the offset
    row·D + col is 32-bit, so past 2^31 values it would wrap (a read before K)."""
    from lowprec.attention.sm90 import config

    k = _meta(1, 8, (1 << 21) + 128, 128)  # a 2M-token context, 8 KV heads of 128
    assert config.prepass_k_unsupported(k) is not None and config.prepass_v_unsupported(k) is not None
    assert config.qkv_unsupported(_meta(1, 64, 128, 128), k, k, False, 0.1) is not None
    kv = _meta((1 << 21) + 128, 8, 128)  # packed [total, heads, D]
    assert config.packed_prepass_unsupported(_meta(128, 64, 128), kv, kv) is not None
    k = _meta(1, 8, 1 << 21, 128)  # exactly 2^31 values: the last offset is 2^31 - 1
    assert config.prepass_k_unsupported(k) is None and config.prepass_v_unsupported(k) is None


def test_forward_refuses_heads_of_more_than_2_31_values():
    """The forward's direct Q loads (Q quantized in the kernel) and O stores (D = 256) address a
    head's [Sq, D] rows as row·D + col in Int32 (static stride D): past 2^31 values it would wrap."""
    from lowprec.attention.sm90 import config

    f8 = torch.float8_e4m3fn
    for d in (128, 256):
        long_sq = (1 << 31) // d + 128  # a whole number of 128-row Q blocks
        q, k, v = _meta(1, 1, long_sq, d), _meta(1, 1, 128, d), _meta(1, 1, 128, d)
        assert config.qkv_unsupported(q, k, v, False, 0.1) is not None
        args = (_meta(1, 1, long_sq, d, dtype=f8), None, _meta(1, 1, 128, d, dtype=f8), None,
                _meta(1, 1, d, 128, dtype=f8), None, False, 0.1, torch.bfloat16)
        assert config.attention_unsupported(*args) is not None
        ops = (_meta(1, 1, 128, d, dtype=f8), _meta(1, 1, 1, dtype=torch.float32), _meta(1, 1, d, 128, dtype=f8),
               _meta(1, 1, d, dtype=torch.float32))
        assert config.q_unsupported(q, *ops, False, 0.1) is not None
        q = _meta(1, 1, (1 << 31) // d, d)  # exactly 2^31 values: the last offset is 2^31 - 1
        assert config.qkv_unsupported(q, k, v, False, 0.1) is None
        assert config.q_unsupported(q, *ops, False, 0.1) is None


def test_prepass_refuses_more_than_65535_heads():
    """The dense pre-pass grid is (cluster, B·H, 1): gridDim.y is at most 65535."""
    from lowprec.attention.sm90 import config

    k = _meta(8192, 8, 128, 128)  # B·Hkv = 65536 short sequences
    assert config.prepass_k_unsupported(k) is not None and config.prepass_v_unsupported(k) is not None
    assert config.qkv_unsupported(_meta(8192, 8, 128, 128), k, k, False, 0.1) is not None
    assert config.prepass_k_unsupported(_meta(8191, 8, 128, 128)) is None


def _empty_q_cache_operands(b, hkv, sk, d):
    return (torch.zeros(b, hkv, sk, d, dtype=F8), torch.ones(b, hkv, -(-sk // 128)),
            torch.zeros(b, hkv, d, -(-sk // 16) * 16, dtype=F8), torch.ones(b, hkv, d))


EMPTY_Q_SHAPES = [(0, 8, 2, 1), (2, 0, 2, 1), (2, 0, 1, 16), (0, 4, 4, 128)]  # (B, H, Hkv, Sq)


@pytest.mark.parametrize("b,h,hkv,sq", EMPTY_Q_SHAPES)
def test_q_op_accepts_only_what_it_launches(b, h, hkv, sq, monkeypatch):
    q = torch.zeros(b, h, sq, 64, dtype=torch.bfloat16)
    ops = _empty_q_cache_operands(b, hkv, 2048, 64)

    def q_prepass(dtype, q_row):
        def launch(x, codes, scales):
            # the rowwise kernel's grid is (rows, 1, 1): CUDA rejects gridDim.x = 0
            assert x.shape[0] > 0, "Q pre-pass launched with a grid of 0 CTAs (cudaErrorInvalidConfiguration)"
        return launch

    monkeypatch.setattr(sm90_interface, "_q_prepass_kernel", q_prepass)
    monkeypatch.setattr(sm90_interface, "_forward", lambda *a, **k: None)
    if sm90_config.q_unsupported(q, *ops, False, 0.1) is None:
        sm90_interface.attention_fp8_q_op(q, *ops, False, 0.1)
    plan = torch.zeros(b, 8, dtype=torch.int32)
    if sm90_config.cache_attention_unsupported(q, *ops, 0.1, plan) is None:
        sm90_interface.CacheAttention(q, *ops, plan, 0.1)(q, 2048)


def test_qkv_op_accepts_only_what_it_runs():
    # H = 0 query heads over one KV head, decode over 8 KV blocks: kv_splits divides by 0 CTAs
    q = torch.zeros(1, 0, 1, 64, dtype=torch.bfloat16)
    k = torch.zeros(1, 1, 1024, 64, dtype=torch.bfloat16)
    if sm90_config.qkv_unsupported(q, k, k, False, 0.1) is None:
        sm90_interface.attention_fp8_qkv_op(q, k, k, False, 0.1)  # ZeroDivisionError before any launch


def test_non_empty_still_accepted():
    q = torch.zeros(2, 8, 1, 64, dtype=torch.bfloat16)
    ops = _empty_q_cache_operands(2, 2, 2048, 64)
    assert sm90_config.q_unsupported(q, *ops, False, 0.1) is None
    assert sm90_config.cache_attention_unsupported(q, *ops, 0.1, torch.zeros(2, 8, dtype=torch.int32)) is None




def _meta_tensor(*shape, dtype=torch.bfloat16):
    return torch.empty(*shape, dtype=dtype, device="meta")


def _meta_forward_args(b, h, hkv=1, sq=1, sk=16, d=64):
    return (_meta_tensor(b, h, sq, d, dtype=F8), None, _meta_tensor(b, hkv, sk, d, dtype=F8), None,
            _meta_tensor(b, hkv, d, -(-sk // 16) * 16, dtype=F8), None, False, 0.1, torch.bfloat16)


def test_forward_refuses_grid_past_65535():
    assert sm90_config.attention_unsupported(*_meta_forward_args(GRID_YZ_MAX + 1, 1)) is not None  # gridDim.z = B
    assert sm90_config.attention_unsupported(*_meta_forward_args(1, GRID_YZ_MAX + 1)) is not None  # gridDim.y = H
    assert sm90_config.attention_unsupported(*_meta_forward_args(GRID_YZ_MAX, 1)) is None


def test_varlen_refuses_more_than_65535_sequences():
    q = _meta_tensor(GRID_YZ_MAX + 1, 4, 64)
    many = torch.empty(GRID_YZ_MAX + 2, dtype=torch.int32, device="meta")  # 65536 sequences
    assert sm90_config.varlen_unsupported(q, q, q, many, many, 1, 1, False, 0.1, False) is not None
    ok = torch.empty(GRID_YZ_MAX + 1, dtype=torch.int32, device="meta")
    assert sm90_config.varlen_unsupported(q, q, q, ok, ok, 1, 1, False, 0.1, False) is None


def test_kv_append_refuses_more_than_65535_rows():
    new = _meta_tensor(GRID_YZ_MAX + 1, 1, 1, 64)
    assert sm90_config.kv_append_unsupported(new, new, *(None,) * 8, None) is not None
    new = _meta_tensor(GRID_YZ_MAX, 1, 1, 64)
    assert sm90_config.kv_append_unsupported(new, new, *(None,) * 8, None) is None
