"""``python -m lowprec demo``: every recipe on a weight-like tensor, a block-scaled GEMM, an FP8
mixture-of-experts layer (training module and its FP8 inference form) and FP8 attention."""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from . import attention, convert, gemm, metrics, quantize
from .moe import MoE
from .recipes import RECIPE_NAMES


def weight_like(rows: int, cols: int, device: torch.device, seed: int = 0) -> torch.Tensor:
    """N(0, 0.02²) with a few heavy outlier channels, as in trained LLM weights."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * 0.02
    outlier_cols = torch.randperm(cols, generator=g)[: max(cols // 256, 1)]
    w[:, outlier_cols] *= 10
    return w.to(device)


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    line = "  ".join(h.ljust(w) for h, w in zip(header, widths))
    out = [line, "-" * len(line)]
    out += ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in rows]
    return "\n".join(out)


def run_on(device: torch.device) -> None:
    w = weight_like(1024, 4096, device)
    print(f"\n== {device}: weight-like tensor {tuple(w.shape)} fp32, N(0, 0.02) with outlier channels")
    rows = []
    for name in RECIPE_NAMES:
        options = [{}]
        if name == "nvfp4":
            options.append({"weight_2d": True})
        if name.startswith("mx"):
            options.append({"rounding": "floor"})
        for opts in options:
            qt = quantize(w, name, **opts)
            label = name + "".join(f" ({k}={v})" for k, v in opts.items())
            deq = qt.dequantize(torch.float32)
            rows.append([label, f"{qt.bits_per_element:.3f}", f"{metrics.sqnr_db(deq, w):.2f}",
                         f"{metrics.max_rel_err(deq, w):.2e}"])
    print(_table(["recipe", "bits/elem", "SQNR dB", "max rel err"], rows))

    g = torch.Generator(device="cpu").manual_seed(1)
    x = torch.randn(256, 4096, generator=g).to(device)
    a = quantize(x, "fp8_block1x128")
    b = quantize(w, "fp8_block128x128")
    timings = []
    for _ in range(2 if device.type == "cuda" else 1):  # the first CUDA call compiles or loads the kernel
        t0 = time.perf_counter()
        d = gemm(a, b, out_dtype=torch.float32)
        if device.type == "cuda":
            torch.cuda.synchronize()
        timings.append((time.perf_counter() - t0) * 1e3)
    took = (f"{timings[0]:.1f} ms on the reference path" if len(timings) == 1 else
            f"first call {timings[0]:.1f} ms with the kernel's compile or cache load, then {timings[1]:.2f} ms")
    ref = x.double() @ w.double().T
    print(f"\nGEMM D = A·Bᵀ, A {tuple(x.shape)} fp8_block1x128, B {tuple(w.shape)} fp8_block128x128, fp32 out: "
          f"SQNR {metrics.sqnr_db(d, ref):.2f} dB, rel L2 {metrics.rel_l2(d, ref):.2e} vs the fp64 product "
          f"of the unquantized inputs ({took})")


def moe_on(device: torch.device) -> None:
    """An FP8 MoE layer's forward next to the same layer unquantized (FP32), then its FP8 and NVFP4
    inference forms."""
    torch.manual_seed(0)
    hidden, ffn, experts, top_k, tokens = 512, 256, 8, 2, 512
    layer = MoE(hidden, ffn, experts, top_k, capacity_factor=1.0, device=device)
    exact = MoE(hidden, ffn, experts, top_k, capacity_factor=1.0, recipe=None, device=device)
    exact.load_state_dict(layer.state_dict())
    x = torch.randn(tokens, hidden, device=device)
    with torch.no_grad():
        y, routing = layer(x, return_routing=True)
        ref = exact(x)
        stats = routing.stats()
        print(f"\nMoE layer (H={hidden}, F={ffn}, E={experts}, top-{top_k}, capacity factor 1.0), {tokens} tokens: "
              f"FP8 forward vs the same layer in FP32: cos-sim {metrics.cos_sim(y, ref):.5f}, "
              f"rel L2 {metrics.rel_l2(y, ref):.2e}; {stats['dropped']:.0f} of {tokens * top_k} slots dropped "
              f"(capacity {stats['capacity']:.0f}, max load {stats['max_load']:.0f}, mean "
              f"{stats['mean_load']:.0f})")
        expert_bytes = layer.w1.nbytes + layer.w2.nbytes
        inference = convert(layer, inference=True)
        fp8_bytes = sum(b.nbytes for b in inference.buffers())
        same = torch.equal(inference(x), y)
        nvfp4 = convert(exact, "nvfp4", inference=True)
        nvfp4_bytes = sum(b.nbytes for name, b in nvfp4.named_buffers())
        y4 = nvfp4(x)
    print(f"FP8InferenceMoE (convert(layer, inference=True)): FP32 expert weights {expert_bytes / 2**20:.1f} -> "
          f"{fp8_bytes / 2**20:.1f} MiB, output {'identical' if same else 'DIFFERENT'} to the training layer's")
    print(f"NVFP4InferenceMoE (convert(layer, 'nvfp4', inference=True)): {nvfp4_bytes / 2**20:.2f} MiB of expert "
          f"weights and scales; vs the FP32 layer: cos-sim {metrics.cos_sim(y4, ref):.5f}, "
          f"rel L2 {metrics.rel_l2(y4, ref):.2e}")


def attention_on(device: torch.device) -> None:
    """FP8 attention's output and gradients next to exact attention in FP64, and bf16 SDPA's."""
    g = torch.Generator(device="cpu").manual_seed(2)
    b, h, s, d = 1, 8, 1024, 128
    q, k, v = (torch.randn(b, h, s, d, generator=g) for _ in range(3))
    k = k + 3 * torch.randn(1, h, 1, d, generator=g)  # a per-channel key bias, as trained models' keys have
    q, k, v = (t.to(device, torch.bfloat16).requires_grad_() for t in (q, k, v))
    w = torch.randn(b, h, s, d, generator=g).to(device)
    exact = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*exact, is_causal=True)
    ref_grads = torch.autograd.grad((ref * w).sum(), exact)
    rows = []
    for label, fn in (('lowprec.attention(quant="fp8")', lambda: attention(q, k, v, causal=True, quant="fp8")),
                      ("SDPA bf16", lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))):
        out = fn()
        grads = torch.autograd.grad((out.float() * w).sum(), (q, k, v))
        rows.append([label, f"{metrics.cos_sim(out, ref):.5f}", f"{metrics.rel_l2(out, ref):.2e}",
                     f"{min(metrics.cos_sim(a, r) for a, r in zip(grads, ref_grads)):.5f}"])
    print(f"\nAttention B{b} H{h} S{s} d{d} causal, keys with a per-channel bias, vs exact attention in FP64 "
          f"(speed: python -m lowprec bench attention, on a GPU)")
    print(_table(["", "out cos-sim", "out rel L2", "grad cos-sim (min of q, k, v)"], rows))


def main() -> None:
    print("lowprec demo: quantization recipes (x ≈ q · scale), a block-scaled GEMM, an FP8 MoE layer and FP8 "
          "attention")
    for device in [torch.device("cpu")] + ([torch.device("cuda")] if torch.cuda.is_available() else []):
        run_on(device)
        moe_on(device)
        attention_on(device)
    if not torch.cuda.is_available():
        print("\n(no CUDA device: GPU part skipped)")
