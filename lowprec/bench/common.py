"""Timing and result files shared by the benchmarks."""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import time

import torch

__all__ = ["bench_ms", "bench_stream_ms", "bench_graph_ms", "sustained", "cuda_graph_replay", "gpu_slug",
           "save_results", "copy_bandwidth_gbs", "print_table"]

_FLUSH_BYTES = 256 << 20  # > H100/H200 L2 (50 MB): every timed run starts from a cold L2


def positive_tuples(text: str, between: str, within: str, arity: int) -> list[tuple[int, ...]]:
    """``text`` as tuples of ``arity`` positive ints (``within`` inside a tuple, ``between`` tuples),
    else an ``argparse.ArgumentTypeError`` quoting it."""
    try:
        tuples = [tuple(int(v) for v in s.split(within)) for s in text.split(between)]
    except ValueError:
        tuples = []
    if not tuples or any(len(t) != arity or min(t) < 1 for t in tuples):
        form = within.join("ABCD"[:arity])
        raise argparse.ArgumentTypeError(f"expected positive {form} tuples, {between!r}-separated, got {text!r}")
    return tuples


def shape_pairs(text: str) -> list[tuple[int, int]]:
    """argparse type of a ``--shapes`` list: comma-separated ``AxB`` pairs of positive ints."""
    return positive_tuples(text, ",", "x", 2)


def off_16(pairs: list[tuple[int, int]]) -> list[str]:
    """The ``AxB`` pairs with a size not a multiple of 16 (the FP8 / NVFP4 layers' alignment), as given."""
    return [f"{a}x{b}" for a, b in pairs if a % 16 or b % 16]


def positive_int(text: str) -> int:
    """argparse type of a count (runs, rounds, steps, tokens): an int ≥ 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an int ≥ 1, got {text!r}")
    return value


def bench_ms(fn, warmup: int = 10, rep: int = 50, queued: bool = False, before=None) -> float:
    """Median milliseconds of ``fn()`` between CUDA events, L2 flushed before every run.

    By default the host syncs before each run, so the host time to ``fn``'s first launch counts.
    ``queued``: no sync between runs (as ``triton.testing.do_bench``): the host queues work
    ahead, as in a training step of many layers, so host time only counts where it exceeds the
    GPU time. ``before``: called before every run, warm-up included, instead of the flush; with a
    large GEMM (and ``queued``) this is how a memory-bound kernel runs inside a training step, on
    a chip held at its power cap, at a lower SM clock than when idle.
    """
    if before is None:
        flush = torch.empty(_FLUSH_BYTES, dtype=torch.uint8, device="cuda")
        before = flush.zero_
        for _ in range(warmup):
            fn()
    else:
        for _ in range(warmup):
            before()
            fn()
    events = []
    for _ in range(rep):
        before()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        if not queued:
            end.synchronize()
        events.append((start, end))
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in events)


def synced_wall_ms(fn, warmup: int = 3, reps: int = 10) -> float:
    """Median wall-clock milliseconds of ``fn()`` with the device synchronized before and after
    each call: what one eager call costs a caller that waits for it (host time included)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def back_to_back_us(fn, calls: int = 50, reps: int = 5, warmup: int = 20) -> float:
    """Microseconds per call of ``calls`` back-to-back eager calls, waiting for the GPU at the end
    of each batch (median of ``reps``): the host time where the GPU keeps up, else the GPU's."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t) / calls * 1e6)
    return statistics.median(times)


def bench_stream_ms(fn, reps: int = 20, batches: int = 5) -> float:
    """Milliseconds per call of a streaming kernel: ``reps`` back-to-back calls between two events
    (median over ``batches``), so host launch overhead overlaps the GPU work. For inputs larger
    than L2, which each call streams from memory anyway."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(batches):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / reps)
    return statistics.median(times)


