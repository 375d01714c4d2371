"""A tiny CuTe DSL kernel (y = x * s) used to test compilation and the kernel cache."""

import cutlass
import cutlass.cute as cute


@cute.kernel
def _scale_kernel(x: cute.Tensor, y: cute.Tensor, s: cutlass.Float32):
    tidx, _, _ = cute.arch.thread_idx()
    bidx, _, _ = cute.arch.block_idx()
    i = bidx * 128 + tidx
    if i < x.shape[0]:
        y[i] = x[i] * s


@cute.jit
def scale(x: cute.Tensor, y: cute.Tensor, s: cutlass.Float32, stream):
    n = x.shape[0]
    _scale_kernel(x, y, s).launch(grid=((n + 127) // 128, 1, 1), block=(128, 1, 1), stream=stream)


def fake_args():
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

    x = make_fake_compact_tensor(cutlass.Float32, (cute.sym_int(),))
    y = make_fake_compact_tensor(cutlass.Float32, (cute.sym_int(),))
    return x, y, cutlass.Float32(1.0), make_fake_stream()
