"""``python -m lowprec bench decode``: ``y = x · Wᵀ`` at decode sizes, where the weight bytes set the time.

Shapes: the Llama-3-8B projections (N x K: QKV 6144x4096, O 4096x4096, gate+up 28672x4096, down
4096x14336) at M in {1, 4, 16, 64, 256} tokens, ``x`` bf16. Implementations:

- ``bf16``: cuBLAS, ``x @ W.t()``;
- ``fp8-cublas``: ``torch._scaled_mm`` with FP8 rowwise weights and ``x`` quantized per row in
  the call (as a user of cuBLAS FP8 would), where cuBLAS takes the shape;
- ``lowprec-fp8``: :class:`~lowprec.nn.FP8InferenceLinear` (128x128 weight blocks: the weight-only
  kernel up to ``weight_only_max_m`` rows, W8A8 beyond);
- ``lowprec-nvfp4``: :class:`~lowprec.nn.NVFP4InferenceLinear` (the weight-only kernel).

Then a decode step of a Llama-3-8B-shaped 2-layer model (``bench train``'s ``llama3-8b-2l``, every
linear including the LM head converted; embedding bf16) at B = 1 and 8 tokens, one new position
attending over a bf16 KV cache of ``CONTEXT`` positions (SDPA), as a CUDA graph: bf16 weights vs
``convert(model, "fp8_block", inference=True)`` vs ``convert(model, "nvfp4", inference=True)``,
two ways: ``eager-ops``, the step's PyTorch ops as they are captured in the graph, and
``compiled``, the step through ``torch.compile`` (fullgraph; the norms, rotary, SiLU and residual
adds fused by inductor, the lowprec layers traced as their custom ops) captured in the graph, as
a compiled decode loop runs it.

Each projection is timed three ways:

- ``graph_us``: the GPU time of a CUDA graph of back-to-back calls (the kernel's own speed);
- ``after_op_us``: the same with each call's ``x`` made by an elementwise kernel just before it
  (``x * 1``, its own graph time subtracted), as in a model, where a norm or an activation
  precedes most projections. The lowprec kernels launch with programmatic dependent launch: back
  to back, a call starts loading its weight while the previous one drains; after a PyTorch kernel
  it cannot, so this column counts its start-up as a model step does;
- ``eager_us``: back-to-back Python calls (what an eager decode loop pays, host time included).

The calls cycle over copies of the layer whose weights add up to more than ``ROTATE_BYTES`` (four
times H100's 50 MB L2), so each call reads its weight from HBM as a model's layers do (one weight
replayed back to back would stay in L2: 120% of the copy rate, measured). ``GB/s`` counts the
bytes of the weight as stored (the floor of a
memory-bound GEMM), ``% copy`` against the measured device copy bandwidth.

    python -m lowprec bench decode [--ms 1,4,16,64,256] [--shapes 6144x4096,...]
                                   [--impls bf16,fp8-cublas,lowprec-fp8,lowprec-nvfp4] [--batches 1,8]
                                   [--model-modes eager-ops,compiled] [--out FILE]
"""

from __future__ import annotations

import argparse
import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import nn

from .common import off_16, shape_pairs

__all__ = ["SHAPES", "MS", "IMPLS", "MODEL_IMPLS", "weight_bytes", "ratio_summary", "decode_step", "model_decode_rows",
           "is_partial", "save", "main"]

SHAPES = ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336))  # N x K
MS = (1, 4, 16, 64, 256)
IMPLS = ("bf16", "fp8-cublas", "lowprec-fp8", "lowprec-nvfp4")
ROTATE_BYTES = 200e6
CONTEXT = 1024  # KV-cache positions of the model decode step
MODEL_IMPLS = ("bf16", "lowprec-fp8", "lowprec-nvfp4")
MODEL_MODES = ("eager-ops", "compiled")
BATCHES = (1, 8)  # model decode step: tokens per step
_BYTES_PER_WEIGHT = {"bf16": 2.0, "fp8-cublas": 1.0, "lowprec-fp8": 1.0, "lowprec-nvfp4": 0.5 + 1 / 16}


