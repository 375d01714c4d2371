# ruff: noqa: B023, E501  (scratch script: lambdas timed inside their own iteration)
"""Packed variable-length FP8 attention on the H100, one run: lowprec.attention_varlen(quant="fp8")
(the packed pre-pass kernels + the varlen kernel; also with incoherent=True), each part alone, the
pre-pass in torch ops (also incoherent, as the call ran it before session 29),
and PyTorch's bf16 varlen flash attention
(``aten._flash_attention_forward`` with cu_seqlens). do_bench medians (L2 flushed), eager calls,
TFLOPS counting each sequence's own work (causal: half, bottom-right)."""

from __future__ import annotations

import sys

import torch
from triton.testing import do_bench

sys.path.insert(0, ".")
import lowprec  # noqa: E402
from lowprec.attention.packed import longest_first, quantize_packed, sequence_plan  # noqa: E402
from lowprec.attention.sm90.interface import fp8_attention_varlen_forward, packed_prepass  # noqa: E402

# (name, sequence lengths, H, Hkv, D)
CASES = [
    ("docs 16k, mixed", [4096, 2048, 2048, 1024, 3000, 1500, 900, 700, 600, 500], 32, 8, 128),
    ("16 x 1k", [1024] * 16, 32, 8, 128),
    ("4 x 4k", [4096] * 4, 32, 32, 128),
    ("64 short", [100 + 37 * i for i in range(64)], 32, 8, 128),
]


def flops(lens, h, d, causal):
    return sum(4 * n * n * h * d * (0.5 if causal else 1.0) for n in lens)


def main():
    for name, lens, h, hkv, d in CASES:
        total = sum(lens)
        g = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(total, h, d, device="cuda", generator=g, dtype=torch.bfloat16)
        k = torch.randn(total, hkv, d, device="cuda", generator=g, dtype=torch.bfloat16)
        v = torch.randn(total, hkv, d, device="cuda", generator=g, dtype=torch.bfloat16)
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
        mx = max(lens)
        for causal in (False, True):
            f = flops(lens, h, d, causal)
            x = quantize_packed(q, k, v, cu, cu, permute_v_keys=True)
            plan = sequence_plan(cu, cu, total, total)
            plan_f = longest_first(plan)
            ke, ve = (t.repeat_interleave(h // hkv, 1) for t in (k, v))
            fns = {
                "lowprec fp8 (with quant)": lambda: lowprec.attention_varlen(q, k, v, cu, cu, mx, mx, causal=causal, quant="fp8"),
                "lowprec fp8 kernel only": lambda: fp8_attention_varlen_forward(
                    x.q, x.q_scale, x.k, x.k_scale, x.v_t, x.v_scale, plan_f, total, mx, causal=causal,
                    softmax_scale=d ** -0.5, out_dtype=torch.bfloat16, v_keys_permuted=True),
                "lowprec fp8 incoherent": lambda: lowprec.attention_varlen(q, k, v, cu, cu, mx, mx, causal=causal, quant="fp8",
                                                                         incoherent=True),
                "lowprec pre-pass kernels": lambda: packed_prepass(q, k, v, plan, mx, mx),
                "pre-pass in torch ops": lambda: quantize_packed(q, k, v, cu, cu, permute_v_keys=True),
                "incoherent pre-pass, torch": lambda: quantize_packed(q, k, v, cu, cu, incoherent=True, permute_v_keys=True),
                "aten flash varlen bf16": lambda: torch.ops.aten._flash_attention_forward(
                    q, ke, ve, cu, cu, mx, mx, 0.0, causal, False, scale=d ** -0.5),
            }
            try:
                from flash_attn.cute import flash_attn_varlen_func

                fns["FA4 varlen bf16"] = lambda: flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu,
                                                                       max_seqlen_q=mx, max_seqlen_k=mx, causal=causal)
            except Exception as err:  # noqa: BLE001
                print("FA4 varlen:", type(err).__name__, err)
            ms = {}
            for n, fn in fns.items():
                try:
                    ms[n] = do_bench(fn, warmup=20, rep=200, return_mode="median")
                except Exception as err:  # noqa: BLE001
                    print(n, "failed:", type(err).__name__, str(err)[:200])
            base = ms["aten flash varlen bf16"]
            for n, t in ms.items():
                print(f"{name:18s} {'causal' if causal else 'full':6s} {n:26s} {t:8.3f} ms {f / t / 1e9:7.0f} TFLOPS  x{base / t:.2f} vs flash bf16", flush=True)


if __name__ == "__main__":
    main()
