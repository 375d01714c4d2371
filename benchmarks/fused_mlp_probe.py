"""The fused FP8 SwiGLU MLP against three FP8Linear layers and bf16 (issue 26, item 3).

    python benchmarks/fused_mlp_probe.py [--tokens 8192] [--hidden 4096] [--ffn 14336] [--compile]

Forward + backward of ``down(silu(gate(x)) * up(x))`` with bf16 weights, in the same process
(synced steps, L2 flushed, median of 3 interleaved rounds): bf16 ``nn.Linear``; ``lowprec.convert
(..., fuse_mlp=False)`` (three FP8Linear, each quantizing its own input; silu and the product as
torch ops); ``lowprec.convert`` (:class:`lowprec.nn.FP8SwiGLUMLP`); the same MLP as one expert of
``lowprec.moe.experts`` (gate and up as one grouped GEMM, the MoE's SwiGLU kernels, plus the
routing, pack and unpack a dense layer does not need).
"""

from __future__ import annotations

import argparse
import sys

import torch
from torch import nn

sys.path.insert(0, ".")
import lowprec  # noqa: E402
from lowprec.bench.common import bench_ms  # noqa: E402
from lowprec.nn import SwiGLUMLP  # noqa: E402


class OneExpert(nn.Module):
    """The same weights as one expert: w1 = [gate; up], every token routed to it with weight 1."""

    def __init__(self, mlp: SwiGLUMLP):
        super().__init__()
        self.w1 = nn.Parameter(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]).detach()[None].clone())
        self.w2 = nn.Parameter(mlp.down_proj.weight.detach()[None].clone())

    def forward(self, x):
        x2 = x.reshape(-1, x.shape[-1])
        ones = torch.ones(x2.shape[0], 1, device=x.device, dtype=torch.float32)
        ids = torch.zeros(x2.shape[0], 1, device=x.device, dtype=torch.int32)
        return lowprec.moe.experts(x2, ones, ids, self.w1, self.w2, check_ids=False).view_as(x)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--ffn", type=int, default=14336)
    p.add_argument("--compile", action="store_true")
    args = p.parse_args()
    torch.manual_seed(0)
    base = SwiGLUMLP(args.hidden, args.ffn).cuda().bfloat16()
    fp8 = lowprec.convert(SwiGLUMLP(args.hidden, args.ffn).cuda().bfloat16(), min_weight_numel=0, fuse_mlp=False)
    fp8.load_state_dict(base.state_dict())
    fused = lowprec.convert(SwiGLUMLP(args.hidden, args.ffn).cuda().bfloat16(), min_weight_numel=0)
    fused.load_state_dict(base.state_dict())
    one = OneExpert(base).cuda()
    x = torch.randn(args.tokens, args.hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)
    with torch.no_grad():
        ref = base(x)
        for name, m in (("fp8linear", fp8), ("fused", fused), ("one-expert", one)):
            y = m(x)
            print(f"{name}: rel err vs bf16 {((y.float() - ref.float()).norm() / ref.float().norm()).item():.4f}")
    models = {"bf16": base, "fp8linear": fp8, "fused": fused, "one-expert": one}
    if args.compile:
        models.update({f"{k}-compiled": torch.compile(m) for k, m in list(models.items())})

    def step(m):
        def run():
            y = m(x)
            y.backward(dy)
        return run

    times = {k: [] for k in models}
    for _ in range(3):
        for k, m in models.items():
            times[k].append(bench_ms(step(m), warmup=5, rep=20))
    med = {k: sorted(v)[1] for k, v in times.items()}
    for k, t in med.items():
        ref_k = "bf16-compiled" if k.endswith("-compiled") else "bf16"
        print(f"T{args.tokens} H{args.hidden} F{args.ffn} {k:22s} fwd+bwd {t:.3f} ms  x bf16 {med[ref_k] / t:.3f}")


if __name__ == "__main__":
    main()
