# ruff: noqa: B023, E501
"""Where the fused FP8 attention call's time goes, per shape (H100, do_bench median, L2 flushed):
the whole eager ``lowprec.attention(q, k, v, quant="fp8")``, its forward kernel alone as the call
launches it (Q quantized inside, on the call's own K / Vᵀ codes), the same forward on Q codes from
the pre-pass (Q not quantized inside), and the K and V pre-pass kernels alone.
    python benchmarks/attention_call_breakdown.py [--shapes 0,4]   (indices into SHAPES)
"""

from __future__ import annotations

import sys

import torch
from triton.testing import do_bench

import lowprec
from lowprec.attention.sm90 import interface as it
from lowprec.attention.sm90.config import TILE_M, TILE_N, V_PAD

SHAPES = [  # B, H, Hkv, S, D, causal
    (4, 32, 32, 4096, 128, False),
    (4, 32, 32, 4096, 128, True),
    (4, 32, 8, 4096, 128, True),
    (4, 32, 32, 4096, 64, False),
    (4, 16, 16, 4096, 256, False),
    (1, 32, 32, 16384, 128, True),
    (16, 32, 32, 1024, 128, True),
]


def ms(fn):
    fn()
    return do_bench(fn, warmup=25, rep=200, return_mode="median")


def main():
    shapes = SHAPES
    if "--shapes" in sys.argv:
        shapes = [SHAPES[int(i)] for i in sys.argv[sys.argv.index("--shapes") + 1].split(",")]
    for b, h, hkv, s, d, causal in shapes:
        q = torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(b, hkv, s, d, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(b, hkv, s, d, device="cuda", dtype=torch.bfloat16)
        scale = d ** -0.5
        full = ms(lambda: lowprec.attention(q, k, v, causal=causal, quant="fp8"))
        sk_pad = -(-s // V_PAD) * V_PAD
        k_codes = torch.empty(b, hkv, s, d, dtype=torch.uint8, device="cuda")
        v_t = torch.empty(b, hkv, d, sk_pad, dtype=torch.uint8, device="cuda")
        k_scale = torch.empty(b, hkv, s // TILE_N, device="cuda")
        k_mean = torch.empty(b, hkv, d, device="cuda")
        v_scale = torch.empty(b, hkv, d, device="cuda")
        parts = [torch.empty(it.prepass_partials_numel(b * hkv, d), device="cuda") for _ in range(2)]
        k_pass = ms(lambda: it._launch_prepass_k(k, k_codes, k_scale.view(-1, 1), k_mean.view(-1, d), parts[0]))
        v_pass = ms(lambda: it._launch_prepass_v("v_perm", v, v_t.view(-1, sk_pad), v_scale.view(-1, d), parts[1]))
        q_scale = torch.empty(b, h, s // TILE_M, device="cuda")
        fwd_qk = ms(lambda: it._forward(q, q_scale, k_codes, k_scale, v_t, v_scale, causal, scale, q.dtype,
                                        v_keys_permuted=True, quantize_q=True))
        q_codes = torch.randint(0, 120, (b, h, s, d), dtype=torch.uint8, device="cuda")
        q_scale.fill_(0.01)
        fwd = ms(lambda: it._forward(q_codes, q_scale, k_codes, k_scale, v_t, v_scale, causal, scale, q.dtype,
                                     v_keys_permuted=True))
        print(f"B{b} H{h}/{hkv} S{s} d{d} {'causal' if causal else 'full':6s}: call {full:.3f} ms | forward, Q inside "
              f"{fwd_qk:.3f} | forward on Q codes {fwd:.3f} | K pre-pass {k_pass:.3f} | V pre-pass {v_pass:.3f} | "
              f"call - (fwd Q inside + K + V) {full - fwd_qk - k_pass - v_pass:+.3f}", flush=True)


if __name__ == "__main__":
    main()
