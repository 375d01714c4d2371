"""FSDP2 training step with the plain all-gather of FP8Linear weights vs the FP8 all-gather
(``lowprec.nn.enable_fp8_all_gather``): the bytes each step all-gathers and the step time.

    python benchmarks/fsdp_fp8_all_gather.py [--world 2] [--backend nccl|gloo] [--hidden 4096]
        [--ffn 14336] [--blocks 4] [--tokens 8192] [--dtype bf16|fp32]

One process per GPU (NCCL) or CPU process (gloo: a dry run, its timings mean nothing). The model is
``--blocks`` MLP blocks (Linear(H, F), GELU, Linear(F, H), residual) converted to FP8Linear
(``fp8_block``), every block and the root ``fully_shard``-ed; AdamW; each rank its own tokens.
Bytes: every all-gather output of one step (forward and backward re-gathers), as
FSDP2 issues them, counted on rank 0. Time: median of host-synced steps, the slowest rank's. The
two runs start from the same weights; the largest difference of their final losses is printed.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

sys.path.insert(0, ".")


class _Block(nn.Module):
    def __init__(self, hidden: int, ffn: int):
        super().__init__()
        self.up = nn.Linear(hidden, ffn, bias=False)
        self.down = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


def _worker(rank, args, init_file, out):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import lowprec
    from lowprec.nn import enable_fp8_all_gather

    nccl = args.backend == "nccl"
    device = torch.device("cuda", rank) if nccl else torch.device("cpu")
    if nccl:
        torch.cuda.set_device(device)
    dist.init_process_group(args.backend, init_method=f"file://{init_file}", rank=rank, world_size=args.world,
                            timeout=datetime.timedelta(seconds=600))
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    gathered = [0]

    def counting(gather):
        def counted(output, *a, **k):
            gathered[0] += output.numel() * output.element_size()
            return gather(output, *a, **k)
        return counted

    # FSDP2 gathers every parameter group through one of these (all_gather_single since torch 2.12)
    for name in ("all_gather_into_tensor", "all_gather_single"):
        if hasattr(dist, name):
            setattr(dist, name, counting(getattr(dist, name)))
    rows = []
    try:
        torch.manual_seed(0)
        base = lowprec.convert(nn.Sequential(*[_Block(args.hidden, args.ffn) for _ in range(args.blocks)]),
                               min_weight_numel=0).to(device=device, dtype=dtype)
        g = torch.Generator(device=device).manual_seed(1 + rank)
        x = torch.randn(args.tokens, args.hidden, device=device, dtype=dtype, generator=g)
        mesh = init_device_mesh(device.type, (args.world,))
        for mode in ("plain", "fp8"):
            model = copy.deepcopy(base)
            if mode == "fp8":
                assert enable_fp8_all_gather(model) == 2 * args.blocks
            for block in model:
                fully_shard(block, mesh=mesh)
            fully_shard(model, mesh=mesh)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
            times, loss = [], None
            for i in range(args.warmup + args.steps):
                dist.barrier()
                if nccl:
                    torch.cuda.synchronize(device)
                gathered[0] = 0
                start = time.perf_counter()
                loss = model(x).float().square().mean()
                loss.backward()
                opt.step()
                opt.zero_grad()
                if nccl:
                    torch.cuda.synchronize(device)
                if i >= args.warmup:
                    times.append((time.perf_counter() - start) * 1e3)
            slowest = torch.tensor([statistics.median(times)], device=device)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            rows.append({"mode": mode, "step_ms": slowest.item(), "gathered_bytes": gathered[0],
                         "final_loss": loss.item()})
            del model, opt
        if rank == 0:
            with open(out, "w") as f:
                json.dump(rows, f)
    finally:
        dist.barrier()
        dist.destroy_process_group()
    os._exit(0)  # as bench moe --ep: a rank done cleanly ends at once


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--backend", default="nccl", choices=("nccl", "gloo"))
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--ffn", type=int, default=14336)
    p.add_argument("--blocks", type=int, default=4)
    p.add_argument("--tokens", type=int, default=8192, help="per rank")
    p.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"), help="the master weights' dtype")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.json")
        mp.spawn(_worker, args=(args, os.path.join(tmp, "init"), out), nprocs=args.world, join=True)
        with open(out) as f:
            rows = json.load(f)
    plain = rows[0]
    print(f"# FSDP2 step, {args.blocks} MLP blocks H{args.hidden} F{args.ffn} FP8Linear, {args.dtype} master weights, "
          f"{args.tokens} tokens per rank, world {args.world} ({args.backend}); host-synced steps, slowest rank")
    for r in rows:
        print(f"{r['mode']:5s}  step {r['step_ms']:8.2f} ms  x{plain['step_ms'] / r['step_ms']:.3f}  "
              f"all-gathered {r['gathered_bytes'] / 1e6:9.1f} MB per step "
              f"({r['gathered_bytes'] / plain['gathered_bytes']:.3f} of plain)  final loss {r['final_loss']:.6f}")


if __name__ == "__main__":
    main()
