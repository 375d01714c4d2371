"""FP8 attention accuracy on real activations: Q, K, V captured from every layer of a small byte-level
GPT trained on the Python standard library's own source files (issue 25's accuracy check).

    python benchmarks/attention_real_qkv.py [--steps 300] [--out benchmarks/results/attention_real_qkv.json]

Model: 4 layers, d_model 512, 4 heads (head dim 128), MLP 2048, context 512, bytes as tokens; AdamW,
bf16 autocast, seed 0. After training, one held-out batch: per layer, Q, K, V (bf16, as the model
computes them) go through ``lowprec.attention(..., causal=True, quant="fp8")`` (plain and with
``incoherent=True``) and through FP64 exact attention; printed and saved per layer: the output's
cosine / rel-L1 / RMSE to FP64, and the cosine of dQ, dK, dV (backward of a random dO) to FP64.
First the issue's synthetic inputs (normal, outliers, K bias) at B1 H8 S2048 d128.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import lowprec  # noqa: E402
from lowprec import metrics  # noqa: E402
from lowprec.bench.corpus import random_windows, stdlib_bytes  # noqa: E402

CONTEXT, D_MODEL, HEADS, LAYERS, FFN = 512, 512, 4, 4, 2048


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(D_MODEL), nn.LayerNorm(D_MODEL)
        self.qkv = nn.Linear(D_MODEL, 3 * D_MODEL)
        self.proj = nn.Linear(D_MODEL, D_MODEL)
        self.fc1, self.fc2 = nn.Linear(D_MODEL, FFN), nn.Linear(FFN, D_MODEL)
        self.captured = None

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, HEADS, d // HEADS).permute(2, 0, 3, 1, 4)
        if self.captured is not None:
            self.captured.append((q.detach().clone(), k.detach().clone(), v.detach().clone()))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, d)
        x = x + self.proj(a)
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(256, D_MODEL)
        self.pos = nn.Parameter(torch.randn(CONTEXT, D_MODEL) * 0.02)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = nn.LayerNorm(D_MODEL)
        self.lm_head = nn.Linear(D_MODEL, 256, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.norm(x))


def exact_attention(q, k, v):
    """FP64 causal attention (autograd)."""
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    n = s.shape[-1]
    s = s.masked_fill(~torch.ones(n, n, dtype=torch.bool, device=s.device).tril(), -math.inf)
    return torch.softmax(s, -1) @ v


def compare(q, k, v, incoherent: bool) -> dict:
    dout = torch.randn(q.shape, generator=torch.Generator(device=q.device).manual_seed(1), device=q.device)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = lowprec.attention(*leaves, causal=True, quant="fp8", incoherent=incoherent)
    out.backward(dout.to(out.dtype))
    exact = [t.double().requires_grad_() for t in (q, k, v)]
    ref = exact_attention(*exact)
    ref.backward(dout.double())
    row = {"cos": metrics.cos_sim(out, ref), "rel_l1": metrics.rel_l1(out, ref), "rmse": metrics.rmse(out, ref)}
    for name, leaf, e in zip(("dq", "dk", "dv"), leaves, exact):
        row[f"{name}_cos"] = metrics.cos_sim(leaf.grad, e.grad)
    return row


def synthetic(device) -> list[dict]:
    """The issue's synthetic inputs at B1 H8 S2048 d128 (non-causal): N(0,1); FlashAttention-3's
    outliers N(0,1) + N(0,100)·Bernoulli(0.001); K with a large per-channel bias. Output vs FP64."""
    g = torch.Generator(device=device).manual_seed(0)

    def randn():
        return torch.randn(1, 8, 2048, 128, device=device, generator=g)

    cases = {"normal": [randn() for _ in range(3)]}
    cases["outliers"] = [randn() + randn() * 10 * (torch.rand(1, 8, 2048, 128, device=device, generator=g) < 1e-3)
                         for _ in range(3)]
    q, k, v = (randn() for _ in range(3))
    cases["k_bias"] = [q, k + 10 * torch.randn(1, 8, 1, 128, device=device, generator=g), v]
    rows = []
    for name, (q, k, v) in cases.items():
        qb, kb, vb = (t.bfloat16() for t in (q, k, v))
        s = (qb.double() @ kb.double().transpose(-1, -2)) / math.sqrt(128)
        ref = torch.softmax(s, -1) @ vb.double()
        for incoherent in (False, True):
            out = lowprec.attention(qb, kb, vb, quant="fp8", incoherent=incoherent)
            rows.append({"case": name, "incoherent": incoherent, "cos": metrics.cos_sim(out, ref),
                         "rel_l1": metrics.rel_l1(out, ref), "rmse": metrics.rmse(out, ref)})
            print(f"{name} incoherent={incoherent}: cos {rows[-1]['cos']:.5f} rel-L1 {rows[-1]['rel_l1']:.4f} "
                  f"RMSE {rows[-1]['rmse']:.2e}", flush=True)
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--out", default=os.path.join("benchmarks", "results", "attention_real_qkv.json"))
    args = p.parse_args(argv)
    device = "cuda"
    synthetic_rows = synthetic(device)
    torch.manual_seed(0)
    train_data, held_out = stdlib_bytes(device)
    model = GPT().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    g = torch.Generator().manual_seed(0)
    for step in range(args.steps):
        x, y = random_windows(train_data, args.batch, CONTEXT, g)
        with torch.autocast("cuda", torch.bfloat16):
            loss = F.cross_entropy(model(x).float().view(-1, 256), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step % 100 == 0 or step == args.steps - 1:
            print(f"step {step}: loss {loss.item():.3f} (bits/byte {loss.item() / math.log(2):.2f})", flush=True)
    for block in model.blocks:
        block.captured = []
    x, _ = random_windows(held_out, 4, CONTEXT, torch.Generator().manual_seed(1))
    with torch.no_grad(), torch.autocast("cuda", torch.bfloat16):
        model(x)
    rows = []
    for layer, block in enumerate(model.blocks):
        q, k, v = (t.contiguous() for t in block.captured[0])
        for incoherent in (False, True):
            row = {"layer": layer, "incoherent": incoherent, **compare(q, k, v, incoherent)}
            rows.append(row)
            print(f"layer {layer} incoherent={incoherent}: out cos {row['cos']:.5f} rel-L1 {row['rel_l1']:.4f} "
                  f"RMSE {row['rmse']:.2e}; grad cos dq {row['dq_cos']:.5f} dk {row['dk_cos']:.5f} "
                  f"dv {row['dv_cos']:.5f}", flush=True)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "steps": args.steps, "final_loss": loss.item(),
                   "shape": {"B": 4, "H": HEADS, "S": CONTEXT, "D": D_MODEL // HEADS}, "rows": rows,
                   "synthetic": synthetic_rows}, f, indent=1)
    print(f"results: {args.out}")


if __name__ == "__main__":
    main()
