"""``python -m lowprec bench quant``: byte counts on the CPU; the after-a-GEMM timer on the GPU."""

import pytest
import torch

from lowprec.__main__ import BENCHES
from lowprec.bench import common
from lowprec.bench import quant as bench


def test_bytes_count_input_outputs_and_scales_once():
    assert "quant" in BENCHES
    m, k = 256, 384  # 3 blocks of 128 along K, 2 along M
    assert bench._bytes(m, k, "1x128") == 2 * m * k + m * k + 4 * m * 3
    assert bench._bytes(m, k, "rowwise") == 2 * m * k + m * k + 4 * m
    assert bench._bytes(m, k, "128x128") == 2 * m * k + m * k + 4 * 2 * 3
    assert bench._bytes(m, k, "dual") == 2 * m * k + 2 * m * k + 4 * (m * 3 + k * 2)


@pytest.mark.gpu
def test_bench_ms_before_times_the_call_after_the_other_work():
    x = torch.randn(1 << 20, device="cuda")
    y = torch.empty_like(x)
    z = torch.empty_like(x)
    calls = []

    def before():
        calls.append("before")
        z.copy_(x)

    ms = common.bench_ms(lambda: y.copy_(x), warmup=3, rep=5, queued=True, before=before)
    assert ms > 0 and torch.equal(y, x)
    assert calls == ["before"] * 8  # 3 warm-up calls, then one before each of the 5 timed ones
