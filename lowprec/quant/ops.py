"""torch.library custom ops for the FP8 quantize kernels, used while ``torch.compile`` traces.

A CuTe DSL launch cannot go into a graph. Traced without these ops, the quantization became the
reference ops compiled by inductor: slower than the kernels (a compiled FP8Linear step ran slower
than bf16) and rounding ~60% of the 1x128 scales one bit differently (its division is approximate).
These ops launch the kernels at run time. Their fake implementations give the kernels' output
layouts (1x128 scales MN-major and TMA-aligned). Where a kernel cannot run (another arch,
``LOWPREC_BACKEND=reference``, columns not a multiple of 16) the reference runs and its results
are copied into those layouts, so the traced graph holds either way.
"""

from __future__ import annotations

import torch

from ..recipes import get_recipe
from ..runtime import registry
from .layouts import empty_dual_outputs, empty_mn_major_tma_aligned
from .reference import quantize_reference

__all__ = ["quantize_fp8", "quantize_dual_fp8", "quantize_128x128_t_fp8", "swiglu_dual_fp8", "swiglu_dual_codes",
           "swiglu_values", "RECIPES", "SWIGLU_KINDS"]

RECIPES = ("fp8_block1x128", "fp8_block128x128", "fp8_rowwise")  # of quantize_fp8 (exact FP32 scales)


