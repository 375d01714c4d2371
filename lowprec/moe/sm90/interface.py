"""Host side of the MoE kernels (top-k ids, dispatch plan, pack, SwiGLU and its backward, unpack): compile
cache and launch. What they take is stated in :mod:`.config`; the registry checks it before a
call, so these functions assume valid arguments."""

from __future__ import annotations

import functools

import torch

from ...quant.layouts import empty_mn_major_tma_aligned
from ...quant.sm90.interface import cutlass_dtype, fake_rows, fake_scales
from ...runtime import ffi_entry, kernel_cache, on_device
from .config import THREADS

__all__ = ["ARCH", "KERNELS", "build_dispatch_kernel", "build_kernel", "build_unpack_kernel", "dispatch_plan",
           "pack_1x128", "swiglu_1x128", "swiglu_backward_1x128", "swiglu_rows", "topk_ids", "unpack_rows",
           "build_topk_kernel"]

ARCH = "sm_90a"
KERNELS = ("pack_1x128", "pack_tokens_1x128", "swiglu_1x128", "swiglu_h_1x128", "swiglu_backward_1x128",
           "swiglu_backward", "swiglu_rows")


def build_topk_kernel(num_experts: int, top_k: int, arch: str = ARCH):
    """Compile the top-k ids kernel for ``num_experts`` scores and ``top_k`` ids per row (both
    static: the rounds and the per-lane scores unroll) on fake tensors, uncached."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_stream, make_fake_tensor

    from ...runtime import compile_for_arch
    from . import topk

    rows = cute.sym_int()
    bits = make_fake_tensor(cutlass.Int32, (rows, num_experts), stride=(num_experts, 1), assumed_align=4)
    ids = make_fake_tensor(cutlass.Int64, (rows, top_k), stride=(top_k, 1), assumed_align=8)
    return compile_for_arch(topk.topk_ids, bits, ids, num_experts, make_fake_stream(use_tvm_ffi_env_stream=True),
                            arch=arch, tvm_ffi=True)


def topk_ids(scores: torch.Tensor, top_k: int) -> torch.Tensor:
    """``scores`` FP32 ``[T, E]`` contiguous -> int64 ``[T, top_k]``: each row's expert ids by
    descending score, equal scores lower id first, NaN first (``torch.sort(..., descending=True,
    stable=True)``'s order)."""
    t, e = scores.shape
    ids = torch.empty(t, top_k, dtype=torch.int64, device=scores.device)
    if t:
        kernel = kernel_cache.get("moe_topk_ids", {"num_experts": e, "top_k": top_k}, ARCH,
                                  lambda: build_topk_kernel(e, top_k))
        with on_device(scores.device):
            kernel(scores.view(torch.int32), ids)
    return ids


def build_dispatch_kernel(num_experts: int, arch: str = ARCH):
    """Compile the dispatch plan for ``num_experts`` on fake tensors (no GPU needed), uncached."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_stream, make_fake_tensor

    from ...runtime import compile_for_arch
    from . import dispatch

    def vec(dtype, align):
        return make_fake_tensor(dtype, (cute.sym_int(),), stride=(1,), assumed_align=align)

    hist = make_fake_tensor(cutlass.Int32, (cute.sym_int(), num_experts), stride=(num_experts, 1), assumed_align=4)
    experts = make_fake_tensor(cutlass.Int32, (num_experts,), stride=(1,), assumed_align=4)
    ends = make_fake_tensor(cutlass.Int32, (num_experts,), stride=(1,), assumed_align=4)
    return compile_for_arch(dispatch.dispatch_plan, vec(cutlass.Int64, 8), hist, experts, ends,
                            vec(cutlass.Int64, 8), vec(cutlass.Int64, 8), vec(cutlass.Uint8, 1), cutlass.Int32(1),
                            num_experts, make_fake_stream(use_tvm_ffi_env_stream=True), arch=arch, tvm_ffi=True)


def dispatch_plan(ids: torch.Tensor, num_experts: int, capacity: int | None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``ids``: int64 [n] expert id per slot, on a CUDA device;
    ``capacity``: None (dropless) or the slots each expert keeps, its earliest (the
    ``"position"`` drop policy). Returns (kept bool [n], slot_rows int64 [n], row_slots int64 [n],
    counts int32 [E], group_ends int32 [E]) of :func:`lowprec.moe.dispatch`'s plan."""
    ids = ids.contiguous()
    n = ids.shape[0]
    dev = ids.device
    kept = torch.empty(n, dtype=torch.bool, device=dev)
    slot_rows = torch.empty(n, dtype=torch.int64, device=dev)
    row_slots = torch.empty(n, dtype=torch.int64, device=dev)
    counts = torch.empty(num_experts, dtype=torch.int32, device=dev)
    ends = torch.empty(num_experts, dtype=torch.int32, device=dev)
    if n == 0:
        counts.zero_()
        ends.zero_()
        return kept, slot_rows, row_slots, counts, ends
    hist = torch.empty(-(-n // THREADS), num_experts, dtype=torch.int32, device=dev)
    kernel = kernel_cache.get("moe_dispatch_plan", {"num_experts": num_experts}, ARCH,
                              lambda: build_dispatch_kernel(num_experts))
    with on_device(dev):
        kernel(ids, hist, counts, ends, row_slots, slot_rows, kept.view(torch.uint8), min(capacity or n, n))
    return kept, slot_rows, row_slots, counts, ends


def build_kernel(kind: str, dtype: torch.dtype, arch: str = ARCH):
    """Compile one pack / SwiGLU kernel for ``dtype`` inputs on fake tensors (no GPU needed), uncached.
    SwiGLU's backward: ``dtype`` is da's (h is FP8; dh and a are FP32); ``swiglu_rows``: h's and
    the output's."""
    if kind not in KERNELS:
        raise ValueError(f"kind: expected one of {KERNELS}, got {kind!r}")
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_stream, make_fake_tensor

    from ...runtime import compile_for_arch
    from . import pack, swiglu, swiglu_backward

    x, q = fake_rows(cutlass_dtype(dtype)), fake_rows(cutlass.Uint8)
    row_weights = make_fake_tensor(cutlass.Float32, (cute.sym_int(),), stride=(1,), assumed_align=4)
    fn = {"pack_1x128": pack.pack_1x128, "pack_tokens_1x128": pack.pack_tokens_1x128,
          "swiglu_1x128": swiglu.swiglu_1x128, "swiglu_h_1x128": swiglu.swiglu_h_1x128,
          "swiglu_backward_1x128": swiglu_backward.swiglu_backward_1x128,
          "swiglu_backward": swiglu_backward.swiglu_backward, "swiglu_rows": swiglu.swiglu_rows}[kind]
    if kind == "swiglu_rows":
        args = (x, fake_rows(cutlass_dtype(dtype)))
    elif kind.startswith("swiglu_backward"):
        dh_q = (fake_rows(cutlass.Uint8), fake_scales()) if kind == "swiglu_backward_1x128" else ()
        args = (q, fake_scales(), x, row_weights, *dh_q, fake_rows(cutlass.Float32), fake_rows(cutlass.Float32),
                fake_scales())
    elif kind.startswith("pack"):
        slot_rows = make_fake_tensor(cutlass.Int64, (cute.sym_int(), cute.sym_int()), stride=(cute.sym_int64(), 1),
                                     assumed_align=8)
        slots = make_fake_tensor(cutlass.Int64, (cute.sym_int(),), stride=(1,), assumed_align=8)
        tokens = (fake_rows(cutlass.Uint8), fake_scales()) if kind == "pack_tokens_1x128" else ()
        args = (x, slot_rows, slots, q, fake_scales(), *tokens)
    else:
        hq = (fake_rows(cutlass.Uint8), fake_scales()) if kind == "swiglu_h_1x128" else ()
        args = (x, row_weights, q, fake_scales(), *hq)
    return compile_for_arch(fn, *args, make_fake_stream(use_tvm_ffi_env_stream=True), arch=arch, tvm_ffi=True)


@functools.cache  # in front of the kernel cache: one hash of plain values per launch
def compile_kernel(kind: str, dtype: torch.dtype, arch: str = ARCH):
    """The launchable kernel, compiled once per (kind, dtype, arch) through the kernel cache."""
    return ffi_entry(kernel_cache.get(f"moe_{kind}", {"dtype": dtype}, arch,
                                      lambda: build_kernel(kind, dtype, arch)))


def pack_1x128(x: torch.Tensor, routing, r, with_tokens: bool
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """MoE packing fused with 1x128 quantization: ``x`` [T, H] -> (FP8 [T·k, H], FP32 scales
    [T·k, ceil(H/128)] MN-major), then with ``with_tokens`` ``quantize(x)`` (FP8 [T, H], scales
    MN-major) from the same pass, else None, None. Packed row ``routing.slot_rows[t, j]`` holds
    token ``t`` (nothing where -1); row ``p`` with ``routing.row_slots[p] == -1`` is zero with scale 1."""
    slot_rows, row_slots = routing.slot_rows, routing.row_slots
    t, h = x.shape
    n = row_slots.shape[0]
    q = torch.empty(n, h, dtype=torch.float8_e4m3fn, device=x.device)
    s = empty_mn_major_tma_aligned(n, -(-h // 128), x.device)
    xq = xs = None
    if with_tokens:
        xq = torch.empty(t, h, dtype=torch.float8_e4m3fn, device=x.device)
        xs = empty_mn_major_tma_aligned(t, -(-h // 128), x.device)
    if t and h:
        with on_device(x.device):
            if with_tokens:
                compile_kernel("pack_tokens_1x128", x.dtype)(x, slot_rows, row_slots, q.view(torch.uint8), s,
                                                              xq.view(torch.uint8), xs)
            else:
                compile_kernel("pack_1x128", x.dtype)(x, slot_rows, row_slots, q.view(torch.uint8), s)
    return q, s, xq, xs


def swiglu_1x128(h: torch.Tensor, row_weights: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``h = [gate | up]`` [R, 2F] -> ``A = silu(gate) · up · row_weights[:, None]`` (FP32, as torch
    on the GPU) quantized 1x128: (FP8 [R, F], FP32 scales [R, ceil(F/128)] MN-major), and when F
    is a multiple of 128 also ``h`` quantized 1x128 (FP8 [R, 2F], scales MN-major), else None, None.
    ``row_weights``: FP32 [R], contiguous."""
    r, two_f = h.shape
    f = two_f // 2
    with_h = f % 128 == 0
    q = torch.empty(r, f, dtype=torch.float8_e4m3fn, device=h.device)
    s = empty_mn_major_tma_aligned(r, -(-f // 128), h.device)
    hq = hs = None
    if with_h:
        hq = torch.empty(r, two_f, dtype=torch.float8_e4m3fn, device=h.device)
        hs = empty_mn_major_tma_aligned(r, two_f // 128, h.device)
    if r and f:
        with on_device(h.device):
            if with_h:
                compile_kernel("swiglu_h_1x128", h.dtype)(h, row_weights, q.view(torch.uint8), s, hq.view(torch.uint8),
                                                           hs)
            else:
                compile_kernel("swiglu_1x128", h.dtype)(h, row_weights, q.view(torch.uint8), s)
    return q, s, hq, hs


def swiglu_rows(h: torch.Tensor) -> torch.Tensor:
    """``h = [gate | up]`` [R, 2F] -> ``silu(gate) · up`` [R, F] in ``h``'s dtype (FP32 steps as
    torch on the GPU, one rounding); F a multiple of 16, rows contiguous."""
    r, two_f = h.shape
    a = torch.empty(r, two_f // 2, dtype=h.dtype, device=h.device)
    if r and two_f:
        with on_device(h.device):
            compile_kernel("swiglu_rows", h.dtype)(h, a)
    return a


def swiglu_backward_1x128(h, da: torch.Tensor, row_weights: torch.Tensor
                          ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor,
                                     torch.Tensor]:
    """SwiGLU backward (see :mod:`.swiglu_backward`) from the saved ``h = [gate | up]`` (a
    QuantizedTensor [R, 2F], FP8 codes contiguous, 1x128 scales of any strides), ``da`` [R, F]
    FP32 and ``row_weights`` FP32 [R], F a multiple of 16.

    Returns ``(dh FP32 [R, 2F], dh codes FP8 [R, 2F], dh scales [R, 2F/128] MN-major, a =
    silu(gate)·up·w FP32 [R, F], ∂y/∂w FP32 [R])``; the codes and scales are None unless F is a
    multiple of 128 (then dh's 1x128 blocks straddle gate and up: quantize ``dh`` instead)."""
    hq, hs = h.data, h.scale
    r, f = da.shape
    dev = da.device
    with_q = f % 128 == 0
    dh = torch.empty(r, 2 * f, dtype=torch.float32, device=dev)
    a = torch.empty(r, f, dtype=torch.float32, device=dev)
    dw_parts = torch.empty(r, -(-f // 128), dtype=torch.float32, device=dev)
    dhq = dhs = None
    if with_q:
        dhq = torch.empty(r, 2 * f, dtype=torch.float8_e4m3fn, device=dev)
        dhs = empty_mn_major_tma_aligned(r, 2 * f // 128, dev)
    if r and f:
        with on_device(dev):
            if with_q:
                compile_kernel("swiglu_backward_1x128", da.dtype)(hq.view(torch.uint8), hs, da, row_weights,
                                                                   dhq.view(torch.uint8), dhs, dh, a, dw_parts)
            else:
                compile_kernel("swiglu_backward", da.dtype)(hq.view(torch.uint8), hs, da, row_weights, dh, a,
                                                             dw_parts)
    return dh, dhq, dhs, a, dw_parts.sum(dim=1)


def build_unpack_kernel(dtype: torch.dtype, out_dtype: torch.dtype, top_k: int, arch: str = ARCH):
    """Compile the MoE unpack kernel for ``dtype`` rows, ``out_dtype`` output and ``top_k`` slots
    per token (a static dimension: the slot loop unrolls) on fake tensors, uncached."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_stream, make_fake_tensor

    from ...runtime import compile_for_arch
    from . import unpack

    tokens = cute.sym_int()
    slot_rows = make_fake_tensor(cutlass.Int64, (tokens, top_k), stride=(top_k, 1), assumed_align=8)
    weights = make_fake_tensor(cutlass.Float32, (tokens, top_k), stride=(top_k, 1), assumed_align=4)
    stream = make_fake_stream(use_tvm_ffi_env_stream=True)
    return compile_for_arch(unpack.unpack_rows, fake_rows(cutlass_dtype(dtype)), slot_rows, weights,
                            fake_rows(cutlass_dtype(out_dtype)), stream, arch=arch, tvm_ffi=True)


def unpack_rows(rows: torch.Tensor, routing, weights: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """MoE combine: ``rows`` [T·k, H] -> ``out`` [T, H] in ``out_dtype``, ``out[t] = Σ_j weights[t, j] ·
    rows[slot_rows[t, j]]`` over ``slot_rows[t, j] >= 0`` (FP32, slot order, product rounded before
    the add); ``weights`` None: all ones (a plain sum)."""
    slot_rows = routing.slot_rows
    tokens, top_k = slot_rows.shape
    # FP32 weights, as the reference rounds them (ones for a plain sum: exact)
    weights = (torch.ones(slot_rows.shape, dtype=torch.float32, device=rows.device) if weights is None
               else weights.detach().float().contiguous())
    out = torch.empty(tokens, rows.shape[1], dtype=out_dtype, device=rows.device)
    if tokens and rows.shape[1]:
        kernel = kernel_cache.get("moe_unpack", {"dtype": rows.dtype, "out_dtype": out_dtype, "top_k": top_k}, ARCH,
                                  lambda: build_unpack_kernel(rows.dtype, out_dtype, top_k))
        with on_device(rows.device):
            kernel(rows.detach(), slot_rows, weights, out)
    return out
