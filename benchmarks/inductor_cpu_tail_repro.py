"""torch 2.13, CPU: inductor miscompiles ``x * g.repeat_interleave(128, 1)[:, :200]`` (a product
with a cut repeat_interleave: the block scales of a tail), wrong values in the tail block. No
lowprec involved; lowprec's reference quantize / dequantize of tails hit it under torch.compile on
the CPU (README: compile the reference with backend="aot_eager" there). CUDA (Triton) is fine.
    python benchmarks/inductor_cpu_tail_repro.py"""

import torch


def scaled(x, g):
    return x * g.repeat_interleave(128, 1)[:, :200]


x, g = torch.randn(8, 200), torch.rand(8, 2) + 0.5
bad = (torch.compile(scaled)(x, g) != scaled(x, g)).sum().item()
print(f"torch {torch.__version__}: {bad} of {x.numel()} values differ from eager")
