"""``python -m lowprec bench train``: whole training steps of a Llama-style model, bf16 vs FP8.

The model is written here (no ``transformers``): token embedding, per layer RMSNorm -> Q, K, V
projections -> rotary embedding -> causal SDPA (grouped KV heads) -> output projection, RMSNorm ->
SwiGLU MLP (:class:`lowprec.nn.SwiGLUMLP`: gate_proj, up_proj, down_proj, as transformers' LlamaMLP),
final RMSNorm, LM head. Every projection is an ``nn.Linear``, so ``lowprec.convert`` swaps them;
the LM head stays in its dtype for every implementation (as torchao's recipes leave it too).

Sizes (B·S = 8192 tokens per step): ``h1024`` (hidden 1024, 8 layers, 16 heads, FFN 2816, B8 S1024)
and ``llama3-8b-2l`` (Llama-3-8B-shaped layers: hidden 4096, 32 heads / 8 KV heads, FFN 14336,
2 layers, B4 S2048); vocabulary 32000.

For each size, weights (``bf16``: bf16 parameters; ``fp32-autocast``: FP32 master weights under
``torch.autocast(bfloat16)``), implementation (``bf16``: ``nn.Linear``; ``lowprec``:
``lowprec.convert(model, "fp8_block")``, which keeps layers under 4096² weights in bf16 (the row's
note says how many projections are FP8) and fuses each SwiGLU MLP (:class:`lowprec.nn.FP8SwiGLUMLP`);
``lowprec-wgrad16``: ``lowprec.convert(model)``, its default recipe ``fp8_block_wgrad16`` (the weight
gradients reading the activations in 16x128 blocks);
``lowprec-unfused``, on request only: the same with ``fuse_mlp=False``, three FP8Linear layers;
``lowprec-wgrad2d``, on request only: ``convert(model, "fp8_block_wgrad2d")``, the weight gradients
reading the activations in 128x128 blocks;
``torchao-tensorwise`` / ``torchao-rowwise``: torchao's float8 training, when it imports) and mode
(``eager``; ``compiled``: ``torch.compile(model)``), one row: the median step time (forward, loss,
backward, AdamW step (fused on CUDA); ``bench_ms``: the host syncs before each step, so host time
that is not hidden behind the GPU counts), peak memory, and the ratio to the bf16 implementation
with the same weights and mode. Rows merge into the saved results: a row measured again replaces
its old one, the others stay, each with the date it was measured.

``--train-steps N`` then trains the first size N steps on real text (the Python standard
library's sources as bytes, :mod:`lowprec.bench.corpus`) with each of ``--text-impls`` (bf16,
lowprec and lowprec-wgrad16 by default), same seed, initial weights and batches; the losses go to the results JSON
(and, with matplotlib, a PNG).

    python -m lowprec bench train [--sizes h1024,llama3-8b-2l] [--impls bf16,lowprec,...]
        [--weights bf16,fp32-autocast] [--modes eager,compiled] [--steps 20] [--train-steps 300]
        [--text-impls bf16,lowprec,...] [--text-seeds 1] [--text-first-seed 0] [--min-weight-numel N]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import functools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..nn import FP8Linear, FP8SwiGLUMLP, SwiGLUMLP

__all__ = ["LlamaConfig", "Llama", "SIZES", "IMPLS", "make_model", "main"]


@dataclass(frozen=True)
class LlamaConfig:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int = 32000
    batch: int = 8
    seq: int = 1024

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


SIZES = {
    "h1024": LlamaConfig(hidden=1024, layers=8, heads=16, kv_heads=16, ffn=2816, batch=8, seq=1024),
    "llama3-8b-2l": LlamaConfig(hidden=4096, layers=2, heads=32, kv_heads=8, ffn=14336, batch=4, seq=2048),
}
IMPLS = ("bf16", "lowprec", "torchao-tensorwise", "torchao-rowwise", "lowprec-unfused", "lowprec-wgrad16",
         "lowprec-wgrad2d")
DEFAULT_IMPLS = IMPLS[:4] + ("lowprec-wgrad16",)
WEIGHTS = ("bf16", "fp32-autocast")
MODES = ("eager", "compiled")


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def rotary_tables(seq: int, head_dim: int, base: float = 500000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin ``[seq, head_dim / 2]`` (FP32) of the rotary embedding."""
    inv = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq, dtype=torch.float32), inv)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (first half, second half) of ``x`` ``[B, H, S, D]`` by the position's angles."""
    x1, x2 = x.float().chunk(2, dim=-1)
    cos, sin = cos[: x.shape[-2]], sin[: x.shape[-2]]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).to(x.dtype)


