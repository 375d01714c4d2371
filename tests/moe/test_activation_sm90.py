"""The MoE layer's fused SwiGLU + 1x128 quantization on Hopper, and the layer forward with the fused
kernels (token packing with the tokens' own codes, SwiGLU, unpack) against the unfused torch steps;
the unquantized SwiGLU (``gated_activation``, NVFP4 experts' rows) against the torch ops.

Compiles for sm_90a on any machine (``tests/moe/test_kernels_sm90.py`` compiles every entry of
``KERNELS``); on the GPU the kernel must match the torch ops bit for bit.
"""

import pytest
import torch

import lowprec
from lowprec.moe import core, experts, gather_rows
from lowprec.moe.core import _quantized_activation, gated_activation
from lowprec.moe.sm90.config import swiglu_rows_unsupported, swiglu_unsupported
from lowprec.moe.sm90.interface import KERNELS

from ..quant.test_sm90 import _poison_allocator


def test_swiglu_kernels_are_shipped_and_compiled_in_ci():
    assert {"swiglu_1x128", "swiglu_h_1x128", "swiglu_rows"} <= set(KERNELS)


def test_unquantized_swiglu_kernel_eligibility():
    h = torch.randn(8, 512, dtype=torch.bfloat16)
    assert swiglu_rows_unsupported(h) is None
    assert "multiple of 16" in swiglu_rows_unsupported(h[:, :48])
    assert "dtype" in swiglu_rows_unsupported(h.double())
    assert "contiguous" in swiglu_rows_unsupported(h[:, :256].t().contiguous().t())


@pytest.mark.parametrize("activation", ["swiglu", "geglu"])
def test_gated_activation_is_the_fp32_activation_rounded_once(activation, monkeypatch):
    monkeypatch.setenv("LOWPREC_BACKEND", "auto")
    h = torch.randn(6, 96, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    a = gated_activation(activation, h)
    assert a.dtype == h.dtype and a.shape == (6, 48)
    assert torch.equal(a, core._activation(activation, h.float()).to(torch.bfloat16))


def test_swiglu_kernel_eligibility():
    h = torch.randn(8, 512, dtype=torch.bfloat16)
    w = torch.rand(8)
    assert swiglu_unsupported(h, w) is None
    assert "multiple of 16" in swiglu_unsupported(h[:, :48], w)
    assert "float32" in swiglu_unsupported(h, w.double())
    assert "dtype" in swiglu_unsupported(h.double(), w)


@pytest.mark.parametrize("activation", ["swiglu", "geglu"])
def test_cpu_takes_the_torch_ops(activation, monkeypatch):  # and geglu everywhere: it has no kernel
    g = torch.Generator().manual_seed(0)
    h = torch.randn(20, 512, generator=g, dtype=torch.bfloat16)
    w = torch.rand(20, generator=g)
    monkeypatch.setenv("LOWPREC_BACKEND", "auto")
    a, hq = _quantized_activation(activation, h, w)
    ref = core._activation(activation, h.float()) * w[:, None]
    assert torch.equal(a.dequantize(torch.float32), lowprec.quantize(ref, "fp8_block1x128").dequantize(torch.float32))
    assert a.dtype == torch.float32 and hq.dtype == torch.bfloat16 and hq.shape == h.shape
    _same(hq, lowprec.quantize(h, "fp8_block1x128"))


def _same(out, ref):
    assert out.shape == ref.shape and out.dtype == ref.dtype and out.recipe == ref.recipe
    assert torch.equal(out.data.view(torch.uint8), ref.data.view(torch.uint8))
    assert torch.equal(out.scale, ref.scale)


def _both(h, w, monkeypatch):
    monkeypatch.setenv("LOWPREC_BACKEND", "reference")
    ref = _quantized_activation("swiglu", h, w)
    monkeypatch.setenv("LOWPREC_BACKEND", "kernel")
    _poison_allocator()
    out = _quantized_activation("swiglu", h, w)
    for o, r in zip(out, ref):
        _same(o, r)
    assert out[0].scale.stride(0) == 1 and out[1].scale.stride(0) == 1  # MN-major, as the GEMM reads them
    return out


def _h(rows, ffn, dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    h = torch.randn(rows, 2 * ffn, device="cuda", generator=g) * torch.exp(2 * torch.randn(rows, 1, device="cuda",
                                                                                          generator=g))
    h[0, :5] *= 100  # outliers
    if rows > 3:
        h[1] = 0  # a padding row, as the GEMM writes them
        h[2, :ffn] = -torch.linspace(1, 200, ffn)  # exp(-gate) overflows: silu -> -0
        h[3, :ffn] = torch.linspace(1, 200, ffn)  # exp(-gate) underflows
    return h.to(dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(1, 16), (300, 1040), (300, 1024), (4096, 2048), (1000, 80)])
def test_swiglu_kernel_matches_torch(shape, dtype, monkeypatch):
    rows, ffn = shape
    h = _h(rows, ffn, dtype, seed=rows + ffn)
    w = torch.rand(rows, device="cuda", generator=torch.Generator(device="cuda").manual_seed(1))
    w[1 % rows] = 0  # padding rows weigh 0
    _both(h, w, monkeypatch)


@pytest.mark.gpu
def test_swiglu_kernel_every_bf16_gate(monkeypatch):
    """Each finite bf16 gate value alone in its 128-block (up = 1, w = 1): the block's scale is
    silu(gate) / 448, so silu itself is compared, not only its 3-bit FP8 code."""
    bits = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16)
    gates = bits.view(torch.bfloat16).cuda()
    gates = gates[torch.isfinite(gates)]
    h = torch.zeros(gates.numel(), 256, dtype=torch.bfloat16, device="cuda")
    h[:, 0] = gates
    h[:, 128] = 1
    _both(h, torch.ones(gates.numel(), device="cuda"), monkeypatch)
    h[:, 128] = torch.randn(gates.numel(), device="cuda", generator=torch.Generator(device="cuda").manual_seed(2))
    _both(h, torch.rand(gates.numel(), device="cuda"), monkeypatch)


