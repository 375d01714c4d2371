"""Hopper quantize kernels and the MoE unpack kernel (CuTe DSL). The kernels use no sm_90-only instructions."""
