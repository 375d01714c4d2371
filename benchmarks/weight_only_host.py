# ruff: noqa: E501  (scratch measurement script: one printed line per measurement)
"""Host time of an eager weight-only layer call and of its pieces (GPU machine): back-to-back
calls at M = 1 on 4096x4096, where the call is host-bound (the kernel takes ~7 us). Prints
us per call for the layer, each step below it, and a cProfile of the layer call.

    python benchmarks/weight_only_host.py [--calls 3000]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats

import torch
from torch import nn

import lowprec
from lowprec.bench.common import back_to_back_us, bench_graph_ms
from lowprec.gemm import ops
from lowprec.gemm.sm90 import weight_only_interface as wo


def per_call_us(fn, calls: int) -> float:
    """Back-to-back calls, the GPU waited for at the end of each batch (bench's helper)."""
    return back_to_back_us(fn, calls=max(1, calls // 5), reps=5, warmup=50)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--calls", type=int, default=3000)
    args = p.parse_args()
    dev = torch.device("cuda")
    base = nn.Linear(4096, 4096, bias=False, device=dev, dtype=torch.bfloat16)
    x = torch.randn(1, 4096, device=dev, dtype=torch.bfloat16)
    layers = {"bf16": base}
    for fmt in ("nvfp4", "fp8_block"):
        m = nn.Sequential(nn.Linear(4096, 4096, bias=False, device=dev, dtype=torch.bfloat16))
        m[0].weight.data.copy_(base.weight)
        lowprec.convert(m, fmt, inference=True, min_weight_numel=0)
        layers[fmt] = m[0]
    with torch.no_grad():
        for name, layer in layers.items():
            print(f"{name:10s} layer call          {per_call_us(lambda layer=layer: layer(x), args.calls):6.1f} us")
        # as bench decode times it: a round over copies whose weights add up past L2
        from lowprec.bench.decode import _make, rotation_copies, weight_bytes
        for impl in ("bf16", "lowprec-nvfp4"):
            copies = [_make(impl, base.weight) for _ in range(rotation_copies(weight_bytes(impl, 4096, 4096)))]
            fn = (lambda copies=copies: [c(x) for c in copies])
            fn()
            print(f"{impl:14s} rotation of {len(copies)}: {back_to_back_us(fn) / len(copies):6.1f} us per call; "
                  f"same layer {back_to_back_us(lambda c=copies[0]: c(x)):6.1f}")
            bench_graph_ms(fn)
            print(f"{impl:14s} after a graph capture: {back_to_back_us(fn) / len(copies):6.1f} us per call")
        layer = layers["nvfp4"]
        packed = layer.packed_weight()
        print(f"nvfp4      packed_weight()     {per_call_us(layer.packed_weight, args.calls):6.1f} us")
        print(f"nvfp4      ops.weight_only     "
              f"{per_call_us(lambda: ops.weight_only(x, packed, layer.quantized_weight, None), args.calls):6.1f} us")
        print(f"nvfp4      interface launch    {per_call_us(lambda: wo.weight_only_nvfp4(x, packed), args.calls):6.1f} us")
        op_args = (x, packed.data, packed.global_scale, "nvfp4", packed.n, packed.k, None)
        print(f"nvfp4      custom op (compiled path) {per_call_us(lambda: ops.weight_only_op(*op_args), args.calls):6.1f} us")
        print(f"nvfp4      why_not             "
              f"{per_call_us(lambda: wo_unsupported(x, packed), args.calls):6.1f} us")
        splits = wo.choose_split(packed.n_tiles, packed.k_chunks, torch.cuda.get_device_properties(dev).multi_processor_count)
        fn = wo.compile_kernel("nvfp4", 8, splits)
        y = torch.empty(1, 4096, device=dev, dtype=torch.bfloat16)
        work = wo._workspace(dev, splits * 4096)
        scale = packed.global_scale.view(1, 1)
        unused = wo._unused(dev)
        bare = (lambda: fn(x, packed.tiles, y, unused, scale, work, unused.view(torch.int32), 1, 0))  # noqa: E731
        print(f"nvfp4      bare FFI launch     {per_call_us(bare, args.calls):6.1f} us")
        print(f"           torch.empty         "
              f"{per_call_us(lambda: torch.empty(1, 4096, device=dev, dtype=torch.bfloat16), args.calls):6.1f} us")
        print(f"           current stream id   "
              f"{per_call_us(lambda: torch.cuda.current_stream(dev).stream_id, args.calls):6.1f} us")
        print(f"           tensor.view         {per_call_us(lambda: packed.data.view(packed.n_tiles, -1, 64), args.calls):6.1f} us")
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.calls):
            layer(x)
        prof.disable()
        torch.cuda.synchronize()
        pstats.Stats(prof).sort_stats("tottime").print_stats(22)


def wo_unsupported(x, packed):
    from lowprec.gemm.sm90.config import weight_only_unsupported

    return weight_only_unsupported(x, packed, None)


if __name__ == "__main__":
    main()
