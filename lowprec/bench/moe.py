"""``python -m lowprec bench moe``: MoE expert GEMMs and the MoE layer, lowprec FP8 vs torch.

Per config (E experts, hidden H, expert FFN width F, top-k, T tokens) and routing (``balanced``:
k distinct experts uniformly at random; ``skewed``: Zipf popularity, expert e drawn ∝ 1/(e+1)^s):

- GEMM, the first expert GEMM: packed tokens ``[T·k, H]`` times ``w1[e]ᵀ`` (``w1`` ``[E, 2F, H]``).
  ``lowprec.grouped_gemm`` (1x128 activations from ``pack``, 128x128 weights) vs
  ``torch._scaled_grouped_mm`` (FP8, rowwise scales) and ``torch._grouped_mm`` (bf16). TFLOPS count
  useful rows only (2 · routed · 2F · H); ``x`` columns are the peer's time over lowprec's (> 1:
  lowprec faster); errors are rel-L2 against the FP64 product of the unquantized inputs on up to 4
  experts x 128 rows.
- layer: ``lowprec.moe.experts`` (``fp8_block``) vs the same MoE in bf16 on ``torch._grouped_mm``
  (dispatch, gather rows, grouped_mm w1, swiglu, grouped_mm w2, weighted unpack), forward (no grad)
  and forward + backward, both from the same top-k choices; lowprec also with the expert weights
  kept in FP8 (forward) and with them quantized once per ``reuse_quantized_weights`` block
  (forward + backward of the micro-batches after the first). Neither checks the expert ids (as
  ``lowprec.moe.MoE`` and the baseline do not: the check reads a flag back from the GPU).
- permutation: the dispatch plan (``lowprec.moe.dispatch``, also the baseline's), lowprec's
  ``pack`` (gather fused with FP8 1x128 quantization), the bf16 gather, and ``unpack``.
  Padding: buffer rows beyond the routed ones (slots dropped by ``--capacity-factor``), and rows
  that 128-row M tiles compute beyond their expert's, both over the routed rows.

Timing: ``bench_ms`` (median, L2 flushed before every call), random data, never zeros; the three
GEMMs in four interleaved rounds of alternating order, median of the rounds (one round of one
kernel spreads ±5-10% with the chip's clock under its power cap). A peer that fails (e.g. an op
missing from the installed torch) is reported as n/a with the reason.

``--sustained S`` also runs each GEMM back to back for S seconds: TFLOPS with the chip at its
power cap, with the SM clock and power ``nvidia-smi`` reads meanwhile.

``--decode T1,T2,...`` instead times inference steps of the whole layer (router included, no
gradients) at those token counts, per config (its T unused): ``FP8InferenceMoE`` eager and under
``torch.compile(fullgraph=True, mode="reduce-overhead")`` (one custom op, captured into CUDA
graphs), ``NVFP4InferenceMoE`` (grouped weight-only GEMMs) eager and replayed from a CUDA graph,
vs the bf16 MoE eager and replayed from a CUDA graph; host synced before each call, so host time
counts. Saved under ``moe_decode``.

``--train T1,T2,...`` instead times training steps of the ``MoE`` module (router included, forward
and backward into every parameter) at those token counts: eager, under
``torch.compile(fullgraph=True)`` and with ``mode="reduce-overhead"`` (CUDA graphs), vs the bf16
MoE eager; the compiled gradients' largest rel-L2 against eager's. Saved under ``moe_train``.

``--ep WORLD`` instead times the expert-parallel layer's training step on WORLD GPUs, its rows
dispatched in FP8 vs bf16 (:mod:`lowprec.bench.moe_ep`). Saved under ``moe_ep``.

    python -m lowprec bench moe [--quick] [--configs E,H,F,k,T;...] [--routings balanced,skewed]
                                [--sustained S] [--decode T1,T2,...] [--train T1,T2,...] [--ep WORLD]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import statistics
import time

import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

from ..gemm import grouped_gemm
from ..metrics import rel_l2
from ..moe import (
    FP8InferenceMoE,
    MoE,
    NVFP4InferenceMoE,
    Routing,
    dispatch,
    experts,
    gather_rows,
    pack,
    select_experts,
    unpack,
)
from ..nn import reuse_quantized_weights
from ..quant import quantize
from ..tensor import QuantizedTensor
from .common import bench_ms, cuda_graph_replay, load_results, print_table, save_results, sustained

# (E, H, F, k, T): Mixtral-8x7B, DeepSeek-V3, Qwen3-30B-A3B-like expert shapes
CONFIGS = [(8, 4096, 14336, 2, 4096), (64, 7168, 2048, 8, 4096), (128, 2048, 768, 8, 8192)]
ROUTINGS = ("balanced", "skewed")
TILE_M = 128  # M tile of the padding-waste estimate
ERROR_EXPERTS, ERROR_ROWS = 4, 128
GEMM_ROUNDS = 4


def _config(text: str) -> tuple[int, int, int, int, int]:
    parts = text.split(",")
    if len(parts) != 5 or not all(p.strip().isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(f"expected five positive ints E,H,F,k,T, got {text!r}")
    e, h, f, k, t = (int(p) for p in parts)
    if k > e:
        raise argparse.ArgumentTypeError(f"top-k {k} is more than E={e} in {text!r}")
    if h % 16 or f % 16:
        raise argparse.ArgumentTypeError(f"H and F must be multiples of 16 (FP8 GEMMs), got {text!r}")
    return e, h, f, k, t


def _configs(text: str) -> list[tuple[int, int, int, int, int]]:
    configs = [_config(c) for c in text.split(";") if c.strip()]
    if not configs:
        raise argparse.ArgumentTypeError(f"expected at least one config E,H,F,k,T, got {text!r}")
    return configs


def _routings(text: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    bad = [n for n in names if n not in ROUTINGS]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"expected a comma-separated subset of {','.join(ROUTINGS)}, got {text!r}")
    return names


def _token_counts(text: str) -> tuple[int, ...]:
    try:
        counts = tuple(int(v) for v in text.split(","))
    except ValueError:
        counts = ()
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated token counts ≥ 1, got {text!r}")
    return counts


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}")
    return value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m lowprec bench moe", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="the first config only")
    p.add_argument("--configs", type=_configs, default=None, help="E,H,F,k,T;... (replaces the defaults)")
    p.add_argument("--routings", type=_routings, default=ROUTINGS, help="comma-separated: balanced,skewed")
    p.add_argument("--zipf", type=_positive, default=1.2, help="exponent s of the skewed routing (default 1.2)")
    p.add_argument("--capacity-factor", type=_positive, default=None,
                   help="drop slots over each expert's capacity (default: dropless)")
    p.add_argument("--no-layer", action="store_true", help="skip the MoE layer timings")
    p.add_argument("--no-error", action="store_true", help="skip the FP64 error check")
    p.add_argument("--budget-ms", type=_positive, default=2000.0,
                   help="rough time per measurement: slow calls get fewer repetitions (5 to 50)")
    p.add_argument("--sustained", type=_positive, default=None, metavar="SECONDS",
                   help="also run each GEMM back to back this long: TFLOPS, SM clock and power at the power cap")
    p.add_argument("--decode", type=_token_counts, default=None, metavar="T1,T2,...",
                   help="time inference steps of the layer at these token counts instead (module docstring)")
    p.add_argument("--train", type=_token_counts, default=None, metavar="T1,T2,...",
                   help="time training steps of the layer at these token counts instead (module docstring)")
    p.add_argument("--ep", type=int, default=None, metavar="WORLD",
                   help="time the expert-parallel layer on WORLD GPUs instead (lowprec.bench.moe_ep; "
                        "--configs' T is per rank)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="results JSON (default benchmarks/results/<gpu>.json)")
    args = p.parse_args(argv)
    if args.ep is not None and args.ep < 2:
        p.error(f"--ep: expected a world size of at least 2, got {args.ep}")
    modes = [f"--{name}" for name in ("ep", "decode", "train") if getattr(args, name) is not None]
    if len(modes) > 1:
        p.error(f"{' and '.join(modes)}: pick one (each runs instead of the default benchmark)")
    if args.configs is None:
        from .moe_ep import EP_CONFIGS

        args.configs = list(EP_CONFIGS) if args.ep else CONFIGS[:1] if args.quick else list(CONFIGS)
    return args


def make_routing(tokens: int, top_k: int, num_experts: int, kind: str, *, zipf: float = 1.2,
                 capacity_factor: float | None = None, generator: torch.Generator, device="cuda") -> Routing:
    """Top-k choices with ``kind`` load (module docstring), random combine weights, dispatched."""
    if kind == "balanced":
        ids = torch.rand(tokens, num_experts, device=device, generator=generator).argsort(dim=1)[:, :top_k]
    elif kind == "skewed":
        popularity = torch.arange(1, num_experts + 1, device=device, dtype=torch.float32) ** -zipf
        ids = torch.multinomial(popularity.expand(tokens, -1).contiguous(), top_k, replacement=False,
                                generator=generator)
    else:
        raise ValueError(f"kind: expected one of {ROUTINGS}, got {kind!r}")
    weights = torch.rand(tokens, top_k, device=device, generator=generator).softmax(dim=-1)
    return dispatch(weights, ids, num_experts, capacity_factor=capacity_factor)


def padding_stats(routing: Routing, tile_m: int = TILE_M) -> dict[str, float]:
    """``padding_waste``: buffer rows beyond the routed ones; ``tile_waste``: rows that ``tile_m``-row
    M tiles compute beyond their expert's rows; both over the routed rows (reads back counts)."""
    counts = routing.counts.tolist()
    routed = sum(counts)
    tiled = sum(-(-c // tile_m) * tile_m for c in counts)
    return {"routed_rows": routed, "padding_waste": (routing.num_rows - routed) / max(routed, 1),
            "tile_waste": (tiled - routed) / max(routed, 1), "max_load": max(counts),
            "empty_experts": sum(c == 0 for c in counts)}


def bf16_experts(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, w1: torch.Tensor,
                 w2: torch.Tensor, capacity_factor: float | None = None) -> torch.Tensor:
    """The baseline: the MoE of :func:`lowprec.moe.experts` (swiglu) in x's dtype on ``torch._grouped_mm``."""
    r = dispatch(topk_weights, topk_ids, w1.shape[0], capacity_factor=capacity_factor, check_ids=False)
    h = torch._grouped_mm(gather_rows(x, r), w1.transpose(-2, -1), offs=r.group_ends)
    gate, up = h.chunk(2, dim=-1)
    o = torch._grouped_mm(F.silu(gate) * up, w2.transpose(-2, -1), offs=r.group_ends)
    return unpack(o, r, topk_weights, out_dtype=x.dtype)


def error_rows(routing: Routing) -> list[tuple[int, torch.Tensor]]:
    """``(expert, packed rows)``: the first rows of up to 4 non-empty experts spread over the ids."""
    ends = routing.group_ends.tolist()
    starts = [0] + ends[:-1]
    nonempty = [e for e, (s, t) in enumerate(zip(starts, ends)) if t > s]
    chosen = nonempty[::max(1, len(nonempty) // ERROR_EXPERTS)][:ERROR_EXPERTS]
    device = routing.group_ends.device
    return [(e, torch.arange(starts[e], min(ends[e], starts[e] + ERROR_ROWS), device=device)) for e in chosen]


def reference_rows(x: torch.Tensor, w1: torch.Tensor, routing: Routing,
                   sample: list[tuple[int, torch.Tensor]]) -> torch.Tensor:
    """FP64 ``x[token] · w1[e]ᵀ`` for the sampled packed rows, in order."""
    return torch.cat([x[routing.row_slots[rows] // routing.top_k].double() @ w1[e].double().T for e, rows in sample])


def _time(fn, budget_ms: float) -> float:
    """bench_ms with fewer repetitions for slow calls (each call is run once first, untimed)."""
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    once = (time.perf_counter() - start) * 1e3
    rep = int(min(50, max(5, budget_ms / max(once, 1e-3))))
    return bench_ms(fn, warmup=2 if once > 10 else 10, rep=rep)


def _measure(name: str, fn, budget_ms: float, failures: dict[str, str]):
    """``(ms, first output)``, or ``(nan, None)`` with the reason in ``failures``: one broken peer
    (an op missing from this torch, out of memory) must not end the run."""
    try:
        out = fn()
        return _time(fn, budget_ms), out
    except Exception as err:  # noqa: BLE001 — reported as n/a
        failures[name] = f"{type(err).__name__}: {str(err).splitlines()[0][:160] if str(err) else ''}"
        torch.cuda.empty_cache()
        return math.nan, None


def _no_grad(fn):
    def run():
        with torch.no_grad():
            return fn()
    return run


def _fwd_bwd(fn, leaves: list[torch.Tensor], dy: torch.Tensor):
    def run():
        for t in leaves:
            t.grad = None
        fn().backward(dy)
    return run


@dataclasses.dataclass
class W1Gemm:
    """The first expert GEMM ``[T·k, H] · w1[e]ᵀ`` of one routing, its operands in each form timed:
    ``a_q``/``w1_q`` lowprec's (1x128 activations from ``pack``, 128x128 weights), ``a_row``/``w1_row``
    FP8 rowwise, ``rows`` the bf16 gathered tokens; ``ends`` the int32 group ends."""

    w1: torch.Tensor
    a_q: QuantizedTensor
    ends: torch.Tensor
    w1_q: QuantizedTensor
    rows: torch.Tensor
    a_row: QuantizedTensor
    w1_row: QuantizedTensor

    @classmethod
    def build(cls, x: torch.Tensor, w1: torch.Tensor, routing: Routing) -> W1Gemm:
        a_q, ends = pack(x, routing, "fp8_block1x128")
        rows = pack(x, routing, None)[0]
        return cls(w1, a_q, ends, quantize(w1, "fp8_block128x128", check_finite=False), rows,
                   quantize(rows, "fp8_rowwise", check_finite=False), quantize(w1, "fp8_rowwise", check_finite=False))

    def calls(self) -> dict:
        """``lowprec`` (``grouped_gemm``), ``fp8_rowwise`` (``torch._scaled_grouped_mm``) and ``bf16``
        (``torch._grouped_mm``), each a no-argument call returning bf16 ``[T·k, 2F]``."""
        num_experts, two_ffn, _ = self.w1.shape
        scale_a, scale_b = self.a_row.scale.reshape(-1), self.w1_row.scale.reshape(num_experts, two_ffn)
        return {
            "lowprec": lambda: grouped_gemm(self.a_q, self.w1_q, group_ends=self.ends, out_dtype=torch.bfloat16),
            "fp8_rowwise": lambda: torch._scaled_grouped_mm(
                self.a_row.data, self.w1_row.data.transpose(-2, -1), scale_a, scale_b, offs=self.ends,
                out_dtype=torch.bfloat16),
            "bf16": lambda: torch._grouped_mm(self.rows, self.w1.transpose(-2, -1), offs=self.ends,
                                              out_dtype=torch.bfloat16),
        }


def _gemm_case(x, w1, routing, args, failures):
    _, two_ffn, hidden = w1.shape
    operands = W1Gemm.build(x, w1, routing)
    ends, calls = operands.ends, operands.calls()
    sample = None if args.no_error else error_rows(routing)
    ref = None if sample is None else reference_rows(x, w1, routing, sample)
    picked = None if sample is None else torch.cat([r for _, r in sample])
    flops = 2.0 * int(ends[-1]) * two_ffn * hidden
    out, rounds = {}, {}
    for name, fn in calls.items():
        ms, y = _measure(f"gemm {name}", fn, args.budget_ms / GEMM_ROUNDS, failures)
        err = math.nan if y is None or ref is None or not len(picked) else rel_l2(y[picked], ref)
        out[name] = {"rel_err": err}
        rounds[name] = [] if y is None else [ms]
        del y
    for r in range(1, GEMM_ROUNDS):
        for name in calls if r % 2 == 0 else reversed(calls):
            if rounds[name]:
                rounds[name].append(_time(calls[name], args.budget_ms / GEMM_ROUNDS))
    for name, ms_rounds in rounds.items():
        ms = statistics.median(ms_rounds) if ms_rounds else math.nan
        out[name].update({"ms": ms, "ms_rounds": ms_rounds, "tflops": flops / ms / 1e9})
        if args.sustained and ms_rounds:
            held = sustained(calls[name], args.sustained)
            out[name]["sustained"] = {**held, "tflops": flops / held["ms"] / 1e9}
    return out


def _layer_case(x, w1, w2, routing, args, failures):
    ids, weights = routing.topk_ids, routing.topk_weights
    cf = args.capacity_factor
    fns = {"lowprec": lambda x, tw, w1, w2: experts(x, tw, ids, w1, w2, recipe="fp8_block", capacity_factor=cf,
                                                    check_ids=False),
           "bf16": lambda x, tw, w1, w2: bf16_experts(x, tw, ids, w1, w2, cf)}
    leaves = [t.detach().clone().requires_grad_() for t in (x, weights, w1, w2)]
    dy = torch.randn_like(x)
    out = {}
    for name, f in fns.items():
        fwd, _ = _measure(f"layer fwd {name}", _no_grad(lambda f=f: f(x, weights, w1, w2)), args.budget_ms, failures)
        fwd_bwd, _ = _measure(f"layer fwd+bwd {name}", _fwd_bwd(lambda f=f: f(*leaves), leaves, dy), args.budget_ms,
                              failures)
        for t in leaves:
            t.grad = None
        out[name] = {"fwd_ms": fwd, "fwd_bwd_ms": fwd_bwd,
                     "fwd_queued_ms": _queued(_no_grad(lambda f=f: f(x, weights, w1, w2)), fwd)}
    # micro-batches of one optimizer step (gradient accumulation): the weights are quantized by the
    # first forward of the block and reused by the others, as lowprec.nn.reuse_quantized_weights does
    with reuse_quantized_weights():
        out["lowprec"]["fwd_bwd_reused_weights_ms"], _ = _measure(
            "layer fwd+bwd lowprec, weights reused", _fwd_bwd(lambda: fns["lowprec"](*leaves), leaves, dy),
            args.budget_ms, failures)
    for t in leaves:
        t.grad = None
    # inference with the expert weights kept in FP8 (quantized once, not per call)
    w1_q, w2_q = (quantize(w, "fp8_block128x128", check_finite=False) for w in (w1, w2))
    fp8_fwd = _no_grad(lambda: fns["lowprec"](x, weights, w1_q, w2_q))
    out["lowprec"]["fwd_fp8_weights_ms"], _ = _measure("layer fwd lowprec, FP8 weights", fp8_fwd, args.budget_ms,
                                                       failures)
    out["lowprec"]["fwd_fp8_weights_queued_ms"] = _queued(fp8_fwd, out["lowprec"]["fwd_fp8_weights_ms"])
    return out


def _queued(fn, synced_ms: float) -> float:
    """Queued timing (no host sync between calls, as a model of many layers queues work ahead:
    host time counts only where it exceeds GPU time); nan where the synced timing failed."""
    return math.nan if math.isnan(synced_ms) else _time_queued(fn)


def _time_queued(fn) -> float:
    return bench_ms(fn, warmup=2, rep=20, queued=True)


def _permutation_case(x, routing, args, failures):
    rows = torch.randn(routing.num_rows, x.shape[1], device=x.device, dtype=x.dtype)
    weights, ids, num_experts = routing.topk_weights, routing.topk_ids, routing.num_experts
    calls = {"dispatch": lambda: dispatch(weights, ids, num_experts, capacity_factor=args.capacity_factor,
                                          check_ids=False),
             "pack_fp8": lambda: pack(x, routing, "fp8_block1x128"), "gather_bf16": lambda: gather_rows(x, routing),
             "unpack": lambda: unpack(rows, routing, routing.topk_weights, out_dtype=x.dtype)}
    return {name: _measure(name, fn, args.budget_ms, failures)[0] for name, fn in calls.items()}


def _ratio(peer_ms: float, ms: float) -> float:
    return peer_ms / ms if ms > 0 else math.nan


def run(args: argparse.Namespace) -> dict:
    if not torch.cuda.is_available():
        raise SystemExit("bench moe needs a CUDA GPU (none is visible to torch)")
    if args.ep:
        from .moe_ep import EP_CONFIGS, ep_rows, print_rows, save

        rows = ep_rows(args.ep, args.configs, seed=args.seed)
        print_rows(rows)
        path = save(rows, torch.cuda.get_device_name(), args.out, partial=args.configs != list(EP_CONFIGS))
        print(f"results: {path}")
        return {"rows": rows}
    if args.decode:
        return run_decode(args)
    if args.train:
        return run_train(args)
    gen = torch.Generator(device="cuda").manual_seed(args.seed)
    dev = torch.cuda.get_device_name()
    print(f"# {dev}, torch {torch.__version__}; capacity_factor {args.capacity_factor} (None: dropless)")
    records, gemm_rows, layer_rows, held_rows = [], [], [], []
    for cfg in args.configs:
        num_experts, hidden, ffn, top_k, tokens = cfg
        x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, generator=gen)
        w1 = (torch.randn(num_experts, 2 * ffn, hidden, device="cuda", generator=gen) / math.sqrt(hidden)).bfloat16()
        w2 = (torch.randn(num_experts, hidden, ffn, device="cuda", generator=gen) / math.sqrt(ffn)).bfloat16()
        for kind in args.routings:
            routing = make_routing(tokens, top_k, num_experts, kind, zipf=args.zipf,
                                   capacity_factor=args.capacity_factor, generator=gen)
            failures: dict[str, str] = {}
            pad = padding_stats(routing)
            gemm = _gemm_case(x, w1, routing, args, failures)
            perm = _permutation_case(x, routing, args, failures)
            layer = None if args.no_layer else _layer_case(x, w1, w2, routing, args, failures)
            lp = gemm["lowprec"]
            record = {"E": num_experts, "H": hidden, "F": ffn, "top_k": top_k, "T": tokens, "routing": kind,
                      **pad, "gemm": gemm, "gemm_speedup_vs_fp8_rowwise": _ratio(gemm["fp8_rowwise"]["ms"], lp["ms"]),
                      "gemm_speedup_vs_bf16": _ratio(gemm["bf16"]["ms"], lp["ms"]), "permutation_ms": perm,
                      "lowprec_permutation_ms": perm["pack_fp8"] + perm["unpack"], "layer": layer,
                      "failures": failures}
            name = f"E{num_experts} H{hidden} F{ffn} k{top_k} T{tokens}"
            gemm_rows.append([name, kind, pad["padding_waste"], pad["tile_waste"], lp["tflops"],
                              gemm["fp8_rowwise"]["tflops"], gemm["bf16"]["tflops"],
                              record["gemm_speedup_vs_fp8_rowwise"], record["gemm_speedup_vs_bf16"], lp["rel_err"],
                              gemm["fp8_rowwise"]["rel_err"], gemm["bf16"]["rel_err"], perm["dispatch"],
                              perm["pack_fp8"], perm["unpack"], perm["gather_bf16"]])
            if args.sustained:
                held = {n: g.get("sustained", {}) for n, g in gemm.items()}
                record["gemm_sustained_speedup_vs_fp8_rowwise"] = _ratio(
                    held["fp8_rowwise"].get("ms", math.nan), held["lowprec"].get("ms", math.nan))
                held_rows.append([name, kind] + [held[n].get(key, math.nan) for n in ("lowprec", "fp8_rowwise", "bf16")
                                                 for key in ("tflops", "sm_clock_mhz", "power_w")]
                                 + [record["gemm_sustained_speedup_vs_fp8_rowwise"]])
            if layer is not None:
                lpl, bfl = layer["lowprec"], layer["bf16"]
                record["layer_speedup_fwd"] = _ratio(bfl["fwd_ms"], lpl["fwd_ms"])
                record["layer_speedup_fwd_fp8_weights"] = _ratio(bfl["fwd_ms"], lpl["fwd_fp8_weights_ms"])
                record["layer_speedup_fwd_bwd"] = _ratio(bfl["fwd_bwd_ms"], lpl["fwd_bwd_ms"])
                record["layer_speedup_fwd_bwd_reused_weights"] = _ratio(bfl["fwd_bwd_ms"],
                                                                        lpl["fwd_bwd_reused_weights_ms"])
                record["layer_speedup_fwd_queued"] = _ratio(bfl["fwd_queued_ms"], lpl["fwd_queued_ms"])
                record["layer_speedup_fwd_fp8_weights_queued"] = _ratio(bfl["fwd_queued_ms"],
                                                                        lpl["fwd_fp8_weights_queued_ms"])
                layer_rows.append([name, kind, lpl["fwd_ms"], lpl["fwd_fp8_weights_ms"], bfl["fwd_ms"],
                                   record["layer_speedup_fwd"], record["layer_speedup_fwd_fp8_weights"],
                                   record["layer_speedup_fwd_queued"], record["layer_speedup_fwd_fp8_weights_queued"],
                                   lpl["fwd_bwd_ms"], bfl["fwd_bwd_ms"], record["layer_speedup_fwd_bwd"],
                                   lpl["fwd_bwd_reused_weights_ms"], record["layer_speedup_fwd_bwd_reused_weights"]])
            for what, why in failures.items():
                print(f"# {name} {kind}: {what} n/a ({why})")
            records.append(record)
            print(f"# done {name} {kind}", flush=True)
        del x, w1, w2
        torch.cuda.empty_cache()

    na = [[_cell(c) for c in r] for r in gemm_rows]
    print("\nfirst expert GEMM [T·k, H] x w1[e]ᵀ; TFLOPS over routed rows; x = peer ms / lowprec ms; "
          "err = rel-L2 vs FP64 of the unquantized inputs; ms of the permutation")
    print_table(["config", "routing", "pad", "tile pad", "lowprec TF", "fp8row TF", "bf16 TF", "x fp8row",
                 "x bf16", "err lp", "err fp8row", "err bf16", "dispatch ms", "pack ms", "unpack ms",
                 "bf16 gather ms"], na)
    if held_rows:
        print(f"\nthe same GEMMs, each back to back for {args.sustained:g} s (the chip at its power cap): TFLOPS, "
              "median SM clock (MHz) and power (W) from nvidia-smi; x = peer ms / lowprec ms")
        print_table(["config", "routing", "lowprec TF", "MHz", "W", "fp8row TF", "MHz", "W", "bf16 TF", "MHz", "W",
                     "x fp8row"], [[_cell(c) for c in r] for r in held_rows])
    if layer_rows:
        print("\nMoE layer (swiglu): lowprec fp8_block vs bf16 on torch._grouped_mm; x = bf16 ms / lowprec ms; "
              "'w8': expert weights kept in FP8 (inference), the others quantize them every call; 'q': queued "
              "(no host sync between calls: GPU time where the host keeps ahead); 'W reused': f+b of the "
              "micro-batches after the first in a reuse_quantized_weights block (gradient accumulation)")
        print_table(["config", "routing", "lp fwd ms", "lp fwd w8 ms", "bf16 fwd ms", "x fwd", "x fwd w8", "x fwd q",
                     "x fwd w8 q", "lp f+b ms", "bf16 f+b ms", "x f+b", "lp f+b W reused ms", "x f+b W reused"],
                    [[_cell(c) for c in r] for r in layer_rows])
    payload = {"device": dev, "torch": torch.__version__, "capacity_factor": args.capacity_factor,
               "zipf": args.zipf, "tile_m": TILE_M, "sustained_s": args.sustained,
               "timing": ("bench_ms median (L2 flushed before every call), 5 to 50 calls, host synced before each; "
                          "*_queued_ms: 20 calls without host sync between them; gemm ms: median of 4 "
                          "interleaved rounds; gemm *.sustained: back to back for --sustained s; random data"),
               "rows": records, "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    partial = args.configs != list(CONFIGS) or not set(args.routings) >= set(ROUTINGS)  # --quick, --configs, ...
    path = save("moe", payload, args.out, partial)
    print(f"saved {path}")
    return payload


def bf16_layer(x: torch.Tensor, router_weight: torch.Tensor, top_k: int, w1: torch.Tensor,
               w2: torch.Tensor) -> torch.Tensor:
    """The bf16 MoE layer of the decode table: the modules' FP32 router and top-k, then :func:`bf16_experts`."""
    weights, ids = select_experts(F.linear(x.float(), router_weight.float()), top_k)
    return bf16_experts(x, weights, ids, w1, w2)


def run_decode(args: argparse.Namespace) -> dict:
    dev = torch.cuda.get_device_name()
    print(f"# {dev}, torch {torch.__version__}; decode steps, tokens {args.decode}")
    torch.manual_seed(args.seed)
    rows, records = [], []
    for num_experts, hidden, ffn, top_k, _ in args.configs:
        moe = MoE(hidden, ffn, num_experts, top_k, device="cuda", dtype=torch.bfloat16)
        layer = FP8InferenceMoE.from_moe(moe)
        nvfp4 = NVFP4InferenceMoE.from_moe(moe)
        compiled = torch.compile(layer, fullgraph=True, mode="reduce-overhead")
        name = f"E{num_experts} H{hidden} F{ffn} k{top_k}"
        for tokens in args.decode:
            x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
            failures: dict[str, str] = {}
            with torch.no_grad():
                bf16 = functools.partial(bf16_layer, x, moe.router.weight, top_k, moe.w1, moe.w2)
                calls = {"fp8_eager": functools.partial(layer, x), "fp8_compiled": functools.partial(compiled, x),
                         "nvfp4_eager": functools.partial(nvfp4, x), "bf16_eager": bf16}
                for graphed, fn in (("nvfp4_graph", calls["nvfp4_eager"]), ("bf16_graph", bf16)):
                    try:
                        calls[graphed] = cuda_graph_replay(fn)
                    except Exception as err:  # noqa: BLE001 - reported as n/a
                        failures[graphed] = f"{type(err).__name__}: {err}"
                ms = {n: _measure(f"decode {n}", fn, args.budget_ms, failures)[0] for n, fn in calls.items()}
                queued = {n: _queued(fn, ms[n]) for n, fn in calls.items()}
                same = torch.equal(compiled(x).clone(), layer(x)) if not failures else None
            for graphed in ("nvfp4_graph", "bf16_graph"):
                ms.setdefault(graphed, math.nan)
                queued.setdefault(graphed, math.nan)
            record = {"E": num_experts, "H": hidden, "F": ffn, "top_k": top_k, "T": tokens, "ms": ms,
                      "queued_ms": queued, "compiled_equals_eager": same,
                      "speedup_compiled_vs_bf16_graph": _ratio(ms["bf16_graph"], ms["fp8_compiled"]),
                      "speedup_compiled_vs_bf16_graph_queued": _ratio(queued["bf16_graph"], queued["fp8_compiled"]),
                      "speedup_nvfp4_graph_vs_bf16_graph": _ratio(ms["bf16_graph"], ms["nvfp4_graph"]),
                      "speedup_nvfp4_graph_vs_bf16_graph_queued": _ratio(queued["bf16_graph"], queued["nvfp4_graph"]),
                      "failures": failures}
            records.append(record)
            rows.append([name, tokens, ms["fp8_eager"], ms["fp8_compiled"], ms["bf16_eager"], ms["bf16_graph"],
                         queued["fp8_compiled"], queued["bf16_graph"], _ratio(ms["bf16_eager"], ms["fp8_eager"]),
                         record["speedup_compiled_vs_bf16_graph"], record["speedup_compiled_vs_bf16_graph_queued"],
                         same, ms["nvfp4_eager"], ms["nvfp4_graph"], queued["nvfp4_graph"],
                         record["speedup_nvfp4_graph_vs_bf16_graph"],
                         record["speedup_nvfp4_graph_vs_bf16_graph_queued"]])
            for what, why in failures.items():
                print(f"# {name} T{tokens}: {what} n/a ({why})")
        del moe, layer, nvfp4, compiled
        torch.cuda.empty_cache()
    print("\nMoE layer inference step (router included, no grad), ms: lowprec FP8InferenceMoE eager and "
          "compiled (fullgraph, reduce-overhead: CUDA graphs) vs the bf16 MoE on torch._grouped_mm eager and "
          "replayed from a CUDA graph; host synced before each call, 'q': queued (no host sync between calls, "
          "as the layers of a model step); x = bf16 ms / lowprec ms (eager / eager, compiled / graph); "
          "NVFP4InferenceMoE eager and replayed from a CUDA graph, x nvfp4 = bf16 graph / nvfp4 graph")
    print_table(["config", "T", "fp8 eager", "fp8 compiled", "bf16 eager", "bf16 graph", "fp8 compiled q",
                 "bf16 graph q", "x eager", "x compiled", "x compiled q", "compiled == eager", "nvfp4 eager",
                 "nvfp4 graph", "nvfp4 graph q", "x nvfp4", "x nvfp4 q"],
                [[_cell(c) for c in r] for r in rows])
    return _save_steps("moe_decode", dev, records, args)


def run_train(args: argparse.Namespace) -> dict:
    dev = torch.cuda.get_device_name()
    print(f"# {dev}, torch {torch.__version__}; training steps, tokens {args.train}")
    torch.manual_seed(args.seed)
    records = []
    for config in args.configs:
        records += _train_records(*config[:4], args)
        torch._dynamo.reset()  # frees the CUDA graphs' memory pools
        torch.cuda.empty_cache()
    print("\nMoE layer training step (router included, forward + backward into every parameter), ms: lowprec "
          "FP8 MoE eager, compiled (fullgraph) and compiled with CUDA graphs (reduce-overhead) vs the bf16 MoE on "
          "torch._grouped_mm eager; host synced before each call, 'q': queued (no host sync between calls); "
          "x = bf16 eager q / lowprec q; rel = largest rel-L2 of a compiled output or gradient vs eager")
    names = ("fp8_eager", "fp8_compiled", "fp8_graphs", "bf16_eager")
    rows = [[f"E{r['E']} H{r['H']} F{r['F']} k{r['top_k']}", r["T"], *(r["ms"][n] for n in names),
             *(r["queued_ms"][n] for n in names), _ratio(r["queued_ms"]["bf16_eager"], r["queued_ms"]["fp8_eager"]),
             r["speedup_graphs_vs_bf16_queued"], max(r["grads_rel_l2_vs_eager"].values(), default=math.nan)]
            for r in records]
    print_table(["config", "T", "fp8 eager", "fp8 compiled", "fp8 graphs", "bf16 eager", "fp8 eager q",
                 "fp8 compiled q", "fp8 graphs q", "bf16 eager q", "x eager q", "x graphs q", "rel"],
                [[_cell(c) for c in r] for r in rows])
    return _save_steps("moe_train", dev, records, args)


def _save_steps(section: str, dev: str, records: list[dict], args: argparse.Namespace) -> dict:
    """Save the ``--decode`` / ``--train`` rows under ``section`` of the results JSON."""
    payload = {"device": dev, "torch": torch.__version__, "rows": records,
               "timing": ("bench_ms median, L2 flushed before every call; ms: host synced before each call, "
                          "queued_ms: no sync between calls; random data"),
               "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    path = save(section, payload, args.out, partial=True)  # the token counts are this run's choice
    print(f"saved {path}")
    return payload


_SETTINGS = ("capacity_factor", "zipf", "tile_m", "sustained_s")  # of the section: rows of others do not mix


def save(section: str, payload: dict, path: str | None = None, partial: bool = False) -> str:
    """Save ``payload`` under ``section``; a run over part of the rows replaces only the saved rows
    it measured again (same config, tokens and routing), where the saved section has its settings."""
    keys = ("E", "H", "F", "top_k", "T") + (("routing",) if section == "moe" else ())
    saved = load_results(section, path)
    same = saved is not None and all(saved.get(k) == payload.get(k) for k in _SETTINGS)
    return save_results(section, payload, path, merge_rows_by=keys if partial and same else None)


def _train_records(num_experts: int, hidden: int, ffn: int, top_k: int, args: argparse.Namespace) -> list[dict]:
    """``run_train``'s rows of one layer config, one per token count."""
    moe = MoE(hidden, ffn, num_experts, top_k, device="cuda", dtype=torch.bfloat16)
    params = list(moe.parameters())
    runs = {"fp8_eager": (moe, False), "fp8_compiled": (torch.compile(moe, fullgraph=True), False),
            "fp8_graphs": (torch.compile(moe, fullgraph=True, mode="reduce-overhead"), True),
            "bf16_eager": (functools.partial(bf16_layer, router_weight=moe.router.weight, top_k=top_k, w1=moe.w1,
                                             w2=moe.w2), False)}
    records = []
    counters.clear()
    for tokens in args.train:
        x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
        dy = torch.randn_like(x)

        def step(layer, new_graph_step: bool, keep: bool = False, x=x, dy=dy):
            if new_graph_step:  # the previous step's graph outputs are not read any more
                torch.compiler.cudagraph_mark_step_begin()
            for p in params:
                p.grad = None
            xl = x.detach().requires_grad_()
            y = layer(xl)
            y.backward(dy)
            return [y.detach().clone(), xl.grad, *(p.grad.clone() for p in params)] if keep else None

        failures: dict[str, str] = {}
        ms = {n: _measure(f"train {n}", functools.partial(step, *run), args.budget_ms, failures)[0]
              for n, run in runs.items()}
        queued = {n: _queued(functools.partial(step, *run), ms[n]) for n, run in runs.items()}
        rel = {}
        if "train fp8_eager" not in failures:
            eager = step(*runs["fp8_eager"], keep=True)
            for n in ("fp8_compiled", "fp8_graphs"):
                if f"train {n}" not in failures:
                    rel[n] = max(rel_l2(g, e) for g, e in zip(step(*runs[n], keep=True), eager))
        for what, why in failures.items():
            print(f"# E{num_experts} H{hidden} F{ffn} k{top_k} T{tokens}: {what} n/a ({why})")
        records.append({"E": num_experts, "H": hidden, "F": ffn, "top_k": top_k, "T": tokens, "ms": ms,
                        "queued_ms": queued, "grads_rel_l2_vs_eager": rel,
                        "speedup_graphs_vs_bf16_queued": _ratio(queued["bf16_eager"], queued["fp8_graphs"]),
                        "cudagraph_skips": int(counters["inductor"]["cudagraph_skips"]), "failures": failures})
    return records


def _cell(value):
    return "n/a" if value is None or (isinstance(value, float) and math.isnan(value)) else value


def main(argv: list[str] | None = None) -> int:
    run(parse_args(argv))
    return 0
