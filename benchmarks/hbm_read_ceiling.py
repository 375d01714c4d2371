# ruff: noqa: B023
"""What one streaming pass over K can reach on this GPU: the ceilings the K / V pre-pass is judged by.

K is B4 H32 S4096 D (bf16, 134 MB at D = 128) as [heads·S, D]. Rows, do_bench median (L2 flushed):
- ``copy``: torch's bf16 copy (one read, one write of the same bytes);
- ``cast``: torch's cast to E4M3 (one read, a half-size write);
- ``sum-torch``: torch's sum over the tokens (read only);
- ``sum-ld`` / ``sum-tma``: a Triton column sum per (head, 512-token chunk), tiles of 32 tokens read
  by plain loads (cp.async-pipelined) or by TMA descriptors into an FP32 accumulator per element,
  reduced once at the end: read only;
- ``cast-ld``: Triton, each 32-token tile read and written as E4M3 (the pre-pass's second pass
  without its statistic).

    python benchmarks/hbm_read_ceiling.py [D]
"""

from __future__ import annotations

import sys

import torch
import triton
import triton.language as tl
from triton.testing import do_bench

CHUNK = 512  # tokens per program
TILE = 32


@triton.jit
def _sum_ld(x_ptr, out_ptr, D: tl.constexpr, CHUNK: tl.constexpr, TILE: tl.constexpr, STAGES: tl.constexpr):
    pid = tl.program_id(0)
    rows = tl.arange(0, TILE)
    cols = tl.arange(0, D)
    acc = tl.zeros((TILE, D), tl.float32)  # reduced over the tokens once, after the loop
    for t in tl.range(0, CHUNK // TILE, num_stages=STAGES):
        ptrs = x_ptr + (pid * CHUNK + t * TILE + rows)[:, None].to(tl.int64) * D + cols[None, :]
        acc += tl.load(ptrs).to(tl.float32)
    tl.store(out_ptr + pid * D + cols, tl.sum(acc, 0))


@triton.jit
def _sum_tma(desc, out_ptr, D: tl.constexpr, CHUNK: tl.constexpr, TILE: tl.constexpr, STAGES: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, D)
    acc = tl.zeros((TILE, D), tl.float32)
    for t in tl.range(0, CHUNK // TILE, num_stages=STAGES):
        acc += desc.load([pid * CHUNK + t * TILE, 0]).to(tl.float32)
    tl.store(out_ptr + pid * D + cols, tl.sum(acc, 0))


@triton.jit
def _cast_ld(x_ptr, y_ptr, D: tl.constexpr, CHUNK: tl.constexpr, TILE: tl.constexpr, STAGES: tl.constexpr):
    pid = tl.program_id(0)
    rows = tl.arange(0, TILE)
    cols = tl.arange(0, D)
    for t in tl.range(0, CHUNK // TILE, num_stages=STAGES):
        offs = (pid * CHUNK + t * TILE + rows)[:, None].to(tl.int64) * D + cols[None, :]
        tl.store(y_ptr + offs, tl.load(x_ptr + offs).to(tl.float8e4nv))


def main() -> None:
    d = int(sys.argv[1]) if len(sys.argv) > 1 else 128
    rows = 4 * 32 * 4096
    k = torch.randn(rows, d, device="cuda", dtype=torch.bfloat16)
    nbytes = k.numel() * 2
    programs = rows // CHUNK
    part = torch.empty(programs, d, device="cuda", dtype=torch.float32)
    k16, k8 = torch.empty_like(k), torch.empty(rows, d, device="cuda", dtype=torch.float8_e4m3fn)
    print(f"{torch.cuda.get_device_name()}  K [{rows}, {d}] bf16 = {nbytes / 1e6:.0f} MB; "
          "µs, MB moved (read + write), TB/s")

    def report(name, fn, moved):
        us = do_bench(fn) * 1e3
        print(f"  {name:34s} {us:7.1f} µs  {moved / 1e6:5.0f} MB  {moved / us / 1e6:5.2f} TB/s", flush=True)

    report("copy (torch)", lambda: k16.copy_(k), 2 * nbytes)
    report("cast to e4m3 (torch)", lambda: k8.copy_(k), nbytes * 3 // 2)
    report("sum over tokens (torch)", lambda: k.view(128, 4096, d).sum(1), nbytes)
    for warps in (4, 8):
        for stages in (2, 3, 4):
            report(f"sum-ld warps {warps} stages {stages}",
                   lambda: _sum_ld[(programs,)](k, part, d, CHUNK, TILE, stages, num_warps=warps), nbytes)
            report(f"cast-ld warps {warps} stages {stages}",
                   lambda: _cast_ld[(programs,)](k, k8, d, CHUNK, TILE, stages, num_warps=warps), nbytes * 3 // 2)
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor
        desc = TensorDescriptor.from_tensor(k, [TILE, d])
    except Exception as err:  # an older Triton: no host descriptors
        print(f"  sum-tma: no TensorDescriptor ({type(err).__name__}: {err})")
        return
    for warps in (4, 8):
        for stages in (2, 3, 4):
            report(f"sum-tma warps {warps} stages {stages}",
                   lambda: _sum_tma[(programs,)](desc, part, d, CHUNK, TILE, stages, num_warps=warps), nbytes)
    ref = k.view(programs, CHUNK, d).float().sum(1)
    _sum_tma[(programs,)](desc, part, d, CHUNK, TILE, 3, num_warps=4)
    print(f"  sum-tma max |err| vs torch: {(part - ref).abs().max().item():.3g}")


if __name__ == "__main__":
    main()
