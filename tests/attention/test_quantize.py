"""The FP8 attention pre-pass: the kernel's operands, in the recipes' exact arithmetic."""

import math

import pytest
import torch

import lowprec
from lowprec import metrics
from lowprec.attention import ATTN_QK_RECIPE, quantize_kv_cache, quantize_qkv
from lowprec.attention import quantize as attention_quantize
from lowprec.attention.quantize import hadamard_rotation
from lowprec.attention.reference import attention_reference, dense_rescale_slack, fp8_forward_reference, lse_correction


def _qkv(b=2, h=4, hkv=2, sq=200, sk=300, d=64, dv=None, seed=0, k_offset=0.0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, sq, d, generator=g)
    k = torch.randn(b, hkv, sk, d, generator=g) + k_offset
    v = torch.randn(b, hkv, sk, dv or d, generator=g)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def test_contract_shapes_dtypes_and_layouts():
    q, k, v = _qkv(sq=200, sk=300, dv=32)
    x = quantize_qkv(q, k, v)
    assert x.q.shape == (2, 4, 200, 64) and x.q.dtype == torch.float8_e4m3fn and x.q.is_contiguous()
    assert x.q_scale.shape == (2, 4, 2) and x.q_scale.dtype == torch.float32
    assert x.k.shape == (2, 2, 300, 64) and x.k_scale.shape == (2, 2, 3)
    assert x.v_t.shape == (2, 2, 32, 304) and x.v_t.is_contiguous() and x.v_scale.shape == (2, 2, 32)
    assert x.k_mean.shape == (2, 2, 64) and x.k_mean.dtype == torch.float32
    assert (x.v_t[..., 300:].float() == 0).all()  # zero padding to a multiple of 16 tokens


