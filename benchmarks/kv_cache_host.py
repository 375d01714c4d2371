# ruff: noqa: B023  (step closures timed inside their own iteration)
"""Host time of an eager decode step on :class:`lowprec.attention.FP8KVCache`: each call alone
(``append`` of one token, ``attend`` of one query, ``decode_step``) and a whole step, back to back
(the GPU keeps up at small batches, so µs per call is the host's), next to a bf16 cache written in
place + SDPA flash in the same process; then cProfile's top functions of ``append`` + ``attend``.

    python benchmarks/kv_cache_host.py [--shapes B,H,Hkv,Sk,D;...] [--old DIR] [--profile] [--pieces]
                                       [--sync-probe] [--graph]

``--graph``: also ``decode_step`` replayed from a CUDA graph (10 steps a graph, the GPU time per
step: no host time), per tree.

``--old DIR``: also time another tree (a directory holding it as package ``lowprec_old``, e.g.
``git archive HEAD lowprec | tar -x -C DIR && mv DIR/lowprec DIR/lowprec_old``), same process,
interleaved rounds.
"""

from __future__ import annotations

import argparse
import cProfile
import importlib
import math
import pstats
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from lowprec.attention import FP8KVCache
from lowprec.bench.common import back_to_back_us, bench_graph_ms, print_table

_CALLS, _REPS, _WARMUP = 50, 5, 20
_GROWTH = (_CALLS * _REPS + _WARMUP) * 2 + 64  # tokens a measurement may append


def _fp8_calls(cache_cls, b, h, hkv, sk, d, k, v, q, new_k, new_v):
    cache = cache_cls(b, hkv, sk + _GROWTH, d, device="cuda")

    def fresh():
        cache.reset()
        cache.append(k, v)

    def append():
        cache.append(new_k, new_v)

    def step():
        cache.append(new_k, new_v)
        return cache.attend(q)

    return fresh, {
        "append": append,
        "attend": lambda: cache.attend(q),
        "append + attend": step,
        "decode_step": lambda: cache.decode_step(q, new_k, new_v),
    }


_B1 = (1, 32, 8, 8192, 128)  # B, H, Hkv, Sk, D of the --pieces and --sync-probe runs


def _b1_decode():
    """A B1 H32/8 Sk8192 d128 cache holding a prompt, attended once (its kernels bound): ``(cache,
    k, v, new_k, new_v, q)``, the prompt's K / V, one new token's and one query, bf16."""
    b, h, hkv, sk, d = _B1
    bf = torch.bfloat16
    cache = FP8KVCache(b, hkv, sk + _GROWTH, d, device="cuda")
    k, v = (torch.randn(b, hkv, sk, d, device="cuda").to(bf) for _ in range(2))
    new_k, new_v = (torch.randn(b, hkv, 1, d, device="cuda").to(bf) for _ in range(2))
    q = torch.randn(b, h, 1, d, device="cuda").to(bf)
    cache.append(k, v)
    cache.attend(q)
    return cache, k, v, new_k, new_v, q


def _pieces():
    """µs per call of each piece of an eager B1 H32/8 d128 decode step (back to back)."""
    from lowprec.attention.sm90.config import kv_append_tokens_unsupported
    from lowprec.runtime import on_device

    cache, _, _, new_k, new_v, q = _b1_decode()
    cache.append(new_k, new_v)
    sk, d, bf = _B1[3], _B1[4], q.dtype
    attend = cache._prepared["attention_fp8_cache_attend", (q.shape, bf, 1.0 / math.sqrt(d))]
    append = cache._prepared["attention_fp8_cache_append", ()]
    launch, front, back, _ = next(iter(attend._by_splits.values()))
    lengths = cache._device_lengths
    dev = q.device
    pieces = {
        "torch.empty (cuda, 4 KB)": lambda: torch.empty((1, 32, 1, 128), dtype=bf, device=dev),
        "tensor.view": lambda: q.view(-1, 128),
        "lengths.add_(0)": lambda: lengths.add_(0),
        "on_device": lambda: on_device(dev),
        "_check_q": lambda: cache._check_q(q),
        "_check_kv": lambda: cache._check_kv(new_k, new_v),
        "length": lambda: cache.length,
        "Q pre-pass launch": lambda: attend.q_kernel(q.view(-1, attend.q_row), *attend.q_dst),
        "forward launch": lambda: launch.fn(*front, *back, attend.scale_log2, *launch.ints, attend.plan),
        "CacheAttention call": lambda: attend(q, sk),
        "CacheAppend check (no launch)": lambda: kv_append_tokens_unsupported(new_k, new_v, None),
        "CacheAppend call": lambda: append(new_k, new_v, None),
        "attend": lambda: cache.attend(q),
    }
    rows = [(name, f"{back_to_back_us(fn, _CALLS, _REPS, _WARMUP):.2f}") for name, fn in pieces.items()]
    print(f"# {torch.cuda.get_device_name()}: pieces of a B1 H32/8 Sk{sk} d128 decode step, µs per call "
          f"(splits {list(attend._by_splits)})")
    print_table(["piece", "µs"], rows)