class Block(nn.Module):
    def __init__(self, c: LlamaConfig):
        super().__init__()
        self.c = c
        self.attn_norm, self.mlp_norm = RMSNorm(c.hidden), RMSNorm(c.hidden)
        self.q = nn.Linear(c.hidden, c.heads * c.head_dim, bias=False)
        self.k = nn.Linear(c.hidden, c.kv_heads * c.head_dim, bias=False)
        self.v = nn.Linear(c.hidden, c.kv_heads * c.head_dim, bias=False)
        self.o = nn.Linear(c.heads * c.head_dim, c.hidden, bias=False)
        self.mlp = SwiGLUMLP(c.hidden, c.ffn)

    def forward(self, x, cos, sin):
        c = self.c
        b, s, _ = x.shape
        h = self.attn_norm(x)
        q = self.q(h).view(b, s, c.heads, c.head_dim).transpose(1, 2)
        k = self.k(h).view(b, s, c.kv_heads, c.head_dim).transpose(1, 2)
        v = self.v(h).view(b, s, c.kv_heads, c.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=c.kv_heads != c.heads)
        x = x + self.o(a.transpose(1, 2).reshape(b, s, -1))
        h = self.mlp_norm(x)
        return x + self.mlp(h)


class Llama(nn.Module):
    def __init__(self, c: LlamaConfig):
        super().__init__()
        self.c = c
        self.embed = nn.Embedding(c.vocab, c.hidden)
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.layers))
        self.norm = RMSNorm(c.hidden)
        self.lm_head = nn.Linear(c.hidden, c.vocab, bias=False)
        cos, sin = rotary_tables(c.seq, c.head_dim)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        for m in self.modules():  # small init, as Llama's: the losses start near log(vocab)
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, self.cos, self.sin)
        return self.lm_head(self.norm(x))


def _not_lm_head(name: str, module: nn.Module) -> bool:
    return not name.endswith("lm_head")


def make_model(c: LlamaConfig, impl: str, weights: str, device="cuda", base: Llama | None = None,
               min_weight_numel: int | None = None) -> nn.Module:
    """A model of ``impl`` with ``weights`` (a copy of ``base`` when given: same initial weights);
    ``min_weight_numel``: ``lowprec.convert``'s (None: its default)."""
    if impl not in IMPLS:
        raise ValueError(f"impl: expected one of {IMPLS}, got {impl!r}")
    if weights not in WEIGHTS:
        raise ValueError(f"weights: expected one of {WEIGHTS}, got {weights!r}")
    model = copy.deepcopy(base) if base is not None else Llama(c)
    model = model.to(device=device, dtype=torch.bfloat16 if weights == "bf16" else torch.float32)
    model.cos, model.sin = model.cos.float(), model.sin.float()
    if impl.startswith("lowprec"):
        import lowprec

        recipe = {"lowprec-wgrad16": "fp8_block_wgrad16", "lowprec-wgrad2d": "fp8_block_wgrad2d"}.get(impl, "fp8_block")
        lowprec.convert(model, recipe, filter_fn=_not_lm_head, min_weight_numel=min_weight_numel,
                        fuse_mlp=impl != "lowprec-unfused")
    elif impl.startswith("torchao"):
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        config = Float8LinearConfig.from_recipe_name(impl.removeprefix("torchao-"))
        convert_to_float8_training(model, config=config, module_filter_fn=lambda m, fqn: _not_lm_head(fqn, m))
    return model


def _autocast(weights: str, device: str):
    return torch.autocast(device, torch.bfloat16) if weights == "fp32-autocast" else contextlib.nullcontext()


