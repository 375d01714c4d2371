"""Microbenchmark: MUFU.EX2 throughput on this GPU, FP32 (ex2.approx.ftz.f32) against packed
half (ex2.approx.f16x2, two exponentials per instruction). Prints exponentials per clock per SM.
The attention softmax spends one MUFU.EX2 per score (NOTES.md: the loop's MUFU share)."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.testing import do_bench

ITERS = 2048


@triton.jit
def _ex2(v, HALF: tl.constexpr):
    if HALF:  # two exponentials per instruction
        return tl.inline_asm_elementwise("ex2.approx.f16x2 $0, $1;", "=r,r", [v], dtype=tl.float16, is_pure=True,
                                         pack=2)
    else:
        return tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=f,f", [v], dtype=tl.float32, is_pure=True,
                                         pack=1)


@triton.jit
def _ex2_loop(x_ptr, out_ptr, ITERS: tl.constexpr, BLOCK: tl.constexpr, HALF: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs)
    if HALF:
        x = x.to(tl.float16)
    a, b, c, d = x, x + 0.25, x + 0.5, x - 0.25  # four independent chains per thread
    for _ in range(ITERS):
        a, b, c, d = _ex2(a, HALF), _ex2(b, HALF), _ex2(c, HALF), _ex2(d, HALF)
        a, b, c, d = a - 1.5, b - 1.5, c - 1.5, d - 1.5
    tl.store(out_ptr + offs, (a + b + c + d).to(tl.float32))


def main():
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    block = 1024
    n = sms * 16 * block
    x = torch.rand(n, device="cuda") - 0.5
    out = torch.empty_like(x)
    for name, half in (("f32", False), ("f16x2", True)):
        fn = functools.partial(_ex2_loop[(n // block,)], x, out, ITERS=ITERS, BLOCK=block, HALF=half, num_warps=8)
        fn()
        ms = do_bench(fn, warmup=5, rep=50)
        exps = n * 4 * ITERS
        clk = 1.755e9  # H100 SXM under load (approximate): the ratio between the rows is what counts
        per_clk = exps / (ms * 1e-3) / sms / clk
        print(f"{name:6s} {ms:.3f} ms  {exps / ms / 1e6:.0f} G exp/s  ~{per_clk:.1f} exp/clk/SM")


if __name__ == "__main__":
    main()
