"""Command line: ``python -m lowprec demo`` | ``python -m lowprec bench <op> [options]``."""

from __future__ import annotations

import argparse
import importlib
import sys

BENCHES = ("attention", "decode", "gemm", "linear", "moe", "quant", "train")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lowprec", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("demo", help="quantize a weight-like tensor in every recipe and run a GEMM")
    bench = sub.add_parser("bench", help="benchmark an op against its peers on the GPU")
    bench.add_argument("op", choices=BENCHES)
    bench.add_argument("rest", nargs=argparse.REMAINDER, help="options for the op's benchmark")
    args = parser.parse_args(argv)
    if args.command == "demo":
        from .demo import main as demo

        demo()
        return 0
    module = importlib.import_module(f"lowprec.bench.{args.op}")
    return module.main(args.rest) or 0


if __name__ == "__main__":
    sys.exit(main())