def weight_bytes(impl: str, n: int, k: int) -> float:
    """Bytes of an ``n x k`` weight as ``impl`` stores it (codes and per-block scales; the
    per-tensor or per-row FP32 scales are negligible)."""
    extra = 4 * n * -(-k // 128) / 128 if impl == "lowprec-fp8" else 0.0  # 128x128 FP32 block scales
    return n * k * _BYTES_PER_WEIGHT[impl] + extra


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m lowprec bench decode", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ms", default=",".join(map(str, MS)), help="tokens per call, comma-separated")
    p.add_argument("--shapes", type=shape_pairs, default=",".join(f"{n}x{k}" for n, k in SHAPES),
                   help="N x K, comma-separated")
    p.add_argument("--impls", default=",".join(IMPLS),
                   help=f"projection implementations, comma-separated ({', '.join(IMPLS)})")
    p.add_argument("--batches", default=",".join(map(str, BATCHES)),
                   help="model decode step: tokens per step (empty: skip)")
    p.add_argument("--model-modes", default=",".join(MODEL_MODES),
                   help=f"model decode step: how its ops run, comma-separated ({', '.join(MODEL_MODES)})")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    try:
        args.ms = [int(m) for m in args.ms.split(",")]
        args.batches = [int(b) for b in args.batches.split(",") if b]
    except ValueError as e:
        p.error(f"--ms / --batches: expected comma-separated ints: {e}")
    for name, counts in (("--ms", args.ms), ("--batches", args.batches)):
        if any(c < 1 for c in counts):
            p.error(f"{name}: expected token counts ≥ 1, got {counts}")
    args.impls = args.impls.split(",")
    args.model_modes = [m for m in args.model_modes.split(",") if m]
    if [m for m in args.model_modes if m not in MODEL_MODES]:
        p.error(f"--model-modes: expected some of {MODEL_MODES}, got {args.model_modes}")
    unknown = [i for i in args.impls if i not in IMPLS]
    if unknown:
        p.error(f"--impls: unknown {unknown}; choose from {IMPLS}")
    odd = off_16(args.shapes)
    if odd and set(args.impls) != {"bf16"}:  # else the FP8 / NVFP4 layers raise after the GPU set-up
        p.error(f"--shapes: the FP8 and NVFP4 projections need N and K in multiples of 16, got {odd}")
    return args


SUMMARY_MS = (1, 4, 16)  # the geomean: the four shapes at these token counts


def ratio_summary(rows: list[dict]) -> dict:
    """Per lowprec format and timing (``graph_us``, ``after_op_us``): the geomean and the lowest of
    bf16's time over its time, over the rows at ``SUMMARY_MS`` tokens that both timed."""
    bf16 = {(r["n"], r["k"], r["m"]): r for r in rows if r["impl"] == "bf16"}
    summary = {}
    for impl in ("lowprec-fp8", "lowprec-nvfp4"):
        for mode in ("graph_us", "after_op_us"):
            ratios = [bf16[key][mode] / r[mode] for r in rows
                      if r["impl"] == impl and r["m"] in SUMMARY_MS and mode in r
                      and mode in bf16.get(key := (r["n"], r["k"], r["m"]), {})]
            if ratios:
                summary.setdefault(impl, {})[mode] = {
                    "geomean": math.exp(sum(map(math.log, ratios)) / len(ratios)), "lowest": min(ratios),
                    "cells": len(ratios)}
    return summary


def rotation_copies(weight_nbytes: float) -> int:
    """Copies of a layer to cycle over so a round of calls reads more than ``ROTATE_BYTES``."""
    return max(1, math.ceil(ROTATE_BYTES / weight_nbytes))


def _fp8_cublas(weight: torch.Tensor):
    """``x -> x · Wᵀ`` through cuBLAS FP8 with rowwise scales (x quantized per row in the call)."""
    amax_w = weight.float().abs().amax(dim=1, keepdim=True).clamp(min=1e-12)
    w8 = (weight.float() * (448.0 / amax_w)).to(torch.float8_e4m3fn)
    w_scale = (amax_w / 448.0).t().contiguous()  # [1, N]

    def call(x):
        amax_x = x.float().abs().amax(dim=1, keepdim=True).clamp(min=1e-12)
        x8 = (x.float() * (448.0 / amax_x)).to(torch.float8_e4m3fn)
        return torch._scaled_mm(x8, w8.t(), scale_a=amax_x / 448.0, scale_b=w_scale, out_dtype=torch.bfloat16)

    return call