def test_scales_are_the_recipes_and_k_is_smoothed():
    q, k, v = _qkv(k_offset=3.0)
    x = quantize_qkv(q, k, v)
    ref_q = lowprec.quantize(q, ATTN_QK_RECIPE)
    assert torch.equal(x.q.view(torch.uint8), ref_q.data.view(torch.uint8))
    assert torch.equal(x.q_scale, ref_q.scale.squeeze(-1))
    mean = k.mean(dim=-2)
    torch.testing.assert_close(x.k_mean, mean)
    ref_k = lowprec.quantize(k - mean[:, :, None], ATTN_QK_RECIPE)
    assert torch.equal(x.k.view(torch.uint8), ref_k.data.view(torch.uint8))
    ref_v = lowprec.quantize(v.transpose(-1, -2), "fp8_rowwise")
    assert torch.equal(x.v_t[..., :300].view(torch.uint8), ref_v.data.view(torch.uint8))
    assert torch.equal(x.v_scale, ref_v.scale.squeeze(-1))
    # per-block scales: amax / 448 of each 128-token block of each head
    blk = q[0, 1, 128:200].abs().amax() / 448
    assert x.q_scale[0, 1, 1] == blk


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("sq,d", [(256, 64), (256, 128), (384, 128), (256, 256), (200, 128), (1, 128), (100, 64)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_prepass_on_the_quantize_kernels_recipes_is_the_attention_recipe(sq, d, dtype, device):
    """Where the pre-pass quantizes Q and K rowwise on the [B·H·S/128, 128·D] view and Vᵀ rowwise
    (on Hopper the quantize kernels), the bits are the attention recipe's (reference arithmetic)."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    q, k, v = (t.to(device) for t in _qkv(sq=sq, sk=sq, d=d, k_offset=1.0, dtype=dtype))
    x = quantize_qkv(q, k, v)
    ref_q = lowprec.quantize(q.float(), ATTN_QK_RECIPE)
    assert torch.equal(x.q.view(torch.uint8), ref_q.data.view(torch.uint8))
    assert torch.equal(x.q_scale, ref_q.scale.squeeze(-1))
    # smoothing: K minus its FP32 token mean (the kernel sums in its own order), the difference in FP32
    torch.testing.assert_close(x.k_mean, k.sum(-2, dtype=torch.float32) / sq, rtol=1e-6, atol=1e-6)
    ref_k = lowprec.quantize(k.float() - x.k_mean[:, :, None], ATTN_QK_RECIPE)
    assert torch.equal(x.k.view(torch.uint8), ref_k.data.view(torch.uint8))
    assert torch.equal(x.k_scale, ref_k.scale.squeeze(-1))
    ref_v = lowprec.quantize(v.float().transpose(-1, -2), "fp8_rowwise")
    assert torch.equal(x.v_t[..., :sq].view(torch.uint8), ref_v.data.view(torch.uint8))
    assert torch.equal(x.v_scale, ref_v.scale.squeeze(-1))


def test_smoothing_off_and_empty_keys():
    q, k, v = _qkv(sk=0)
    x = quantize_qkv(q, k, v)
    assert x.k.shape[-2] == 0 and x.k_scale.shape[-1] == 0 and x.v_t.shape[-1] == 0
    assert (x.k_mean == 0).all()  # the mean of no keys is 0, not NaN
    q, k, v = _qkv(k_offset=2.0)
    x = quantize_qkv(q, k, v, smooth=False)
    assert (x.k_mean == 0).all()
    assert torch.equal(x.k.view(torch.uint8), lowprec.quantize(k, ATTN_QK_RECIPE).data.view(torch.uint8))


def test_reference_is_prepass_then_kernel_math_then_correction():
    q, k, v = _qkv(k_offset=1.0, dtype=torch.bfloat16)
    out, lse = attention_reference(q, k, v, True, 0.125, "fp8")
    x = quantize_qkv(q, k, v)
    o2, l2 = fp8_forward_reference(x.q, x.q_scale, x.k, x.k_scale, x.v_t, x.v_scale, True, 0.125)
    assert torch.equal(out, o2.to(torch.bfloat16))
    assert torch.equal(lse, l2 + lse_correction(q, x.k_mean, 0.125))
    # the kernel's LSE is that of the smoothed scores
    s = (q.float() @ (k.float() - x.k_mean[:, :, None]).repeat_interleave(2, 1).transpose(-1, -2)) * 0.125
    mask = torch.ones(200, 300, dtype=torch.bool).tril(100)
    exact_smoothed = torch.logsumexp(s.masked_fill(~mask, -math.inf), -1)
    assert (l2 - exact_smoothed).abs().mean() < 0.02


def test_hadamard_rotation_is_orthogonal_and_seeded():
    for d in (64, 128, 256):
        m = hadamard_rotation(d).double()
        torch.testing.assert_close(m @ m.T, torch.eye(d, dtype=torch.float64), atol=1e-6, rtol=0)
        torch.testing.assert_close(m.abs(), torch.full_like(m, 1 / math.sqrt(d)))
    assert torch.equal(hadamard_rotation(64), hadamard_rotation(64))
    with pytest.raises(ValueError, match="power-of-two"):
        hadamard_rotation(96)


def test_incoherent_processing_reduces_error_on_outliers():
    """FA3's outlier inputs: N(0,1) + N(0,100)·Bernoulli(0.001) for Q, K, V."""
    g = torch.Generator().manual_seed(0)

    def outliers(*shape):
        x = torch.randn(*shape, generator=g)
        return x + torch.randn(*shape, generator=g) * 10 * (torch.rand(*shape, generator=g) < 1e-3)

    q, k, v = (outliers(1, 4, 512, 128) for _ in range(3))
    exact = attention_reference(q.double(), k.double(), v.double(), False, 128 ** -0.5, None)[0]
    plain = lowprec.attention(q, k, v, quant="fp8")
    rotated = lowprec.attention(q, k, v, quant="fp8", incoherent=True)
    e_plain, e_rot = metrics.rmse(plain, exact), metrics.rmse(rotated, exact)
    assert e_rot < 0.85 * e_plain, (e_rot, e_plain)
    # the LSE stays that of the unrotated, unsmoothed scores
    _, lse = lowprec.attention(q, k, v, quant="fp8", incoherent=True, return_lse=True)
    _, lse_exact = lowprec.attention(q, k, v, return_lse=True)
    assert (lse - lse_exact).abs().mean() < 0.02


def test_incoherent_needs_power_of_two_and_fp8():
    q, k, v = _qkv(d=48)
    with pytest.raises(ValueError, match="power-of-two"):
        lowprec.attention(q, k, v, quant="fp8", incoherent=True)
    with pytest.raises(ValueError, match="incoherent"):
        lowprec.attention(*_qkv(), incoherent=True)


def test_kv_cache_inputs_are_taken_as_quantized():
    q, k, v = _qkv(sq=3, sk=300)  # Sk not a multiple of 16: Vᵀ codes padded, not requantized
    k_q, v_q = quantize_kv_cache(k, v)
    assert k_q.recipe == ATTN_QK_RECIPE and v_q.shape == (2, 2, 64, 300) and v_q.recipe.name == "fp8_rowwise"
    out, lse = lowprec.attention(q, k_q, v_q, quant="fp8", return_lse=True)
    x = quantize_qkv(q, k, v, smooth=False)
    assert torch.equal(k_q.data.view(torch.uint8), x.k.view(torch.uint8))
    # GQA at 3 queries: the packed two-warpgroup launch, whose P scale the reference is given
    o2, l2 = fp8_forward_reference(x.q, x.q_scale, x.k, x.k_scale, x.v_t, x.v_scale, False, 0.125,
                                   rescale_slack=dense_rescale_slack(x.q, x.k))
    assert dense_rescale_slack(x.q, x.k) == 0
    assert torch.equal(out, o2) and torch.equal(lse, l2)
    # a quantized input stands for its dequantized value
    kd, vd = k_q.dequantize(torch.float32), v_q.dequantize(torch.float32).transpose(-1, -2)
    exact, lse_exact = lowprec.attention(q, kd, vd, return_lse=True)
    assert metrics.cos_sim(out, exact) > 0.999 and (lse - lse_exact).abs().mean() < 0.01


def test_quantized_inputs_errors():
    q, k, v = _qkv(sq=3)
    k_q, v_q = quantize_kv_cache(k, v)
    with pytest.raises(ValueError, match="k: a QuantizedTensor"):
        lowprec.attention(q, lowprec.quantize(k, "fp8_rowwise"), v_q, quant="fp8")
    with pytest.raises(ValueError, match="v: a QuantizedTensor"):
        lowprec.attention(q, k_q, lowprec.quantize(v.transpose(-1, -2), "fp8_block1x128"), quant="fp8")
    with pytest.raises(ValueError, match="needs quant='fp8'"):
        lowprec.attention(q, k_q, v_q)
    with pytest.raises(ValueError, match="q: requires grad"):
        lowprec.attention(q.requires_grad_(), k_q, v_q, quant="fp8")
    with pytest.raises(ValueError, match="incoherent"):
        lowprec.attention(q.detach(), k_q, v_q, quant="fp8", incoherent=True)


def test_strided_inputs_give_contiguous_operands():
    q, k, v = _qkv()
    qs, ks, vs = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))  # [B, S, H, D] memory
    x, y = quantize_qkv(qs, ks, vs), quantize_qkv(q, k, v)
    for a, b in zip(x, y):
        assert a.is_contiguous() and torch.equal(a.view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a,
                                                 b.view(torch.uint8) if b.dtype == torch.float8_e4m3fn else b)


