"""CuTe DSL building blocks shared by lowprec's kernels (no torch import anywhere below)."""
