"""bench decode on the CPU: arguments, the weight-byte floor, and that each lowprec implementation
computes x · Wᵀ (the timing itself needs a GPU)."""

import pytest
import torch

from lowprec.bench import decode


def test_arguments_and_defaults():
    args = decode.parse_args([])
    assert args.ms == [1, 4, 16, 64, 256] and args.shapes == list(decode.SHAPES) and args.impls == list(decode.IMPLS)
    args = decode.parse_args(["--ms", "1,8", "--shapes", "256x512", "--impls", "bf16,lowprec-nvfp4"])
    assert (args.ms, args.shapes, args.impls) == ([1, 8], [(256, 512)], ["bf16", "lowprec-nvfp4"])
    with pytest.raises(SystemExit):
        decode.parse_args(["--impls", "int4"])


def test_weight_bytes():
    n, k = 4096, 4096
    assert decode.weight_bytes("bf16", n, k) == 2 * n * k
    assert decode.weight_bytes("lowprec-nvfp4", n, k) == n * k * 0.5625  # 4.5 bits
    assert decode.weight_bytes("lowprec-fp8", n, k) == n * k + 4 * (n // 128) * (k // 128)


@pytest.mark.parametrize("impl", ["bf16", "lowprec-fp8", "lowprec-nvfp4"])
def test_each_implementation_computes_the_product(impl):
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(256, 512, generator=g).to(torch.bfloat16) * 512 ** -0.5
    x = torch.randn(4, 512, generator=g).to(torch.bfloat16)
    with torch.no_grad():
        y = decode._make(impl, weight)(x)
    ref = x.float() @ weight.float().t()
    assert y.shape == (4, 256) and ((y.float() - ref).norm() / ref.norm()) < 0.15


def test_rotation_reads_more_than_l2_per_round():
    for impl in decode.IMPLS:
        for n, k in decode.SHAPES:
            nbytes = decode.weight_bytes(impl, n, k)
            copies = decode.rotation_copies(nbytes)
            assert copies * nbytes >= decode.ROTATE_BYTES and (copies - 1) * nbytes < decode.ROTATE_BYTES
    assert decode.rotation_copies(1e9) == 1
