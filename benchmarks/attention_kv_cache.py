# ruff: noqa: B023  (scratch script: step closures timed inside their own iteration)
"""A decode loop's attention on a growing cache: per step, append one token's K and V, then attend
(eager, as a generation loop calls it). Compared in the same run:

- ``fp8 cache``: :class:`lowprec.attention.FP8KVCache` (append quantizes the new token and the
  partial K block; attend reads the buffers in place);
- ``fp8 requantized``: the whole cache quantized again each step (``quantize_kv_cache`` then
  ``lowprec.attention``), what a loop had to do before the growing cache;
- ``bf16 cache``: a preallocated bf16 cache written in place, ``F.scaled_dot_product_attention``
  (flash backend) on its length-L views (GQA through ``enable_gqa``). SDPA's default backend here,
  cuDNN, builds an execution plan for every new length (~50 ms a step in a growing loop).

    python benchmarks/attention_kv_cache.py [--shapes B,H,Hkv,Sk,D;...] [--steps 64]

Each row: µs per step, the mean over ``--steps`` steps queued back to back (CUDA events around the
loop; the host runs ahead as it does in a generation loop) after a warm-up, and synced (the host
waits for each step: its host time shows). Prints the ratios to the bf16 cache (eager, queued).
Then ``graph`` rows: one CUDA graph per cache replayed once per step (``FP8KVCache.decode_step``,
lengths on the device, against a bf16 static cache: the token written at a device position, SDPA
over the whole buffer with a mask of the live positions, as transformers' StaticCache runs).
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import lowprec
from lowprec.attention import FP8KVCache, quantize_kv_cache
from lowprec.bench.common import print_table


def _loop_us(step, steps: int, synced: bool) -> float:
    for i in range(3):
        step(i)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for i in range(steps):
        step(i)
        if synced:
            torch.cuda.synchronize()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / steps


def _write_token(k_buf, v_buf, length: list, new_k, new_v, i: int) -> int:
    """Token ``i`` of the new ones written at position ``length[0]`` of a bf16 cache, which grows by
    one; returns that position."""
    n = length[0]
    k_buf[:, :, n:n + 1] = new_k[:, :, i:i + 1]
    v_buf[:, :, n:n + 1] = new_v[:, :, i:i + 1]
    length[0] = n + 1
    return n


def _replay_us(graph, steps: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(steps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / steps


def _graph_rows(b, h, hkv, sk, d, steps, k, v, new_k, new_v, q, bf16_eager_us):
    """One CUDA graph per cache replayed ``steps`` times, each replay one decode step at the next
    length: FP8KVCache.decode_step (lengths on the device) against a bf16 static cache (the
    transformers StaticCache way: the token written at a device position, SDPA over the whole
    buffer with a mask of the live positions)."""
    max_len = sk + 2 * steps + 8
    cache = FP8KVCache(b, hkv, max_len, d, device="cuda")
    cache.append(k, v)
    k_in, v_in = new_k[:, :, :1].clone(), new_v[:, :, :1].clone()
    cache.decode_step(q, k_in, v_in)  # compiles, outside the capture
    fp8_graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(fp8_graph):
        cache.decode_step(q, k_in, v_in)

    k_bf = torch.zeros(b, hkv, max_len, d, device="cuda", dtype=torch.bfloat16)
    v_bf = torch.zeros_like(k_bf)
    k_bf[:, :, :sk], v_bf[:, :, :sk] = k, v
    pos = torch.full((1,), sk, device="cuda", dtype=torch.long)
    keys = torch.arange(max_len, device="cuda")

    def bf16_step():
        k_bf.index_copy_(2, pos, k_in)
        v_bf.index_copy_(2, pos, v_in)
        mask = (keys <= pos)[None, None, None, :]
        # a KV head's query heads as its rows (transformers' decode packing): no K / V repeat
        out = F.scaled_dot_product_attention(q.view(b, hkv, h // hkv, d), k_bf, v_bf, attn_mask=mask)
        pos.add_(1)
        return out

    bf16_step()  # warm-up outside the capture
    bf16_graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(bf16_graph):
        bf16_step()
    bf16_us, fp8_us = _replay_us(bf16_graph, steps), _replay_us(fp8_graph, steps)
    shape = f"B{b} H{h}/{hkv} Sk{sk} d{d}"
    return [(shape, "graph", "bf16 static cache (masked SDPA)", f"{bf16_us:.1f}", f"{bf16_eager_us / bf16_us:.2f}"),
            (shape, "graph", "fp8 cache decode_step", f"{fp8_us:.1f}", f"{bf16_eager_us / fp8_us:.2f}"),
            (shape, "graph", "fp8 decode_step x bf16 static graph", "-", f"{bf16_us / fp8_us:.2f}")]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="1,32,8,8192,128;8,32,8,8192,128;64,32,8,8192,128;8,32,32,8192,128")
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--profile", action="store_true", help="also print torch.profiler's table of 20 fp8 cache steps")
    p.add_argument("--host-profile", action="store_true", help="also print cProfile's top functions over 200 fp8 steps")
    args = p.parse_args()
    rows = []
    for spec in args.shapes.split(";"):
        b, h, hkv, sk, d = (int(x) for x in spec.split(","))
        steps = args.steps
        max_len = sk + 4 * (steps + 3) + 16
        g = torch.Generator(device="cuda").manual_seed(0)
        k = torch.randn(b, hkv, sk, d, device="cuda", generator=g).to(torch.bfloat16)
        v = torch.randn(b, hkv, sk, d, device="cuda", generator=g).to(torch.bfloat16)
        new_k = torch.randn(b, hkv, max_len - sk, d, device="cuda", generator=g).to(torch.bfloat16)
        new_v = torch.randn_like(new_k)
        q = torch.randn(b, h, 1, d, device="cuda", generator=g).to(torch.bfloat16)

        for synced in (False, True):
            cache = FP8KVCache(b, hkv, max_len, d, device="cuda")
            cache.append(k, v)

            def fp8_step(i):
                cache.append(new_k[:, :, i:i + 1], new_v[:, :, i:i + 1])
                return cache.attend(q)

            k_bf = torch.zeros(b, hkv, max_len, d, device="cuda", dtype=torch.bfloat16)
            v_bf = torch.zeros_like(k_bf)
            k_bf[:, :, :sk] = k
            v_bf[:, :, :sk] = v
            length = [sk]

            def bf16_step(i):
                n = _write_token(k_bf, v_bf, length, new_k, new_v, i)
                # the flash backend: cuDNN's (the default here) builds a plan per new length
                with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                    return F.scaled_dot_product_attention(q, k_bf[:, :, :n + 1], v_bf[:, :, :n + 1],
                                                          enable_gqa=hkv != h)

            k_re, v_re = k_bf.clone(), v_bf.clone()
            re_length = [sk]

            def requant_step(i):
                n = _write_token(k_re, v_re, re_length, new_k, new_v, i)
                kq, vq = quantize_kv_cache(k_re[:, :, :n + 1], v_re[:, :, :n + 1])
                return lowprec.attention(q, kq, vq, quant="fp8")

            times = {name: _loop_us(fn, steps, synced) for name, fn in
                     (("bf16 cache", bf16_step), ("fp8 cache", fp8_step), ("fp8 requantized", requant_step))}
            if not synced:
                bf16_queued_us = times["bf16 cache"]
            for name, us in times.items():
                rows.append((f"B{b} H{h}/{hkv} Sk{sk} d{d}", "synced" if synced else "queued", name, f"{us:.1f}",
                             f"{times['bf16 cache'] / us:.2f}"))
        rows.extend(_graph_rows(b, h, hkv, sk, d, steps, k, v, new_k, new_v, q, bf16_queued_us))
        if args.profile:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for i in range(20):
                    fp8_step(i)
                torch.cuda.synchronize()
            print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=25))
        if args.host_profile:
            import cProfile
            import pstats

            cache.reset()
            cache.append(k, v)
            prof = cProfile.Profile()
            prof.enable()
            for i in range(200):
                fp8_step(i % steps)
            prof.disable()
            torch.cuda.synchronize()
            pstats.Stats(prof).sort_stats("tottime").print_stats(25)
        if args.profile or args.host_profile:  # the cache again as the timed loops left it (warm-up, steps)
            cache.reset()
            cache.append(k, v)
            for i in [0, 1, 2, *range(steps)]:
                fp8_step(i)
        # accuracy of the last step against exact attention on the same tokens (bf16 cache's values)
        n = cache.length
        exact = F.scaled_dot_product_attention(q.float(), k_bf[:, :, :n].float(), v_bf[:, :, :n].float(),
                                               enable_gqa=hkv != h)
        out = cache.attend(q)
        cos = F.cosine_similarity(out.float().flatten(), exact.flatten(), dim=0).item()
        rows.append((f"B{b} H{h}/{hkv} Sk{sk} d{d}", "-", f"fp8 cache cos vs exact {cos:.5f}", "-", "-"))
    print(f"# {torch.cuda.get_device_name()}: one decode step (append 1 token + attend), µs per step")
    print_table(["shape", "mode", "cache", "µs/step", "x bf16 cache"], rows)


if __name__ == "__main__":
    main()
