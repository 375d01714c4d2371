"""torch 2.13: ``torch.compile(dynamic=True)`` fails (dynamo ``AssertionError: lift_tracked_freevar_to_input
should not be called on root SubgraphTracer``) when two ``autograd.Function`` calls read the same
Python float attribute: with ``specialize_float=False`` (dynamic=True's default) the float becomes a
graph input cached for the first call's subgraph, and the second cannot lift it. No lowprec involved;
lowprec's training layers (FP8Linear, FP8SwiGLUMLP, MoE) read the format constants this way, so two
of them in a row hit it under ``dynamic=True`` (README: use the default ``dynamic=None``,
``torch._dynamo.mark_dynamic``, or ``torch._dynamo.config.specialize_float = True``).
    python benchmarks/dynamo_symfloat_repro.py [backend]"""

import sys
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Format:
    max: float


E4M3 = Format(448.0)


class Scale(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, fmt):
        return x / torch.full((), fmt.max, dtype=x.dtype)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def twice(x):
    return Scale.apply(Scale.apply(x, E4M3), E4M3)


x = torch.randn(4, 8, requires_grad=True)
try:
    torch.compile(twice, dynamic=True, fullgraph=True, backend=sys.argv[1] if len(sys.argv) > 1 else "eager")(x)
    print(f"torch {torch.__version__}: compiled")
except Exception as err:  # noqa: BLE001 (the repro reports whatever dynamo raises)
    print(f"torch {torch.__version__}: {type(err).__name__}: {str(err).splitlines()[0]}")
