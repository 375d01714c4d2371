# ruff: noqa: E501
"""Runs the sm_90a attention GPU test cases one by one in this process, printing each outcome as it
finishes, from case index --start on (a driver loop restarts after a hang: see
attention_sm90_gpu_check.sh). Usage: python benchmarks/attention_sm90_cases.py [--start N] [--list]"""

from __future__ import annotations

import faulthandler
import os
import sys
import threading
import time
import traceback

sys.path.insert(0, ".")
import tests.attention.test_sm90 as t  # noqa: E402


class _Patch:
    def setattr(self, obj, name, value):
        setattr(obj, name, value)


def spec_cases(specs):
    """Cases named on the command line: FLAGS:B,H,Hkv,Sq,Sk,D,causal (FLAGS "-" or a+b)."""
    out = []
    for spec in specs:
        flags, shape = spec.split(":")
        case = tuple(int(x) for x in shape.split(","))
        case = (*case[:6], bool(case[6]))
        fl = () if flags == "-" else tuple(flags.split("+"))
        out.append((spec, lambda f=fl, c=case: _variant(f, c)))
    return out


def all_cases():
    out = [(f"emu {c}", lambda c=c: t.test_matches_emulation(c)) for c in t.CASES]
    flags_list = [("PINGPONG",), ("PACK_GQA",), ("SPLIT_KV",), ("PACK_GQA", "SPLIT_KV"), ("PERSISTENT",),
                  ("PINGPONG", "PERSISTENT"), ("OVERLAP",), ("V_KEY_PERM",)]
    for flags in flags_list:
        for c in t.VARIANT_CASES:
            out.append((f"{'+'.join(flags)} {c}", lambda f=flags, c=c: _variant(f, c)))
    out += [("fp16_determinism", t.test_fp16_out_and_determinism), ("empty_keys", t.test_empty_keys)]
    return out


def _variant(flags, case):
    from lowprec.attention.sm90 import interface
    saved = {n: getattr(interface, n) for n in ("PINGPONG", "PACK_GQA", "SPLIT_KV", "PERSISTENT", "OVERLAP")}
    try:
        t.test_variants_match_emulation(flags, case, _Patch())
    finally:
        for n, v in saved.items():
            setattr(interface, n, v)


def main():
    start = int(sys.argv[sys.argv.index("--start") + 1]) if "--start" in sys.argv else 0
    specs = [a for a in sys.argv[1:] if ":" in a]
    cases = spec_cases(specs) if specs else all_cases()
    if "--list" in sys.argv:
        print(len(cases))
        return
    case_timeout = float(os.environ.get("CASE_TIMEOUT", "40"))
    for i in range(start, len(cases)):
        name, fn = cases[i]
        print(f"START {i} {name}", flush=True)
        t0 = time.time()
        watchdog = threading.Timer(case_timeout, lambda i=i, name=name: (print(f"HANG {i} {name}", flush=True),
                                                                 faulthandler.dump_traceback(), os._exit(3)))
        watchdog.start()
        try:
            fn()
            print(f"OK {i} {name} {time.time() - t0:.1f}s", flush=True)
        except Exception as e:  # noqa: BLE001
            print(f"FAIL {i} {name}: {type(e).__name__} {str(e)[:300]}", flush=True)
            traceback.print_exc(limit=3)
        watchdog.cancel()


if __name__ == "__main__":
    main()
