# ruff: noqa: B023, E501  (scratch script: lambdas timed inside their own iteration)
"""Scratch timing of the sm_90a FP8 attention kernel (kernel only, inputs pre-quantized) against
SDPA bf16 (flash and cuDNN backends) in the same process. Usage:
    python benchmarks/attention_sm90_timing.py [--quick] [--serial] [--pingpong] [--decode] [--pack] [--persistent] [--vperm] [--inmma] [--wg2] [--short] [--prepass] [--no-skip1]
Prints one line per shape and backend: ms (median of do_bench), TFLOPS (causal counts half)."""

from __future__ import annotations

import functools
import sys

import torch
import torch.nn.functional as F
from triton.testing import do_bench

sys.path.insert(0, ".")
from lowprec.attention.sm90.interface import fp8_attention_forward  # noqa: E402
from tests.attention.test_sm90 import quantize_inputs  # noqa: E402

SHAPES = [  # B, H, Hkv, Sq, Sk, D, causal
    (4, 32, 32, 4096, 4096, 128, False),
    (4, 32, 32, 4096, 4096, 128, True),
    (4, 32, 8, 4096, 4096, 128, True),
    (4, 32, 32, 4096, 4096, 64, False),
    (4, 16, 16, 4096, 4096, 256, False),
]
DECODE = [(64, 32, 8, 1, 8192, 128, False)]
SHORT = [(16, 32, 32, 1024, 1024, 128, True)]


def tflops(B, H, Sq, Sk, D, causal, ms):
    f = 4 * B * H * Sq * Sk * D * (0.5 if causal and Sq == Sk else 1.0)
    return f / ms / 1e9


