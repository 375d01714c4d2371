"""Ops on a CUDA device that is not the current one (a model split over GPUs, as transformers'
``device_map="auto"`` places it): each kernel launches on its operands' device and gives what it
gives there as the current device (to 1e-3: a backward's atomics may sum in another order; a
launch on the wrong device gives garbage or a fault)."""

import pytest
import torch
from torch import nn

import lowprec
from lowprec.metrics import rel_l2
from lowprec.nn import FP8InferenceLinear, FP8Linear

from ..hopper import gpu, needs_gpu

needs_two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")


def _fp8_results(device: str) -> list[torch.Tensor]:
    torch.manual_seed(0)
    linear, x = nn.Linear(512, 384), torch.randn(256, 512)
    out = []
    a = lowprec.quantize(x.to(device), "fp8_block1x128")
    out.append(lowprec.gemm(a, lowprec.quantize(linear.weight.detach().to(device), "fp8_block128x128")))
    train = FP8Linear.from_linear(linear, "fp8_block").to(device)  # shares linear's weight: moves it too
    xd = x.to(device, torch.bfloat16).requires_grad_()
    train(xd).float().square().sum().backward()
    out += [xd.grad, train.weight.grad]
    layer = FP8InferenceLinear.from_linear(linear)  # quantized on the device
    with torch.no_grad():
        out += [layer(x[:4].to(device, torch.bfloat16)), layer(x.to(device, torch.bfloat16))]  # weight-only; GEMM
    torch.cuda.synchronize(device)
    return [t.detach().cpu() for t in out]


@gpu
@needs_gpu
@needs_two_gpus
def test_fp8_ops_on_a_device_that_is_not_the_current_one():
    torch.cuda.set_device(0)
    first, second = _fp8_results("cuda:0"), _fp8_results("cuda:1")
    assert torch.cuda.current_device() == 0
    for i, (a, b) in enumerate(zip(first, second)):
        assert rel_l2(b, a) < 1e-3, f"result {i} differs on cuda:1"


@gpu
@needs_two_gpus
@pytest.mark.xfail(strict=True, reason="session 55, 2x H200: NVFP4 codes quantized on cuda:1 while cuda:0 is "
                                       "current differ from the CPU's (the scales agree); cause not isolated yet")
def test_nvfp4_quantize_on_a_device_that_is_not_the_current_one():
    torch.cuda.set_device(0)
    w = torch.randn(384, 512, generator=torch.Generator().manual_seed(0))
    expect = lowprec.quantize(w, "nvfp4")
    got = lowprec.quantize(w.to("cuda:1"), "nvfp4")
    assert torch.equal(got.data.cpu(), expect.data)
    assert torch.equal(got.scale.cpu().view(torch.uint8), expect.scale.view(torch.uint8))
