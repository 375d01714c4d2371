"""The dense GEMM of ``bench gemm`` (1x128 x 128x128, bf16 out) against DeepGEMM's dense
``gemm_fp8_fp8_bf16_nt``, on the same quantized operands, over a list of lowprec tile configs.

Each DeepGEMM output is compared with lowprec's (bit-identical where both keep the 128-wide
K-block order). Timing as ``bench gemm``'s rot columns: a CUDA graph of back-to-back calls
cycling over input sets larger than L2, rounds interleaved with the first alternating; plus the
eager time (do_bench of single Python calls, L2 flushed) of the pick, the best config and
DeepGEMM. DeepGEMM is not a dependency; how to get the version measured: see
``benchmarks/grouped_vs_deepgemm.py``.

    PYTHONPATH=dg:$PYTHONPATH python benchmarks/dense_vs_deepgemm.py \
        [--shapes M,N,K;...] [--configs 128x192_c2x1_m1,...] [--rounds 4]
"""
import argparse
import statistics

import torch

from lowprec.bench.gemm import DSV3_NK, _bench, _interleaved_rounds, _rot_timer, blockwise_input_sets, deepgemm_call
from lowprec.gemm.sm90 import interface
from lowprec.gemm.sm90.interface import choose_config, gemm_blockwise_fp8
from lowprec.gemm.sm90.tune import parse_config

DEFAULT_CONFIGS = ("128x128_c1x2_m1,128x128_c2x1_m1,128x160_c2x1_m1,128x160_c1x2_m1,"
                   "128x176_c2x1_m1,128x192_c1x1_m1,128x192_c2x1_m1,128x192_c1x2_m1")


def fewest_sms(m, n, cfg, num_sms):
    """DeepGEMM's grid: the fewest SMs (a multiple of the cluster size) that run the tiles in as
    many waves as all SMs would."""
    tiles = -(-m // cfg.tile_m) * -(-n // cfg.tile_n)
    waves = -(-tiles // num_sms)
    csize = cfg.cluster_m * cfg.cluster_n
    per_wave = -(-tiles // waves)
    return min(num_sms, -(-per_wave // csize) * csize)


def lowprec_call(a, sa, b, sb, cfg, sms):
    """The dense kernel compiled for a persistent grid of ``sms`` CTAs, launched as ``_run_dense`` does."""
    fn = interface._get_compiled(cfg, torch.bfloat16, 128, None, sms)
    d = torch.empty(a.shape[0], b.shape[0], device="cuda", dtype=torch.bfloat16)
    sa_t, sb_t = interface._tma_a_scale(sa), interface._tma_b_scale_blocks(sb)
    no_bias, no_group = interface._unused_args(a.device)
    return lambda: interface._launch(fn, a, b, d, sa_t, sb_t, no_bias, no_group) or d


def deepgemm_pick(m, n, k):
    from deep_gemm.jit_kernels.gemm import get_best_configs

    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    sms, bm, bn, stages, (mc, on_a), _ = get_best_configs(m, n, k, 1, num_sms)
    return f"{bm}x{bn} {stages}st mc{mc}{'A' if on_a else 'B'} {sms}sm"


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default=";".join(f"4096,{n},{k}" for n, k in DSV3_NK) + ";8192,8192,8192")
    p.add_argument("--configs", default=DEFAULT_CONFIGS)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--rep", type=int, default=100)
    p.add_argument("--fewest-sms", action="store_true", help="also time each config on DeepGEMM's grid")
    args = p.parse_args()
    try:
        import deep_gemm  # noqa: F401
        have_dg = True
    except ImportError as e:
        print(f"# DeepGEMM not importable ({e}); lowprec configs only")
        have_dg = False
    gen = torch.Generator(device="cuda").manual_seed(0)
    for shape in args.shapes.split(";"):
        m, n, k = (int(v) for v in shape.split(","))
        sets = blockwise_input_sets(m, n, k, gen)
        pick = choose_config(m, n, k)
        cfgs = [pick] + [c for c in (parse_config(s) for s in args.configs.split(",")) if c != pick]
        timers, eager = {}, {}
        ref = gemm_blockwise_fp8(*sets[0], config=pick)
        for cfg in cfgs:
            try:
                d = gemm_blockwise_fp8(*sets[0], config=cfg)
            except Exception as e:  # noqa: BLE001
                print(f"  {cfg}: failed {type(e).__name__}: {str(e)[:120]}")
                continue
            same = torch.equal(d, ref)
            name = f"{cfg}{'' if same else ' (bits differ)'}"
            timers[name] = _rot_timer([(lambda s=s_, cfg=cfg: gemm_blockwise_fp8(*s, config=cfg)) for s_ in sets])
            eager[name] = lambda cfg=cfg, s0=sets[0]: gemm_blockwise_fp8(*s0, config=cfg)
            sms = fewest_sms(m, n, cfg, torch.cuda.get_device_properties(0).multi_processor_count)
            if args.fewest_sms and sms < torch.cuda.get_device_properties(0).multi_processor_count:
                calls = [lowprec_call(*s_, cfg, sms) for s_ in sets]
                same = torch.equal(calls[0](), ref)
                timers[f"{cfg} @{sms}sm{'' if same else ' (bits differ)'}"] = _rot_timer(calls)
        if have_dg:
            dg_calls = [deepgemm_call(*s_) for s_ in sets]
            d = dg_calls[0]()
            torch.cuda.synchronize()
            diff = (d.float() - ref.float()).abs().max().item()
            name = f"deepgemm {deepgemm_pick(m, n, k)}{'' if diff == 0 else f' (max diff {diff:.3g})'}"
            timers[name] = _rot_timer(dg_calls)
            eager[name] = dg_calls[0]
        rounds = _interleaved_rounds(timers, args.rep, args.rounds)
        flops = 2.0 * m * n * k
        tf = {nm: flops / (statistics.median(ts) * 1e-3) / 1e12 for nm, ts in rounds.items()}
        best = max((nm for nm in tf if not nm.startswith("deepgemm")), key=tf.get)
        dg = next((nm for nm in tf if nm.startswith("deepgemm")), None)
        print(f"{m},{n},{k}: pick {pick}; rot TFLOPS (rounds spread)", flush=True)
        for nm in sorted(tf, key=tf.get, reverse=True):
            spread = [flops / (t * 1e-3) / 1e12 for t in rounds[nm]]
            print(f"  {nm:44s} {tf[nm]:7.0f}  [{min(spread):.0f}-{max(spread):.0f}]", flush=True)
        for nm in dict.fromkeys([str(pick), best] + ([dg] if dg else [])):
            if nm in eager:
                print(f"  eager {nm:38s} {flops / (_bench(eager[nm], args.rep) * 1e-3) / 1e12:7.0f}", flush=True)
        del sets, timers, eager
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
