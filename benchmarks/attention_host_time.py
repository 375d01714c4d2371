"""Host time per eager call of the FP8 attention op on a tiny problem (GPU always ahead of the
host, so wall time per call = host time), next to SDPA, with the fused call's steps (the registry
decision, the one-pass host function, each launch on preallocated buffers) and torch's own costs
on the same host; then a cProfile of the FP8 calls.
    python benchmarks/attention_host_time.py"""

from __future__ import annotations

import cProfile
import pstats

import torch
import torch.nn.functional as F

import lowprec
from lowprec.attention import ops
from lowprec.attention.sm90 import interface as ai
from lowprec.bench.common import back_to_back_us
from lowprec.runtime import registry


def main():
    q, k, v = (torch.randn(1, 2, 128, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    from lowprec.attention.quantize import quantize_k, quantize_q, quantize_qkv, quantize_v, token_mean
    from lowprec.attention.sm90.interface import attention_prepass_k_op, attention_prepass_v_op
    x = quantize_qkv(q, k, v)
    fwd = torch.ops.lowprec.attention_fp8_forward
    rows = q.reshape(-1, 128 * 128)
    scale, dev, u8 = 128 ** -0.5, q.device, torch.uint8
    q_scale = ai._attention_fp8_qkv(q, k, v, True, scale)[3]
    kc, vt = x.k.view(u8), ai.permute_v_keys(x.v_t.view(u8))
    k_codes, v_t = torch.empty_like(kc), torch.empty(2 * 128, 128, dtype=u8, device=dev)
    k_scale, km, v_sc = torch.empty(2, 1, device=dev), torch.empty(2, 128, device=dev), torch.empty(2, 128, device=dev)
    part = torch.empty(ai.prepass_partials_numel(2, 128), device=dev)
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
        # the fused call's steps
        "ops._attention_fp8": lambda: ops._attention_fp8(q, k, v, True, scale, False),
        "registry.kernel_for": lambda: registry.kernel_for("attention_fp8_qkv", dev, q, k, v, True, scale),
        "interface._attention_fp8_qkv": lambda: ai._attention_fp8_qkv(q, k, v, True, scale),
        "_launch_prepass_k": lambda: ai._launch_prepass_k(k, k_codes, k_scale, km, part),
        "_launch_prepass_v": lambda: ai._launch_prepass_v("v_perm", v, v_t, v_sc, part),
        "_forward (Q inside)": lambda: ai._forward(q, q_scale, kc, x.k_scale, vt, x.v_scale, True, scale,
                                                  q.dtype, v_keys_permuted=True, quantize_q=True),
        "torch.empty x2": lambda: (torch.empty(1000, dtype=u8, device=dev), torch.empty(100, device=dev)),
        "10 views": lambda: [q.view(-1, 128) for _ in range(10)],
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
