# ruff: noqa: B023, E501
"""Does the fused FP8 attention call gain from running its K / V pre-pass beside the forward?

The call today: K pre-pass, V pre-pass (memory-bound, ~80 µs each on the H200 at B4 H32 S4096
d128), then the forward (compute-bound, at the power cap). Here the heads are cut into ``chunks``
runs of KV heads: a high-priority side stream quantizes chunk g + 1 while the call's stream runs
the forward of chunk g (it waits for chunk g's event). Same kernels, same bits (checked).
    python benchmarks/attention_overlap_probe.py [--shapes 0,1] [--chunks 1,2,4,8]
Prints per shape the whole call (do_bench median, L2 flushed; and synced: one call, then a
synchronize, timed by events) for the shipped op and each chunk count.
"""

from __future__ import annotations

import sys

import torch
from attention_call_breakdown import SHAPES  # the same shapes (benchmarks/ is on sys.path)
from triton.testing import do_bench

from lowprec.attention.sm90 import interface as it
from lowprec.attention.sm90.config import TILE_M, TILE_N, V_PAD

_SIDE = {}


def side_stream(dev):
    if dev not in _SIDE:
        _SIDE[dev] = torch.cuda.Stream(device=dev, priority=-1)
    return _SIDE[dev]


def chunked_call(q, k, v, causal, scale, chunks):
    b, h, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    r = h // hkv
    heads = b * hkv
    assert heads % chunks == 0
    n = heads // chunks
    dev = q.device
    sk_pad = -(-sk // V_PAD) * V_PAD
    k_codes = torch.empty(heads, sk, d, dtype=torch.uint8, device=dev)
    v_t = torch.empty(heads, d, sk_pad, dtype=torch.uint8, device=dev)
    k_scale = torch.empty(heads, sk // TILE_N, device=dev)
    k_mean = torch.empty(heads, d, device=dev)
    v_scale = torch.empty(heads, d, device=dev)
    parts = torch.empty(2, it.prepass_partials_numel(n, d), device=dev)
    q_scale = torch.empty(b * h, sq // TILE_M, device=dev)
    out = torch.empty(b, h, sq, d, dtype=q.dtype, device=dev)
    lse = torch.empty(b * h, sq, device=dev)
    kf, vf, qf, of = k.view(heads, sk, d), v.view(heads, sk, d), q.view(b * h, sq, d), out.view(b * h, sq, d)
    main = torch.cuda.current_stream(dev)
    side = side_stream(dev)
    side.wait_stream(main)
    events = []
    with torch.cuda.stream(side):
        for g in range(chunks):
            s0, s1 = g * n, (g + 1) * n
            it._launch_prepass_k(kf[s0:s1].unsqueeze(0), k_codes[s0:s1], k_scale[s0:s1].view(-1, 1),
                                 k_mean[s0:s1], parts[0])
            it._launch_prepass_v("v_perm", vf[s0:s1].unsqueeze(0), v_t[s0:s1].view(-1, sk_pad),
                                 v_scale[s0:s1], parts[1])
            ev = torch.cuda.Event()
            ev.record(side)
            events.append(ev)
    for g in range(chunks):
        s0, s1 = g * n, (g + 1) * n
        main.wait_event(events[g])
        o, l_ = it._forward(qf[s0 * r:s1 * r].unsqueeze(0), q_scale[s0 * r:s1 * r].unsqueeze(0),
                            k_codes[s0:s1].unsqueeze(0), k_scale[s0:s1].unsqueeze(0), v_t[s0:s1].unsqueeze(0),
                            v_scale[s0:s1].unsqueeze(0), causal, scale, q.dtype, out=of[s0 * r:s1 * r].unsqueeze(0),
                            v_keys_permuted=True, quantize_q=True)
        lse[s0 * r:s1 * r] = l_.view(-1, sq)
    return out, lse.view(b, h, sq), k_mean.view(b, hkv, d)


def synced_ms(fn, reps=30):
    flush = torch.empty(256 * 1024 * 1024 // 4, dtype=torch.int32, device="cuda")
    times = []
    for _ in range(reps):
        flush.zero_()
        torch.cuda.synchronize()
        a, z = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        z.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(z))
    times.sort()
    return times[len(times) // 2]


def main():
    shapes = SHAPES
    if "--shapes" in sys.argv:
        shapes = [SHAPES[int(i)] for i in sys.argv[sys.argv.index("--shapes") + 1].split(",")]
    chunk_counts = [2, 4, 8]
    if "--chunks" in sys.argv:
        chunk_counts = [int(c) for c in sys.argv[sys.argv.index("--chunks") + 1].split(",")]
    for b, h, hkv, s, d, causal in shapes:
        torch.manual_seed(0)
        q = torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(b, hkv, s, d, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(b, hkv, s, d, device="cuda", dtype=torch.bfloat16)
        scale = d ** -0.5
        assert it.quantizes_q(b, h, hkv, s, s)
        ref = it.attention_fp8_qkv_op(q, k, v, causal, scale)
        shipped = lambda: it.attention_fp8_qkv_op(q, k, v, causal, scale)
        row = [f"B{b} H{h}/{hkv} S{s} d{d} {'causal' if causal else 'full':6s}",
               f"shipped {do_bench(shipped, warmup=25, rep=200, return_mode='median'):.3f} / {synced_ms(shipped):.3f}"]
        for c in chunk_counts:
            if (b * hkv) % c:
                continue
            got = chunked_call(q, k, v, causal, scale, c)
            torch.cuda.synchronize()
            same = all(torch.equal(x, y) for x, y in zip(ref, got))
            fn = lambda: chunked_call(q, k, v, causal, scale, c)
            row.append(f"{c} chunks {do_bench(fn, warmup=25, rep=200, return_mode='median'):.3f} / "
                       f"{synced_ms(fn):.3f}{'' if same else ' (BITS DIFFER)'}")
        print(" | ".join(row), flush=True)


if __name__ == "__main__":
    main()
