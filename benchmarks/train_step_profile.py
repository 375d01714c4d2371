"""Where a ``bench train`` step's GPU time goes: torch.profiler over a few steps of one size and
implementation, CUDA kernels grouped by kind (FP8 GEMM, quantize, bf16 GEMM, attention,
elementwise, optimizer...), ms per step.

    python benchmarks/train_step_profile.py [--size llama3-8b-2l] [--impl lowprec] [--weights bf16] [--compiled]
"""
import argparse
import collections

import torch

from lowprec.bench.train import SIZES, make_model, make_step

KINDS = (("fp8 gemm", ("BlockScaledGemm",)), ("quantize", ("quant", "Quant")),
         ("bf16 gemm", ("gemm", "Gemm", "sm90_xmma", "cutlass", "nvjet")),
         ("attention", ("flash", "fmha", "attention")),
         ("optimizer", ("multi_tensor", "adam", "Adam")), ("reduce", ("reduce", "Reduce")),
         ("elementwise", ("elementwise", "vectorized", "Elementwise")))


def kind_of(name: str) -> str:
    for kind, keys in KINDS:
        if any(k in name for k in keys):
            return kind
    return "other"


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--size", default="llama3-8b-2l")
    p.add_argument("--impl", default="lowprec")
    p.add_argument("--weights", default="bf16")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--compiled", action="store_true", help="profile the torch.compile'd step")
    p.add_argument("--top", type=int, default=25, help="kernels listed by name")
    args = p.parse_args()
    c = SIZES[args.size]
    model = make_model(c, args.impl, args.weights)
    step = make_step(model, args.weights, compiled=args.compiled)
    gen = torch.Generator(device="cuda").manual_seed(0)
    tokens = torch.randint(0, c.vocab, (c.batch, c.seq), device="cuda", generator=gen)
    targets = torch.randint(0, c.vocab, (c.batch, c.seq), device="cuda", generator=gen)
    for _ in range(3):
        step(tokens, targets)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            step(tokens, targets)
        torch.cuda.synchronize()
    by_kind, by_name = collections.Counter(), collections.Counter()
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            by_kind[kind_of(e.name)] += e.device_time / 1e3 / args.steps
            by_name[e.name[:90]] += e.device_time / 1e3 / args.steps
    mode = "compiled" if args.compiled else "eager"
    print(f"{args.size} {args.impl} {args.weights} {mode}: GPU ms per step {sum(by_kind.values()):.1f}")
    for k, v in by_kind.most_common():
        print(f"  {k:12s} {v:7.2f}")
    for k, v in by_name.most_common(args.top):
        print(f"    {v:7.2f}  {k}")


if __name__ == "__main__":
    main()
