"""``python -m lowprec bench attention``: FP8 attention vs the bf16 attention a user would pick.

Rows per shape, in one run: lowprec FP8 with its quantization pre-pass (``lowprec.attention(...,
quant="fp8")``, bf16 in and out), with K and V in an FP8 cache (an ``FP8KVCache`` filled once,
``attend`` quantizing Q per call: how a decoder runs it) and kernel only (pre-quantized operands, Vᵀ in the permuted
key order the pre-pass writes), cuDNN SDPA bf16, SDPA
flash bf16 and FlashAttention-4 bf16 (``flash_attn.cute``, when it imports). The FP8 rows need the
sm_90a kernel: without it they are listed as missing with the reason (never timed on the
reference emulation). TFLOPS = 4·B·H·Sq·Sk·D / time (causal counts half); ``x best bf16``: TFLOPS
over the fastest bf16 peer's. Accuracy per row vs an FP64 reference on batch 0, the first heads:
cosine, rel-L1, RMSE. Median time between CUDA events, L2 flushed before each run, in two modes:
synced (the host waits for each run, so host time to the first launch counts where it exceeds the
flush: a lone eager call) and queued (``... q``: runs queued back to back, as ``do_bench`` and a
training step run them: host time counts only where it exceeds the GPU's); each mode's time is the
median of ``--rounds`` rounds that interleave the peers. ``--after-gemm``: each
run follows a bf16 GEMM instead of the flush, so the chip is at its power cap when the call starts,
as between a model's projections (a separate section of the results, ``attention_after_gemm``).

    python -m lowprec bench attention [--quick] [--only NAME,...] [--no-accuracy] [--after-gemm] [--rounds N]
        [--out FILE]
"""

from __future__ import annotations

import argparse
import math
import statistics
from dataclasses import dataclass

import torch

from .. import metrics
from .common import bench_ms, gpu_slug, positive_int, print_table, save_results


@dataclass(frozen=True)
class Shape:
    name: str
    b: int
    h: int
    hkv: int
    sq: int
    sk: int
    d: int
    causal: bool

    @property
    def flops(self) -> float:
        """4·B·H·Sq·Sk·D (two GEMMs), halved for causal (the issue's convention)."""
        return 4.0 * self.b * self.h * self.sq * self.sk * self.d * (0.5 if self.causal else 1.0)


# issue 25's shapes
SHAPES = [
    Shape("d128", 4, 32, 32, 4096, 4096, 128, False),
    Shape("d128-causal", 4, 32, 32, 4096, 4096, 128, True),
    Shape("gqa-causal", 4, 32, 8, 4096, 4096, 128, True),
    Shape("d64", 4, 32, 32, 4096, 4096, 64, False),
    Shape("d256", 4, 16, 16, 4096, 4096, 256, False),
    Shape("s16k-causal", 1, 32, 32, 16384, 16384, 128, True),
    Shape("b16-s1k-causal", 16, 32, 32, 1024, 1024, 128, True),
    Shape("decode", 64, 32, 8, 1, 8192, 128, False),
    Shape("decode-mha", 8, 32, 32, 1, 8192, 128, False),  # not the issue's: MHA decode (no GQA packing)
]
QUICK = ("d128", "d128-causal", "decode")
BF16_PEERS = ("cudnn-sdpa-bf16", "sdpa-flash-bf16", "fa4-bf16")
REF_HEADS = 4  # FP64 reference on batch 0, heads 0..REF_HEADS-1
GEMM_BEFORE = 8192  # --after-gemm: a bf16 GEMM of this size (~1.6 ms on an H100 / H200) before each run


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m lowprec bench attention", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help=f"only {', '.join(QUICK)}")
    p.add_argument("--only", type=str, default=None, help="comma-separated shape names")
    p.add_argument("--no-accuracy", action="store_true", help="skip the FP64 accuracy columns")
    p.add_argument("--rep", type=positive_int, default=30, help="timed runs per row and mode")
    p.add_argument("--rounds", type=positive_int, default=3,
                   help="interleaved rounds over the peers (each mode's time: the median of its rounds)")
    p.add_argument("--no-fp8", action="store_true", help="leave the FP8 rows out (the bf16 peers only)")
    p.add_argument("--after-gemm", action="store_true",
                   help=f"each run follows a bf16 {GEMM_BEFORE}^3 GEMM instead of the L2 flush (the chip at its "
                        "power cap, as inside a model); results under 'attention_after_gemm'")
    p.add_argument("--out", type=str, default=None, help="JSON path (default benchmarks/results/<gpu>.json)")
    return p.parse_args(argv)


def select_shapes(args) -> list[Shape]:
    names = QUICK if args.quick else None
    if args.only:
        names = tuple(n.strip() for n in args.only.split(","))
        unknown = set(names) - {s.name for s in SHAPES}
        if unknown:
            raise SystemExit(f"--only: unknown shapes {sorted(unknown)}; known: {[s.name for s in SHAPES]}")
    return [s for s in SHAPES if names is None or s.name in names]