def _make(impl: str, weight: torch.Tensor):
    from ..nn import FP8InferenceLinear, NVFP4InferenceLinear

    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device=weight.device, dtype=weight.dtype)
    with torch.no_grad():
        linear.weight.copy_(weight)
    if impl == "bf16":
        return linear
    if impl == "fp8-cublas":
        return _fp8_cublas(weight)
    if impl == "lowprec-fp8":
        return FP8InferenceLinear.from_linear(linear)
    return NVFP4InferenceLinear.from_linear(linear)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench decode needs a CUDA GPU")
    from .common import back_to_back_us, bench_graph_ms, copy_bandwidth_gbs, print_table

    copy_gbs = copy_bandwidth_gbs()
    print(f"# {torch.cuda.get_device_name()}: device copy {copy_gbs:.0f} GB/s; graph_us = GPU time (CUDA graph of "
          "back-to-back calls), after_op_us = the same, each call after an elementwise kernel (as in a model), "
          "eager_us = back-to-back Python calls (host time included)")
    rows, table = [], []
    g = torch.Generator(device="cuda").manual_seed(0)
    for n, k in args.shapes:
        weight = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g) * k ** -0.5
        layers = {}
        for impl in args.impls:
            try:
                layers[impl] = [_make(impl, weight) for _ in range(rotation_copies(weight_bytes(impl, n, k)))]
            except Exception as err:  # a peer that cannot take this weight: its rows say why
                layers[impl] = err
        for m in args.ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=g)
            for impl, layer in layers.items():
                row = {"n": n, "k": k, "m": m, "impl": impl, "weight_bytes": weight_bytes(impl, n, k)}
                try:
                    if isinstance(layer, Exception):
                        raise layer
                    with torch.no_grad():
                        fn = (lambda layer=layer, x=x: [copy(x) for copy in layer])
                        fn()
                        row["graph_us"] = bench_graph_ms(fn) * 1e3 / len(layer)
                        after_op = (lambda layer=layer, x=x: [copy(x * 1) for copy in layer])
                        op_alone = (lambda layer=layer, x=x: [x * 1 for _ in layer])
                        row["after_op_us"] = (bench_graph_ms(after_op) - bench_graph_ms(op_alone)) * 1e3 / len(layer)
                        row["eager_us"] = back_to_back_us(fn) / len(layer)
                    row["gbs"] = row["weight_bytes"] / row["graph_us"] / 1e3
                    row["pct_copy"] = 100 * row["gbs"] / copy_gbs
                except Exception as err:  # e.g. cuBLAS FP8 refusing a shape
                    row["note"] = f"{type(err).__name__}: {str(err).splitlines()[0][:100]}"
                rows.append(row)
                table.append([f"{n}x{k}", m, impl, row.get("graph_us", "-"), row.get("after_op_us", "-"),
                              row.get("eager_us", "-"), row.get("gbs", "-"), row.get("pct_copy", "-"),
                              row.get("note", "")])
    print_table(["N x K", "M", "impl", "graph_us", "after_op_us", "eager_us", "GB/s", "% copy", "note"], table)
    summary = ratio_summary(rows)
    for impl, by_mode in summary.items():
        print(f"{impl}: geomean x bf16 at M = {', '.join(map(str, SUMMARY_MS))} over the shapes: " + ", ".join(
            f"{mode} {r['geomean']:.2f}x (lowest {r['lowest']:.2f}x)" for mode, r in by_mode.items()))
    model_rows = model_decode_rows(args.batches, args.model_modes) if args.batches else []
    path = save({"device": torch.cuda.get_device_name(), "copy_gbs": copy_gbs, "rows": rows,
                 "summary": summary, "model_step": model_rows, "context": CONTEXT}, args.out, is_partial(args))
    print(f"results: {path}")
    return 0


def is_partial(args) -> bool:
    """Whether ``args`` leave out some of the default run's rows (``--ms``, ``--shapes``, ``--impls``,
    ``--batches``, ``--model-modes``): such a run is merged into the saved section, not over it."""
    full = ((args.ms, MS), (args.shapes, SHAPES), (args.impls, IMPLS), (args.batches, BATCHES),
            (args.model_modes, MODEL_MODES))
    return any(not set(given) >= set(default) for given, default in full)


