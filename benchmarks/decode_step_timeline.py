"""Where a model decode step's GPU time goes: ``bench decode``'s Llama-3-8B-shaped 2-layer step
(B tokens, bf16 KV cache of ``CONTEXT`` positions) captured in a CUDA graph, one replay traced by
torch.profiler (CUPTI records the graph's kernels one by one). Per weight format: every kernel in
order with its duration and the idle gap before it, then totals (GEMM kernels, the rest, gaps).

    python benchmarks/decode_step_timeline.py [--batch 1] [--impls bf16,lowprec-nvfp4] [--compiled] [--list]

``TORCHINDUCTOR_ENABLE_PDL=1`` with ``--compiled``: inductor's Triton kernels launch with
programmatic dependent launch, so a kernel after them may start before they end.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import tempfile

import torch

_GEMM_MARKS = ("gemm", "Gemm", "sm90_xmma", "cutlass", "nvjet", "gemv")


def _is_gemm(name: str) -> bool:
    """A GEMM kernel (cuBLAS, CUTLASS, lowprec's); not inductor's Triton kernels, whose names carry
    the ops they fuse (``..._weight_only_0``)."""
    return any(m in name for m in _GEMM_MARKS) and not name.startswith("triton_")


def _timeline(step) -> list[tuple[str, float, float]]:
    """(name, µs, gap µs before it) of each kernel of one replay of ``step``'s graph."""
    from torch.profiler import ProfilerActivity, profile

    from lowprec.bench.common import cuda_graph_replay

    replay = cuda_graph_replay(step)
    for _ in range(3):
        replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        replay()
        torch.cuda.synchronize()
    path = os.path.join(tempfile.mkdtemp(), "trace.json")
    prof.export_chrome_trace(path)
    with open(path) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("cat") == "kernel"]
    events.sort(key=lambda e: e["ts"])
    rows, end = [], None
    for e in events:
        gap = 0.0 if end is None else e["ts"] - end
        rows.append((e["name"], e["dur"], gap))
        end = e["ts"] + e["dur"]
    return rows


def main():
    import lowprec
    from lowprec.bench.common import bench_graph_ms
    from lowprec.bench.decode import CONTEXT, decode_step
    from lowprec.bench.train import SIZES, Llama

    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--impls", default="bf16,lowprec-nvfp4")
    p.add_argument("--compiled", action="store_true", help="the step through torch.compile (fullgraph)")
    p.add_argument("--list", action="store_true", help="print every kernel, not only the totals")
    args = p.parse_args()
    c = dataclasses.replace(SIZES["llama3-8b-2l"], seq=CONTEXT)
    torch.manual_seed(0)
    base = Llama(c).to(device="cuda", dtype=torch.bfloat16)
    base.cos, base.sin = base.cos.float(), base.sin.float()
    tokens = torch.randint(0, c.vocab, (args.batch,), device="cuda")
    caches = [tuple(torch.randn(args.batch, c.kv_heads, CONTEXT, c.head_dim, device="cuda", dtype=torch.bfloat16)
                    for _ in range(2)) for _ in range(c.layers)]
    for impl in args.impls.split(","):
        model = copy.deepcopy(base)
        if impl != "bf16":
            lowprec.convert(model, impl.removeprefix("lowprec-").replace("fp8", "fp8_block"), inference=True)
        fn = decode_step
        if args.compiled:
            torch._dynamo.reset()
            fn = torch.compile(decode_step, fullgraph=True, dynamic=False)
        with torch.no_grad():
            decode_step(model, tokens, caches, CONTEXT - 1)
            step = lambda m=model, f=fn: f(m, tokens, caches, CONTEXT - 1)  # noqa: E731
            rows = _timeline(step)
            step_ms = bench_graph_ms(step, reps=5)
        gemm = [r for r in rows if _is_gemm(r[0])]
        other = [r for r in rows if r not in gemm]
        total = sum(r[1] + r[2] for r in rows)
        print(f"## {impl}, B{args.batch}, {'compiled' if args.compiled else 'eager ops'}: {len(rows)} kernels, "
              f"{total:.1f} µs from the first start to the last end; "
              f"{step_ms * 1e3:.1f} µs a step in a graph of 5 (bench decode's timing)")
        print(f"   GEMM kernels {len(gemm)}: {sum(r[1] for r in gemm):.1f} µs (gaps before them "
              f"{sum(r[2] for r in gemm):.1f}); others {len(other)}: {sum(r[1] for r in other):.1f} µs "
              f"(gaps {sum(r[2] for r in other):.1f})")
        if args.list:
            for name, dur, gap in rows:
                print(f"   {dur:7.2f} µs  gap {gap:6.2f}  {name[:110]}")
        del model


if __name__ == "__main__":
    main()