def _sync_probe():
    """Host µs to issue each call of a B1 H32/8 decode step right after ~2 ms of GPU work was queued
    (``torch.cuda._sleep``), median of 20: a call that waits for the GPU (a hidden sync) shows the
    queue's ~2000 µs, one that does not its host time. SDPA and a torch op as controls."""
    cache, k, v, new_k, new_v, q = _b1_decode()
    cache.decode_step(q, new_k, new_v)
    torch.cuda.synchronize()
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(1_000_000)
    end.record()
    torch.cuda.synchronize()
    cycles = int(1_000_000 * 2.0 / start.elapsed_time(end))  # ~2 ms
    calls = {
        "sdpa flash (control)": lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True),
        "add_ (control)": lambda: cache._device_lengths.add_(0),
        "append": lambda: cache.append(new_k, new_v),
        "attend": lambda: cache.attend(q),
        "decode_step": lambda: cache.decode_step(q, new_k, new_v),
    }
    rows = []
    for name, fn in calls.items():
        times = []
        for _ in range(20):
            torch.cuda.synchronize()
            torch.cuda._sleep(cycles)
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e6)
        torch.cuda.synchronize()
        rows.append((name, f"{statistics.median(times):.1f}"))
    print(f"# {torch.cuda.get_device_name()}: host µs to issue a call behind ~2 ms of queued GPU work")
    print_table(["call", "µs"], rows)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="1,32,8,8192,128;8,32,8,8192,128;1,32,32,4096,128")
    p.add_argument("--old", default=None)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--pieces", action="store_true", help="also time the pieces of a B1 decode step one by one")
    p.add_argument("--graph", action="store_true", help="also decode_step from a CUDA graph (GPU µs per step)")
    p.add_argument("--sync-probe", action="store_true",
                   help="also time each call issued behind ~2 ms of queued GPU work: a call that waits for "
                        "the GPU takes the queue's time")
    args = p.parse_args()
    if args.pieces:
        _pieces()
    if args.sync_probe:
        _sync_probe()
    trees = {"new": FP8KVCache}
    if args.old:
        sys.path.insert(0, args.old)
        trees = {"old": importlib.import_module("lowprec_old.attention").FP8KVCache, **trees}
    rows = []
    for spec in args.shapes.split(";"):
        b, h, hkv, sk, d = (int(x) for x in spec.split(","))
        g = torch.Generator(device="cuda").manual_seed(0)
        bf = torch.bfloat16
        k, v = (torch.randn(b, hkv, sk, d, device="cuda", generator=g).to(bf) for _ in range(2))
        new_k, new_v = (torch.randn(b, hkv, 1, d, device="cuda", generator=g).to(bf) for _ in range(2))
        q = torch.randn(b, h, 1, d, device="cuda", generator=g).to(bf)
        k_bf, v_bf = (torch.zeros(b, hkv, sk + _GROWTH, d, device="cuda", dtype=bf) for _ in range(2))
        k_bf[:, :, :sk], v_bf[:, :, :sk] = k, v
        length = [sk]

        def bf16_step():
            n = length[0] % (sk + _GROWTH - 1) or sk
            k_bf[:, :, n:n + 1] = new_k
            v_bf[:, :, n:n + 1] = new_v
            length[0] = n + 1
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return F.scaled_dot_product_attention(q, k_bf[:, :, :n + 1], v_bf[:, :, :n + 1], enable_gqa=hkv != h)

        setups = {name: _fp8_calls(cls, b, h, hkv, sk, d, k, v, q, new_k, new_v) for name, cls in trees.items()}
        times: dict[tuple[str, str], list[float]] = {}
        for _ in range(args.rounds):
            length[0] = sk
            times.setdefault(("bf16", "write + sdpa flash"), []).append(
                back_to_back_us(bf16_step, _CALLS, _REPS, _WARMUP))
            for tree, (fresh, calls) in setups.items():
                for name, fn in calls.items():
                    fresh()
                    times.setdefault((tree, name), []).append(back_to_back_us(fn, _CALLS, _REPS, _WARMUP))
                if args.graph:  # 10 steps a graph, replayed 7 times after a warm-up and the capture
                    fresh()
                    step = calls["decode_step"]
                    step()
                    times.setdefault((tree, "decode_step graph (GPU)"), []).append(
                        bench_graph_ms(step, reps=10, batches=7) * 1e3)
        bf16_us = min(times[("bf16", "write + sdpa flash")])
        shape = f"B{b} H{h}/{hkv} Sk{sk} d{d}"
        for (tree, name), ts in times.items():
            rows.append((shape, tree, name, f"{min(ts):.1f}", f"{bf16_us / min(ts):.2f}"))
        # the last step's output of each tree against exact attention on the same tokens
        for tree, (fresh, calls) in setups.items():
            fresh()
            out = calls["append + attend"]()
            keys = torch.cat([k, new_k], dim=2).float()
            vals = torch.cat([v, new_v], dim=2).float()
            exact = F.scaled_dot_product_attention(q.float(), keys, vals, enable_gqa=hkv != h)
            cos = F.cosine_similarity(out.float().flatten(), exact.flatten(), dim=0).item()
            rows.append((shape, tree, f"cos vs exact {cos:.5f}", "-", "-"))
        if args.profile:
            for tree, (fresh, calls) in setups.items():
                fresh()
                prof = cProfile.Profile()
                prof.enable()
                for _ in range(200):
                    calls["append + attend"]()
                prof.disable()
                torch.cuda.synchronize()
                print(f"===== cProfile {tree} {shape}: 200 x append + attend")
                pstats.Stats(prof).sort_stats("tottime").print_stats(22)
    print(f"# {torch.cuda.get_device_name()}: eager calls back to back, µs per call (min over {args.rounds} rounds of "
          f"the median of {_REPS} x {_CALLS}); x: the bf16 step over this row")
    print_table(["shape", "tree", "call", "µs", "x bf16 step"], rows)


if __name__ == "__main__":
    main()