def save(payload: dict, path: str | None = None, partial: bool = False) -> str:
    """Save ``payload`` as the ``decode`` section; a partial run (:func:`is_partial`) replaces only
    the saved rows and model steps it measured again, the summary recomputed over all rows."""
    from .common import load_results, merged_section, save_results

    if partial:
        payload = merged_section(load_results("decode", path), payload,
                                 {"rows": ("n", "k", "m", "impl"), "model_step": ("impl", "batch", "mode")})
        payload["summary"] = ratio_summary(payload["rows"])
    return save_results("decode", payload, path)


def decode_step(model, tokens: torch.Tensor, caches: list, pos: int) -> torch.Tensor:
    """Logits of one new position of ``tokens`` [B] for ``bench train``'s Llama, each block's
    keys and values written into its cache (``caches[i]`` = (k, v) [B, Hkv, CONTEXT, D]) at
    ``pos`` and attended over ``0..pos``."""
    from .train import apply_rotary

    c = model.c
    b = tokens.shape[0]
    cos, sin = model.cos[pos:pos + 1], model.sin[pos:pos + 1]
    x = model.embed(tokens)[:, None]
    for block, (k_cache, v_cache) in zip(model.blocks, caches):
        h = block.attn_norm(x)
        q = block.q(h).view(b, 1, c.heads, c.head_dim).transpose(1, 2)
        k = block.k(h).view(b, 1, c.kv_heads, c.head_dim).transpose(1, 2)
        v = block.v(h).view(b, 1, c.kv_heads, c.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        k_cache[:, :, pos:pos + 1] = k
        v_cache[:, :, pos:pos + 1] = v
        a = F.scaled_dot_product_attention(q, k_cache[:, :, :pos + 1], v_cache[:, :, :pos + 1],
                                           enable_gqa=c.kv_heads != c.heads)
        x = x + block.o(a.transpose(1, 2).reshape(b, 1, -1))
        h = block.mlp_norm(x)
        x = x + block.mlp(h)
    return model.lm_head(model.norm(x))[:, 0]


def model_decode_rows(batches: list[int], modes=MODEL_MODES) -> list[dict]:
    """The model decode step of each weight format at each batch and mode (``MODEL_MODES``):
    CUDA-graph ms per step."""
    import copy

    import lowprec

    from .common import bench_graph_ms, print_table
    from .train import SIZES, Llama

    c = dataclasses.replace(SIZES["llama3-8b-2l"], seq=CONTEXT)
    torch.manual_seed(0)
    base = Llama(c).to(device="cuda", dtype=torch.bfloat16)
    base.cos, base.sin = base.cos.float(), base.sin.float()
    rows, table, steps = [], [], {}
    for impl in MODEL_IMPLS:
        model = copy.deepcopy(base)
        if impl != "bf16":
            lowprec.convert(model, impl.removeprefix("lowprec-").replace("fp8", "fp8_block"), inference=True)
        weight_bytes = sum(t.nbytes for n, t in model.state_dict().items() if not n.startswith("embed"))
        for b in batches:
            tokens = torch.randint(0, c.vocab, (b,), device="cuda")
            caches = [tuple(torch.randn(b, c.kv_heads, CONTEXT, c.head_dim, device="cuda", dtype=torch.bfloat16)
                            for _ in range(2)) for _ in range(c.layers)]
            for mode in modes:
                step = decode_step
                if mode == "compiled":
                    torch._dynamo.reset()  # each model and batch compiles afresh (no recompile limit)
                    step = torch.compile(decode_step, fullgraph=True, dynamic=False)
                with torch.no_grad():
                    # an eager step first: the layers make their kernel-layout weights on first use
                    decode_step(model, tokens, caches, CONTEXT - 1)
                    ms = bench_graph_ms(lambda m=model, t=tokens, kv=caches, f=step: f(m, t, kv, CONTEXT - 1), reps=5)
                steps[(impl, b, mode)] = ms
                row = {"impl": impl, "batch": b, "mode": mode, "step_ms": ms, "weight_bytes": weight_bytes,
                       "x_bf16": steps[("bf16", b, mode)] / ms}
                rows.append(row)
                table.append([impl, b, mode, ms, weight_bytes / 1e6, row["x_bf16"]])
        del model
    print(f"# decode step, Llama-3-8B-shaped 2 layers + LM head, KV cache {CONTEXT} (CUDA graph; x bf16 within a mode)")
    print_table(["weights", "B", "mode", "step ms", "weight MB", "x bf16"], table)
    return rows