def test_no_keys_quantize_as_documented():
    """Sk = 0: V's scales are [B, Hkv, Dv] (ones), an empty quantized cache attends to 0 / -inf."""
    q, k, v = torch.randn(2, 4, 5, 64), torch.zeros(2, 2, 0, 64), torch.zeros(2, 2, 0, 32)
    assert quantize_qkv(q, k, v).v_scale.shape == (2, 2, 32)
    kq, vq = quantize_kv_cache(k, v)
    out, lse = lowprec.attention(q, kq, vq, quant="fp8", return_lse=True)
    assert out.shape == (2, 4, 5, 32) and (out == 0).all() and torch.isneginf(lse).all()


@pytest.mark.parametrize("sk,dtype", [(200, torch.float32), (64, torch.float64), (128, torch.float32)])
def test_quantize_kv_cache_carries_no_gradient(sk, dtype):
    """A quantized KV cache is taken as it is, without gradients: its scales must not keep the
    caller's graph (else attention over it requires grad and backpropagates through the scales)."""
    g = torch.Generator().manual_seed(0)
    k = torch.randn(1, 2, sk, 64, generator=g, dtype=dtype, requires_grad=True)
    v = torch.randn(1, 2, sk, 64, generator=g, dtype=dtype, requires_grad=True)
    kq, vq = quantize_kv_cache(k, v)
    assert not any(t.requires_grad for t in (kq.data, kq.scale, vq.data, vq.scale))
    out, lse = lowprec.attention(torch.randn(1, 2, 3, 64, generator=g, dtype=dtype), kq, vq, quant="fp8",
                                 return_lse=True)
    assert not out.requires_grad and not lse.requires_grad
    ref_k, _ = quantize_kv_cache(k.detach(), v.detach())
    assert torch.equal(kq.scale, ref_k.scale) and torch.equal(kq.data.view(torch.uint8), ref_k.data.view(torch.uint8))