def fp8_kernel_status() -> str | None:
    """Why the FP8 rows cannot run here (None: the sm_90a kernel is importable on this GPU)."""
    from ..runtime import backend_mode, dsl_available
    from ..runtime.arch import device_arch

    if backend_mode() == "reference":
        return "LOWPREC_BACKEND=reference (the emulation is not timed)"
    arch = device_arch(torch.device("cuda"))
    if arch != "sm_90a":
        return f"no FP8 attention kernel for {arch}"
    if not dsl_available():
        return "CuTe DSL does not import"
    try:
        from ..attention.sm90 import interface  # noqa: F401
    except Exception as err:
        return f"the sm_90a attention kernel does not import ({type(err).__name__}: {err})"
    return None


def _inputs(s: Shape):
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(s.b, s.h, s.sq, s.d, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(s.b, s.hkv, s.sk, s.d, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(s.b, s.hkv, s.sk, s.d, device="cuda", dtype=torch.bfloat16, generator=g)
    return q, k, v


def _reference(s: Shape, q, k, v) -> torch.Tensor:
    """FP64 exact attention of batch 0, heads 0..REF_HEADS-1 ([heads, Sq, D]), one head at a time."""
    group = s.h // s.hkv
    outs = []
    for head in range(min(REF_HEADS, s.h)):
        qh, kh, vh = q[0, head].double(), k[0, head // group].double(), v[0, head // group].double()
        sc = (qh @ kh.T) / math.sqrt(s.d)
        if s.causal:
            mask = torch.ones(s.sq, s.sk, dtype=torch.bool, device="cuda").tril(s.sk - s.sq)
            sc = sc.masked_fill(~mask, -math.inf)
        outs.append(torch.softmax(sc, -1).nan_to_num() @ vh)
        del sc
    return torch.stack(outs)


def _peers(s: Shape, q, k, v, fp8_reason: str | None) -> dict:
    """name -> (callable returning out [B, H, Sq, D], or the reason it cannot run)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import lowprec

    f = torch.nn.functional.scaled_dot_product_attention
    gqa = s.h != s.hkv
    causal = s.causal
    peers: dict = {}
    if fp8_reason is None:
        from ..attention import FP8KVCache, quantize_qkv
        from ..attention.quantize import quantize_v
        from ..attention.sm90.interface import fp8_attention_forward, permute_v_keys
        from ..runtime import registry

        x = quantize_qkv(q, k, v)
        served = registry.why_no_kernel("attention_fp8", q.device, x.q, x.q_scale, x.k, x.k_scale, x.v_t,
                                        x.v_scale, causal, s.d ** -0.5, torch.bfloat16)
        peers["lowprec-fp8+quant"] = (lambda: lowprec.attention(q, k, v, causal=causal, quant="fp8")) \
            if served is None else f"missing: {served}"
        # as a decoder runs it: K and V appended once to an FP8KVCache (V's scales quantize_kv_cache's,
        # quantize_v's, so the codes are its), Q quantized per call
        cache = FP8KVCache(s.b, s.hkv, s.sk, s.d, dtype=k.dtype, device=k.device, v_scale=quantize_v(v)[1])
        cache.append(k, v)
        peers["lowprec-fp8-kv-cache"] = (lambda: cache.attend(q, causal=causal)) \
            if served is None else f"missing: {served}"
        # the kernel the pre-pass path runs: Vᵀ with its keys permuted (no P shuffles)
        v_perm = permute_v_keys(x.v_t)
        peers["lowprec-fp8-kernel"] = lambda: fp8_attention_forward(
            x.q, x.q_scale, x.k, x.k_scale, v_perm, x.v_scale, causal=causal, softmax_scale=s.d ** -0.5,
            out_dtype=torch.bfloat16, v_keys_permuted=True)[0]
    else:
        peers["lowprec-fp8+quant"] = peers["lowprec-fp8-kv-cache"] = peers["lowprec-fp8-kernel"] = \
            f"missing: {fp8_reason}"

    def sdpa(backend):
        def run():
            with sdpa_kernel([backend]):
                return f(q, k, v, is_causal=causal, enable_gqa=gqa)
        return run

    peers["cudnn-sdpa-bf16"] = sdpa(SDPBackend.CUDNN_ATTENTION)
    peers["sdpa-flash-bf16"] = sdpa(SDPBackend.FLASH_ATTENTION)
    try:
        from flash_attn.cute import flash_attn_func
    except Exception as err:
        peers["fa4-bf16"] = f"missing: flash_attn.cute does not import ({type(err).__name__})"
    else:
        qt, kt, vt = (t.transpose(1, 2).contiguous() for t in (q, k, v))  # FA4 takes [B, S, H, D]

        def fa4():
            res = flash_attn_func(qt, kt, vt, causal=causal)
            return (res[0] if isinstance(res, tuple) else res).transpose(1, 2)
        peers["fa4-bf16"] = fa4
    return peers


def run_shape(s: Shape, args, fp8_reason: str | None, before=None) -> list[dict]:
    """The rows of one shape; ``before``: called before every timed run instead of the L2 flush.

    The peers are timed in ``args.rounds`` interleaved rounds (each round every peer, synced then
    queued, ``rep / rounds`` runs each) and each mode's time is the median of its rounds: a phase of
    slow host launches (one lasted ~0.1-1 s, hitting whichever rows ran then) skews one round of a
    few peers instead of whole rows, and the peer timed first after the untimed calls (on a chip with
    power to spare, as ``bench gemm`` found for its eager column) gains in one round only."""
    q, k, v = _inputs(s)
    ref = None if args.no_accuracy else _reference(s, q, k, v)
    rows, timed = [], {}
    for name, fn in _peers(s, q, k, v, fp8_reason).items():
        row = {"shape": s.name, "impl": name, "B": s.b, "H": s.h, "Hkv": s.hkv, "Sq": s.sq, "Sk": s.sk, "D": s.d,
               "causal": s.causal}
        rows.append(row)
        if isinstance(fn, str):
            row["note"] = fn
            continue
        try:
            with torch.no_grad():
                out = fn()
        except Exception as err:  # a peer that does not take this shape: say so, go on
            row["note"] = f"error: {type(err).__name__}: {str(err).splitlines()[0][:120]}"
            continue
        if ref is not None:
            got = out[0, : ref.shape[0]]
            row.update(cos=metrics.cos_sim(got, ref), rel_l1=metrics.rel_l1(got, ref), rmse=metrics.rmse(got, ref))
        del out
        timed[name] = (fn, row, [], [])
    per_round = max(1, math.ceil(args.rep / args.rounds))
    for r in range(args.rounds):
        for name, (fn, row, synced, queued) in list(timed.items()):
            try:
                with torch.no_grad():
                    synced.append(bench_ms(fn, warmup=5 if r == 0 else 2, rep=per_round, before=before))
                    queued.append(bench_ms(fn, warmup=2, rep=per_round, queued=True, before=before))
            except Exception as err:  # e.g. out of memory only when timed: the row says so
                row["note"] = f"error: {type(err).__name__}: {str(err).splitlines()[0][:120]}"
                del timed[name]
    for name, (_, row, synced, queued) in timed.items():
        ms, ms_q = statistics.median(synced), statistics.median(queued)
        row.update(ms=ms, tflops=s.flops / ms / 1e9, ms_queued=ms_q, tflops_queued=s.flops / ms_q / 1e9,
                   ms_rounds=synced, ms_queued_rounds=queued)
        print(f"  {s.name} {name}: {ms:.3f} ms, {row['tflops']:.0f} TFLOPS; queued {ms_q:.3f} ms "
              f"(rounds {' '.join(f'{t:.3f}' for t in synced)} / {' '.join(f'{t:.3f}' for t in queued)})", flush=True)
    for mode in ("", "_queued"):
        best = max((r["tflops" + mode] for r in rows if r["impl"] in BF16_PEERS and "tflops" in r), default=None)
        for r in rows:
            if best and "tflops" in r:
                r["x_best_bf16" + mode] = r["tflops" + mode] / best
    return rows


def timing_setup(args, device="cuda") -> tuple:
    """``(before, section, preceded)``: what runs before each timed run (None: the L2 flush), the
    results section the rows go to, and the timing note's words for it."""
    if not args.after_gemm:
        return None, "attention", "L2 flushed"
    # a model's projection: the chip at its power cap when the call starts (its output flushes the L2)
    a = torch.randn(GEMM_BEFORE, GEMM_BEFORE, device=device, dtype=torch.bfloat16)
    c = torch.empty_like(a)
    return (lambda: torch.mm(a, a, out=c)), "attention_after_gemm", \
        f"after a bf16 {GEMM_BEFORE}^3 GEMM (the chip at its power cap)"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench attention needs a CUDA GPU")
    shapes = select_shapes(args)
    fp8_reason = "left out (--no-fp8)" if args.no_fp8 else fp8_kernel_status()
    print(f"{torch.cuda.get_device_name()} ({gpu_slug()}); FP8 rows: "
          f"{'sm_90a kernel' if fp8_reason is None else 'missing (' + fp8_reason + ')'}")
    before, section, preceded = timing_setup(args)
    rows = []
    for s in shapes:
        rows += run_shape(s, args, fp8_reason, before)
        torch.cuda.empty_cache()
    header = ["shape", "impl", "ms", "TFLOPS", "x best bf16", "ms q", "x best bf16 q", "cos", "rel-L1", "RMSE", "note"]
    print_table(header, [[r["shape"], r["impl"], r.get("ms", "-"), r.get("tflops", "-"), r.get("x_best_bf16", "-"),
                          r.get("ms_queued", "-"), r.get("x_best_bf16_queued", "-"),
                          r.get("cos", "-"), r.get("rel_l1", "-"), r.get("rmse", "-"), r.get("note", "")]
                         for r in rows])
    path = save_results(section, {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                  "fp8_missing": fp8_reason, "rows": rows,
                                  "timing": f"ms: synced per run; ms_queued: queued back to back; both {preceded}; "
                                            f"the median of {args.rounds} rounds interleaving the peers, each "
                                            "round's the median of its runs"}, args.out,
                        merge_rows_by="shape" if args.only or args.quick else None)  # a subset of the shapes
    print(f"results: {path}")
    return 0
