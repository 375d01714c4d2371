import re

from lowprec.__main__ import main
from lowprec.recipes import RECIPE_NAMES


def test_demo_prints_a_table_for_every_recipe(capsys):
    assert main(["demo"]) == 0
    out = capsys.readouterr().out
    assert "SQNR dB" in out and "bits/elem" in out and "GEMM" in out
    assert "MoE layer" in out and "output identical to the training layer's" in out
    for name in RECIPE_NAMES:
        assert f"\n{name} " in out
    # FP8 attention's row: output and gradient cosines near the exact attention's
    fp8_rows = re.findall(r'lowprec\.attention\(quant="fp8"\)\s+([\d.]+)\s+[\d.e+-]+\s+([\d.]+)', out)
    assert fp8_rows and all(float(c) > 0.998 and float(g) > 0.999 for c, g in fp8_rows), fp8_rows
