# ruff: noqa: B023, E501
"""Timing of the FP8 attention pre-pass (K smoothed, V transposed, the whole qkv pre-pass) and the
eager ``lowprec.attention(..., quant="fp8")`` call, do_bench median (L2 flushed), bf16 inputs.
    python benchmarks/attention_prepass_timing.py [--pkg DIR] [--tag NAME] [--ring-kb N,...]
        [--target-ctas N,...] [--fix-target N]
``--pkg DIR`` imports lowprec from DIR (an older tree, for an A/B in one run); ``--ring-kb`` /
``--target-ctas``: time the K and V kernels with each ring size (``config.PREPASS_RING_BYTES``) /
launch size the cluster rule aims at (``config.PREPASS_TARGET_CTAS``), rounds interleaved, bits
compared; ``--fix-target N``: the launch size for a ring sweep."""

from __future__ import annotations

import sys

if "--pkg" in sys.argv:
    sys.path.insert(0, sys.argv[sys.argv.index("--pkg") + 1])

import torch  # noqa: E402
from triton.testing import do_bench  # noqa: E402

import lowprec  # noqa: E402
from lowprec.attention.quantize import quantize_k, quantize_qkv, quantize_v  # noqa: E402

SHAPES = [  # B, H, Hkv, S, D, causal
    (4, 32, 32, 4096, 128, False),
    (4, 32, 8, 4096, 128, True),
    (4, 32, 32, 4096, 64, False),
    (4, 16, 16, 4096, 256, False),
    (1, 32, 32, 16384, 128, True),
    (16, 32, 32, 1024, 128, True),
]


def sweep(knob: str, values, rounds=3):
    """K and V pre-pass kernels per value of ``knob`` (ring KB or target CTAs), same process,
    rounds interleaved."""
    from lowprec.attention.sm90 import config, interface

    def use(x):
        if knob == "ring":
            config.PREPASS_RING_BYTES = x * 1024
        else:
            config.PREPASS_TARGET_CTAS = (x, x // 2)
        interface._prepass_ffi.cache_clear()
        return config.prepass_cluster(B * Hkv, S, D * 2)

    sizes_kb = values if knob == "ring" else [config.PREPASS_RING_BYTES // 1024]

    for B, _, Hkv, S, D, _ in SHAPES:
        if any(kb * 1024 // (config.TILE_N * D * 2) < 2 for kb in sizes_kb):
            continue  # a ring of fewer than two blocks: no kernel
        g = torch.Generator(device="cuda").manual_seed(0)
        k = torch.randn(B, Hkv, S, D, device="cuda", dtype=torch.bfloat16, generator=g) + 0.5
        v = torch.randn(B, Hkv, S, D, device="cuda", dtype=torch.bfloat16, generator=g)
        times = {(x, n): [] for x in values for n in "kv"}
        ref, clusters = {}, {}
        for _ in range(rounds):
            for x in values:
                clusters[x] = use(x)
                for n, f in (("k", lambda: quantize_k(k)), ("v", lambda: quantize_v(v))):
                    out = f()
                    ref.setdefault(n, out)
                    # K's mean sums in an order that follows the cluster size: its bits may move
                    assert (knob != "ring" and n == "k") or all(torch.equal(a.view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a,
                                           b.view(torch.uint8) if b.dtype == torch.float8_e4m3fn else b)
                               for a, b in zip(out, ref[n])), f"{n}: {knob} {x} changed the bits"
                    times[(x, n)].append(do_bench(f, warmup=20, rep=200, return_mode="median") * 1e3)
        med = {key: sorted(t)[len(t) // 2] for key, t in times.items()}
        print(f"B{B} H{Hkv} S{S} d{D} us: " + "  ".join(
            f"{knob} {x} (cluster {clusters[x]}) K {med[(x, 'k')]:.1f} V {med[(x, 'v')]:.1f}"
            for x in values), flush=True)


def main():
    if "--fix-target" in sys.argv:  # a ring sweep at another launch size
        from lowprec.attention.sm90 import config
        n = int(sys.argv[sys.argv.index("--fix-target") + 1])
        config.PREPASS_TARGET_CTAS = (n, n // 2)
    for flag, knob in (("--ring-kb", "ring"), ("--target-ctas", "ctas")):
        if flag in sys.argv:
            return sweep(knob, [int(x) for x in sys.argv[sys.argv.index(flag) + 1].split(",")])
    tag = sys.argv[sys.argv.index("--tag") + 1] if "--tag" in sys.argv else "new"
    print(f"[{tag}] lowprec from {lowprec.__file__}")
    for B, H, Hkv, S, D, causal in SHAPES:
        g = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, generator=g)
        k = torch.randn(B, Hkv, S, D, device="cuda", dtype=torch.bfloat16, generator=g) + 0.5
        v = torch.randn(B, Hkv, S, D, device="cuda", dtype=torch.bfloat16, generator=g)
        res = {}
        k8, k16 = torch.empty(k.shape, device="cuda", dtype=torch.float8_e4m3fn), torch.empty_like(k)
        # the ceilings of one pass over K: a bf16 copy (the HBM rate) and torch's cast, which reads it
        # once and writes its codes
        for name, f in (("copy", lambda: k16.copy_(k)), ("cast", lambda: k8.copy_(k)),
                        ("k", lambda: quantize_k(k)), ("v", lambda: quantize_v(v)),
                        ("qkv", lambda: quantize_qkv(q, k, v)),
                        ("call", lambda: lowprec.attention(q, k, v, causal=causal, quant="fp8"))):
            f()
            res[name] = do_bench(f, warmup=20, rep=200, return_mode="median") * 1e3
        kv_mb = 2 * B * Hkv * S * D * 2 / 1e6
        line = " ".join(f"{n} {t:7.1f}" for n, t in res.items())
        print(f"[{tag}] B{B} H{H}/{Hkv} S{S} d{D} {'causal' if causal else 'full':6s} us: {line}"
              f"  (K+V read once: {kv_mb / 3.0e3 * 1e3:.0f} us at 3 TB/s + writes {kv_mb / 2 / 3.0e3 * 1e3:.0f})")


if __name__ == "__main__":
    main()
