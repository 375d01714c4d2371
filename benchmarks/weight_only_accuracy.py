"""What NVFP4 and FP8 weights do to a trained model's outputs: a byte-level Llama (``bench train``'s
model, small) trained on the standard library's sources, then its weights converted for inference
(``lowprec.convert(model, "nvfp4" | "fp8_block", inference=True)``, every linear including the LM
head) and compared with the bf16 model on held-out text: cosine of the logits, and the held-out
loss (nats per byte) and perplexity.

The weight-only kernels compute the dequantized product within one bf16 rounding (GPU tests), so
the reference path (CPU) measures the format's effect.

    python benchmarks/weight_only_accuracy.py [--steps 400] [--out benchmarks/results/weight_only_accuracy.json]
"""

from __future__ import annotations

import argparse
import copy
import json
import math

import torch
import torch.nn.functional as F

import lowprec
from lowprec.bench.corpus import random_windows, stdlib_bytes
from lowprec.bench.train import Llama, LlamaConfig


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--eval-batches", type=int, default=8)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    c = LlamaConfig(hidden=192, layers=3, heads=6, kv_heads=2, ffn=512, vocab=256, batch=16, seq=128)
    train, held_out = stdlib_bytes(device)
    torch.manual_seed(0)
    model = Llama(c).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.01)
    g = torch.Generator().manual_seed(0)
    for i in range(args.steps):
        x, y = random_windows(train, c.batch, c.seq, g)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if i % 100 == 0 or i == args.steps - 1:
            print(f"step {i}: train loss {loss.item():.3f}", flush=True)
    base = model.to(torch.bfloat16).eval()
    variants = {"bf16": base}
    for fmt in ("nvfp4", "fp8_block"):
        variants[fmt] = lowprec.convert(copy.deepcopy(base), fmt, inference=True)
    g = torch.Generator().manual_seed(1)
    batches = [random_windows(held_out, c.batch, c.seq, g) for _ in range(args.eval_batches)]
    results = {}
    with torch.no_grad():
        ref_logits = [base(x).double() for x, _ in batches]
        for name, m in variants.items():
            nll, cos = [], []
            for (x, y), ref in zip(batches, ref_logits):
                logits = m(x).double()
                nll.append(F.cross_entropy(logits.flatten(0, 1), y.flatten()).item())
                cos.append(F.cosine_similarity(logits.flatten(0, 1), ref.flatten(0, 1), dim=-1).mean().item())
            loss = sum(nll) / len(nll)
            results[name] = {"held_out_nats_per_byte": loss, "perplexity": math.exp(loss),
                             "logits_cos_vs_bf16": sum(cos) / len(cos)}
    for name, r in results.items():
        delta = r["perplexity"] / results["bf16"]["perplexity"] - 1
        r["perplexity_delta"] = delta
        print(f"{name:10s} held-out loss {r['held_out_nats_per_byte']:.4f} nats/byte, perplexity "
              f"{r['perplexity']:.4f} ({100 * delta:+.2f}%), logits cos vs bf16 {r['logits_cos_vs_bf16']:.5f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"config": vars(c), "steps": args.steps, "device": device, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
