"""What the FP8 attention buys a whole transformers model (Llama-3-8B-shaped layers, bf16 weights):
``attn_implementation="lowprec_fp8"`` against ``"sdpa"``, alone and with every projection converted
by ``lowprec.convert`` (``fp8_block``; ``inference=True`` for prefill), eager.

Rows: prefill (a no-grad forward of the whole batch: logits included) and a training step
(forward, cross-entropy, backward; no optimizer). Synced ms per call, median of ``--reps`` after
warm-up; the FP8 forward's attention calls are counted so that none silently runs SDPA.
``--decode``: eager decode steps (one token per row, after a prompt of S tokens) on
``lowprec.attention.fp8_cache`` + ``"lowprec_fp8"`` against transformers' ``DynamicCache`` +
``"sdpa"``, bf16 linears, and the caches' KV bytes.

    python benchmarks/attention_hf_model.py --shapes 1x16384,4x4096,16x1024 --decode 8x8192,32x4096
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
import warnings

import torch

from lowprec.bench.common import synced_wall_ms


def main():
    from transformers import LlamaConfig, LlamaForCausalLM

    import lowprec
    from lowprec.attention import register_transformers_attention

    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="1x16384,4x4096,16x1024", help="BxS, comma separated")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--decode", default="", help="BxS prompts for the decode rows, comma separated")
    p.add_argument("--profile", action="store_true", help="torch.profiler tables of 5 decode steps of each cache")
    args = p.parse_args()
    fp8_attn = register_transformers_attention()
    cfg = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                      num_hidden_layers=args.layers, vocab_size=32000, max_position_embeddings=32768)
    torch.manual_seed(0)
    base = LlamaForCausalLM(cfg).to("cuda", torch.bfloat16)
    if args.decode:
        _decode_rows(base, cfg, args.decode, args.reps, fp8_attn, args.profile)
    models = {}
    for linear in ("bf16", "fp8") if args.shapes else ():
        for mode in ("prefill", "train"):
            m = copy.deepcopy(base)
            if linear == "fp8":
                lowprec.convert(m, "fp8_block", inference=mode == "prefill")
            models[linear, mode] = m
    print(f"{torch.cuda.get_device_name()}, Llama-3-8B-shaped layers x{args.layers}, bf16 weights, eager, synced ms")
    print("| B x S | linears | step | sdpa | lowprec_fp8 | ratio |")
    print("|---|---|---|---|---|---|")
    for shape in filter(None, args.shapes.split(",")):
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
                    row[impl] = synced_wall_ms(step, reps=args.reps)
                fell_back = [str(w.message) for w in caught if "lowprec_fp8" in str(w.message)]
                if fell_back:
                    raise SystemExit(f"{shape} {linear} {mode}: lowprec_fp8 ran sdpa: {fell_back[0]}")
            m.zero_grad(set_to_none=True)
            print(f"| {b} x {s} | {linear} | {mode} | {row['sdpa']:.2f} | {row[fp8_attn]:.2f} | "
                  f"{row['sdpa'] / row[fp8_attn]:.3f}x |", flush=True)


def _decode_rows(model, cfg, shapes: str, reps: int, fp8_attn: str, profile: bool) -> None:
    import contextlib

    from torch.nn.attention import SDPBackend, sdpa_kernel
    from transformers import DynamicCache

    from lowprec.attention import fp8_cache

    def flash():  # cuDNN, SDPA's default here, builds a plan for every new key length (~40 ms a step)
        return sdpa_kernel([SDPBackend.FLASH_ATTENTION])

    print("| B x prompt | cache | decode step ms | KV MB | x bf16 (flash) |")
    print("|---|---|---|---|---|")
    for shape in shapes.split(","):
        b, s = map(int, shape.split("x"))
        ids = torch.randint(0, cfg.vocab_size, (b, s + reps + 8), device="cuda")
        row = {}
        for label, impl, make, backend in (
                ("bf16 DynamicCache, sdpa (default: cuDNN)", "sdpa", DynamicCache, contextlib.nullcontext),
                ("bf16 DynamicCache, sdpa (flash)", "sdpa", DynamicCache, flash),
                ("fp8_cache, lowprec_fp8", fp8_attn, lambda n=s + reps + 16: fp8_cache(n), contextlib.nullcontext)):
            model.set_attn_implementation(impl)
            cache = make()
            with torch.no_grad(), warnings.catch_warnings(), backend():
                warnings.simplefilter("ignore", FutureWarning)
                model(ids[:, :s], past_key_values=cache, use_cache=True)
                times = []
                for i in range(s, s + reps + 8):
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    model(ids[:, i:i + 1], past_key_values=cache, use_cache=True)
                    torch.cuda.synchronize()
                    times.append((time.perf_counter() - t0) * 1e3)
                if profile and label != "bf16 DynamicCache, sdpa (default: cuDNN)":
                    from torch.profiler import ProfilerActivity
                    from torch.profiler import profile as torch_profile

                    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                        for i in range(s + reps + 3, s + reps + 8):
                            model(ids[:, i:i + 1], past_key_values=cache, use_cache=True)
                        torch.cuda.synchronize()
                    print(f"===== {label}, B{b} prompt {s}: 5 decode steps")
                    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12))
                    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=12))
            ms = statistics.median(times[8:])
            if impl == "sdpa":
                kv = sum(t.nbytes for layer in cache.layers for t in (layer.keys, layer.values))
            else:
                kv = sum(t.nbytes for layer in cache.layers for t in (layer.fp8._k, layer.fp8._v_t, layer.fp8._k_scale))
            row[label] = ms
            flash_ms = row.get("bf16 DynamicCache, sdpa (flash)")
            ratio = f"{flash_ms / ms:.3f}x" if flash_ms else "-"
            print(f"| {b} x {s} | {label} | {ms:.3f} | {kv / 1e6:.0f} | {ratio} |", flush=True)
            del cache
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
