import math

import pytest
import torch

import lowprec
from lowprec import metrics
from lowprec.attention import attention_varlen, quantize_kv_cache


def _qkv(b=2, h=4, hkv=2, sq=200, sk=200, d=64, device="cpu", seed=0, k_offset=0.0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, sq, d, generator=g)
    k = torch.randn(b, hkv, sk, d, generator=g) + k_offset
    v = torch.randn(b, hkv, sk, d, generator=g)
    return q.to(device), k.to(device), v.to(device)


@pytest.mark.parametrize("causal", [False, True])
def test_exact_matches_sdpa(causal, device):
    q, k, v = _qkv(device=device)
    out = lowprec.attention(q, k, v, causal=causal)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), is_causal=causal)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_causal_is_bottom_right_aligned_and_empty_rows():
    q, k, v = _qkv(b=1, h=1, hkv=1, sq=6, sk=4, d=8)
    out, lse = lowprec.attention(q, k, v, causal=True, return_lse=True)
    # query i sees keys j <= i - 2: rows 0 and 1 see nothing
    assert (out[..., :2, :] == 0).all() and torch.isinf(lse[..., :2]).all() and (lse[..., :2] < 0).all()
    s = q @ k.transpose(-1, -2) / math.sqrt(8)
    mask = torch.arange(4)[None, :] <= torch.arange(6)[:, None] - 2
    p = torch.softmax(s.masked_fill(~mask, -math.inf)[..., 2:, :], -1)
    torch.testing.assert_close(out[..., 2:, :], p @ v)
    torch.testing.assert_close(lse[..., 2:], torch.logsumexp(s.masked_fill(~mask, -math.inf)[..., 2:, :], -1))


@pytest.mark.parametrize("causal", [False, True])
def test_fp8_emulation_close_to_exact(causal, device):
    q, k, v = _qkv(sq=300, sk=300, device=device, k_offset=2.0)
    exact, lse = lowprec.attention(q, k, v, causal=causal, return_lse=True)
    fp8, lse8 = lowprec.attention(q, k, v, causal=causal, quant="fp8", return_lse=True)
    assert metrics.cos_sim(fp8, exact) > 0.998
    assert metrics.rel_l2(fp8, exact) < 0.08
    assert (lse8 - lse).abs().mean() < 0.02 and (lse8 - lse).abs().max() < 0.2


def test_fp8_smoothing_makes_k_offset_irrelevant():
    q, k, v = _qkv(sq=130, sk=260)
    shift = torch.randn(1, 1, 1, 64, generator=torch.Generator().manual_seed(1)) * 5
    a, lse_a = lowprec.attention(q, k, v, quant="fp8", return_lse=True)
    b, lse_b = lowprec.attention(q, k + shift, v, quant="fp8", return_lse=True)
    # equal up to a few K codes whose rounding flips (k - mean(k) is not bit-exact under a shift):
    # over 20 shifts a flip moved one lse by at most 5e-4; unsmoothed FP8 differs by ~0.1 here
    assert metrics.rel_l2(b, a) < 2e-3
    lse_error = (lse_b - lse_a - (q @ shift.transpose(-1, -2)).squeeze(-1) / 8).abs()
    assert lse_error.mean() < 2e-5 and lse_error.max() < 2e-3


def test_fp8_quantizes_p():
    """P·V in FP8 differs from the FP32 product: the emulation is not the exact path renamed."""
    q, k, v = _qkv(b=1, h=1, hkv=1, sq=128, sk=128)
    exact = lowprec.attention(q, k, v)
    fp8 = lowprec.attention(q, k, v, quant="fp8")
    assert 1e-4 < metrics.rel_l2(fp8, exact) < 0.08


