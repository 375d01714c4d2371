"""Ops on a CUDA device that is not the current one (a model split over GPUs, as transformers'
``device_map="auto"`` places it): each kernel launches on its operands' device and gives what it
gives there as the current device (to 1e-3: a backward's atomics may sum in another order; a
launch on the wrong device gives garbage or a fault)."""

import pytest
import torch
from torch import nn

import lowprec
from lowprec.metrics import rel_l2
from lowprec.moe import NVFP4InferenceMoE
from lowprec.nn import FP8InferenceLinear, FP8Linear, NVFP4InferenceLinear

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
    moe = lowprec.moe.MoE(512, 256, 4, 2, dtype=torch.bfloat16).to(device)
    xd = x.to(device, torch.bfloat16).requires_grad_()
    moe(xd).float().square().sum().backward()
    out += [xd.grad, moe.w1.grad]
    q, k, v = (torch.randn(2, h, 300, 128).to(device, torch.bfloat16) for h in (8, 2, 2))  # GQA, a tail
    q.requires_grad_()
    o = lowprec.attention(q, k, v, causal=True, quant="fp8")
    o.float().square().sum().backward()
    out += [o, q.grad, lowprec.attention(q[:, :, :1], k, v, quant="fp8")]  # decode: split-KV
    torch.cuda.synchronize(device)
    return [t.detach().cpu() for t in out]


@gpu
@needs_gpu
@needs_two_gpus
def test_fp8_ops_on_a_device_that_is_not_the_current_one():
    """FP8 quantization, GEMM, linear layers, the MoE and attention, forward and backward."""
    torch.cuda.set_device(0)
    first, second = _fp8_results("cuda:0"), _fp8_results("cuda:1")
    assert torch.cuda.current_device() == 0
    for i, (a, b) in enumerate(zip(first, second)):
        assert rel_l2(b, a) < 1e-3, f"result {i} differs on cuda:1"


def _fp4_results(device: str) -> list[torch.Tensor]:
    torch.manual_seed(0)
    linear, x = nn.Linear(512, 384), torch.randn(256, 512)
    out = []
    for recipe in ("nvfp4", "mxfp4"):
        q = lowprec.quantize(linear.weight.detach().to(device), recipe)
        out += [q.data, q.scale.view(torch.uint8), q.dequantize()]
    layer = NVFP4InferenceLinear.from_linear(linear.to(device))  # quantized and packed on the device
    moe = NVFP4InferenceMoE.from_moe(lowprec.moe.MoE(512, 256, 4, 2, dtype=torch.bfloat16).to(device))
    with torch.no_grad():
        xd = x.to(device, torch.bfloat16)
        out += [layer(xd[:4]), layer(xd), moe(xd[:4]), moe(xd)]  # weight-only kernels; decoded weight + cuBLAS
    torch.cuda.synchronize(device)
    return [t.detach().cpu() for t in out]


@gpu
@needs_gpu
@needs_two_gpus
def test_fp4_ops_on_a_device_that_is_not_the_current_one():
    """Session 55 found NVFP4 / MXFP4 codes quantized on cuda:1 wrong (``torch.ldexp`` there) and
    the NVFP4 layer faulting; every op now runs with its operands' device current."""
    torch.cuda.set_device(0)
    first, second = _fp4_results("cuda:0"), _fp4_results("cuda:1")
    assert torch.cuda.current_device() == 0
    for i, (a, b) in enumerate(zip(first, second)):
        assert rel_l2(b.float(), a.float()) < 1e-3, f"result {i} differs on cuda:1"
    w = torch.randn(384, 512, generator=torch.Generator().manual_seed(0))
    for recipe in ("nvfp4", "mxfp4"):
        expect, got = lowprec.quantize(w, recipe), lowprec.quantize(w.to("cuda:1"), recipe)
        assert torch.equal(got.data.cpu(), expect.data), recipe
        assert torch.equal(got.scale.cpu().view(torch.uint8), expect.scale.view(torch.uint8)), recipe