@pytest.mark.gpu
def test_swiglu_kernel_does_not_sync(monkeypatch):
    monkeypatch.setenv("LOWPREC_BACKEND", "kernel")
    h = _h(1024, 256, torch.bfloat16, seed=3)
    w = torch.rand(1024, device="cuda")
    expected = _quantized_activation("swiglu", h, w)  # compiles the kernel
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = _quantized_activation("swiglu", h, w)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for o, r in zip(out, expected):
        _same(o, r)


def _unfused_pack_tokens(x, routing, recipe):
    """The layer's forward before pack_tokens: quantize the tokens, then gather rows with torch."""
    xq = lowprec.quantize(x, recipe, check_finite=False)
    return gather_rows(xq, routing), xq, routing.group_ends


def _unfused_activation(name, h, row_w):
    """The layer's forward before the fused kernel: torch SwiGLU in FP32, then two quantizations."""
    a = core._activation(name, h.float()) * row_w[:, None]
    return (lowprec.quantize(a, "fp8_block1x128", check_finite=False),
            lowprec.quantize(h, "fp8_block1x128", check_finite=False))


@pytest.mark.gpu
@pytest.mark.parametrize("ffn", [256, 192])  # h quantized in the SwiGLU kernel (F % 128 == 0), or separately
@pytest.mark.parametrize("capacity_factor", [None, 0.75])
def test_layer_forward_and_gradients_unchanged_by_the_fused_kernels(ffn, capacity_factor, monkeypatch):
    monkeypatch.setenv("LOWPREC_BACKEND", "kernel")
    g = torch.Generator(device="cuda").manual_seed(ffn)
    tokens, hidden, num_experts, k = 512, 256, 8, 2
    x = torch.randn(tokens, hidden, device="cuda", generator=g).to(torch.bfloat16)
    weights = torch.rand(tokens, k, device="cuda", generator=g)
    ids = torch.rand(tokens, num_experts, device="cuda", generator=g).argsort(dim=1)[:, :k]
    w1 = torch.randn(num_experts, 2 * ffn, hidden, device="cuda", generator=g) / hidden**0.5
    w2 = torch.randn(num_experts, hidden, ffn, device="cuda", generator=g) / ffn**0.5
    dy = torch.randn(tokens, hidden, device="cuda", generator=g).to(torch.bfloat16)

    def run():
        leaves = [t.clone().requires_grad_() for t in (x, weights, w1, w2)]
        y = experts(*leaves[:2], ids, *leaves[2:], capacity_factor=capacity_factor)
        y.backward(dy)
        return [y.detach()] + [t.grad for t in leaves]

    fused = run()
    monkeypatch.setattr(core, "pack_tokens", _unfused_pack_tokens)
    monkeypatch.setattr(core, "_quantized_activation", _unfused_activation)
    unfused = run()
    for name, a, b in zip(("y", "dx", "dweights", "dw1", "dw2"), fused, unfused):
        assert torch.equal(a, b), name


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(1, 16), (8, 768), (300, 1040), (64, 2048), (3, 4096)])
def test_unquantized_swiglu_kernel_matches_torch(shape, dtype, monkeypatch):
    rows, ffn = shape
    h = _h(rows, ffn, dtype, seed=rows + ffn)
    expected = core._activation("swiglu", h.float()).to(dtype)
    monkeypatch.setenv("LOWPREC_BACKEND", "kernel")
    _poison_allocator()
    a = gated_activation("swiglu", h)
    assert a.dtype == dtype and a.shape == (rows, ffn)
    assert torch.equal(a.view(torch.uint8), expected.view(torch.uint8))  # bits: -0 and NaN included


@pytest.mark.gpu
def test_unquantized_swiglu_kernel_every_bf16_gate(monkeypatch):
    bits = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16)
    gates = bits.view(torch.bfloat16).cuda()
    gates = gates[torch.isfinite(gates)]
    h = torch.empty(gates.numel(), 32, dtype=torch.bfloat16, device="cuda")
    h[:, :16] = gates[:, None]
    h[:, 16:] = torch.randn(gates.numel(), 16, device="cuda", generator=torch.Generator(device="cuda").manual_seed(4))
    expected = core._activation("swiglu", h.float()).to(torch.bfloat16)
    monkeypatch.setenv("LOWPREC_BACKEND", "kernel")
    a = gated_activation("swiglu", h)
    assert torch.equal(a.view(torch.int16), expected.view(torch.int16))
