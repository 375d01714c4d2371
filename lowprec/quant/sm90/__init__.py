"""Hopper quantize kernels (CuTe DSL). The kernels use no sm_90-only instructions."""
