# ruff: noqa: B023, E501  (scratch script: lambdas timed inside their own iteration)
"""Same-run A/B of one interface flag of the sm_90a FP8 attention kernel (kernel only, Vᵀ permuted
as the fused call runs it), rounds interleaved, do_bench median with L2 flushed. Usage:
    python benchmarks/attention_ab.py FLAG VALUE_A VALUE_B [--rounds N] [--decode] [--graph] [--full] [--shapes I,J]
e.g. ``PV_ROWSUM 0 1``. Prints ms per shape and value, and the ratio. ``--full``: the whole
``lowprec.attention(q, k, v, quant="fp8")`` call (pre-pass kernels and forward) instead of the kernel."""

from __future__ import annotations

import functools
import sys

import torch
from triton.testing import do_bench

sys.path.insert(0, ".")
import lowprec  # noqa: E402
from lowprec.attention.sm90 import interface  # noqa: E402
from lowprec.attention.sm90.interface import fp8_attention_forward, permute_v_keys  # noqa: E402
from lowprec.bench.common import cuda_graph_replay  # noqa: E402
from tests.attention.test_sm90 import quantize_inputs  # noqa: E402

sys.path.insert(0, "benchmarks")
from attention_sm90_timing import SHAPES, SHORT  # noqa: E402  (the timing script's shapes)

SHAPES = SHAPES + SHORT
# decode (--decode): Sq 1..16 over long KV at batches under a wave, where split-KV applies
DECODE = [(1, 32, 8, 1, 8192, 128, False), (4, 32, 8, 1, 8192, 128, False), (1, 32, 8, 16, 32768, 128, True),
          (8, 32, 8, 4, 16384, 128, True), (2, 32, 32, 1, 16384, 128, False), (64, 32, 8, 1, 8192, 128, False),
          (8, 32, 32, 1, 8192, 128, False), (64, 32, 32, 1, 4096, 128, False), (1, 32, 32, 16, 16384, 64, True),
          (8, 16, 16, 1, 8192, 256, False), (2, 16, 16, 1, 16384, 256, False), (1, 16, 16, 16, 16384, 256, True)]


def main():
    flag, a, b = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    rounds = int(sys.argv[sys.argv.index("--rounds") + 1]) if "--rounds" in sys.argv else 3
    shapes = DECODE if "--decode" in sys.argv else SHAPES
    if "--shapes" in sys.argv:  # indices into the list, e.g. --shapes 0,1,5
        shapes = [shapes[int(i)] for i in sys.argv[sys.argv.index("--shapes") + 1].split(",")]
    for B, H, Hkv, Sq, Sk, D, causal in shapes:
        q = torch.randn(B, H, Sq, D, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(B, Hkv, Sk, D, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(B, Hkv, Sk, D, device="cuda", dtype=torch.bfloat16)
        qc, qs, kc, ks, vt, vs = quantize_inputs(q, k, v)
        vtp = permute_v_keys(vt)
        out = torch.empty(B, H, Sq, D, device="cuda", dtype=torch.bfloat16)
        fn = functools.partial(fp8_attention_forward, qc, qs, kc, ks, vtp, vs, causal=causal, softmax_scale=D ** -0.5,
                               out_dtype=torch.bfloat16, out=out, v_keys_permuted=True)
        if "--full" in sys.argv:
            fn = functools.partial(lowprec.attention, q, k, v, causal=causal, quant="fp8")
        times = {a: [], b: []}
        for _ in range(rounds):
            for val in (a, b):
                current = getattr(interface, flag)  # None: a rule; the A/B forces the value
                setattr(interface, flag, val if current is None else type(current)(val))
                fn()
                times[val].append(do_bench(cuda_graph_replay(fn) if "--graph" in sys.argv else fn, warmup=50, rep=300,
                                           return_mode="median"))
        ta, tb = (sorted(times[x])[len(times[x]) // 2] for x in (a, b))
        f = 4 * B * H * Sq * Sk * D * (0.5 if causal else 1.0)
        print(f"B{B} H{H}/{Hkv} S{Sq} d{D} {'causal' if causal else 'full':6s} {flag}={a}: {ta:.3f} ms "
              f"({f / ta / 1e9:.0f} TFLOPS)  {flag}={b}: {tb:.3f} ms ({f / tb / 1e9:.0f})  b/a time {tb / ta:.3f}", flush=True)


if __name__ == "__main__":
    main()