def test_fp8_lazy_rescaling():
    """The running max moves only when a block's max passes it by more than a factor 2**slack of p;
    P is scaled by 448 / 2**slack (never above 448). At head dims <= 128 that is the default."""
    from lowprec.attention.reference import fp8_forward_reference
    from lowprec.attention.sm90.config import RESCALE_SLACK, rescale_slack

    assert rescale_slack(64) == rescale_slack(128) == RESCALE_SLACK == 2 and rescale_slack(256) == 0
    # packed GQA decode (at most 128 packed rows) runs the two-level kernel; more rows, MHA: the default
    assert rescale_slack(128, 4, 1) == rescale_slack(64, 8, 16) == 0
    assert rescale_slack(128, 8, 32) == rescale_slack(128, 1, 1) == rescale_slack(128, 4, 200) == 2
    f8 = torch.float8_e4m3fn
    # one query, keys in blocks of 2 with scores (0, 0 | t, 0), V the identity: out[j] shows P8[j]
    q, q_scale = torch.ones(1, 1, 1, 1).to(f8), torch.ones(1, 1, 1)
    k = torch.tensor([0.0, 0.0, 1.0, 0.0]).view(1, 1, 4, 1).to(f8)
    v_t, v_scale = torch.eye(4).view(1, 1, 4, 4).to(f8), torch.ones(1, 1, 4)

    def run(t, slack):
        out, lse = fp8_forward_reference(q, q_scale, k, torch.tensor([[[1.0, t]]]), v_t, v_scale, False, 1.0,
                                         block=2, rescale_slack=slack)
        torch.testing.assert_close(lse, torch.tensor([[[math.log(3 + math.exp(t))]]]))
        return out.flatten()

    # 8x (three powers of two) moves the max: P8 = 112 at the new max, the first block rescaled
    torch.testing.assert_close(run(math.log(8), 2), torch.tensor([1 / 8, 1 / 8, 1, 1 / 8]) / 1.375)
    # 3x does not: the stale max keeps the first block; key 2's p = 3 is cast as 336 -> E4M3 320
    torch.testing.assert_close(run(math.log(3), 2), torch.tensor([1, 1, 320 / 112, 1]) / 6)
    # without slack the max moves at once: key 3's p = 1/3 is cast as 149.3 -> E4M3 144
    torch.testing.assert_close(run(math.log(3), 0), torch.tensor([1 / 3, 1 / 3, 1, 144 / 448]) / 2)
    assert torch.equal(run(math.log(3), None), run(math.log(3), 2))  # head dim 1: the default is lazy


def test_inputs_not_mutated_and_dtype_kept():
    q, k, v = (t.to(torch.bfloat16) for t in _qkv(sq=64, sk=64))
    before = [t.clone() for t in (q, k, v)]
    out = lowprec.attention(q, k, v, quant="fp8")
    assert out.dtype == torch.bfloat16
    assert all(torch.equal(a, b) for a, b in zip(before, (q, k, v)))


def test_errors():
    q, k, v = _qkv(h=3, hkv=2)
    with pytest.raises(ValueError, match="Hkv dividing"):
        lowprec.attention(q, k, v)
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="quant"):
        lowprec.attention(q, k, v, quant="int8")
    with pytest.raises(ValueError, match="4-D"):
        lowprec.attention(q[0], k, v)
    with pytest.raises(ValueError, match="v: expected"):
        lowprec.attention(q, k, v[:, :, :10])
    for quant in (None, "fp8"):  # no head dim: no score to scale (was a ZeroDivisionError)
        with pytest.raises(ValueError, match="q: expected a head dim D ≥ 1"):
            lowprec.attention(q[..., :0], k[..., :0], v, quant=quant)


@pytest.mark.parametrize("quant", [None, "fp8"])
def test_empty_keys_give_zero_and_minus_inf(quant):
    q, k, v = _qkv(sq=5, sk=0)
    out, lse = lowprec.attention(q, k, v, quant=quant, return_lse=True)
    assert out.shape == (2, 4, 5, 64) and (out == 0).all()
    assert torch.isinf(lse).all() and (lse < 0).all()


def test_zero_kv_heads_is_a_clear_error():
    q, k, v = _qkv(hkv=1)
    with pytest.raises(ValueError, match="k: expected Hkv"):
        lowprec.attention(q, k[:, :0], v[:, :0])


def test_exact_attention_of_fp64_inputs_is_fp64():
    """quant=None on the CPU: FP64 inputs are computed in FP64 (an exact reference; gradcheck passes)."""
    torch.manual_seed(0)
    q, k = torch.randn(1, 4, 5, 8, dtype=torch.float64), torch.randn(1, 2, 7, 8, dtype=torch.float64)
    v = torch.randn(1, 2, 7, 8, dtype=torch.float64)
    for causal in (False, True):
        out, lse = lowprec.attention(q, k, v, causal=causal, return_lse=True)
        ref = torch.nn.functional.scaled_dot_product_attention(
            q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), is_causal=False,
            attn_mask=torch.ones(5, 7, dtype=torch.bool).tril(2) if causal else None)
        assert out.dtype == torch.float64 and lse.dtype == torch.float32
        assert (out - ref).abs().max() < 1e-12
    args = tuple(t.clone().requires_grad_() for t in (q[:, :, :3, :4], k[:, :, :4, :4], v[:, :, :4, :4]))
    assert torch.autograd.gradcheck(lambda a, b, c: lowprec.attention(a, b, c, causal=True), args)


