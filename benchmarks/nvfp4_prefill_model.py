"""A prefill forward of the Llama-3-8B-shaped 2-layer model (+ LM head over every position) with
NVFP4 weights against bf16: the shipped rule (the prefill path from ``DEQUANT_MIN_M`` tokens) and
the weight-only kernel at every size, eager and ``torch.compile`` (default mode). CUDA events
around one forward, host synced before each (a lone prefill call), L2 flushed.

    python benchmarks/nvfp4_prefill_model.py [--shapes 1x512,1x2048,4x2048]
"""

from __future__ import annotations

import argparse
import copy
import dataclasses

import torch

import lowprec
from lowprec.bench.common import bench_ms
from lowprec.bench.train import SIZES, Llama
from lowprec.gemm.sm90 import weight_only_interface as wo


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="1x512,1x2048,4x2048", help="batch x sequence, comma-separated")
    args = p.parse_args()
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    c = dataclasses.replace(SIZES["llama3-8b-2l"], seq=max(s for _, s in shapes))
    torch.manual_seed(0)
    bf16 = Llama(c).to(device="cuda", dtype=torch.bfloat16)
    bf16.cos, bf16.sin = bf16.cos.float(), bf16.sin.float()
    nvfp4 = lowprec.convert(copy.deepcopy(bf16), "nvfp4", inference=True)
    rule = wo.DEQUANT_MIN_M
    for b, s in shapes:
        tokens = torch.randint(0, c.vocab, (b, s), device="cuda")
        for mode in ("eager", "compiled"):
            times = {}
            for name, model, least in (("bf16", bf16, rule), ("nvfp4", nvfp4, rule), ("nvfp4 kernel", nvfp4, 1 << 62)):
                wo.DEQUANT_MIN_M = least
                torch._dynamo.reset()
                fn = model if mode == "eager" else torch.compile(model)
                with torch.no_grad():
                    times[name] = bench_ms(lambda fn=fn, t=tokens: fn(t), warmup=3, rep=10)
            wo.DEQUANT_MIN_M = rule
            print(f"B{b} S{s} {mode:8s}: bf16 {times['bf16']:7.2f} ms | NVFP4 {times['nvfp4']:7.2f} ms "
                  f"({times['bf16'] / times['nvfp4']:4.2f}x) | NVFP4, kernel only {times['nvfp4 kernel']:7.2f} ms "
                  f"({times['bf16'] / times['nvfp4 kernel']:4.2f}x)", flush=True)


if __name__ == "__main__":
    main()
