"""The grouped GEMM of ``bench moe`` (``[T·k, H] x w1[e]ᵀ``) against DeepGEMM's contiguous grouped
GEMM and the FP8 rowwise ``torch._scaled_grouped_mm``, same routing and same quantized operands.

DeepGEMM needs each expert's rows padded to 128 (padding rows marked -1, which it skips): its
operands are copied into that layout once, outside the timing; its output rows are asserted
bit-identical to lowprec's. TFLOPS over the routed rows for all three; ``bench_ms`` (L2 flushed),
rounds in alternating order, median.

DeepGEMM is not a dependency. The version measured (its last pure-Python JIT, nvcc at run time)::

    git clone https://github.com/deepseek-ai/DeepGEMM dg && git -C dg checkout 03d0be3
    git clone https://github.com/NVIDIA/cutlass && git -C cutlass checkout eefa1713
    cp -r cutlass/include/cute cutlass/include/cutlass dg/deep_gemm/include/
    PYTHONPATH=dg python benchmarks/grouped_vs_deepgemm.py [tile configs, e.g. 128x192_c1x2] [rounds]

With nvcc >= 12.9 DeepGEMM skips its FFMA-interleaving SASS pass (as on the CUDA 13 H100 image).
"""
import math
import sys

import deep_gemm
import torch

from lowprec.bench.common import bench_ms
from lowprec.bench.moe import CONFIGS, ROUTINGS, W1Gemm, make_routing
from lowprec.gemm.sm90.interface import choose_grouped_config, grouped_gemm_blockwise_fp8
from lowprec.gemm.sm90.tune import parse_config


def deepgemm_operands(a_q, ends, num_experts):
    """``(lhs, lhs scales, m_indices, our rows, its rows)``: a_q's rows with every expert padded
    to 128 rows, and the row indices that correspond in the two layouts."""
    counts = torch.diff(ends, prepend=ends.new_zeros(1)).tolist()
    padded = [-(-c // 128) * 128 for c in counts]
    rows = sum(padded)
    lhs = torch.zeros(rows, a_q.data.shape[1], device="cuda", dtype=a_q.data.dtype)
    scales = torch.ones(rows, a_q.scale.shape[1], device="cuda", dtype=torch.float32)
    m_indices = torch.full((rows,), -1, device="cuda", dtype=torch.int32)
    ours, theirs = [], []
    start = pos = 0
    for e in range(num_experts):
        c = counts[e]
        lhs[pos:pos + c] = a_q.data[start:start + c]
        scales[pos:pos + c] = a_q.scale[start:start + c]
        m_indices[pos:pos + c] = e
        ours.append(torch.arange(start, start + c, device="cuda"))
        theirs.append(torch.arange(pos, pos + c, device="cuda"))
        start += c
        pos += padded[e]
    return lhs, deep_gemm.get_col_major_tma_aligned_tensor(scales), m_indices, torch.cat(ours), torch.cat(theirs)


def compare(num_experts, hidden, ffn, top_k, tokens, kind, configs, rounds):
    gen = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(tokens, hidden, device="cuda", generator=gen).bfloat16()
    w1 = torch.randn(num_experts, 2 * ffn, hidden, device="cuda", generator=gen) / math.sqrt(hidden)
    w1 = w1.bfloat16()
    op = W1Gemm.build(x, w1, make_routing(tokens, top_k, num_experts, kind, generator=gen))
    a_q, ends, w1_q = op.a_q, op.ends, op.w1_q
    lhs, lhs_scales, m_indices, ours, theirs = deepgemm_operands(a_q, ends, num_experts)
    out_dg = torch.empty(lhs.shape[0], 2 * ffn, device="cuda", dtype=torch.bfloat16)
    w1_scales = w1_q.scale.contiguous()
    routed = int(ends[-1])
    picked = choose_grouped_config(routed / num_experts, 2 * ffn, hidden, num_experts)
    calls = {
        "deepgemm": lambda: deep_gemm.m_grouped_gemm_fp8_fp8_bf16_nt_contiguous(
            (lhs, lhs_scales), (w1_q.data, w1_scales), out_dg, m_indices),
        "fp8_rowwise": op.calls()["fp8_rowwise"],
    }
    for cfg in [picked] + [c for c in configs if c != picked]:
        calls[f"lowprec {cfg.tile_m}x{cfg.tile_n}_c1x{cfg.cluster_n}"] = (
            lambda cfg=cfg: grouped_gemm_blockwise_fp8(a_q.data, a_q.scale, w1_q.data, w1_q.scale,
                                                       group_ends=ends, config=cfg))
    calls["deepgemm"]()
    for name, fn in calls.items():
        if name.startswith("lowprec"):
            assert torch.equal(fn()[ours], out_dg[theirs]), f"{name}: not bit-identical to DeepGEMM"
    flops = 2.0 * routed * 2 * ffn * hidden
    names = list(calls)
    tflops = {n: [] for n in names}
    for r in range(rounds):
        for n in names if r % 2 == 0 else names[::-1]:
            tflops[n].append(flops / bench_ms(calls[n], warmup=5, rep=20) / 1e9)
    med = {n: sorted(v)[len(v) // 2] for n, v in tflops.items()}
    print(f"E{num_experts} H{hidden} F{ffn} k{top_k} T{tokens} {kind}, {routed} rows "
          f"(DeepGEMM {lhs.shape[0]} padded): TFLOPS (x FP8 rowwise); first lowprec row: the library's pick",
          flush=True)
    for n in names:
        print(f"  {n:24s} {med[n]:6.0f}  ({med[n] / med['fp8_rowwise']:.2f})", flush=True)


def main(argv):
    configs = [parse_config(c + "_m1") for c in argv[0].split(",")] if argv else []
    rounds = int(argv[1]) if len(argv) > 1 else 6
    for shape in CONFIGS:
        for kind in ROUTINGS:
            compare(*shape, kind, configs, rounds)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main(sys.argv[1:])