@pytest.mark.parametrize("quant", [None, "fp8"])
def test_raw_float8_tensors_are_refused_by_name(quant):
    """float8 tensors carry no scale (FP8 inputs come as QuantizedTensors): a clear error naming the argument."""
    x = torch.randn(1, 2, 5, 16)
    f8 = x.to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="q: expected a 4-D float16/bfloat16/float32/float64"):
        lowprec.attention(f8, x, x, quant=quant)
    with pytest.raises(ValueError, match="v: expected a 4-D float16/bfloat16/float32/float64"):
        lowprec.attention(x, x, f8, quant=quant)
    cu = torch.tensor([0, 5], dtype=torch.int32)
    with pytest.raises(ValueError, match="k: expected a 3-D float16/bfloat16/float32/float64"):
        lowprec.attention_varlen(x[0].transpose(0, 1), f8[0].transpose(0, 1), x[0].transpose(0, 1), cu, cu, 5, 5,
                                 quant=quant)


def test_fp8_kv_cache_refuses_a_raw_float8_query_by_name():
    from lowprec.attention import FP8KVCache

    cache = FP8KVCache(1, 2, 16, 16, dtype=torch.float32)
    cache.append(torch.randn(1, 2, 3, 16), torch.randn(1, 2, 3, 16))
    with pytest.raises(ValueError, match="q: expected a 4-D float16/bfloat16/float32/float64"):
        cache.attend(torch.randn(1, 2, 1, 16).to(torch.float8_e4m3fn))


@pytest.mark.parametrize("quant", [None, "fp8"])
@pytest.mark.parametrize("which", ["k", "v"])
def test_mixed_dtypes_are_a_value_error_naming_the_argument(quant, which):
    t = {n: torch.randn(1, 2, 16, 64) for n in "qkv"}
    t[which] = t[which].bfloat16()
    with pytest.raises(ValueError, match=f"{which}: torch.bfloat16, but q is torch.float32"):
        lowprec.attention(t["q"], t["k"], t["v"], quant=quant)


def test_varlen_mixed_dtypes_are_a_value_error():
    q, k, v = torch.randn(16, 2, 64), torch.randn(16, 2, 64).half(), torch.randn(16, 2, 64)
    cu = torch.tensor([0, 16], dtype=torch.int32)
    with pytest.raises(ValueError, match="k: torch.float16, but q is torch.float32"):
        attention_varlen(q, k, v, cu, cu, 16, 16)


def test_quantized_kv_with_a_float_q_of_another_dtype_still_runs():
    q = torch.randn(1, 2, 16, 64)
    k_q, v_q = quantize_kv_cache(torch.randn(1, 2, 16, 64).bfloat16(), torch.randn(1, 2, 16, 64).bfloat16())
    assert lowprec.attention(q, k_q, v_q, quant="fp8").shape == (1, 2, 16, 64)
    same = [torch.randn(1, 2, 16, 64, dtype=torch.float64) for _ in range(3)]
    assert lowprec.attention(*same).dtype == torch.float64


@pytest.mark.parametrize("quant", [None, "fp8"])
@pytest.mark.parametrize("scale", [float("nan"), float("inf"), "0.1", torch.tensor(0.125, requires_grad=True)])
def test_scale_must_be_a_finite_real_number(quant, scale):
    """A NaN or Inf scale gave NaN rows (FP8: zeros), a string was parsed, and a scale tensor that
    requires grad silently got none: a ValueError naming ``scale`` in every entry point now."""
    from lowprec.attention import FP8KVCache

    q, k, v = _qkv(b=1, h=2, hkv=1, sq=8, sk=8, d=64)
    cu = torch.tensor([0, 8], dtype=torch.int32)
    cache = FP8KVCache(1, 1, 16, 64, dtype=torch.float32)
    cache.append(k, v)
    calls = [lambda: lowprec.attention(q, k, v, scale=scale, quant=quant),
             lambda: attention_varlen(q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1), cu, cu, 8, 8,
                                      scale=scale, quant=quant),
             lambda: cache.attend(q, scale=scale),
             lambda: cache.decode_step(q[:, :, :1], k[:, :, :1], v[:, :, :1], scale=scale)]
    for call in calls:
        with pytest.raises(ValueError, match="scale: expected a finite real number"):
            call()
    assert cache.length == 8  # decode_step refused before appending its token
    # numbers and tensors without gradient are taken as their value
    ref = lowprec.attention(q, k, v, scale=0.125, quant=quant)
    for ok in (0.125, torch.tensor(0.125), torch.tensor([0.125], dtype=torch.float64)):
        assert torch.equal(lowprec.attention(q, k, v, scale=ok, quant=quant), ref)