def make_step(model: nn.Module, weights: str, compiled: bool, lr: float = 3e-4):
    """A training step ``step(tokens, targets) -> loss`` (forward, loss, backward, AdamW)."""
    device = next(model.parameters()).device.type
    forward = torch.compile(model) if compiled else model
    # the fused CUDA AdamW (HF Trainer's default `adamw_torch_fused`): the foreach one read its
    # bytes ~3 times over (11 ms of a 57 ms Llama-3-8B-shaped step, NOTES.md)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1, fused=device == "cuda")

    def step(tokens, targets):
        with _autocast(weights, device):
            logits = forward(tokens)
        loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss

    return step


def available_impls(requested: list[str]) -> dict[str, str | None]:
    """impl -> None (runs here) or why not."""
    out = {}
    for impl in requested:
        reason = None
        if impl.startswith("torchao"):
            try:
                import torchao.float8  # noqa: F401
            except Exception as err:  # not a dependency: rows say why they are missing
                reason = f"torchao.float8 does not import ({type(err).__name__})"
        out[impl] = reason
    return out


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m lowprec bench train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default=",".join(SIZES))
    p.add_argument("--impls", default=",".join(DEFAULT_IMPLS))
    p.add_argument("--weights", default=",".join(WEIGHTS))
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--steps", type=int, default=20, help="timed steps per row (median)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--train-steps", type=int, default=0, help="then train the first size this many steps on "
                                                              "real text, each of --text-impls (0: skip)")
    p.add_argument("--text-impls", default="bf16,lowprec,lowprec-wgrad16",
                   help="the implementations of the real-text run")
    p.add_argument("--text-seeds", type=int, default=1, help="seeds of the real-text run (initial weights, batches)")
    p.add_argument("--text-first-seed", type=int, default=0,
                   help="the first of those seeds (to split a many-seed comparison over several runs)")
    p.add_argument("--min-weight-numel", type=int, default=None,
                   help="lowprec.convert's threshold for the timed rows (default: convert's own; 0: every projection)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    for name, known in (("sizes", SIZES), ("impls", IMPLS), ("weights", WEIGHTS), ("modes", MODES),
                        ("text_impls", [i for i in IMPLS if not i.startswith("torchao")])):
        values = [v for v in getattr(args, name).split(",") if v]
        unknown = sorted(set(values) - set(known))
        if unknown:
            p.error(f"--{name.replace('_', '-')}: unknown {unknown}; known: {list(known)}")
        setattr(args, name, values)
    if args.steps < 1:
        p.error(f"--steps: expected at least 1 timed step, got {args.steps}")
    for name in ("warmup", "train_steps", "min_weight_numel"):
        if getattr(args, name) is not None and getattr(args, name) < 0:  # min_weight_numel: None is convert's own
            p.error(f"--{name.replace('_', '-')}: expected an int ≥ 0, got {getattr(args, name)}")
    if args.train_steps and not args.sizes:
        p.error("--train-steps: trains the first of --sizes, which is empty")
    if args.text_seeds < 1:
        p.error(f"--text-seeds: expected at least 1, got {args.text_seeds}")
    if args.text_first_seed < 0:
        p.error(f"--text-first-seed: expected a seed ≥ 0, got {args.text_first_seed}")
    return args


