"""FP8 block-scaled GEMM benchmark: lowprec (sm_90a CuTe DSL kernel) vs cuBLAS.

Peers: cuBLAS blockwise FP8 through ``torch._scaled_mm`` (1x128 activation scales, 128x128
weight scales), cuBLAS bf16 (``torch.matmul``) and, when ``deep_gemm`` is importable (not a
dependency; how to build the version measured: ``benchmarks/grouped_vs_deepgemm.py``), DeepGEMM's
``gemm_fp8_fp8_bf16_nt`` on the same operands (its output compared bit for bit). Shapes: DeepSeek-V3 GEMMs at
M in {64, 128, 4096} plus 8192^3. Median of ``triton.testing.do_bench`` (L2 flushed between
runs), random data. Writes ``benchmarks/results/<gpu>.json``.

    python -m lowprec bench gemm [--quick] [--out FILE]
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import torch

from .common import cuda_graph_replay, load_results, merged_section, positive_int, positive_tuples, save_results

ROUNDS = 8  # timing rounds per library (4 rounds' medians swung by up to 7% under the power cap: session 35)
DSV3_NK = [(2112, 7168), (24576, 1536), (32768, 512), (7168, 16384), (4096, 7168), (7168, 2048)]


def default_shapes(quick: bool = False):
    ms = (64, 4096) if quick else (64, 128, 4096)
    shapes = [(m, n, k) for m in ms for (n, k) in DSV3_NK]
    shapes.append((8192, 8192, 8192))
    return shapes


def _shape_triples(text: str) -> str:
    """argparse type of ``--shapes``: ``M,N,K;M,N,K;...`` of positive ints (kept as the text)."""
    positive_tuples(text, ";", ",", 3)
    return text


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m lowprec bench gemm", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="fewer shapes")
    p.add_argument("--shapes", type=_shape_triples, default=None, help="M,N,K;M,N,K;... (overrides defaults)")
    p.add_argument("--out", type=str, default=None, help="JSON path (default benchmarks/results/<gpu>.json)")
    p.add_argument("--no-error", action="store_true", help="skip the fp64 error check")
    p.add_argument("--rep", type=positive_int, default=100, help="do_bench rep (ms)")
    p.add_argument("--rounds", type=positive_int, default=ROUNDS,
                   help="interleaved timing rounds per library (the median is reported)")
    return p.parse_args(argv)


def _rand_fp8(rows, cols, gen):
    x = torch.randn(rows, cols, device="cuda", generator=gen) * 100.0
    return x.clamp(-448, 448).to(torch.float8_e4m3fn)


def _rand_scale(rows, cols, gen):
    return torch.rand(rows, cols, device="cuda", generator=gen) * 1e-3 + 1e-4


def rot_set_count(m: int, n: int, k: int) -> int:
    """How many input sets of an M x N x K GEMM (FP8 A and B, 16-bit D) a rot timer cycles over:
    enough to total >= 160 MB (past the 50 MB L2), at most 8."""
    return max(1, min(8, -(-160_000_000 // (m * k + n * k + 2 * m * n))))


def blockwise_input_sets(m: int, n: int, k: int, gen) -> list[tuple]:
    """``rot_set_count`` random sets ``(a, sa, b, sb)``: E4M3 A [M, K] and B [N, K], 1x128 A scales
    MN-major (as cuBLAS wants them too), 128x128 B scales."""
    kb, nb = -(-k // 128), -(-n // 128)
    sets = []
    for _ in range(rot_set_count(m, n, k)):
        a, b = _rand_fp8(m, k, gen), _rand_fp8(n, k, gen)
        sets.append((a, _rand_scale(m, kb, gen).t().contiguous().t(), b, _rand_scale(nb, kb, gen)))
    return sets


def _dequant(q, s, block_rows):
    r, k = q.shape
    s_full = s.double().repeat_interleave(block_rows, 0)[:r].repeat_interleave(128, 1)[:, :k]
    return q.double() * s_full


def _rel(d, ref):
    return ((d.double() - ref).norm() / ref.norm()).item()


# candidate (API, scale_b layout) pairs for cuBLAS blockwise with 128x128 B scales (B passed as
# b.t(), i.e. [K, N]); the probe keeps the first that matches the fp64 reference on a
# non-square problem (N != K, NB != KB, so a wrong orientation fails or shows a large error).
# Seen on torch 2.11+cu130: F.scaled_mm wants scale_b as [round_up(K/128, 4), N/128]; the probe
# therefore uses K/128 = 8 (a multiple of 4, like every benchmark shape), and layouts pad to 4.


def _pad_kb4(x):  # [KB, NB] -> [round_up(KB, 4), NB], zero rows appended
    kb, nb = x.shape
    kb4 = -(-kb // 4) * 4
    if kb4 == kb:
        return x
    out = torch.zeros(kb4, nb, dtype=x.dtype, device=x.device)
    out[:kb] = x
    return out


_SB_LAYOUTS = {
    "sb.t() [KB,NB] stride(1,KB)": lambda sb: _pad_kb4(sb.t()).t().contiguous().t(),
    "sb.t().contiguous() [KB,NB]": lambda sb: _pad_kb4(sb.t()).contiguous(),
    "sb [NB,KB] contiguous": lambda sb: sb.contiguous(),
    "sb outer-major [NB,KB] stride(1,NB)": lambda sb: sb.t().contiguous().t(),
}
_CANDIDATES = [(api, lay) for api in ("F.scaled_mm", "torch._scaled_mm") for lay in _SB_LAYOUTS]
_cb_choice = None


def _cublas_blockwise_fn(a, sa, b, sb, choice=None):
    """cuBLAS blockwise FP8: 1x128 scale_a [M, K/128] outer-dim-major (stride (1, M)), B as b.t()."""
    api, lay = choice or _cb_choice
    sa_t = sa.t().contiguous().t()
    sb_t = _SB_LAYOUTS[lay](sb)
    if api == "F.scaled_mm":
        import torch.nn.functional as F

        st = F.ScalingType

        def fn():
            return F.scaled_mm(a, b.t(), sa_t, st.BlockWise1x128, sb_t, st.BlockWise128x128,
                               output_dtype=torch.bfloat16)
    else:
        def fn():
            return torch._scaled_mm(a, b.t(), scale_a=sa_t, scale_b=sb_t, out_dtype=torch.bfloat16)

    return fn


def _probe_cublas():
    """Find the scale_b orientation cuBLAS blockwise accepts *and* computes right with (N != K
    and NB != KB so that a wrong one fails or shows a large error); returns (ok, err, note)."""
    gen = torch.Generator(device="cuda")
    gen.manual_seed(1)
    m, n, k = 256, 384, 1024
    a, b = _rand_fp8(m, k, gen), _rand_fp8(n, k, gen)
    sa = torch.rand(m, k // 128, device="cuda", generator=gen) + 0.5
    sb = torch.rand(n // 128, k // 128, device="cuda", generator=gen) + 0.5
    ref = _dequant(a, sa, 1) @ _dequant(b, sb, 128).T
    notes = []
    global _cb_choice
    for cand in _CANDIDATES:
        try:
            d = _cublas_blockwise_fn(a, sa, b, sb, cand)()
            err = _rel(d, ref)
        except Exception as e:  # noqa: BLE001
            notes.append(f"{cand}: {type(e).__name__}: {str(e)[:80]}")
            continue
        notes.append(f"{cand}: err {err:.2g}")
        if err < 1e-2:
            _cb_choice = cand
            return True, err, f"{cand[0]} with scale_b = {cand[1]}"
    print("# cuBLAS blockwise probe: " + " | ".join(notes))
    return False, float("nan"), "no working (API, scale_b layout) pair found"


def _deepgemm():
    try:
        import deep_gemm
    except ImportError:
        return None
    return deep_gemm


def deepgemm_call(a, sa, b, sb):
    """DeepGEMM's dense 1x128 x 128x128 GEMM (bf16 out) on lowprec's operands, as a call."""
    import deep_gemm

    sa_tma = deep_gemm.get_col_major_tma_aligned_tensor(sa.contiguous())
    out = torch.empty(a.shape[0], b.shape[0], device=a.device, dtype=torch.bfloat16)
    sb = sb.contiguous()
    return lambda: deep_gemm.gemm_fp8_fp8_bf16_nt((a, sa_tma), (b, sb), out) or out


def _bench(fn, rep):
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=rep, return_mode="median")


def _graphed(fn):
    try:
        return cuda_graph_replay(fn)
    except Exception as e:  # noqa: BLE001
        print(f"# graph capture failed: {type(e).__name__}: {str(e)[:120]}")
        return None


def _rot_timer(calls):
    """A CUDA graph of back-to-back calls cycling over ``calls`` (each on its own input set);
    returns ``time(rep)``: ms per call, do_bench median of graph replays over ``rep`` ms divided by
    the calls (nan when capture fails)."""
    import triton.testing

    per = max(1, -(-8 // len(calls)))
    seq = calls * per
    g = _graphed(lambda: [c() for c in seq])
    if g is None:
        return lambda rep: float("nan")
    return lambda rep: triton.testing.do_bench(g, warmup=10, rep=rep, return_mode="median") / len(seq)


def _time_rot(calls, rep):
    """ms per call in rot timing (see ``_rot_timer``), one round."""
    return _rot_timer(calls)(rep)


def _interleaved_rounds(timers, rep, rounds=ROUNDS):
    """Time each of ``timers`` (name -> ``_rot_timer``) ``rounds`` times, each round over
    ``rep / 2`` ms, in orders that alternate which one goes first: under the power cap the one
    timed first on a cooler GPU reads up to ~20% faster (gemm NOTES, session 8). Returns
    name -> list of ms per call, one per round."""
    names = list(timers)
    out = {nm: [] for nm in names}
    for r in range(rounds):
        for nm in (names if r % 2 == 0 else names[::-1]):
            out[nm].append(timers[nm](max(1, rep // 2)))
    return out


def interleaved_tflops_row(calls: dict, sets: list, flop: float, rep: int, rounds: int) -> str:
    """``name -> fn(input set)`` timed in rot timing over ``sets`` (one CUDA graph per name),
    rounds interleaved (``_interleaved_rounds``): ``"name median [per round]"`` TFLOPS per name,
    joined by ``" | "`` (the same-run A/B scripts of ``benchmarks/``)."""
    timers = {nm: _rot_timer([lambda s=s, fn=fn: fn(s) for s in sets]) for nm, fn in calls.items()}
    ms = _interleaved_rounds(timers, rep, rounds)
    tf = {nm: [flop / (t * 1e-3) / 1e12 for t in v] for nm, v in ms.items()}
    return " | ".join(f"{nm} {statistics.median(v):.0f} {[round(x) for x in v]}" for nm, v in tf.items())


def _cublas_rowwise_fn(a, b):
    """cuBLAS FP8 with per-row / per-column scales (a coarser recipe than 1x128 / 128x128)."""
    sa = torch.ones(a.shape[0], 1, device="cuda")
    sb = torch.ones(1, b.shape[0], device="cuda")
    return lambda: torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)


def _host_us(fns, calls: int = 100, reps: int = 7) -> list[float]:
    """Host time of one eager call (µs) of each of ``fns``: ``calls`` back-to-back calls timed on
    the host without waiting for the GPU (too few to fill the launch queue), the functions
    interleaved rep by rep (the host's speed drifts), median of ``reps``."""
    times = [[] for _ in fns]
    for _ in range(reps):
        for fn, ts in zip(fns, times):
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(calls):
                fn()
            ts.append((time.perf_counter() - t) / calls * 1e6)
    torch.cuda.synchronize()
    return [statistics.median(ts) for ts in times]


def _geomean(xs):
    xs = [x for x in xs if x and x > 0 and math.isfinite(x)]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


def summary_of(rows: list[dict]) -> dict:
    """The geomean and worst ratios of ``rows`` (this run's, or the saved ones merged with them)."""
    big = [r["ratio_vs_cublas_fp8"] for r in rows if r["m"] >= 4096 and r["n"] != 8192]
    small = [r["ratio_vs_cublas_fp8"] for r in rows if r["m"] <= 128]
    big_r = [r["ratio_vs_cublas_fp8_rowwise"] for r in rows if r["m"] >= 4096 and r["n"] != 8192]
    small_r = [r["ratio_vs_cublas_fp8_rowwise"] for r in rows if r["m"] <= 128]
    big_e = [r["ratio_vs_cublas_fp8_eager"] for r in rows if r["m"] >= 4096 and r["n"] != 8192]
    small_e = [r["ratio_vs_cublas_fp8_eager"] for r in rows if r["m"] <= 128]
    host = [r["cublas_fp8_blockwise_host_us"] / r["lowprec_host_us"] for r in rows]
    # finite only, as _geomean: min() over a NaN (a failed capture) depends on where the NaN sits
    best = [r["ratio_vs_best_peer"] for r in rows if r["m"] >= 4096 and math.isfinite(r["ratio_vs_best_peer"])]
    best_e = [r["ratio_vs_best_peer_eager"] for r in rows
              if r["m"] >= 4096 and math.isfinite(r["ratio_vs_best_peer_eager"])]
    return dict(geomean_ratio_m4096=_geomean(big), geomean_ratio_m_le_128=_geomean(small),
                geomean_host_time_ratio=_geomean(host),
                geomean_ratio_eager_m4096=_geomean(big_e), geomean_ratio_eager_m_le_128=_geomean(small_e),
                geomean_ratio_rowwise_m4096=_geomean(big_r), geomean_ratio_rowwise_m_le_128=_geomean(small_r),
                min_ratio_vs_best_peer_m_ge_4096=min(best, default=float("nan")),
                min_ratio_vs_best_peer_eager_m_ge_4096=min(best_e, default=float("nan")))


def run(args=None):
    """Entry for ``python -m lowprec bench gemm``; ``args`` is an argparse Namespace, a list of
    CLI strings, or None."""
    if args is None or isinstance(args, (list, tuple)):
        args = parse_args(args)
    if not torch.cuda.is_available():
        raise SystemExit("bench gemm needs a CUDA GPU")
    import lowprec
    from lowprec.gemm.sm90.interface import choose_config, gemm_blockwise_fp8

    dev_name = torch.cuda.get_device_name()
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    shapes = (
        [tuple(int(v) for v in s.split(",")) for s in args.shapes.split(";")]
        if getattr(args, "shapes", None)
        else default_shapes(getattr(args, "quick", False))
    )
    rep = getattr(args, "rep", 100)
    check_err = not getattr(args, "no_error", False)
    cublas_ok, cublas_probe_err, cublas_note = _probe_cublas()
    have_dg = _deepgemm() is not None
    print(f"# {dev_name}, {num_sms} SMs; cuBLAS blockwise probe: {cublas_note} (rel err {cublas_probe_err:.3g});"
          f" DeepGEMM {'importable' if have_dg else 'not importable: no DeepGEMM columns'}")

    gen = torch.Generator(device="cuda")
    gen.manual_seed(0)
    rows = []
    print("# TFLOPS; 'rot' = CUDA graph of back-to-back calls cycling over input sets larger than L2"
          " (pure GPU time, cold inputs, sustained load); 'eager' = one Python call per do_bench"
          " iteration (L2 flushed: a 256 MB memset between calls), median of interleaved rounds as rot;"
          " host_us = host time of one eager call (lowprec.gemm on QuantizedTensors; cuBLAS: torch"
          " scaled_mm), back-to-back calls")
    hdr = (f"{'M':>5} {'N':>6} {'K':>6} {'config':>16} {'lp_rot':>7} {'lp_eager':>8} {'cb8blk':>7}"
           f" {'cb8blk_e':>8} {'cb8row':>7} {'bf16':>7} {'vs_blk':>6} {'vs_blk_e':>8} {'vs_row':>6}"
           f" {'err':>8} {'err_cb':>8} {'lp_host_us':>10} {'cb_host_us':>10} {'dg':>7} {'dg_e':>7} {'vs_best':>7}"
           f" {'vs_best_e':>9}")
    print(hdr)
    for (m, n, k) in shapes:
        sets = blockwise_input_sets(m, n, k, gen)
        a, sa, b, sb = sets[0]
        flops = 2.0 * m * n * k
        cfg = choose_config(m, n, k, num_sms=num_sms)
        t0 = time.time()
        d = gemm_blockwise_fp8(a, sa, b, sb)
        torch.cuda.synchronize()
        compile_s = time.time() - t0
        eager = {"lp": lambda a=a, sa=sa, b=b, sb=sb: gemm_blockwise_fp8(a, sa, b, sb)}
        lp_calls = [(lambda s=s_: gemm_blockwise_fp8(*s)) for s_ in sets]
        qa = lowprec.QuantizedTensor(a, sa, lowprec.get_recipe("fp8_block1x128"), a.shape, torch.bfloat16)
        qb = lowprec.QuantizedTensor(b, sb, lowprec.get_recipe("fp8_block128x128"), b.shape, torch.bfloat16)
        host_fns = [lambda qa=qa, qb=qb: lowprec.gemm(qa, qb)]
        t_cb = host_cb = float("nan")
        d_cb = None
        timers = {"lp": _rot_timer(lp_calls)}
        if cublas_ok:
            d_cb = _cublas_blockwise_fn(a, sa, b, sb)()
            timers["cb"] = _rot_timer([_cublas_blockwise_fn(*s_) for s_ in sets])
            eager["cb"] = _cublas_blockwise_fn(a, sa, b, sb)
            host_fns.append(_cublas_blockwise_fn(a, sa, b, sb))
        host_lp, host_cb = (_host_us(host_fns) + [float("nan")])[:2]
        dg_same = None
        if have_dg:
            dg_calls = [deepgemm_call(*s_) for s_ in sets]
            dg_same = bool(torch.equal(dg_calls[0](), d))
            timers["dg"] = _rot_timer(dg_calls)
            eager["dg"] = dg_calls[0]
        rounds = _interleaved_rounds(timers, rep, args.rounds)
        # eager calls in interleaved rounds too: a single do_bench per library reads up to ~15%
        # apart depending on which ran first (H100, session 33)
        eager_rounds = _interleaved_rounds({nm: (lambda r, f=f: _bench(f, r)) for nm, f in eager.items()}, rep,
                                            args.rounds)
        t_lp_eager, t_cb_eager, t_dg_eager = (
            statistics.median(eager_rounds[nm]) if nm in eager_rounds else float("nan") for nm in ("lp", "cb", "dg"))
        lp_rounds, cb_rounds = rounds["lp"], rounds.get("cb", [])
        t_lp = statistics.median(lp_rounds)
        if cb_rounds:
            t_cb = statistics.median(cb_rounds)
        t_dg = statistics.median(rounds["dg"]) if have_dg else float("nan")
        # the faster peer with the same scaling (cuBLAS blockwise, DeepGEMM), in each timing mode
        t_best = min((t for t in (t_cb, t_dg) if math.isfinite(t)), default=float("nan"))
        t_best_e = min((t for t in (t_cb_eager, t_dg_eager) if math.isfinite(t)), default=float("nan"))
        t_row = _time_rot([_cublas_rowwise_fn(s_[0], s_[2]) for s_ in sets], rep)
        b16s = [(s_[0].to(torch.bfloat16), s_[2].to(torch.bfloat16)) for s_ in sets]
        t_bf = _time_rot([(lambda x=x, y=y: x @ y.t()) for x, y in b16s], rep)
        del b16s
        err = err_cb = float("nan")
        if check_err:
            ref = _dequant(a, sa, 1) @ _dequant(b, sb, 128).T
            err = _rel(d, ref)
            if d_cb is not None:
                err_cb = _rel(d_cb, ref)
            del ref
        tf = lambda t, flops=flops: flops / (t * 1e-3) / 1e12  # noqa: E731
        row = dict(
            m=m, n=n, k=k, config=str(cfg), input_sets=len(sets),
            lowprec_ms=t_lp, lowprec_eager_ms=t_lp_eager, cublas_fp8_blockwise_ms=t_cb,
            cublas_fp8_blockwise_eager_ms=t_cb_eager,
            cublas_fp8_rowwise_ms=t_row, cublas_bf16_ms=t_bf,
            lowprec_tflops=tf(t_lp), lowprec_eager_tflops=tf(t_lp_eager),
            cublas_fp8_blockwise_tflops=tf(t_cb), cublas_fp8_rowwise_tflops=tf(t_row),
            cublas_bf16_tflops=tf(t_bf), ratio_vs_cublas_fp8=t_cb / t_lp,
            cublas_fp8_blockwise_eager_tflops=tf(t_cb_eager), ratio_vs_cublas_fp8_eager=t_cb_eager / t_lp_eager,
            ratio_vs_cublas_fp8_rowwise=t_row / t_lp, rel_err=err, rel_err_cublas=err_cb,
            lowprec_ms_rounds=lp_rounds, cublas_fp8_blockwise_ms_rounds=cb_rounds,
            first_call_s=compile_s, lowprec_host_us=host_lp, cublas_fp8_blockwise_host_us=host_cb,
            deepgemm_ms=t_dg, deepgemm_eager_ms=t_dg_eager, deepgemm_ms_rounds=rounds.get("dg", []),
            eager_ms_rounds=eager_rounds,
            deepgemm_tflops=tf(t_dg), deepgemm_bits_equal=dg_same,
            ratio_vs_best_peer=t_best / t_lp, ratio_vs_best_peer_eager=t_best_e / t_lp_eager,
        )
        rows.append(row)
        print(f"{m:>5} {n:>6} {k:>6} {str(cfg):>16} {tf(t_lp):7.1f} {tf(t_lp_eager):8.1f} {tf(t_cb):7.1f}"
              f" {tf(t_cb_eager):8.1f} {tf(t_row):7.1f} {tf(t_bf):7.1f} {t_cb / t_lp:6.2f}"
              f" {t_cb_eager / t_lp_eager:8.2f} {t_row / t_lp:6.2f} {err:8.1e} {err_cb:8.1e}"
              f" {host_lp:10.1f} {host_cb:10.1f} {tf(t_dg):7.1f} {tf(t_dg_eager):7.1f} {t_best / t_lp:7.2f}"
              f" {t_best_e / t_lp_eager:9.2f}" + ("" if dg_same in (None, True) else "  DeepGEMM bits differ"),
              flush=True)
        del d, d_cb, sets

    summary = summary_of(rows)
    print(f"geomean speedup vs cuBLAS FP8 blockwise, rot: M=4096 {summary['geomean_ratio_m4096']:.3f}x, "
          f"M<=128 {summary['geomean_ratio_m_le_128']:.3f}x | eager: "
          f"M=4096 {summary['geomean_ratio_eager_m4096']:.3f}x, "
          f"M<=128 {summary['geomean_ratio_eager_m_le_128']:.3f}x | vs cuBLAS FP8 rowwise (coarser scaling), rot: "
          f"M=4096 {summary['geomean_ratio_rowwise_m4096']:.3f}x, "
          f"M<=128 {summary['geomean_ratio_rowwise_m_le_128']:.3f}x | host time per eager call, cuBLAS / lowprec: "
          f"{summary['geomean_host_time_ratio']:.3f}x | M>=4096, worst vs the faster of cuBLAS blockwise and DeepGEMM:"
          f" rot {summary['min_ratio_vs_best_peer_m_ge_4096']:.3f}x,"
          f" eager {summary['min_ratio_vs_best_peer_eager_m_ge_4096']:.3f}x")
    payload = dict(
        device=dev_name, num_sms=num_sms, torch=torch.__version__,
        cublas_blockwise_probe=dict(ok=cublas_ok, rel_err=cublas_probe_err, note=cublas_note),
        timing=("*_ms: CUDA graph of back-to-back calls cycling over input sets totalling >= 160 MB "
                f"(> L2), do_bench median / calls (lowprec and cuBLAS blockwise: median of {args.rounds} "
                "rounds each, interleaved, which one goes first alternating: *_ms_rounds); "
                "*_eager_ms: do_bench median of single Python calls (L2 flushed); *_host_us: host time of "
                "one eager call (lowprec.gemm on QuantizedTensors, cuBLAS scaled_mm), 100 back-to-back calls "
                "timed on the host, the two interleaved, median of 7; deepgemm_*: DeepGEMM when importable, "
                "in the same rounds; random data"),
        rows=rows, summary=summary,
        date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    )
    partial = bool(getattr(args, "shapes", None) or getattr(args, "quick", False))  # a subset of the shapes
    out = save(payload, getattr(args, "out", None), partial)
    print(f"wrote {out}")
    return payload


def save(payload: dict, path: str | None = None, partial: bool = False) -> str:
    """Save ``payload`` as the ``gemm`` section; a run over some of the shapes (``--quick``,
    ``--shapes``) replaces only the saved rows of its shapes, the summary recomputed over all rows."""
    if partial:
        payload = merged_section(load_results("gemm", path), payload, ("m", "n", "k"))
        payload["summary"] = summary_of(payload["rows"])
    return save_results("gemm", payload, path)


def main(argv: list[str] | None = None) -> int:
    run(parse_args(argv))
    return 0