def _empty_codes_and_scales(x: torch.Tensor, recipe: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Outputs of the ``recipe`` kernel for ``x`` [M, K], uninitialised, in the kernel's layouts."""
    m, k = x.shape
    q = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x.device)
    if recipe == "fp8_block1x128":
        s = empty_mn_major_tma_aligned(m, -(-k // 128), x.device)
    elif recipe == "fp8_rowwise":  # a row of no columns has no scale (as QuantizedTensor's grid)
        s = torch.empty(m, min(k, 1), dtype=torch.float32, device=x.device)
    else:
        s = torch.empty(-(-m // 128), -(-k // 128), dtype=torch.float32, device=x.device)
    return q, s


def _fill(outputs: tuple[torch.Tensor, ...], values: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    for out, value in zip(outputs, values):
        out.copy_(value)
    return outputs


@torch.library.custom_op("lowprec::quantize_fp8", mutates_args=())
def quantize_fp8(x: torch.Tensor, recipe: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [M, K] in ``fp8_block1x128``, ``fp8_rowwise`` or ``fp8_block128x128``: (codes, scales)."""
    r = get_recipe(recipe)

    def reference():
        ref = quantize_reference(x, r)
        return _fill(_empty_codes_and_scales(x, recipe), (ref.data, ref.scale))

    xk = x.contiguous()  # the kernels read whole 16-byte rows
    return registry.run("quantize", x.device, (xk, r), reference)


@quantize_fp8.register_fake
def _(x, recipe):
    return _empty_codes_and_scales(x, recipe)


def _empty_dual(x: torch.Tensor, t_rows: int = 1) -> tuple[torch.Tensor, ...]:
    return empty_dual_outputs(*x.shape, x.device, t_rows)


# the dual quantization's transposed halves, by their blocks' rows: 1x128 along tokens, 16x128, 128x128
DUAL_T_RECIPES = {1: "fp8_block1x128", 16: "fp8_block16x128", 128: "fp8_block128x128"}


def _t_recipe(t_rows: int) -> str:
    """The transposed half's recipe: blocks of ``t_rows`` x 128 (1, 16 or 128)."""
    if t_rows not in DUAL_T_RECIPES:
        raise ValueError(f"t_rows: expected one of {tuple(DUAL_T_RECIPES)}, got {t_rows!r}")
    return DUAL_T_RECIPES[t_rows]


@torch.library.custom_op("lowprec::quantize_dual_fp8", mutates_args=())
def quantize_dual_fp8(x: torch.Tensor, t_rows: int = 1
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """1x128 along K of ``x`` [T, K] and, of ``x`` zero-padded to T_pad = round_up(T, 16) and
    transposed, blocks of ``t_rows`` x 128 (1x128 along T, 16x128 or 128x128): (codes [T, K],
    scales, codes [K, T_pad], scales)."""
    args = (x.contiguous(), get_recipe("fp8_block1x128"), get_recipe(_t_recipe(t_rows)))
    return registry.run("quantize_dual", x.device, args, lambda: _dual_reference(x, t_rows))


def _dual_reference(x: torch.Tensor, t_rows: int = 1) -> tuple[torch.Tensor, ...]:
    """The reference quantizer's ``quantize_dual_fp8`` outputs for ``x`` [T, K], in the kernel's layouts."""
    padded = torch.nn.functional.pad(x, (0, 0, 0, -(-x.shape[0] // 16) * 16 - x.shape[0]))
    along_k = quantize_reference(x, get_recipe("fp8_block1x128"))
    along_t = quantize_reference(padded.t(), get_recipe(_t_recipe(t_rows)))
    return _fill(_empty_dual(x, t_rows), (along_k.data, along_k.scale, along_t.data, along_t.scale))


@quantize_dual_fp8.register_fake
def _(x, t_rows=1):
    return _empty_dual(x, t_rows)


def _empty_128x128_t(x: torch.Tensor, n: int) -> tuple[torch.Tensor, ...]:
    r, k = x.shape
    q, s = _empty_codes_and_scales(x, "fp8_block128x128")
    return q, s, torch.empty(r // n * k, n, dtype=torch.float8_e4m3fn, device=x.device)


@torch.library.custom_op("lowprec::quantize_128x128_t_fp8", mutates_args=())
def quantize_128x128_t_fp8(x: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """128x128 blocks of ``x`` [R, K], a stack of R / n matrices of ``n`` rows (n % 128 == 0 when
    R > n): (codes [R, K], scales, each matrix's transposed codes [R / n · K, n])."""
    r = get_recipe("fp8_block128x128")

    def reference():
        ref = quantize_reference(x, r)
        # square blocks: the transposed matrices' codes are the codes transposed
        codes_t = ref.data.view(-1, n, x.shape[1]).transpose(-1, -2).reshape(-1, n)
        return _fill(_empty_128x128_t(x, n), (ref.data, ref.scale, codes_t))

    matrices = x.contiguous().view(-1, n, x.shape[1])
    return registry.run("quantize_with_transpose", x.device, (matrices, r), reference)


@quantize_128x128_t_fp8.register_fake
def _(x, n):
    return _empty_128x128_t(x, n)


# The dense SwiGLU MLP's fused activation quantizations (``lowprec.nn.swiglu``): the values in
# FP32 from bf16 / fp16 inputs, then ``quantize_dual``. The kernels' sigmoid is approximate (MUFU
# ex2 and rcp, a few ulp): a code may sit one E4M3 step from the reference's where a value lies on
# a rounding boundary.
SWIGLU_KINDS = {"swiglu": 2, "swiglu_dgate": 3, "swiglu_dup": 2}


def swiglu_values(kind: str, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """FP32 ``silu(g) · u`` (``swiglu``: g, u), ``silu_backward(da · u, g)`` (``swiglu_dgate``:
    g, u, da) or ``da · silu(g)`` (``swiglu_dup``: g, da)."""
    g = inputs[0].float()
    if kind == "swiglu":
        return torch.nn.functional.silu(g) * inputs[1].float()
    if kind == "swiglu_dup":
        return inputs[1].float() * torch.nn.functional.silu(g)
    return torch.ops.aten.silu_backward(inputs[2].float() * inputs[1].float(), g)


def swiglu_dual_codes(kind: str, inputs: tuple[torch.Tensor, ...], t_rows: int = 1
                      ) -> tuple[torch.Tensor, ...]:
    """``quantize_dual``'s codes and scales of :func:`swiglu_values` (the kernel where it serves;
    see the note above); ``t_rows`` (``swiglu`` only: 16 or 128): the transposed half in 16x128
    or 128x128 blocks."""
    if t_rows != 1 and kind != "swiglu":
        raise ValueError(f"t_rows: only the activation (kind 'swiglu') is quantized in {t_rows}x128 blocks "
                         f"for the weight gradient, got kind {kind!r}")
    _t_recipe(t_rows)
    op = f"quantize_{kind}_dual_t{t_rows}x128" if t_rows != 1 else f"quantize_{kind}_dual"
    return registry.run(op, inputs[0].device, inputs,
                        lambda: _dual_reference(swiglu_values(kind, inputs), t_rows))


@torch.library.custom_op("lowprec::swiglu_dual_fp8", mutates_args=())
def swiglu_dual_fp8(kind: str, inputs: list[torch.Tensor], t_rows: int = 1
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`swiglu_dual_codes` as a custom op (``torch.compile``)."""
    return swiglu_dual_codes(kind, tuple(inputs), t_rows)


@swiglu_dual_fp8.register_fake
def _(kind, inputs, t_rows=1):
    return _empty_dual(inputs[0], t_rows)