def sustained(fn, seconds: float, batch: int = 20) -> dict:
    """``fn`` back to back for ``seconds`` (a host sync every ``batch`` calls): GPU milliseconds per
    call, and the median SM clock (MHz) and board power (W) ``nvidia-smi`` reads every 50 ms
    meanwhile (None without ``nvidia-smi``). This is the chip at its power cap, where a kernel that
    does more work per clock may run at a lower clock than its peer."""
    if not seconds > 0:
        raise ValueError(f"seconds: expected a number > 0, got {seconds!r}")
    fn()
    torch.cuda.synchronize()
    smi = shutil.which("nvidia-smi")
    sampler = None if smi is None else subprocess.Popen(
        [smi, "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits", "-lms", "50"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    calls, t0 = 0, time.perf_counter()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    while time.perf_counter() - t0 < seconds:
        for _ in range(batch):
            fn()
        calls += batch
        torch.cuda.synchronize()
    end.record()
    end.synchronize()
    clock = power = None
    if sampler is not None:
        sampler.terminate()
        clock, power = parse_smi_samples(sampler.communicate()[0])
    return {"ms": start.elapsed_time(end) / calls, "calls": calls, "sm_clock_mhz": clock, "power_w": power}


def parse_smi_samples(text: str, skip: int = 5) -> tuple[float | None, float | None]:
    """Median (SM clock, power) of ``nvidia-smi --query-gpu=clocks.sm,power.draw`` CSV lines,
    without the first ``skip`` samples (the clock ramps there); (None, None) when none parse."""
    samples = []
    for line in text.splitlines():
        try:
            clock, power = (float(v) for v in line.split(","))
        except ValueError:
            continue
        samples.append((clock, power))
    samples = samples[skip:] if len(samples) > skip else samples
    if not samples:
        return None, None
    return statistics.median(c for c, _ in samples), statistics.median(p for _, p in samples)


def bench_graph_ms(fn, reps: int = 10, batches: int = 7) -> float:
    """GPU milliseconds per call of a streaming op: one CUDA graph of ``reps`` back-to-back calls,
    replayed ``batches`` times between events (median). Unlike :func:`bench_stream_ms` no host
    time can leak in when the op's Python launch path is slower than its GPU work."""
    graph = cuda_graph_replay(lambda: [fn() for _ in range(reps)])
    graph()
    times = []
    for _ in range(batches):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / reps)
    return statistics.median(times)


def cuda_graph_replay(fn):
    """Capture one call of ``fn`` in a CUDA graph (after a warm-up on a side stream) and return the
    replay function: times GPU work without host launch overhead."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def copy_bandwidth_gbs(nbytes: int = 1 << 30) -> float:
    """Device-to-device copy bandwidth (bytes read + written), the ceiling for memory-bound kernels."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    ms = bench_stream_ms(lambda: dst.copy_(src))
    return 2 * nbytes / ms / 1e6


def gpu_slug() -> str:
    return re.sub(r"[^a-z0-9]+", "-", torch.cuda.get_device_name().lower()).strip("-")


def load_results(op: str, path: str | None = None) -> dict | None:
    """The saved section ``op`` of ``benchmarks/results/<gpu>.json`` (or ``path``); None if absent."""
    path = path or os.path.join("benchmarks", "results", f"{gpu_slug()}.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f).get(op)


def _row_key(row: dict, keys: tuple[str, ...]) -> tuple:
    # JSON reads a tuple back as a list: compare lists as tuples (hashable, and equal to the new row's)
    return tuple(tuple(v) if isinstance(v, list) else v for v in (row.get(k) for k in keys))


def merge_rows(saved: list[dict], rows: list[dict], keys: str | tuple[str, ...]) -> list[dict]:
    """``saved`` rows that ``rows`` did not measure again (their ``keys`` values differ), then ``rows``."""
    keys = (keys,) if isinstance(keys, str) else tuple(keys)
    measured = {_row_key(row, keys) for row in rows}
    return [row for row in saved if _row_key(row, keys) not in measured] + list(rows)


def merged_section(previous: dict | None, payload: dict, merge_rows_by) -> dict:
    """``payload`` over the saved section ``previous`` (see :func:`save_results`' ``merge_rows_by``)."""
    if merge_rows_by is None or not isinstance(previous, dict):
        return payload
    by_field = merge_rows_by if isinstance(merge_rows_by, dict) else {"rows": merge_rows_by}
    merged = {**previous, **payload}
    for field, keys in by_field.items():
        merged[field] = merge_rows(previous.get(field) or [], payload.get(field) or [], keys)
    return merged


def save_results(op: str, payload: dict, path: str | None = None, merge_rows_by=None) -> str:
    """Merge ``payload`` under ``op`` into ``benchmarks/results/<gpu>.json`` (or ``path``).

    ``merge_rows_by``: for a run over part of the rows, the row key (e.g. ``"shape"``) or keys
    (``("m", "n", "k")``) that name a row, or ``{list field: key or keys}`` for a section with
    several row lists (default field ``"rows"``): the file's other rows (and its other ``op``
    fields) stay, rows whose key this run measured are replaced."""
    path = path or os.path.join("benchmarks", "results", f"{gpu_slug()}.json")
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    data = {}
    if os.path.exists(path):
        with open(path) as f:
            data = json.load(f)
    data[op] = merged_section(data.get(op), payload, merge_rows_by)
    with open(path, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
    return path


def print_table(header: list[str], rows: list[list]) -> None:
    cells = [[f"{c:.3g}" if isinstance(c, float) else str(c) for c in r] for r in rows]
    widths = [max([len(h), *(len(r[i]) for r in cells)]) for i, h in enumerate(header)]
    print("  ".join(h.rjust(w) for h, w in zip(header, widths)))
    for r in cells:
        print("  ".join(c.rjust(w) for c, w in zip(r, widths)))
