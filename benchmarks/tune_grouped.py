"""Same-run A/B of the grouped GEMM in 1x1 and 1x2 clusters on the ``bench moe`` shapes, both
expert GEMMs, with routed counts "aligned" (every group a multiple of 128 rows), "balanced"
(uniform) and "skewed" (Zipf 1.2). Bit-identity across the configs is asserted; TFLOPS over the
routed rows, ``bench_ms`` (L2 flushed), four rounds in alternating order, median first.

    python benchmarks/tune_grouped.py [aligned,balanced,skewed]
"""

import math
import sys

import torch

from lowprec import quantize
from lowprec.bench.common import bench_ms
from lowprec.gemm.sm90.config import TileConfig
from lowprec.gemm.sm90.interface import choose_grouped_config, grouped_gemm_blockwise_fp8

SHAPES = [(8, 4096, 14336, 2, 4096), (64, 7168, 2048, 8, 4096), (128, 2048, 768, 8, 8192)]  # E, H, F, k, T


def routed_counts(kind: str, rows: int, num_experts: int, gen: torch.Generator) -> list[int]:
    if kind == "aligned":
        return [rows // num_experts] * num_experts
    if kind == "balanced":
        ids = torch.randint(0, num_experts, (rows,), generator=gen, device="cuda")
    else:
        popularity = torch.arange(1, num_experts + 1, device="cuda", dtype=torch.float32) ** -1.2
        ids = torch.multinomial(popularity, rows, replacement=True, generator=gen)
    return torch.bincount(ids, minlength=num_experts).tolist()


def compare(a_q, w_q, ends, configs: dict, flops: float) -> dict[str, list[float]]:
    def call(config):
        return grouped_gemm_blockwise_fp8(a_q.data, a_q.scale, w_q.data, w_q.scale, group_ends=ends, config=config)

    outs = {name: call(c) for name, c in configs.items()}
    first = next(iter(outs.values()))
    for name, out in outs.items():
        assert torch.equal(out, first), f"{name} differs from the first config"
    names = list(configs)
    tflops = {name: [] for name in names}
    for order in (names, names[::-1], names, names[::-1]):
        for name in order:
            tflops[name].append(flops / bench_ms(lambda c=configs[name]: call(c), warmup=5, rep=30) / 1e9)
    return tflops


def main() -> None:
    kinds = sys.argv[1].split(",") if len(sys.argv) > 1 else ["aligned", "balanced", "skewed"]
    gen = torch.Generator(device="cuda").manual_seed(0)
    for num_experts, hidden, ffn, top_k, tokens in SHAPES:
        rows = tokens * top_k
        for which, (n, k) in (("w1", (2 * ffn, hidden)), ("w2", (hidden, ffn))):
            a_q = quantize(torch.randn(rows, k, device="cuda", generator=gen).bfloat16(), "fp8_block1x128")
            w = torch.randn(num_experts, n, k, device="cuda", generator=gen) / math.sqrt(k)
            w_q = quantize(w.bfloat16(), "fp8_block128x128")
            del w
            for kind in kinds:
                counts = routed_counts(kind, rows, num_experts, gen)
                ends = torch.tensor(counts, device="cuda").cumsum(0).to(torch.int32)
                chosen = choose_grouped_config(rows / num_experts, n, k, num_experts)
                configs = {f"c1x{c}": TileConfig(tile_m=chosen.tile_m, tile_n=chosen.tile_n, cluster_n=c)
                           for c in (1, 2)}
                res = compare(a_q, w_q, ends, configs, 2.0 * rows * n * k)
                partial = sum(1 for c in counts if c % chosen.tile_m)
                cells = [f"{name} {sorted(v)[len(v) // 2]:.0f} ({' '.join(f'{x:.0f}' for x in v)})"
                         for name, v in res.items()]
                print(f"E{num_experts} {which} N{n} K{k} {kind:9s} chosen {chosen} partial groups {partial:3d} | "
                      + " | ".join(cells), flush=True)
            del a_q, w_q
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
