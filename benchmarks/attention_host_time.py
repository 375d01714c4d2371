"""Host time per eager call of the FP8 attention op on a tiny problem (GPU always ahead of the
host, so wall time per call = host time), next to SDPA; then a cProfile of the FP8 calls.
    python benchmarks/attention_host_time.py"""

from __future__ import annotations

import cProfile
import pstats

import torch
import torch.nn.functional as F

import lowprec
from lowprec.bench.common import back_to_back_us


def main():
    q, k, v = (torch.randn(1, 2, 128, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    from lowprec.attention.quantize import quantize_k, quantize_q, quantize_qkv, quantize_v, token_mean
    from lowprec.attention.sm90.interface import attention_prepass_k_op, attention_prepass_v_op
    x = quantize_qkv(q, k, v)
    fwd = torch.ops.lowprec.attention_fp8_forward
    rows = q.reshape(-1, 128 * 128)
    calls = {
        "quantize_q": lambda: quantize_q(q),
        "quantize_k": lambda: quantize_k(k),
        "quantize_v": lambda: quantize_v(v),
        "token_mean": lambda: token_mean(k),
        "prepass_k op (direct)": lambda: attention_prepass_k_op(k),
        "prepass_v op (direct)": lambda: attention_prepass_v_op(v),
        "lowprec.quantize rowwise": lambda: lowprec.quantize(rows, "fp8_rowwise", check_finite=False),
        "lowprec.attention fp8": lambda: lowprec.attention(q, k, v, causal=True, quant="fp8"),
        "quantize_qkv": lambda: quantize_qkv(q, k, v),
        "attention_fp8_forward op": lambda: fwd(x.q, x.q_scale, x.k, x.k_scale, x.v_t, x.v_scale, True,
                                                 128 ** -0.5, torch.bfloat16),
        "F.sdpa bf16": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
    }
    for name, fn in calls.items():
        print(f"{name:28s} {back_to_back_us(fn, calls=300, reps=1):8.1f} us/call")
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        for _ in range(20):
            lowprec.attention(q, k, v, causal=True, quant="fp8")
        torch.cuda.synchronize()
    print(p.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=50))
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(200):
        lowprec.attention(q, k, v, causal=True, quant="fp8")
    torch.cuda.synchronize()
    prof.disable()
    st = pstats.Stats(prof)
    st.sort_stats("tottime").print_stats(30)
    st.sort_stats("cumulative").print_stats(45)
    st.print_callees("backend_impl")


if __name__ == "__main__":
    main()
