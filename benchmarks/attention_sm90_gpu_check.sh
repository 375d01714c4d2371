#!/bin/bash
# One GPU call for the sm_90a FP8 attention kernel: every GPU test case (default kernel and the
# flagged variants) one by one; a case that hangs is reported (HANG) and the run goes on after it;
# then timings of the default kernel vs the variants against SDPA bf16 in one process.
# From the repository root: bash benchmarks/attention_sm90_gpu_check.sh   (logs under $OUT if set;
# CASE_TIMEOUT=40 per case, TIMING=0 skips the timings)
set -u
LOG=${OUT:-/tmp}
export PYTHONUNBUFFERED=1
n=$(python benchmarks/attention_sm90_cases.py --list | tail -1)
start=0
while [ "$start" -lt "$n" ]; do
  python benchmarks/attention_sm90_cases.py --start "$start" >> "$LOG/attn_sm90_cases.log" 2>&1
  start=$(( $(grep -E '^START ' "$LOG/attn_sm90_cases.log" | tail -1 | awk '{print $2}') + 1 ))
done
grep -E '^(OK|FAIL|HANG)' "$LOG/attn_sm90_cases.log"
if [ "${TIMING:-1}" = 1 ]; then
  timeout 240 python benchmarks/attention_sm90_timing.py --serial --pingpong --decode --pack --persistent --vperm --prepass 2>&1 | tee "$LOG/attn_sm90_bench.log" | tail -40
fi
