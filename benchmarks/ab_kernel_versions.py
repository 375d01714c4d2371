"""Same-run A/B of two versions of the dense GEMM kernel module: an old ``blockscaled_gemm.py`` (REF
below) against the working tree's (new), on the M = 4096 ``bench gemm`` shapes, 8192³, a 1x128-B
(weight-gradient) shape and a small-M shape, each with its heuristic config. Outputs are asserted
bit-identical; TFLOPS in the benchmark's rot timing, ``AB_ROUNDS`` (default 4, even) rounds in
alternating order (the mean of the middle two first, then every round); ``AB_SHAPES`` (e.g.
``24576x1536,8192x8192``, N x K) keeps only those shapes.

    git show REF:lowprec/gemm/sm90/blockscaled_gemm.py > lowprec/gemm/sm90/blockscaled_gemm_old_tmp.py
    python benchmarks/ab_kernel_versions.py [NAME ...]

Each NAME adds a third (fourth...) version from ``blockscaled_gemm_NAME_tmp.py``, timed between
old and new in the same rounds (e.g. a change in two steps; only ``*_old_tmp.py`` is git-ignored).

REF: HEAD, or the commit to compare with. Before session 18 the module was self-contained (only
``.config``); since then it imports ``.mainloop`` and ``lowprec.cute``, which the old copy shares
with the new one: to A/B a change in those, check the old commit out in a second worktree and
copy its files under new names instead. Session 18's refactor against the module before it:
``git show c00e11c:lowprec/gemm/sm90/blockscaled_gemm.py``.
"""
import importlib
import os
import sys

import torch

from lowprec.bench.gemm import _time_rot, rot_set_count
from lowprec.gemm.sm90 import interface as gi

pkg = importlib.import_module("lowprec.gemm.sm90")
new = importlib.import_module("lowprec.gemm.sm90.blockscaled_gemm")
names = ["old", *sys.argv[1:], "new"]
ROUNDS = int(os.environ.get("AB_ROUNDS", "4"))
SHAPE_FILTER = os.environ.get("AB_SHAPES")
mods = {nm: new if nm == "new" else importlib.import_module(f"lowprec.gemm.sm90.blockscaled_gemm_{nm}_tmp")
        for nm in names}

def build(mod, cfg, per_col):
    sys.modules["lowprec.gemm.sm90.blockscaled_gemm"] = mod
    pkg.blockscaled_gemm = mod
    return gi.build_kernel(cfg, torch.bfloat16, 1 if per_col else 128, None, 132)

g = torch.Generator(device="cuda").manual_seed(0)
shapes = [(4096, 2112, 7168, False), (4096, 24576, 1536, False), (4096, 32768, 512, False), (4096, 7168, 16384, False),
          (4096, 4096, 7168, False), (4096, 7168, 2048, False), (8192, 8192, 8192, False), (4096, 4096, 16384, True),
          (128, 7168, 2048, False)]
for m, n, k, per_col in shapes:
    if SHAPE_FILTER and f"{n}x{k}" not in SHAPE_FILTER.split(","):
        continue
    cfg = gi.choose_config(m, n, k, 1 if per_col else 128)
    fns = {nm: build(mod, cfg, per_col) for nm, mod in mods.items()}
    nsets = rot_set_count(m, n, k)
    sets = []
    for _ in range(nsets):
        a = (torch.randn(m, k, device="cuda", generator=g) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
        b = (torch.randn(n, k, device="cuda", generator=g) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
        sa = torch.rand(m, k // 128, device="cuda", generator=g) * 1e-3 + 1e-4
        if per_col:
            sb = gi._prep_b_scale_per_col(torch.rand(n, k // 128, device="cuda", generator=g) * 1e-3 + 1e-4)
        else:
            sb = gi._tma_b_scale_blocks(torch.rand(n // 128, k // 128, device="cuda", generator=g) * 1e-3 + 1e-4)
        d = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
        sets.append((a, b, d, gi._tma_a_scale(sa.t().contiguous().t()), sb))
    outs = {}
    for name, fn in fns.items():
        sets[0][2].fill_(float("nan"))
        gi._launch(fn, *sets[0], *gi._unused_args(sets[0][0].device))
        torch.cuda.synchronize()
        outs[name] = sets[0][2].clone()
    for nm in names[1:]:
        assert torch.equal(outs["old"], outs[nm]), (m, n, k, nm)
    res = {nm: [] for nm in names}
    for order in [names, names[::-1]] * (ROUNDS // 2):
        for name in order:
            fn = fns[name]
            t = _time_rot([lambda s=s, fn=fn: gi._launch(fn, *s, *gi._unused_args(s[0].device)) for s in sets], 50)
            res[name].append(2 * m * n * k / t / 1e9)
    med = {nm: sorted(v)[ROUNDS // 2 - 1:ROUNDS // 2 + 1] for nm, v in res.items()}
    cells = [f"{nm} {sum(med[nm]) / 2:.0f} ({' '.join(f'{x:.0f}' for x in v)})" for nm, v in res.items()]
    print(m, n, k, per_col, cfg, " | ".join(cells), flush=True)
