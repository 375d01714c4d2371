"""Arch-neutral CuTe DSL helpers."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import dsl_user_op

__all__ = ["round_up", "pin_f32", "fence_operand", "LoopInvariant"]


def round_up(x: int, m: int) -> int:
    return -(-x // m) * m


@dsl_user_op
def pin_f32(x, *, loc=None, ip=None):
    """Empty volatile asm ``"=f,0"`` on one fp32 value: the compiler may not move reads of the
    value across it (CUTLASS's ``warpgroup_fence_operand``)."""
    v = llvm.inline_asm(
        cutlass.Float32.mlir_type,
        [cutlass.Float32(x).ir_value(loc=loc, ip=ip)],
        "",
        "=f,0",
        has_side_effects=True,
        loc=loc,
        ip=ip,
    )
    return cutlass.Float32(v)


@cute.jit
def fence_operand(t: cute.Tensor):
    """Pin every register of an fp32 fragment (see ``pin_f32``): keeps reads and writes of a
    wgmma accumulator from being moved across an asynchronous wgmma batch."""
    for i in cutlass.range_constexpr(cute.size(t)):
        t[i] = pin_f32(t[i])


class LoopInvariant:
    """Base of state objects that only hold values made before a kernel's loops (tensors, copy
    atoms, coordinates): the DSL carries an object through a dynamic loop / if when a method is
    called on it there; such an object carries no values and comes out unchanged. Do not assign
    its attributes inside a dynamic region."""

    def __extract_mlir_values__(self):
        return []

    def __new_from_mlir_values__(self, values):
        return self
