import time, torch

@torch.library.custom_op("probe::cop", mutates_args=())
def cop(x: torch.Tensor, d: torch.Tensor, s: torch.Tensor, fmt: str, n: int, k: int, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(x.shape)

lib = torch.library.Library("probe2", "DEF")
lib.define("lop(Tensor x, Tensor d, Tensor s, str fmt, SymInt n, SymInt k, Tensor? bias) -> Tensor")
def _impl(x, d, s, fmt, n, k, bias):
    return x.new_empty(x.shape)
lib.impl("lop", _impl, "CompositeExplicitAutograd")
@torch.library.register_fake("probe2::lop")
def _(x, d, s, fmt, n, k, bias):
    return x.new_empty(x.shape)

def per_call(fn, n=3000):
    for _ in range(200): fn()
    t = time.perf_counter()
    for _ in range(n): fn()
    return (time.perf_counter() - t) / n * 1e6

dev = "cuda" if torch.cuda.is_available() else "cpu"
x, d, s = torch.randn(4, 8, device=dev), torch.randn(8, device=dev), torch.randn(1, device=dev)
print("python fn", per_call(lambda: _impl(x, d, s, "nvfp4", 8, 8, None)))
print("custom_op", per_call(lambda: cop(x, d, s, "nvfp4", 8, 8, None)))
print("torch.ops custom_op .default", per_call(lambda: torch.ops.probe.cop.default(x, d, s, "nvfp4", 8, 8, None)))
print("Library op .default", per_call(lambda: torch.ops.probe2.lop.default(x, d, s, "nvfp4", 8, 8, None)))
with torch.no_grad():
    print("no_grad custom_op .default", per_call(lambda: torch.ops.probe.cop.default(x, d, s, "nvfp4", 8, 8, None)))
    print("no_grad Library op .default", per_call(lambda: torch.ops.probe2.lop.default(x, d, s, "nvfp4", 8, 8, None)))
