# ruff: noqa: B023, E501  (scratch script: lambdas timed inside their own iteration)
"""One small launch per kernel variant, errors printed; run first (under `timeout`) on the GPU."""
import sys

import torch

sys.path.insert(0, "tests/attention")
from test_sm90 import _run  # noqa: E402

from lowprec.attention.sm90 import interface  # noqa: E402

for overlap in (False, True):
    interface.OVERLAP = overlap
    for case in ((1, 2, 2, 256, 256, 128, False), (1, 2, 1, 200, 333, 128, True), (1, 2, 2, 256, 384, 64, False),
                 (1, 2, 1, 384, 384, 256, True)):
        o, lse, emu, emu_lse, ref, _ = _run(*case)
        live = ~torch.isinf(emu_lse)
        print(f"overlap={overlap} {case}: err {(o.double()-ref).abs().max().item():.4f} emu {(emu-ref).abs().max().item():.4f}"
              f" vs-emu {(o.double()-emu).abs().max().item():.4f} lse {(lse[live].double()-emu_lse[live]).abs().max().item():.2e}"
              f" nan {torch.isnan(o).sum().item()}", flush=True)
