"""Eager host time of an empty torch.library custom op on this torch (µs per call)."""
import time

import torch


@torch.library.custom_op("overhead_probe::f", mutates_args=())
def f(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return a.new_empty(a.shape), b.new_empty(b.shape)


@torch.library.custom_op("overhead_probe::outer", mutates_args=())
def outer(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return f(a, b)


outer.register_autograd(lambda ctx, x, y: (x, y))


def per_call(fn, n=2000):
    for _ in range(100):
        fn()
    s = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - s) / n * 1e6


dev = "cuda" if torch.cuda.is_available() else "cpu"
a, b = torch.randn(4, 4, device=dev), torch.randn(4, device=dev)
print(torch.__version__, dev)
print("two new_empty", per_call(lambda: (a.new_empty(a.shape), b.new_empty(b.shape))))
print("custom op", per_call(lambda: f(a, b)))
print("nested custom ops + autograd", per_call(lambda: outer(a, b)))
