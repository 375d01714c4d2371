"""Profile target for Nsight Compute: one FP8 attention forward (kernel only, inputs pre-quantized).
    ncu --kernel-name regex:FP8Attention --launch-skip 2 --launch-count 1 --set full \
        -o $OUT/attn python benchmarks/attention_ncu.py [--causal] [--d 128] [--vperm] [--serial] [--sk N]
Runs the kernel three times (two warm-up launches, then the profiled one). ``--sk N``: keys per head
(default S = 4096), e.g. 256 to see a tile's fixed cost."""

from __future__ import annotations

import sys

import torch

sys.path.insert(0, ".")
from lowprec.attention.sm90 import interface  # noqa: E402
from lowprec.attention.sm90.interface import fp8_attention_forward, permute_v_keys  # noqa: E402
from tests.attention.test_sm90 import quantize_inputs  # noqa: E402


def main():
    d = int(sys.argv[sys.argv.index("--d") + 1]) if "--d" in sys.argv else 128
    causal = "--causal" in sys.argv
    interface.OVERLAP = "--serial" not in sys.argv
    B, H, S = 1, 32, 4096
    sk = int(sys.argv[sys.argv.index("--sk") + 1]) if "--sk" in sys.argv else S
    q = torch.randn(B, H, S, d, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(B, H, sk, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    qc, qs, kc, ks, vt, vs = quantize_inputs(q, k, v)
    vperm = "--vperm" in sys.argv
    if vperm:
        vt = permute_v_keys(vt)
    for _ in range(3):
        fp8_attention_forward(qc, qs, kc, ks, vt, vs, causal=causal, softmax_scale=d ** -0.5,
                              out_dtype=torch.bfloat16, v_keys_permuted=vperm)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
