#!/bin/bash
# One GPU call for the sm_90a FP8 attention kernel: every GPU test (default kernel and the
# flagged variants), then timings of the default kernel vs the serial one, ping-pong, and the
# decode shape with and without pack-GQA, against SDPA bf16 in the same process.
# From the repository root: bash benchmarks/attention_sm90_gpu_check.sh   (logs under $OUT if set)
set -u
LOG=${OUT:-/tmp}
export PYTHONUNBUFFERED=1
timeout 300 python -m pytest -q -m gpu tests/attention/test_sm90.py 2>&1 | tee "$LOG/attn_sm90_tests.log" | grep -v -i warn | tail -15
timeout 240 python benchmarks/attention_sm90_timing.py --serial --pingpong --decode --pack --persistent --vperm 2>&1 | tee "$LOG/attn_sm90_bench.log" | tail -40
