"""Where the FP8 attention's gradient error comes from (issue 25's gradient target), on the CPU.

The backward is exact attention's, fed the forward's O (for D = rowsum(dO ∘ O)) and LSE (for
P = exp(S − LSE)). This script swaps each of the two for the exact one, in FP64, and prints the
cosine of dQ, dK, dV to the FP64 exact gradients, on inputs whose score rows grow more peaked with
``t`` (Q and K ~ N(0, t²), K with a shared per-channel bias; causal, B1 H2 S512 d128):

- ``fp8``: the FP8 scheme's O and LSE (the reference of the shipped kernel);
- ``exact O, fp8 LSE`` / ``fp8 O, exact LSE``: one of the two replaced;
- ``bf16 P·V``: Q·Kᵀ from the FP8 Q and K (same scales and smoothing), P and V in bf16 (the
  SageAttention split), its O and LSE.

    python benchmarks/attention_grad_error_sources.py [--t 1,1.5,2,2.5]
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from lowprec import metrics  # noqa: E402
from lowprec.attention.quantize import quantize_qkv  # noqa: E402
from lowprec.attention.reference import attention_backward_reference, attention_reference, lse_correction  # noqa: E402


def _dequant(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return codes.double() * scales.double().repeat_interleave(128, dim=-1)[..., :codes.shape[-2], None]


def bf16_pv_forward(q, k, v, scale):
    """FP8 scores as the scheme computes them; P (normalized) and V rounded to bf16; causal."""
    x = quantize_qkv(q, k, v)
    s = (_dequant(x.q, x.q_scale) @ _dequant(x.k, x.k_scale).transpose(-1, -2)) * scale
    s = s.masked_fill(torch.ones_like(s, dtype=torch.bool).triu(1), -math.inf)
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse[..., None]).bfloat16().double()
    return p @ v.bfloat16().double(), lse + lse_correction(q, x.k_mean, scale).double()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--t", default="1,1.5,2,2.5")
    args = p.parse_args(argv)
    torch.manual_seed(0)
    b, h, s, d = 1, 2, 512, 128
    scale = d ** -0.5
    for t in (float(v) for v in args.t.split(",")):
        q = (torch.randn(b, h, s, d) * t).bfloat16()
        k = (torch.randn(b, h, s, d) * t + 0.5 * torch.randn(b, h, 1, d)).bfloat16()
        v = torch.randn(b, h, s, d).bfloat16()
        dout = torch.randn(b, h, s, d, dtype=torch.float64)
        qd, kd, vd = q.double(), k.double(), v.double()
        o_ex, lse_ex = attention_reference(qd, kd, vd, True, scale, None)
        exact = attention_backward_reference(dout, qd, kd, vd, o_ex, lse_ex, True, scale)
        o8, lse8 = attention_reference(q, k, v, True, scale, "fp8")
        ob, lseb = bf16_pv_forward(q, k, v, scale)
        print(f"t = {t}: out cos to FP64 fp8 {metrics.cos_sim(o8, o_ex):.5f}, bf16 P·V {metrics.cos_sim(ob, o_ex):.5f};"
              f" |LSE error| mean / max {(lse8 - lse_ex).abs().mean():.3f} / {(lse8 - lse_ex).abs().max():.3f}")
        for name, (o, lse) in {"fp8": (o8, lse8), "exact O, fp8 LSE": (o_ex, lse8), "fp8 O, exact LSE": (o8, lse_ex),
                               "bf16 P·V": (ob, lseb)}.items():
            grads = attention_backward_reference(dout, qd, kd, vd, o.double(), lse.double(), True, scale)
            print(f"  {name:18s} " + " ".join(f"{n} {metrics.cos_sim(g, r):.5f}"
                                             for n, g, r in zip(("dQ", "dK", "dV"), grads, exact)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
