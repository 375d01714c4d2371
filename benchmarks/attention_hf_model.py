"""What the FP8 attention buys a whole transformers model (Llama-3-8B-shaped layers, bf16 weights):
``attn_implementation="lowprec_fp8"`` against ``"sdpa"``, alone and with every projection converted
by ``lowprec.convert`` (``fp8_block``; ``inference=True`` for prefill), eager.

Rows: prefill (a no-grad forward of the whole batch: logits included) and a training step
(forward, cross-entropy, backward; no optimizer). Synced ms per call, median of ``--reps`` after
warm-up; the FP8 forward's attention calls are counted so that none silently runs SDPA.

    python benchmarks/attention_hf_model.py --shapes 1x16384,4x4096,16x1024
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
import warnings

import torch


def _timed(fn, reps: int) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main():
    from transformers import LlamaConfig, LlamaForCausalLM

    import lowprec
    from lowprec.attention import register_transformers_attention

    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="1x16384,4x4096,16x1024", help="BxS, comma separated")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--reps", type=int, default=10)
    args = p.parse_args()
    fp8_attn = register_transformers_attention()
    cfg = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                      num_hidden_layers=args.layers, vocab_size=32000, max_position_embeddings=32768)
    torch.manual_seed(0)
    base = LlamaForCausalLM(cfg).to("cuda", torch.bfloat16)
    models = {}
    for linear in ("bf16", "fp8"):
        for mode in ("prefill", "train"):
            m = copy.deepcopy(base)
            if linear == "fp8":
                lowprec.convert(m, "fp8_block", inference=mode == "prefill")
            models[linear, mode] = m
    print(f"{torch.cuda.get_device_name()}, Llama-3-8B-shaped layers x{args.layers}, bf16 weights, eager, synced ms")
    print("| B x S | linears | step | sdpa | lowprec_fp8 | ratio |")
    print("|---|---|---|---|---|---|")
    for shape in args.shapes.split(","):
        b, s = map(int, shape.split("x"))
        ids = torch.randint(0, cfg.vocab_size, (b, s), device="cuda")
        for (linear, mode), m in models.items():
            def step(m=m, mode=mode, ids=ids):
                if mode == "prefill":
                    with torch.no_grad():
                        m(ids)
                else:
                    m(ids, labels=ids).loss.backward()
            row = {}
            for impl in ("sdpa", fp8_attn):
                m.set_attn_implementation(impl)
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    row[impl] = _timed(step, args.reps)
                fell_back = [str(w.message) for w in caught if "lowprec_fp8" in str(w.message)]
                if fell_back:
                    raise SystemExit(f"{shape} {linear} {mode}: lowprec_fp8 ran sdpa: {fell_back[0]}")
            m.zero_grad(set_to_none=True)
            print(f"| {b} x {s} | {linear} | {mode} | {row['sdpa']:.2f} | {row[fp8_attn]:.2f} | "
                  f"{row['sdpa'] / row[fp8_attn]:.3f}x |", flush=True)


if __name__ == "__main__":
    main()
