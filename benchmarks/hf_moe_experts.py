"""A transformers MoE block (Qwen3-MoE-shaped, random weights, transformers 5) timed on each experts
implementation: transformers' ``grouped_mm`` (bf16, ``torch._grouped_mm``) against lowprec's
``lowprec_fp8`` and ``lowprec_nvfp4`` (``lowprec.moe.register_transformers_experts``), the block's
own router in every case.

    python benchmarks/hf_moe_experts.py [--config E,H,F,k] [--tokens 1,8,32,256] [--train-tokens 8192]

Decode rows: the block's forward under ``torch.no_grad`` replayed from a CUDA graph (GPU time, host
excluded; ``lowprec_fp8`` inside ``reuse_quantized_weights``, so its weights are quantized once, as
a generation loop would run it); an implementation that cannot be captured is timed eager, queued,
and its row says so (then the ratio mixes the two modes). Training rows: forward + backward of
``--train-tokens`` tokens, eager, host synced (``lowprec_nvfp4`` has none). Prints ms and x grouped_mm.
"""

from __future__ import annotations

import argparse
import contextlib

import torch

import lowprec
from lowprec.bench.common import bench_graph_ms, bench_ms, print_table


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--config", default="128,2048,768,8", help="experts, hidden, moe ffn, top-k (Qwen3-30B-A3B)")
    p.add_argument("--tokens", default="1,8,32,256")
    p.add_argument("--train-tokens", type=int, default=8192)
    args = p.parse_args()
    import transformers

    experts, hidden, ffn, top_k = (int(v) for v in args.config.split(","))
    config = transformers.Qwen3MoeConfig(hidden_size=hidden, num_experts=experts, num_experts_per_tok=top_k,
                                         moe_intermediate_size=ffn, norm_topk_prob=True, num_hidden_layers=1,
                                         num_attention_heads=16, num_key_value_heads=4, head_dim=128)
    torch.manual_seed(0)
    block = transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock(config)
    with torch.no_grad():
        block.gate.weight.normal_(0, hidden ** -0.5)
        block.experts.gate_up_proj.normal_(0, hidden ** -0.5)
        block.experts.down_proj.normal_(0, ffn ** -0.5)
    block = block.to(device="cuda", dtype=torch.bfloat16)
    impls = ("grouped_mm", lowprec.moe.register_transformers_experts("fp8"),
             lowprec.moe.register_transformers_experts("nvfp4"))
    rows, table = [], []
    for t in [int(v) for v in args.tokens.split(",")]:
        x = torch.randn(1, t, hidden, device="cuda", dtype=torch.bfloat16)
        base = None
        for impl in impls:
            block.experts.config._experts_implementation = impl
            reuse = lowprec.nn.reuse_quantized_weights() if impl == "lowprec_fp8" else contextlib.nullcontext()
            with torch.no_grad(), reuse:
                block(x)  # compiles the kernels, packs / quantizes the weights
                try:
                    mode, ms = "decode graph", bench_graph_ms(lambda x=x: block(x))
                except Exception as err:  # an implementation that syncs the host cannot be captured
                    print(f"{impl} T={t}: no CUDA graph ({type(err).__name__}); eager, queued")
                    mode, ms = "decode eager q", bench_ms(lambda x=x: block(x), queued=True)
            base = base or ms
            rows.append({"mode": mode, "tokens": t, "impl": impl, "ms": ms, "x_grouped_mm": base / ms})
            table.append([mode, t, impl, ms, base / ms])
    x = torch.randn(1, args.train_tokens, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)
    base = None
    for impl in impls[:2]:
        block.experts.config._experts_implementation = impl

        def step():
            block(x).backward(dy)
        step()
        ms = bench_ms(step)
        base = base or ms
        rows.append({"mode": "train eager", "tokens": args.train_tokens, "impl": impl, "ms": ms,
                     "x_grouped_mm": base / ms})
        table.append(["train eager", args.train_tokens, impl, ms, base / ms])
    print(f"# {torch.cuda.get_device_name()}: Qwen3MoeSparseMoeBlock E{experts} H{hidden} F{ffn} top-{top_k}, bf16")
    print_table(["mode", "tokens", "experts", "ms", "x grouped_mm"], table)


if __name__ == "__main__":
    main()
