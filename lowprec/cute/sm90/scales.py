"""Scale tiles: staged in the TMA ring next to the data they scale, read into registers at the
positions of a wgmma accumulator fragment.

Scales ride in the same ring stage as their operand tiles (one TMA box each, 128-byte aligned
slots), so one mbarrier covers tile and scales. Two kinds per stage:

* row scales (e.g. A's 1x128 scales): a box of ``rows`` fp32, MN-major in gmem ([rows, KB] with
  stride (1, ld)); a box must start 16-byte aligned, so a tile starting at any row loads from
  the row rounded down to a multiple of 4 (``row_box_start``) and reads ``row % 4`` further in;
* column scales (e.g. B's): ``(cols, 1)`` boxes of one scale per column, or ``(1, kbox)`` boxes
  of one scale per block of 128 columns covering ``kbox`` K blocks (16 bytes: TMA's smallest
  box row), one box per column block the tile touches.

:class:`FragmentScales` reads a stage's scales for one thread of a wgmma accumulator (value
``c + 2r + 4j`` at row ``rows[r]``, column ``col0 + 8j + c``, see ``promote``).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute

from ..utils import LoopInvariant, round_up

__all__ = ["staged_scale_layout", "staged_scale_floats", "row_box_start", "row_box_offset", "FragmentScales",
           "ScaleRegs"]


def staged_scale_layout(box: tuple, num_stages: int):
    """(box..., stage) smem layout of a staged scale box, each stage's slot 128-byte aligned.
    A 1-row box ``(n, 1)`` is stored along its n; ``(r, c)`` boxes row-major."""
    slot = round_up(box[0] * box[1], 32)
    return cute.make_layout((*box, num_stages), stride=(box[1], 1, slot))


def staged_scale_floats(box: tuple, num_stages: int) -> int:
    """fp32 elements of one staged box buffer (a multiple of 32: 128-byte aligned)."""
    return round_up(box[0] * box[1], 32) * num_stages


def row_box_start(row):
    """First row of the 16-byte aligned TMA box holding the row scales of ``row`` on."""
    return row - row % 4


def row_box_offset(row):
    """Where ``row``'s scale sits in the box loaded from ``row_box_start(row)``."""
    return row % 4


class ScaleRegs(LoopInvariant):
    """Register copies of one K block's scales for a fragment: ``row`` (2: rows +0, +8) and
    ``col`` (per-column scales 2 per column group of 8, or one per column block)."""

    def __init__(self, n_col: int, dtype=cutlass.Float32):
        self.row = cute.make_rmem_tensor((2,), dtype)
        self.col = cute.make_rmem_tensor((n_col,), dtype)


class FragmentScales(LoopInvariant):
    """A thread's view of the scales staged in a ring: ``s_row`` (rows, 1, stage), ``s_col`` a list
    of staged column-scale boxes; ``rows`` the thread's two tile rows, ``col0`` its first column;
    ``per_col``: scales along the tile's columns per K block, one per column or (``col_group`` > 1)
    one per group of ``col_group`` columns, the tile's first group first in the box (else per
    128-column block, ``kbox`` K blocks per box)."""

    def __init__(self, s_row, s_col: list, rows: list, col0, per_col: bool, kbox: int, col_group: int = 1):
        self.s_row, self.s_col, self.rows, self.col0 = s_row, s_col, rows, col0
        self.per_col, self.kbox, self.col_group = per_col, kbox, col_group

    def shifted(self, dr):
        """The same, the row scales read ``dr`` rows further into the box."""
        return FragmentScales(self.s_row, self.s_col, [r + dr for r in self.rows], self.col0, self.per_col, self.kbox,
                              self.col_group)

    def row(self, stage, r):
        return self.s_row[(self.rows[r], 0, stage)]

    def group(self, stage, i):
        """Column group ``i``'s scale (``col_group`` > 1: the same for every thread)."""
        return self.s_col[0][(i, 0, stage)]

    def col(self, stage, j, c):
        """Per-column kind: the scale of the thread's column 8j + c."""
        return self.s_col[0][(self.col0 + 8 * j + c, 0, stage)]

    @cute.jit
    def load(self, stage, k, dst: ScaleRegs, cols: cutlass.Constexpr = True):
        """Copy K block ``k``'s scales of the thread's rows and (``cols``) columns from ``stage`` to
        ``dst``."""
        for r in cutlass.range_constexpr(2):
            dst.row[r] = self.row(stage, r)
        if cutlass.const_expr(cols and self.per_col and self.col_group > 1):
            # every thread reads the same tile_n / col_group scales (shared-memory broadcasts)
            for i in cutlass.range_constexpr(cute.size(dst.col)):
                dst.col[i] = self.group(stage, i)
        elif cutlass.const_expr(cols and self.per_col):
            for j in cutlass.range_constexpr(cute.size(dst.col) // 2):
                for c in cutlass.range_constexpr(2):
                    dst.col[2 * j + c] = self.col(stage, j, c)
        elif cutlass.const_expr(cols):
            for i in cutlass.range_constexpr(len(self.s_col)):
                dst.col[i] = self.s_col[i][(0, k % self.kbox, stage)]
