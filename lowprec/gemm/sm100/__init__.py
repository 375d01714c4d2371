"""Blackwell (sm_100a) block-scaled GEMM kernels (MXFP8, NVFP4).

They are compiled and their SASS checked for sm_100a on CPU-only machines, but never run here
(no Blackwell GPU), so they are NOT registered with the kernel registry: nothing dispatches to
them. Importing this package does not import cutlass.
"""