def test_quantize_kv_cache_checks_its_inputs_by_name():
    k = torch.randn(1, 2, 5, 16)
    with pytest.raises(ValueError, match=r"v: expected \[B, Hkv, Sk\] = \(1, 2, 5\)"):
        quantize_kv_cache(k, torch.randn(1, 2, 7, 16))   # not cut to K's 5 tokens silently
    with pytest.raises(ValueError, match=r"v: expected \[B, Hkv, Sk\]"):
        quantize_kv_cache(k, torch.randn(1, 1, 5, 16))
    with pytest.raises(ValueError, match="k: expected a 4-D float16/bfloat16/float32/float64 tensor"):
        quantize_kv_cache(k[0], torch.randn(2, 5, 16))
    kq, vq = quantize_kv_cache(k, torch.randn(1, 2, 5, 8))  # Dv may differ from D
    assert tuple(kq.shape) == (1, 2, 5, 16) and tuple(vq.shape) == (1, 2, 8, 5)
    kq_in = lowprec.quantize(k, "fp8_block1x128")  # a QuantizedTensor: its dequantized value
    assert tuple(quantize_kv_cache(kq_in, torch.randn(1, 2, 5, 8))[0].shape) == (1, 2, 5, 16)


def test_raw_float8_tensors_are_refused_by_name():
    """float8 codes carry no scale: they were taken as float tensors, then refused by the quantizer
    as a TypeError naming its own argument "x"."""
    x = torch.randn(1, 2, 16, 64)
    f8 = x.to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="k: expected a 4-D float16/bfloat16/float32/float64 tensor, got "
                                         "torch.float8_e4m3fn"):
        quantize_qkv(x, f8, x)
    with pytest.raises(ValueError, match="v: expected a 4-D float16/bfloat16/float32/float64 tensor or "
                                         "QuantizedTensor"):
        quantize_kv_cache(x, f8)


@pytest.mark.parametrize("v_shape", [(1, 2, 40, 64), (1, 1, 64, 64), (2, 2, 64, 64)])
def test_quantize_qkv_refuses_v_of_other_tokens(v_shape):
    q, k = torch.randn(1, 2, 64, 64), torch.randn(1, 2, 64, 64)
    with pytest.raises(ValueError, match=r"v: expected \[B, Hkv, Sk\]"):
        quantize_qkv(q, k, torch.randn(v_shape))


def test_quantize_qkv_refuses_q_of_other_batch_or_head_dim():
    k, v = torch.randn(1, 2, 64, 64), torch.randn(1, 2, 64, 32)
    for q in (torch.randn(2, 2, 64, 64), torch.randn(1, 2, 64, 32)):
        with pytest.raises(ValueError, match="q: expected batch"):
            quantize_qkv(q, k, v)


def test_quantize_qkv_takes_matching_inputs():
    x = quantize_qkv(torch.randn(1, 4, 16, 64), torch.randn(1, 2, 64, 64), torch.randn(1, 2, 64, 32))
    assert x.k.shape == (1, 2, 64, 64) and x.v_t.shape == (1, 2, 32, 64)


@pytest.mark.parametrize("sk", [7, 0])
def test_quantized_inputs_empty_batch(sk):
    q, k, v = torch.randn(0, 4, 5, 64), torch.randn(0, 2, sk, 64), torch.randn(0, 2, sk, 64)
    k_q, v_q = quantize_kv_cache(k, v)
    out, lse = lowprec.attention(q, k_q, v_q, causal=True, quant="fp8", return_lse=True)
    assert out.shape == (0, 4, 5, 64) and lse.shape == (0, 4, 5)
    out = lowprec.attention(lowprec.quantize(q, ATTN_QK_RECIPE), k, v, quant="fp8")  # a quantized Q too
    assert out.shape == (0, 4, 5, 64)


def test_rotation_first_built_under_inference_mode_serves_autograd_later():
    """The cached rotation is a normal tensor even when an inference_mode call builds it first: a
    later call on a tensor that requires grad quantizes (was: 'Inference tensors cannot be saved for
    backward' for the rest of the process)."""
    attention_quantize._cached_rotation.cache_clear()
    q = torch.randn(1, 2, 128, 64)
    with torch.inference_mode():
        first = quantize_qkv(q, q, q, incoherent=True)
    assert not hadamard_rotation(64, q.device).is_inference()
    x = q.clone().requires_grad_()
    again = quantize_qkv(x, x, x, incoherent=True)
    assert torch.equal(again.q.float(), first.q.float()) and torch.equal(again.k_scale, first.k_scale)
