"""Train a small GPT in bf16 and with ``lowprec.convert(model, "fp8_block")``; compare the losses.

    python benchmarks/train_gpt.py [--steps 300] [--out-dir benchmarks/results]

Model: 4 layers, d_model 512, 8 heads, MLP 2048, vocab 512, context 256. Corpus: a fixed random
Markov chain over the vocabulary (each token has 8 possible successors with fixed probabilities;
deterministic, seed 0), so there is structure to learn within 300 steps and the best achievable
loss is known (about the chain's entropy rate). Both runs share the seed,
initial weights and batches; the FP8 run swaps every linear layer but the LM head for FP8Linear.
Writes the losses to the results JSON and the two curves to a PNG.
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import lowprec  # noqa: E402
from lowprec.bench.common import gpu_slug, save_results  # noqa: E402

VOCAB, CONTEXT, D_MODEL, HEADS, LAYERS, FFN = 512, 256, 512, 8, 4, 2048


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(D_MODEL), nn.LayerNorm(D_MODEL)
        self.qkv = nn.Linear(D_MODEL, 3 * D_MODEL)
        self.proj = nn.Linear(D_MODEL, D_MODEL)
        self.fc1, self.fc2 = nn.Linear(D_MODEL, FFN), nn.Linear(FFN, D_MODEL)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, HEADS, d // HEADS).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, d)
        x = x + self.proj(a)
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D_MODEL)
        self.pos = nn.Parameter(torch.randn(CONTEXT, D_MODEL) * 0.02)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = nn.LayerNorm(D_MODEL)
        self.lm_head = nn.Linear(D_MODEL, VOCAB, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.norm(x))


class MarkovCorpus:
    """Tokens from a fixed sparse Markov chain: each token has ``fanout`` successors."""

    def __init__(self, device, seed=0, fanout=8):
        g = torch.Generator().manual_seed(seed)
        self.next_tokens = torch.randint(0, VOCAB, (VOCAB, fanout), generator=g).to(device)
        probs = torch.rand(VOCAB, fanout, generator=g) ** 2
        self.probs = (probs / probs.sum(-1, keepdim=True)).to(device)
        p = self.probs.double()
        self.entropy = float(-(p * p.log()).sum(-1).mean())  # nats per token (uniform over states)

    def batch(self, batch_size, g):
        seq = torch.empty(batch_size, CONTEXT + 1, dtype=torch.long, device=self.probs.device)
        seq[:, 0] = torch.randint(0, VOCAB, (batch_size,), device=seq.device, generator=g)
        for t in range(1, CONTEXT + 1):
            prev = seq[:, t - 1]
            choice = torch.multinomial(self.probs[prev], 1, generator=g).squeeze(1)
            seq[:, t] = self.next_tokens[prev, choice]
        return seq[:, :-1], seq[:, 1:]


def train(model, corpus, steps, batch_size, lr, seed):
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    warmup_cosine = lambda s: min(1.0, (s + 1) / 20) * 0.5 * (1 + math.cos(math.pi * s / steps))  # noqa: E731
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine)
    g = torch.Generator(device="cuda").manual_seed(seed)
    losses = []
    start = time.perf_counter()
    for _ in range(steps):
        x, y = corpus.batch(batch_size, g)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = F.cross_entropy(model(x).float().flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
    return losses, time.perf_counter() - start


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--out-dir", default=os.path.join("benchmarks", "results"))
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    corpus = MarkovCorpus("cuda")
    base = GPT().cuda()
    fp8 = lowprec.convert(copy.deepcopy(base), "fp8_block", filter_fn=lambda name, m: "lm_head" not in name,
                          min_weight_numel=0)  # the numerics of FP8 on every layer, however small
    runs = {}
    for name, model in (("bf16", base), ("fp8_block", fp8)):
        losses, seconds = train(model, corpus, args.steps, args.batch_size, args.lr, seed=1)
        runs[name] = {"losses": losses, "final": sum(losses[-10:]) / 10, "seconds": seconds}
        print(f"{name:10s} final loss (mean of last 10) {runs[name]['final']:.4f}  ({seconds:.1f} s)")
    gap = runs["fp8_block"]["final"] / runs["bf16"]["final"] - 1
    print(f"fp8_block vs bf16: {100 * gap:+.2f}% (target within ±1.5%); chain entropy {corpus.entropy:.3f} nats")
    os.makedirs(args.out_dir, exist_ok=True)
    png = os.path.join(args.out_dir, f"train_gpt_{gpu_slug()}.png")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, run in runs.items():
        ax.plot(run["losses"], label=f"{name} (final {run['final']:.3f})", linewidth=1)
    ax.axhline(corpus.entropy, color="gray", linestyle=":", label="chain entropy")
    ax.set(xlabel="step", ylabel="cross-entropy (nats)", title=f"GPT 4x512, {torch.cuda.get_device_name()}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    path = save_results("train_gpt", {"steps": args.steps, "batch_size": args.batch_size, "entropy": corpus.entropy,
                                      "relative_gap": gap, "runs": runs, "plot": os.path.basename(png)},
                        os.path.join(args.out_dir, f"{gpu_slug()}.json"))
    print(f"saved {path} and {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
