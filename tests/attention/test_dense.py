"""lowprec.attention (dense): forward-mode AD and torch.autocast."""

import pytest
import torch

import lowprec


def _qkv(scale=1.0):
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(1, 2, 16, 64, generator=g) * s for s in (scale, scale, 1.0))


def test_fp8_forward_mode_ad_is_an_error_not_a_silent_zero_tangent():
    # the quantizers dropped the tangent: torch.func.jvp gave zeros, a dual output had none
    q, k, v = _qkv()
    with pytest.raises(NotImplementedError, match=r"attention\(quant='fp8'\): forward-mode AD"):
        torch.func.jvp(lambda x: lowprec.attention(x, k, v, quant="fp8"), (q,), (torch.ones_like(q),))
    with torch.autograd.forward_ad.dual_level(), pytest.raises(NotImplementedError, match="forward-mode AD"):
        lowprec.attention(q, torch.autograd.forward_ad.make_dual(k, torch.ones_like(k)), v, quant="fp8")
    # exact attention is plain torch on the CPU: its tangent is autograd's
    _, tangent = torch.func.jvp(lambda x: lowprec.attention(x, k, v), (q,), (torch.ones_like(q),))
    assert tangent.abs().sum() > 0


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_exact_reference_ignores_autocast(dtype):
    """The FP32 reference ran its matmuls in fp16 / bf16 under torch.autocast: NaN rows where q·k
    passed fp16's 65504. Now the bits of a call without autocast."""
    q, k, v = _qkv(scale=100.0)  # scores ~8e4
    want = lowprec.attention(q, k, v, causal=True, return_lse=True)
    with torch.autocast("cpu", dtype=dtype):
        got = lowprec.attention(q, k, v, causal=True, return_lse=True)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_causal_and_incoherent_take_bools_only():
    """A float in causal's place (a scale, or FlashAttention's dropout_p, passed positionally) was read
    as True: a silent causal mask."""
    from lowprec.attention import FP8KVCache, attention_varlen

    q = torch.randn(1, 2, 8, 64)
    with pytest.raises(TypeError, match="causal: expected a bool, got 0.1"):
        lowprec.attention(q, q, q, 0.1)
    with pytest.raises(TypeError, match="incoherent: expected a bool, got 1"):
        lowprec.attention(q, q, q, quant="fp8", incoherent=1)
    packed, cu = q[0].transpose(0, 1), torch.tensor([0, 8], dtype=torch.int32)
    with pytest.raises(TypeError, match="causal: expected a bool, got 0.0"):
        attention_varlen(packed, packed, packed, cu, cu, 8, 8, 0.0)
    cache = FP8KVCache(1, 2, 128, 64, dtype=torch.float32)
    cache.append(q, q)
    with pytest.raises(TypeError, match="causal: expected a bool, got 1"):
        cache.attend(q, 1)
