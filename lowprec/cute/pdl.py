"""Programmatic dependent launch (CuTe DSL, sm_90 and later)."""

from __future__ import annotations

import cutlass.cute as cute


@cute.jit
def after_previous_grid():
    """Programmatic dependent launch (kernels launched with ``use_pdl=True``): the CTA may start
    while the previous kernel on the stream drains; wait for that grid before touching global
    memory, then let the next kernel's CTAs launch as this grid's leave."""
    cute.arch.griddepcontrol_wait()
    cute.arch.griddepcontrol_launch_dependents()