def main():
    shapes = SHAPES[:2] if "--quick" in sys.argv else SHAPES
    if "--decode" in sys.argv:
        shapes = shapes + DECODE
    if "--short" in sys.argv:
        shapes = SHORT
    rows = []
    for B, H, Hkv, Sq, Sk, D, causal in shapes:
        q = torch.randn(B, H, Sq, D, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(B, Hkv, Sk, D, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(B, Hkv, Sk, D, device="cuda", dtype=torch.bfloat16)
        qc, qs, kc, ks, vt, vs = quantize_inputs(q, k, v)
        out = torch.empty(B, H, Sq, D, device="cuda", dtype=torch.bfloat16)
        fn = functools.partial(fp8_attention_forward, qc, qs, kc, ks, vt, vs, causal=causal,
                               softmax_scale=D ** -0.5, out_dtype=torch.bfloat16, out=out)
        fn()
        torch.cuda.synchronize()
        kr, vr = k.repeat_interleave(H // Hkv, 1), v.repeat_interleave(H // Hkv, 1)
        ref = F.scaled_dot_product_attention(q, kr, vr, is_causal=causal)
        cos = F.cosine_similarity(out.float().flatten(), ref.float().flatten(), dim=0).item()
        from lowprec.attention.sm90 import interface
        res = {"fp8": do_bench(fn, warmup=100, rep=500, return_mode="median")}
        if "--prepass" in sys.argv:
            import lowprec
            from lowprec.attention.quantize import quantize_k, quantize_q, quantize_qkv, quantize_v
            res["fp8_prepass_only"] = do_bench(lambda: quantize_qkv(q, k, v), warmup=20, rep=200, return_mode="median")
            for part, f in (("q", lambda: quantize_q(q)), ("k", lambda: quantize_k(k)), ("v", lambda: quantize_v(v)),
                            ("q_128x128", lambda: lowprec.quantize(q.reshape(-1, D), "fp8_block128x128",
                                                                    check_finite=False))):
                res[f"fp8_prepass_{part}"] = do_bench(f, warmup=20, rep=200, return_mode="median")
            full = lambda: lowprec.attention(q, k, v, causal=causal, quant="fp8")  # noqa: E731
            full()
            res["fp8_with_quant"] = do_bench(full, warmup=20, rep=200, return_mode="median")
        if D <= 128 and "--serial" in sys.argv:
            interface.OVERLAP = False
            fn()
            res["fp8_serial"] = do_bench(fn, warmup=100, rep=500, return_mode="median")
            interface.OVERLAP = True
        if D <= 128 and "--pingpong" in sys.argv:
            interface.PINGPONG = True
            fn()
            res["fp8_pingpong"] = do_bench(fn, warmup=100, rep=500, return_mode="median")
            torch.cuda.synchronize()
            pp_err = (out.float() - ref.float()).abs().max().item()
            print(f"pingpong max|out - sdpa| {pp_err:.4f}")
            interface.PINGPONG = False
        if "--persistent" in sys.argv:
            combos = [(True, False)] + ([(False, False), (False, True)] if D <= 128 and "--inmma" in sys.argv else [])
            for two_level, pp in combos:
                interface.PERSISTENT, interface.TWO_LEVEL_PV, interface.PINGPONG = True, two_level, pp
                fn()
                name = "fp8_persist" + ("" if two_level else "_inmma") + ("_pp" if pp else "")
                res[name] = do_bench(fn, warmup=100, rep=500, return_mode="median")
                torch.cuda.synchronize()
                print(f"{name} max|out - sdpa| {(out.float() - ref.float()).abs().max().item():.4f}")
            interface.PERSISTENT, interface.TWO_LEVEL_PV, interface.PINGPONG = None, True, False
        if "--wg2" in sys.argv and D <= 128:  # the two-warpgroup kernel (two-level, S-ahead loop)
            interface.CONSUMER_WGS = 2
            fn()
            res["fp8_wg2"] = do_bench(fn, warmup=100, rep=500, return_mode="median")
            torch.cuda.synchronize()
            c = F.cosine_similarity(out.float().flatten(), ref.float().flatten(), dim=0).item()
            print(f"wg2 max|out - sdpa| {(out.float() - ref.float()).abs().max().item():.4f} cos {c:.5f}")
            interface.CONSUMER_WGS = 3
        if "--inmma" in sys.argv:
            interface.TWO_LEVEL_PV = False
            for pp in (False, True):
                interface.PINGPONG = pp
                fn()
                res["fp8_inmma" + ("_pp" if pp else "")] = do_bench(fn, warmup=100, rep=500, return_mode="median")
                torch.cuda.synchronize()
                c = F.cosine_similarity(out.float().flatten(), ref.float().flatten(), dim=0).item()
                print(f"inmma pingpong={pp} max|out - sdpa| {(out.float() - ref.float()).abs().max().item():.4f} cos {c:.5f}")
            interface.TWO_LEVEL_PV, interface.PINGPONG = True, False
        if "--vperm" in sys.argv:
            from lowprec.attention.sm90.interface import permute_v_keys
            vtp = permute_v_keys(vt)
            fp = lambda: fp8_attention_forward(qc, qs, kc, ks, vtp, vs, causal=causal,  # noqa: E731
                                               softmax_scale=D ** -0.5, out_dtype=torch.bfloat16, out=out,
                                               v_keys_permuted=True)
            fp()
            res["fp8_vperm"] = do_bench(fp, warmup=100, rep=500, return_mode="median")
            if "--no-skip1" in sys.argv:
                interface.SKIP_UNIT_RESCALE = False
                fp()
                res["fp8_vperm_no-skip1"] = do_bench(fp, warmup=100, rep=500, return_mode="median")
                interface.SKIP_UNIT_RESCALE = True
            torch.cuda.synchronize()
            print(f"vperm max|out - sdpa| {(out.float() - ref.float()).abs().max().item():.4f}")
        for flag, attr, val in (("--no-skip1", "SKIP_UNIT_RESCALE", False),):
            if flag in sys.argv:
                old = getattr(interface, attr)
                setattr(interface, attr, val)
                fn()
                res["fp8_" + flag[2:]] = do_bench(fn, warmup=100, rep=500, return_mode="median")
                torch.cuda.synchronize()
                print(f"{flag} max|out - sdpa| {(out.float() - ref.float()).abs().max().item():.4f}")
                setattr(interface, attr, old)
        if H > Hkv and Sq <= 128 and "--pack" in sys.argv:
            interface.PACK_GQA = True
            fn()
            res["fp8_pack_gqa"] = do_bench(fn, warmup=100, rep=500, return_mode="median")
            torch.cuda.synchronize()
            print(f"pack_gqa max|out - sdpa| {(out.float() - ref.float()).abs().max().item():.4f}")
            interface.PACK_GQA = False
        from torch.nn.attention import SDPBackend, sdpa_kernel
        for name, be in (("sdpa_flash", SDPBackend.FLASH_ATTENTION), ("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION)):
            try:
                with sdpa_kernel(be):
                    g = functools.partial(F.scaled_dot_product_attention, q, k, v, is_causal=causal,
                                          enable_gqa=H != Hkv)
                    g()
                    res[name] = do_bench(g, warmup=100, rep=500, return_mode="median")
            except Exception as e:  # noqa: BLE001
                print(name, "failed:", type(e).__name__, str(e)[:100])
        bf16 = [tflops(B, H, Sq, Sk, D, causal, t) for n, t in res.items() if not n.startswith("fp8")]
        best_bf16 = max(bf16) if bf16 else float("nan")
        tag = f"B{B} H{H}/{Hkv} Sq{Sq} Sk{Sk} d{D} {'causal' if causal else 'full'}"
        for n, t in res.items():
            rows.append(f"{tag:32s} {n:16s} {t:8.3f} ms {tflops(B, H, Sq, Sk, D, causal, t):7.1f} TFLOPS")
        ratio = tflops(B, H, Sq, Sk, D, causal, res["fp8"]) / best_bf16
        rows.append(f"{tag:32s} fp8/best-bf16 {ratio:.3f}x  cos {cos:.5f}")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
