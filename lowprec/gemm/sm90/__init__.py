"""Hopper (sm_90a) kernels of the GEMM family. Importing this package does not import cutlass."""
