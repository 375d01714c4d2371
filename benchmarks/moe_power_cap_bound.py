"""How far can any FP8 GEMM get past the FP8 rowwise grouped peer on the ``bench moe`` w1 GEMMs
with the chip at its power cap?

Each kernel runs back to back for S seconds (``lowprec.bench.common.sustained``: TFLOPS with the
median SM clock and board power ``nvidia-smi`` reads), two passes in opposite order, best pass
reported, ratio to ``torch._scaled_grouped_mm`` (FP8 rowwise):

- ``lowprec``: ``lowprec.grouped_gemm`` (1x128 / 128x128 block scales), the bench's balanced routing;
- ``fp8_rowwise_grouped``: the peer, same routing;
- ``cublas_per_expert``: cuBLAS FP8 with one scale per tensor (no block scales, the cheapest K loop
  there is), one ``torch._scaled_mm`` per expert on exactly T·k/E rows each (no tile waste), the E
  launches replayed as one CUDA graph (64 eager launches of 30 µs are host-bound);
- ``cublas_dense``: the same, one GEMM of all rows against one expert's weights (M = T·k: one weight
  matrix instead of E);
- ``rowwise_dense``: ``torch._scaled_mm`` with rowwise scales, the same dense GEMM.

The per-expert cuBLAS loop is the upper bound that matters: what a grouped kernel could reach
without paying for block scales or tile waste.

    python benchmarks/moe_power_cap_bound.py [seconds per kernel, default 4]
"""
import math
import sys

import torch

from lowprec.bench.common import cuda_graph_replay, sustained
from lowprec.bench.moe import CONFIGS, W1Gemm, make_routing


def kernels(num_experts, hidden, ffn, top_k, tokens):
    gen = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(tokens, hidden, device="cuda", generator=gen).bfloat16()
    w1 = (torch.randn(num_experts, 2 * ffn, hidden, device="cuda", generator=gen) / math.sqrt(hidden)).bfloat16()
    op = W1Gemm.build(x, w1, make_routing(tokens, top_k, num_experts, "balanced", generator=gen))
    grouped = op.calls()
    rows = tokens * top_k
    per_expert = rows // num_experts
    one = torch.ones((), device="cuda")
    out = torch.empty(rows, 2 * ffn, device="cuda", dtype=torch.bfloat16)

    def cublas_per_expert():
        for e in range(num_experts):
            block = slice(e * per_expert, (e + 1) * per_expert)
            torch._scaled_mm(op.a_q.data[block], op.w1_q.data[e].t(), one, one, out_dtype=torch.bfloat16,
                             out=out[block])

    scale_a, scale_b = op.a_row.scale.reshape(-1, 1), op.w1_row.scale[0].reshape(1, -1)
    calls = {
        "lowprec": grouped["lowprec"],
        "fp8_rowwise_grouped": grouped["fp8_rowwise"],
        "cublas_per_expert": cuda_graph_replay(cublas_per_expert),
        "cublas_dense": lambda: torch._scaled_mm(op.a_q.data, op.w1_q.data[0].t(), one, one, out_dtype=torch.bfloat16),
        "rowwise_dense": lambda: torch._scaled_mm(op.a_row.data, op.w1_row.data[0].t(), scale_a, scale_b,
                                                  out_dtype=torch.bfloat16),
    }
    return calls, 2.0 * rows * 2 * ffn * hidden


def main(seconds: float) -> None:
    print(f"{torch.cuda.get_device_name()}: each kernel back to back for {seconds:g} s, best of two passes")
    for config in CONFIGS[:2]:
        num_experts = config[0]
        calls, flops = kernels(*config)
        runs = {name: [] for name in calls}
        for order in (list(calls), list(reversed(calls))):
            for name in order:
                runs[name].append(sustained(calls[name], seconds))
        best = {name: min(r, key=lambda v: v["ms"]) for name, r in runs.items()}
        peer_ms = best["fp8_rowwise_grouped"]["ms"]
        for name, r in best.items():
            print(f"E{num_experts:<4d} {name:20s} {flops / r['ms'] / 1e9:6.0f} TFLOPS  x{peer_ms / r['ms']:.3f}  "
                  f"{r['sm_clock_mhz']} MHz  {r['power_w']} W", flush=True)


if __name__ == "__main__":
    main(float(sys.argv[1]) if len(sys.argv) > 1 else 4.0)
