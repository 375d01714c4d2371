"""Host time of each step of the eager FP8 attention call (tiny problem: the GPU is always ahead,
so µs per back-to-back call = host time): the whole call, the registry decision, the one-pass host
function, each launch on preallocated buffers, and torch's own costs on the same host.
    python benchmarks/attention_host_steps.py"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import lowprec
from lowprec.attention import ops
from lowprec.attention.quantize import quantize_qkv
from lowprec.attention.sm90 import interface as ai
from lowprec.bench.common import back_to_back_us
from lowprec.runtime import registry


def main():
    q, k, v = (torch.randn(1, 2, 128, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    scale = 128 ** -0.5
    dev = q.device
    _, _, k_mean, q_scale = ai._attention_fp8_qkv(q, k, v, True, scale)
    x = quantize_qkv(q, k, v)
    u8 = torch.uint8
    kc, vt = x.k.view(u8), ai.permute_v_keys(x.v_t.view(u8))
    k_codes = torch.empty_like(kc)
    k_scale = torch.empty(2, 1, device=dev)
    km = torch.empty(2, 128, device=dev)
    part = torch.empty(ai.prepass_partials_numel(2, 128), device=dev)
    v_t = torch.empty(2 * 128, 128, dtype=u8, device=dev)
    v_sc = torch.empty(2, 128, device=dev)
    calls = {
        "lowprec.attention fp8": lambda: lowprec.attention(q, k, v, causal=True, quant="fp8"),
        "ops._attention_fp8": lambda: ops._attention_fp8(q, k, v, True, scale, False),
        "registry.kernel_for": lambda: registry.kernel_for("attention_fp8_qkv", dev, q, k, v, True, scale),
        "interface._attention_fp8_qkv": lambda: ai._attention_fp8_qkv(q, k, v, True, scale),
        "_launch_prepass_k": lambda: ai._launch_prepass_k(k, k_codes, k_scale, km, part),
        "_launch_prepass_v": lambda: ai._launch_prepass_v("v_perm", v, v_t, v_sc, part),
        "_forward (Q inside)": lambda: ai._forward(q, q_scale, kc, x.k_scale, vt, x.v_scale, True, scale,
                                                  q.dtype, v_keys_permuted=True, quantize_q=True),
        "torch.empty x2": lambda: (torch.empty(1000, dtype=u8, device=dev), torch.empty(100, device=dev)),
        "10 views": lambda: [q.view(-1, 128) for _ in range(10)],
        "F.sdpa bf16": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
    }
    for _ in range(2):
        for name, fn in calls.items():
            print(f"{name:30s} {back_to_back_us(fn, calls=300, reps=3):8.1f} us/call")
        print()


if __name__ == "__main__":
    main()