def train_on_text(c: LlamaConfig, steps: int, device="cuda", impls=("bf16", "lowprec"), seeds: int = 1,
                  first_seed: int = 0) -> dict:
    """``steps`` steps of each of ``impls`` (bf16 first) on the standard library's sources (bf16
    weights, eager; per seed, ``first_seed`` .. ``first_seed + seeds - 1``, the same initial weights
    and batches for every implementation).

    Returns the first seed's loss of every step (``losses``), and over the seeds: the mean of the
    last-20-step means (``last20_mean``) and each FP8 implementation's mean relative gap to bf16
    (``relative_gap``; ``relative_gap_per_seed`` with several seeds). One seed's gap moves by ~1.7
    points between identical runs (GPU nondeterminism; quant NOTES, session 36): compare recipes
    over several seeds."""
    from .corpus import random_windows, stdlib_bytes

    data, _ = stdlib_bytes(device)
    text = LlamaConfig(c.hidden, c.layers, c.heads, c.kv_heads, c.ffn, vocab=256, batch=c.batch, seq=c.seq)
    first, tails = {}, {impl: [] for impl in impls}
    for seed in range(first_seed, first_seed + seeds):
        torch.manual_seed(seed)
        base = Llama(text)
        for impl in impls:
            # every projection in FP8, however small: this run is about FP8's numerics
            model = make_model(text, impl, "bf16", device, base=base, min_weight_numel=0)
            step = make_step(model, "bf16", compiled=False)
            g = torch.Generator().manual_seed(seed)
            losses = []
            for i in range(steps):
                x, y = random_windows(data, text.batch, text.seq, g)
                losses.append(step(x, y).item())
                if i % 50 == 0:
                    print(f"  train seed {seed} {impl} step {i}: loss {losses[-1]:.4f}", flush=True)
            first.setdefault(impl, losses)
            tails[impl].append(sum(losses[-20:]) / len(losses[-20:]))
            print(f"  train seed {seed} {impl}: last-20 mean loss {tails[impl][-1]:.5f}", flush=True)
    gaps = {impl: [t / b - 1 for t, b in zip(tails[impl], tails["bf16"])] for impl in impls if impl != "bf16"}
    out = {"steps": steps, "seeds": seeds, "first_seed": first_seed, "losses": first,
           "last20_mean": {impl: sum(v) / seeds for impl, v in tails.items()},
           "relative_gap": {impl: sum(v) / seeds for impl, v in gaps.items()}}
    if seeds > 1:
        out["relative_gap_per_seed"] = gaps
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench train needs a CUDA GPU")
    from . import common
    from .common import bench_ms, gpu_slug, load_results, print_table, save_results

    reasons = available_impls(args.impls)
    today = datetime.date.today().isoformat()
    rows = []
    for size in args.sizes:
        c = SIZES[size]
        torch.manual_seed(0)
        base = Llama(c)
        tokens = torch.randint(0, c.vocab, (c.batch, c.seq), device="cuda")
        targets = torch.randint(0, c.vocab, (c.batch, c.seq), device="cuda")
        for weights in args.weights:
            for mode in args.modes:
                for impl in args.impls:
                    row = {"size": size, "weights": weights, "mode": mode, "impl": impl, "date": today}
                    if args.min_weight_numel is not None:
                        row["min_weight_numel"] = args.min_weight_numel
                    model = step = None
                    if reasons[impl]:
                        rows.append({**row, "note": f"missing: {reasons[impl]}"})
                        continue
                    try:
                        model = make_model(c, impl, weights, base=base, min_weight_numel=args.min_weight_numel)
                        step = make_step(model, weights, compiled=mode == "compiled")
                        torch.cuda.reset_peak_memory_stats()
                        ms = bench_ms(functools.partial(step, tokens, targets), warmup=args.warmup, rep=args.steps)
                        # bench_ms holds its L2-flush buffer through every step: not the step's memory
                        peak = torch.cuda.max_memory_allocated() - common._FLUSH_BYTES
                        row.update(step_ms=ms, peak_gib=peak / 2**30)
                        if impl.startswith("lowprec"):  # convert keeps layers too small to gain in bf16
                            fused = sum(isinstance(m, FP8SwiGLUMLP) for m in model.modules())
                            fp8 = sum(isinstance(m, FP8Linear) for m in model.modules()) + 3 * fused
                            linears = sum(type(m) in (nn.Linear, FP8Linear) for m in model.modules()) - 1  # - LM head
                            row["note"] = f"{fp8}/{linears} projections in FP8 ({fused} fused SwiGLU MLPs)"
                        print(f"  {size} {weights} {mode} {impl}: {ms:.2f} ms", flush=True)
                    except Exception as err:  # a peer that cannot run this row: say so, go on
                        row["note"] = f"error: {type(err).__name__}: {str(err).splitlines()[0][:120]}"
                    rows.append(row)
                    del model, step
                    torch.cuda.empty_cache()
                    torch._dynamo.reset()
    by_key = {(r["size"], r["weights"], r["mode"]): r["step_ms"] for r in rows
              if r["impl"] == "bf16" and "step_ms" in r}
    for r in rows:
        bf16 = by_key.get((r["size"], r["weights"], r["mode"]))
        if bf16 and "step_ms" in r:
            r["x_bf16"] = bf16 / r["step_ms"]
    print_table(["size", "weights", "mode", "impl", "step ms", "x bf16", "peak GiB", "note"],
                [[r["size"], r["weights"], r["mode"], r["impl"], r.get("step_ms", "-"), r.get("x_bf16", "-"),
                  r.get("peak_gib", "-"), r.get("note", "")] for r in rows])
    payload = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows,
               "sizes": {s: vars(SIZES[s]) for s in args.sizes}}
    if args.train_steps:
        impls = ["bf16"] + [i for i in args.text_impls if i != "bf16"]
        payload["text"] = train_on_text(SIZES[args.sizes[0]], args.train_steps, impls=impls, seeds=args.text_seeds,
                                        first_seed=args.text_first_seed)
        gaps = ", ".join(f"{impl} {gap:+.2%}" for impl, gap in payload["text"]["relative_gap"].items())
        print(f"last-20 mean loss: {payload['text']['last20_mean']}; against bf16: {gaps}")
    merged = merged_with_saved(payload, load_results("train", args.out))
    if args.train_steps:  # the saved run's curves when this one continues its seeds
        _plot(merged["text"], gpu_slug(), args.out)
    path = save_results("train", merged, args.out)
    print(f"results: {path}")
    return 0


