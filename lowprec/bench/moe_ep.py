"""``python -m lowprec bench moe --ep WORLD``: the expert-parallel MoE layer on WORLD GPUs.

One process per GPU (NCCL; ``torch.multiprocessing`` spawn), each holding ``E / WORLD`` experts of
:class:`lowprec.moe.parallel.ExpertParallelMoE` (``fp8_block``, bf16 weights) and ``T`` tokens of
its own. Per config (E, H, F, top-k, T tokens per rank) the layer's training step (forward, and
backward into the tokens and every weight) is timed twice on the same weights, tokens and
routing: with the rows dispatched as E4M3 codes plus scales (``fp8_dispatch=True``) and as bf16
(``fp8_dispatch=False``, quantized on arrival: the same codes; the outputs' largest difference is
reported). Reported: the step
time (median of host-synced steps, the slowest rank's), tokens per second over all ranks, and
the bytes the forward dispatch moves between ranks (rows leaving their rank times the row's
bytes: ``H + 4·H/128`` in FP8, ``2·H`` in bf16). The combine and the backward's all-to-alls move
bf16 either way.

``ep_rows(..., backend="gloo")`` runs the same code on CPU processes (the tests do; its timings
mean nothing).
"""

from __future__ import annotations

import datetime
import json
import math
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from .common import save_results

EP_CONFIGS = [(64, 7168, 2048, 8, 8192)]  # E, H, F, top-k, tokens per rank (issue 29's target shape)
DISPATCHES = ("fp8", "bf16")
ROW_KEYS = ("E", "H", "F", "top_k", "T_per_rank", "world", "dispatch")  # what names a row


def save(rows: list[dict], device: str, path: str | None = None, partial: bool = False) -> str:
    """Save the rows under ``moe_ep``; a run over other configs than the defaults (``partial``)
    replaces only the saved rows it measured again."""
    return save_results("moe_ep", {"device": device, "rows": rows}, path, merge_rows_by=ROW_KEYS if partial else None)


def row_bytes(hidden: int, dispatch: str) -> int:
    """Bytes of one dispatched row: E4M3 codes and an FP32 scale per 128 values, or bf16."""
    return hidden + 4 * math.ceil(hidden / 128) if dispatch == "fp8" else 2 * hidden


def ep_rows(world: int, configs=EP_CONFIGS, *, steps: int = 10, warmup: int = 3, seed: int = 0,
            backend: str = "nccl") -> list[dict]:
    """One row per config and dispatch (module docstring); spawns ``world`` processes."""
    if backend == "nccl" and torch.cuda.device_count() < world:
        raise SystemExit(f"bench moe --ep {world}: needs {world} CUDA GPUs, {torch.cuda.device_count()} visible")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.json")
        mp.spawn(_worker, args=(world, os.path.join(tmp, "init"), [tuple(c) for c in configs], steps, warmup, seed,
                                backend, out), nprocs=world, join=True)
        with open(out) as f:
            return json.load(f)


def _worker(rank, world, init_file, configs, steps, warmup, seed, backend, out):
    from ..moe.parallel import ExpertParallelMoE
    from ..moe.routing import select_experts

    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600))
    rows = []
    try:
        for num_experts, hidden, ffn, top_k, tokens in configs:
            torch.manual_seed(seed)  # the router: alike on every rank
            layer = ExpertParallelMoE(hidden, ffn, num_experts, top_k, device=device, dtype=torch.bfloat16)
            g = torch.Generator(device=device).manual_seed(seed + 1 + rank)  # this rank's experts and tokens
            with torch.no_grad():
                layer.w1.normal_(0, hidden ** -0.5, generator=g)
                layer.w2.normal_(0, ffn ** -0.5, generator=g)
            x = torch.randn(tokens, hidden, device=device, dtype=torch.bfloat16, generator=g).requires_grad_()
            dy = torch.randn(tokens, hidden, device=device, dtype=torch.bfloat16, generator=g)
            with torch.no_grad():
                _, ids = select_experts(F.linear(x.float(), layer.router.weight.float()), top_k,
                                        score_func=layer.score_func, renormalize=layer.renormalize)
            leaving = torch.tensor([int((ids // (num_experts // world) != rank).sum())], device=device)
            dist.all_reduce(leaving)
            outputs = {}
            for dispatch in DISPATCHES:
                layer.fp8_dispatch = dispatch == "fp8"
                ms, outputs[dispatch] = _time_steps(layer, x, dy, steps, warmup, device)
                slowest = torch.tensor([ms], device=device)
                dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
                rows.append({"E": num_experts, "H": hidden, "F": ffn, "top_k": top_k, "T_per_rank": tokens,
                             "world": world, "dispatch": dispatch, "step_ms": slowest.item(),
                             "tokens_per_s": world * tokens / slowest.item() * 1e3,
                             "dispatch_bytes": int(leaving.item()) * row_bytes(hidden, dispatch)})
            diff = (outputs["fp8"].float() - outputs["bf16"].float()).abs().max().reshape(1)
            dist.all_reduce(diff, op=dist.ReduceOp.MAX)
            for row in rows[-len(DISPATCHES):]:
                row["max_output_diff"] = diff.item()
            del layer, x, dy, outputs
        if rank == 0:
            with open(out, "w") as f:
                json.dump(rows, f)
    finally:
        dist.barrier()  # no rank leaves while another still runs a collective
        dist.destroy_process_group()
    # a rank done cleanly ends at once: the interpreter's shutdown aborted in ~1 run of 8 (torch
    # 2.13, gloo: "terminate called without an active exception")
    os._exit(0)


def _time_steps(layer, x, dy, steps: int, warmup: int, device) -> tuple[float, torch.Tensor]:
    """Median ms of host-synced training steps (every rank steps together), and the last output."""
    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    times, y = [], None
    for i in range(warmup + steps):
        layer.zero_grad(set_to_none=True)
        x.grad = None
        dist.barrier()
        sync()
        start = time.perf_counter()
        y = layer(x)
        y.backward(dy)
        sync()
        if i >= warmup:
            times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times), y.detach()


def print_rows(rows: list[dict]) -> None:
    from .common import print_table

    table = []
    for r in rows:
        base = next(b for b in rows if b["dispatch"] == "bf16" and all(b[k] == r[k] for k in ("E", "H", "F", "top_k",
                                                                                                "T_per_rank")))
        table.append([f"E{r['E']} H{r['H']} F{r['F']} k{r['top_k']} T{r['T_per_rank']}x{r['world']}", r["dispatch"],
                      r["step_ms"], r["tokens_per_s"], r["dispatch_bytes"] / 1e6,
                      r["dispatch_bytes"] / base["dispatch_bytes"] if base["dispatch_bytes"] else math.nan,
                      base["step_ms"] / r["step_ms"], r["max_output_diff"]])
    print("# expert-parallel MoE training step (forward + backward), one rank per GPU, host-synced; "
          "x bf16 = the bf16-dispatch step's time over this one's")
    print_table(["config", "dispatch", "step ms", "tokens/s", "dispatch MB", "bytes / bf16", "x bf16",
                 "max |fp8 - bf16|"], table)
