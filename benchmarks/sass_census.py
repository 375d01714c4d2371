"""SASS census of every shipped sm_90a GEMM configuration, compiled on this machine (no GPU).

One line per kernel: instruction counts by opcode class (QGMMA, FFMA, FMUL, FADD, LDS, STS, STSM,
LDG, STG, UTMALDG, UTMASTG, SYNCS, BAR, BRA, LDL, STL, total) and two hashes: ``ops`` over the
opcode sequence with modifiers (order included: a rescheduled instruction changes it) and
``bag`` over the sorted opcodes (which instructions, whatever their order). A refactor of the
kernel source that keeps the generated code must keep every line; diff two runs:

    python benchmarks/sass_census.py > before.txt      # on the old source
    python benchmarks/sass_census.py > after.txt       # on the new one
    diff before.txt after.txt

Kernels: every ``_shipped_configs()`` entry (bf16 out, 128x128 B scales, no bias; split-K configs
write fp32 partials), the out-dtype / bias / 1x128-B-scale variants of the compile tests, and the
grouped GEMMs (contiguous and masked on the grouped compile-test configs, bf16 and fp32 out;
K-grouped on its configs, fp32 and bf16 out). ``-k SUBSTR`` keeps the lines whose name contains
SUBSTR; ``--sass DIR`` also writes each kernel's SASS there.
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import os
import re
import sys

CLASSES = ("QGMMA", "FFMA", "FMUL", "FADD", "LDS", "STS", "STSM", "LDG", "STG", "UTMALDG", "UTMASTG",
           "SYNCS", "BAR", "BRA", "NOP", "LDL", "STL")
_INSN = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)")


def kernels():
    """(name, build_kernel kwargs) of every kernel of the census."""
    import torch

    from lowprec.gemm.sm90.config import TileConfig
    from lowprec.gemm.sm90.interface import _shipped_configs, choose_config

    bf16, f16, f32 = torch.bfloat16, torch.float16, torch.float32
    out = []

    def add(cfg, out_dtype=bf16, per_col=False, bias=None, grouping=None):
        name = f"{grouping or 'dense'} {cfg} out={str(out_dtype)[6:]} sb={'col' if per_col else 'blk'}"
        name += f" bias={str(bias)[6:]}" if bias is not None else ""
        out.append((name, dict(config=cfg, out_dtype=out_dtype, b_block_n=1 if per_col else 128, bias_dtype=bias,
                               grouping=grouping)))

    for cfg in _shipped_configs():
        add(cfg)
    # tests/gemm/test_sm90.py::test_compile_variants and ::test_compile_per_col_bias_at_large_m
    for od, pc, bias, tn in ((f32, False, None, 128), (bf16, True, None, 128), (bf16, True, f32, 112),
                             (bf16, False, bf16, 160), (f32, True, bf16, 64)):
        add(TileConfig(tile_m=128, tile_n=tn), od, pc, bias)
    big_col = choose_config(8192, 4096, 16384, b_block_n=1)
    for bias in (None, f32, bf16):
        add(big_col, bf16, True, bias)
    add(TileConfig(tile_m=128, tile_n=128, cluster_n=2), f16)
    add(TileConfig(tile_m=128, tile_n=128, cluster_n=2), bf16, False, f32)
    add(TileConfig(tile_m=64, tile_n=64), f32, True)
    # tests/gemm/test_sm90_grouped.py
    kgrouped = [(128, 128, 1), (64, 128, 1), (128, 64, 1), (128, 128, 2), (64, 128, 2)]
    for tm, tn, cn in kgrouped + [(128, 192, 1), (128, 192, 2)]:
        cfg = TileConfig(tile_m=tm, tile_n=tn, cluster_n=cn)
        add(cfg, bf16, grouping="contiguous")
        add(cfg, f32, grouping="contiguous")
        add(cfg, bf16, grouping="masked")
    for tm, tn, cn in kgrouped:
        cfg = TileConfig(tile_m=tm, tile_n=tn, cluster_n=cn)
        add(cfg, f32, True, grouping="kgrouped")
        add(cfg, bf16, True, grouping="kgrouped")
    return out


def census(sass: str) -> str:
    ops = [m.group(1) for m in map(_INSN.search, sass.splitlines()) if m]
    cls = collections.Counter(op.split(".")[0] for op in ops)
    counts = " ".join(f"{c}={cls.get(c, 0)}" for c in CLASSES)
    seq = hashlib.sha256("\n".join(ops).encode()).hexdigest()[:10]
    bag = hashlib.sha256("\n".join(sorted(ops)).encode()).hexdigest()[:10]
    return f"{counts} total={len(ops)} ops={seq} bag={bag}"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-k", default="", help="only kernels whose name contains this")
    ap.add_argument("--sass", default=None, help="write each kernel's SASS into this folder")
    args = ap.parse_args()
    from lowprec.gemm.sm90.interface import build_kernel
    from lowprec.runtime.compile import sass_of

    if args.sass:
        os.makedirs(args.sass, exist_ok=True)
    for name, kw in kernels():
        if args.k not in name:
            continue
        sass = sass_of(build_kernel(num_sms=132, **kw))
        if args.sass:
            with open(os.path.join(args.sass, re.sub(r"[^\w.=-]+", "_", name) + ".sass"), "w") as f:
                f.write(sass)
        print(f"{name:58s} {census(sass)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