def _row_key(row: dict) -> tuple:
    return row["size"], row["weights"], row["mode"], row["impl"], row.get("min_weight_numel")


def merged_with_saved(payload: dict, saved: dict | None) -> dict:
    """This run's section over the saved one: a row measured now replaces the saved row of the same
    size, weights, mode, implementation and ``--min-weight-numel``; the others stay (rows carry the
    date they were measured), as do the saved sizes and the saved real-text run unless this run has
    its own; a real-text run that continues the saved one's seeds (``--text-first-seed`` right after
    them, same steps and implementations) is appended to it (:func:`continued_text`). The saved
    section's free-text ``note`` stays, for the rows it describes."""
    if not saved:
        return payload
    fresh = {_row_key(r) for r in payload["rows"]}
    merged = {**saved, **payload}
    merged["rows"] = [r for r in saved.get("rows", []) if _row_key(r) not in fresh] + payload["rows"]
    merged["sizes"] = {**saved.get("sizes", {}), **payload["sizes"]}
    if "text" in payload and "text" in saved:
        merged["text"] = continued_text(saved["text"], payload["text"])
    return merged


def _per_seed_gaps(text: dict) -> dict:
    return text.get("relative_gap_per_seed") or {impl: [gap] for impl, gap in text["relative_gap"].items()}


def continued_text(saved: dict, new: dict) -> dict:
    """``new`` appended to ``saved`` when its seeds follow on (its ``first_seed`` is the first seed
    ``saved`` did not run, same steps and implementations): the seeds' per-seed gaps in order, their
    means over all the seeds, and ``saved``'s plotted losses (its first seed). Otherwise ``new``."""
    first = saved.get("first_seed", 0)
    if (new.get("first_seed", 0) != first + saved["seeds"] or new["steps"] != saved["steps"]
            or set(new["last20_mean"]) != set(saved["last20_mean"])):
        return new
    seeds = saved["seeds"] + new["seeds"]
    per_seed = {impl: gaps + _per_seed_gaps(new)[impl] for impl, gaps in _per_seed_gaps(saved).items()}
    last20 = {impl: (mean * saved["seeds"] + new["last20_mean"][impl] * new["seeds"]) / seeds
              for impl, mean in saved["last20_mean"].items()}
    return {**saved, "seeds": seeds, "first_seed": first, "relative_gap_per_seed": per_seed,
            "relative_gap": {impl: sum(g) / seeds for impl, g in per_seed.items()}, "last20_mean": last20}


def _plot(text: dict, slug: str, results_path: str | None = None) -> None:
    """The two loss curves as a PNG beside the results JSON (needs matplotlib; skipped without it)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no loss plot")
        return
    import os

    fig, ax = plt.subplots(figsize=(7, 4))
    for impl, losses in text["losses"].items():
        ax.plot(losses, label=impl, linewidth=1)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats / byte)")
    ax.set_ylim(top=min(max(max(v) for v in text["losses"].values()), math.log(256) + 0.5))
    ax.legend()
    folder = os.path.dirname(results_path) if results_path else os.path.join("benchmarks", "results")
    path = os.path.join(folder, f"train_text_{slug}.png")
    os.makedirs(folder or ".", exist_ok=True)  # folder is "" for an --out file in the working directory
    fig.savefig(path, dpi=120)
    print(f"loss plot: {path}")
