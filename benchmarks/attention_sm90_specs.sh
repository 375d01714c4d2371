#!/bin/bash
# Runs named cases (FLAGS:B,H,Hkv,Sq,Sk,D,causal) one by one, going on after a hang.
# Usage: bash benchmarks/attention_sm90_specs.sh SPEC...   (CASE_TIMEOUT=40 per case)
set -u
log=$(mktemp)
specs=("$@")
i=0
while [ "$i" -lt "${#specs[@]}" ]; do
  PYTHONUNBUFFERED=1 python benchmarks/attention_sm90_cases.py "${specs[@]:$i}" >> "$log" 2>&1
  done_now=$(grep -cE '^START ' "$log")
  i=$done_now
done
grep -E '^(OK|FAIL|HANG)' "$log"
