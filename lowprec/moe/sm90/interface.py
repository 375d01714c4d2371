"""Host side of the MoE dispatch kernels: eligibility, compile cache, launch."""

from __future__ import annotations

import torch

from ...runtime import kernel_cache

__all__ = ["ARCH", "MAX_EXPERTS", "MAX_SLOTS", "THREADS", "build_dispatch_kernel", "dispatch_plan",
           "dispatch_unsupported"]

ARCH = "sm_90a"
# kernel sizes, here so that checking eligibility needs no CuTe DSL import (dispatch.py imports it)
THREADS = 1024  # slots per chunk (one CTA, one thread per slot)
MAX_EXPERTS = 512  # the per-warp count table: 32 warps x E int32 in shared memory (64 KB at 512)
MAX_SLOTS = 1 << 17  # every CTA sums its experts' column of the chunk counts: keep that short


def dispatch_unsupported(num_slots: int, num_experts: int) -> str | None:
    """Why the dispatch kernels cannot plan this routing (None: they can)."""
    if num_experts > MAX_EXPERTS:
        return f"E={num_experts} experts (the kernels take up to {MAX_EXPERTS})"
    if num_slots > MAX_SLOTS:
        return f"T·k={num_slots} slots (the kernels take up to {MAX_SLOTS})"
    return None


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
    """``ids``: int64 [n] expert id per slot, contiguous, on a CUDA device (``dispatch_unsupported``
    is None); ``capacity``: None (dropless) or the slots each expert keeps, its earliest (the
    ``"position"`` drop policy). Returns (kept bool [n], slot_rows int64 [n], row_slots int64 [n],
    counts int32 [E], group_ends int32 [E]) of :func:`lowprec.moe.dispatch`'s plan."""
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
    with torch.cuda.device(dev):
        kernel(ids, hist, counts, ends, row_slots, slot_rows, kept.view(torch.uint8), min(capacity or n, n))
    return kept, slot_rows, row_slots, counts, ends
