"""Same-run A/B of two versions of the GEMM kernel module on the grouped GEMMs of ``bench moe``:
an old ``blockscaled_gemm.py`` (REF below) against the working tree's (new). Contiguous (forward) GEMMs
with uniform routed counts and K-grouped (weight-gradient) GEMMs with every expert's tokens
equal, each with the configs the library picks. Outputs are asserted bit-identical; TFLOPS over
the routed rows, ``bench_ms`` (L2 flushed), four rounds in alternating order (median of the
middle two first, then every round).

    git show REF:lowprec/gemm/sm90/blockscaled_gemm.py > lowprec/gemm/sm90/blockscaled_gemm_old_tmp.py
    python benchmarks/ab_grouped_versions.py

REF: HEAD, or the commit to compare with. Before session 18 the module was self-contained (only
``.config``); since then it imports ``.mainloop`` and ``lowprec.cute``, which the old copy shares
with the new one: to A/B a change in those, check the old commit out in a second worktree and
copy its files under new names instead. Session 18's refactor against the module before it:
``git show c00e11c:lowprec/gemm/sm90/blockscaled_gemm.py``.
"""
import importlib
import math
import sys

import torch

from lowprec import quantize
from lowprec.bench.common import bench_ms
from lowprec.gemm.sm90 import interface as gi
from lowprec.moe.wgrad import quantize_k_grouped

pkg = importlib.import_module("lowprec.gemm.sm90")
modules = {"old": importlib.import_module("lowprec.gemm.sm90.blockscaled_gemm_old_tmp"),
           "new": importlib.import_module("lowprec.gemm.sm90.blockscaled_gemm")}
kernels = {}
active = ["new"]


def compiled(config, out_dtype, b_block_n, bias, num_sms, arch=None, grouping=None):
    key = (active[0], config, out_dtype, b_block_n, grouping)
    if key not in kernels:
        mod = modules[active[0]]
        sys.modules["lowprec.gemm.sm90.blockscaled_gemm"] = mod
        pkg.blockscaled_gemm = mod
        kernels[key] = gi.build_kernel(config, out_dtype, b_block_n, bias, num_sms, grouping=grouping)
    return kernels[key]


gi._get_compiled = compiled
g = torch.Generator(device="cuda").manual_seed(0)
# (name, experts, rows, N, K): contiguous x·w[e]ᵀ
CONTIGUOUS = [("E8 w1", 8, 8192, 28672, 4096), ("E64 w1", 64, 32768, 4096, 7168), ("E64 w2", 64, 32768, 7168, 2048),
              ("E128 w2", 128, 65536, 2048, 768)]
# (name, experts, tokens, N, P): K-grouped dW[e] = dyₑᵀ·xₑ
KGROUPED = [("E8 dW1", 8, 8192, 28672, 4096), ("E64 dW1", 64, 32768, 4096, 7168), ("E64 dW2", 64, 32768, 7168, 2048)]


def uniform_counts(rows: int, experts: int) -> torch.Tensor:
    ids = torch.randint(0, experts, (rows,), generator=g, device="cuda")
    return torch.bincount(ids, minlength=experts).cumsum(0).to(torch.int32)


def cases():
    for name, e, rows, n, k in CONTIGUOUS:
        a = quantize(torch.randn(rows, k, device="cuda", generator=g).bfloat16(), "fp8_block1x128")
        w = quantize((torch.randn(e, n, k, device="cuda", generator=g) / math.sqrt(k)).bfloat16(), "fp8_block128x128")
        ends = uniform_counts(rows, e)
        yield name, 2.0 * rows * n * k, lambda a=a, w=w, ends=ends: gi.grouped_gemm_blockwise_fp8(
            a.data, a.scale, w.data, w.scale, group_ends=ends)
    for name, e, tokens, n, p in KGROUPED:
        ends = (torch.arange(1, e + 1, device="cuda") * (tokens // e)).to(torch.int32)
        dy, aligned = quantize_k_grouped(torch.randn(tokens, n, device="cuda", generator=g), ends)
        x, _ = quantize_k_grouped(torch.randn(tokens, p, device="cuda", generator=g).bfloat16(), ends)
        yield name, 2.0 * tokens * n * p, lambda dy=dy, x=x, aligned=aligned: gi.grouped_gemm_wgrad_fp8(
            dy.data, dy.scale, x.data, x.scale, aligned, torch.bfloat16)


def timed(which, fn):
    active[0] = which
    return bench_ms(fn, warmup=3, rep=20)


for name, flops, fn in cases():
    outs = {}
    for which in modules:
        active[0] = which
        outs[which] = fn()
    assert torch.equal(outs["old"], outs["new"]), name
    del outs
    res = {"old": [], "new": []}
    for order in (("old", "new"), ("new", "old"), ("old", "new"), ("new", "old")):
        for which in order:
            res[which].append(flops / timed(which, fn) / 1e9)
    cells = [f"{w} {sum(sorted(v)[1:3]) / 2:.0f} ({' '.join(f'{x:.0f}' for x in v)})" for w, v in res.items()]
    print(f"{name:8s} " + " | ".join(cells), flush=True)
