"""Attention custom ops: autograd through quant="fp8", fake implementations, torch.compile."""

import math

import pytest
import torch

import lowprec
from lowprec import metrics
from lowprec.attention import ops
from lowprec.attention.quantize import quantize_qkv
from lowprec.attention.reference import attention_backward_reference
from lowprec.attention.sm90.config import attention_unsupported


def _qkv(b=2, h=4, hkv=2, sq=150, sk=200, d=64, seed=0, k_offset=0.0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, sq, d, generator=g, dtype=torch.float64)
    k = torch.randn(b, hkv, sk, d, generator=g, dtype=torch.float64) + k_offset
    v = torch.randn(b, hkv, sk, d, generator=g, dtype=torch.float64)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def _leaves(*tensors):
    """Two independent sets of grad-requiring copies of ``tensors``."""
    return [t.clone().requires_grad_() for t in tensors], [t.clone().requires_grad_() for t in tensors]


def _assert_same_grads(out_a, out_b, leaves_a, leaves_b):
    """Backward of both outputs with one random dout: the leaves' gradients are bit-identical."""
    dout = torch.randn_like(out_a)
    out_a.backward(dout)
    out_b.backward(dout)
    for a, b in zip(leaves_a, leaves_b):
        assert torch.equal(a.grad, b.grad)


def _exact_grads(q, k, v, dout, causal):
    """Autograd of exact attention in FP64 (GQA by repeating K and V)."""
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    group = q.shape[1] // k.shape[1]
    s = q @ k.repeat_interleave(group, 1).transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        sq, sk = s.shape[-2:]
        s = s.masked_fill(~torch.ones(sq, sk, dtype=torch.bool, device=s.device).tril(sk - sq), -math.inf)
    p = torch.softmax(s, -1).nan_to_num()
    out = p @ v.repeat_interleave(group, 1)
    out.backward(dout.double())
    _exact_grads.lse = torch.logsumexp(s.detach(), -1)
    return out.detach(), (q.grad, k.grad, v.grad)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("hkv,k_offset,incoherent", [(2, 0.0, False), (4, 0.0, False), (1, 5.0, False),
                                                      (2, 5.0, True)])
def test_fp8_backward_close_to_exact_fp64(causal, hkv, k_offset, incoherent):
    q, k, v = _qkv(hkv=hkv, k_offset=k_offset, dtype=torch.float32)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(1))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = lowprec.attention(*leaves, causal=causal, quant="fp8", incoherent=incoherent)
    assert out.grad_fn is not None
    out.backward(dout)
    _, grads = _exact_grads(q, k, v, dout, causal)
    for name, leaf, g in zip("qkv", leaves, grads):
        assert metrics.cos_sim(leaf.grad, g) >= 0.999, name


def test_fp8_backward_uses_smoothed_k():
    """With a large K bias, dQ from unsmoothed K picks up (Σ_j dS_ij)·mean(K): cos fell to ~0.97."""
    q, k, v = _qkv(hkv=2, k_offset=5.0, dtype=torch.float32)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(1))
    out, lse = lowprec.attention(q, k, v, quant="fp8", return_lse=True)
    _, grads = _exact_grads(q, k, v, dout, False)
    unsmoothed = attention_backward_reference(dout, q, k, v, out, lse, False, 0.125)
    assert metrics.cos_sim(unsmoothed[0], grads[0]) < 0.99  # the leak the op avoids
    leaf = q.clone().requires_grad_()
    lowprec.attention(leaf, k, v, quant="fp8").backward(dout)
    assert metrics.cos_sim(leaf.grad, grads[0]) > 0.9995


@pytest.mark.parametrize("causal,sq,sk,hkv", [(False, 37, 50, 2), (True, 50, 37, 1), (True, 20, 64, 4)])
def test_backward_reference_is_exact_from_exact_forward(causal, sq, sk, hkv):
    """From the exact out and LSE the plain-torch backward is autograd's (rows with no key included)."""
    q, k, v = _qkv(sq=sq, sk=sk, hkv=hkv)
    dout = torch.randn(q.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    out, lse = lowprec.attention(q, k, v, causal=causal, return_lse=True)  # FP32 math
    exact_out, grads = _exact_grads(q, k, v, dout, causal)
    torch.testing.assert_close(out, exact_out, rtol=1e-5, atol=1e-5)
    out, lse = exact_out, _exact_grads.lse
    mine = attention_backward_reference(dout, q, k, v, out, lse, causal, 1 / math.sqrt(64))
    for a, b in zip(mine, grads):
        torch.testing.assert_close(a, b)


def test_lse_carries_no_gradient_and_empty_keys_backward():
    q, k, v = (t.requires_grad_() for t in _qkv(sk=0, dtype=torch.float32))
    out, lse = lowprec.attention(q, k, v, quant="fp8", return_lse=True)
    assert not lse.requires_grad and torch.isinf(lse).all() and (lse < 0).all()
    out.sum().backward()
    assert (q.grad == 0).all() and k.grad.shape == k.shape


def test_bf16_inputs_grads_in_input_dtype():
    q, k, v = (t.requires_grad_() for t in _qkv(sq=64, sk=64, dtype=torch.bfloat16))
    out = lowprec.attention(q, k, v, causal=True, quant="fp8")
    assert out.dtype == torch.bfloat16
    out.float().square().sum().backward()
    assert q.grad.dtype == k.grad.dtype == v.grad.dtype == torch.bfloat16


def test_opcheck_fake_and_autograd():
    q, k, v = _qkv(sq=40, sk=70, dtype=torch.float32)
    x = quantize_qkv(q, k, v)
    torch.library.opcheck(torch.ops.lowprec.attention_fp8_forward.default,
                          (x.q, x.q_scale, x.k, x.k_scale, x.v_t, x.v_scale, True, 0.125, torch.bfloat16),
                          test_utils=("test_faketensor", "test_aot_dispatch_dynamic"))
    torch.library.opcheck(torch.ops.lowprec.attention_fp8.default,
                          (q.requires_grad_(), k, v, True, 0.125, False),
                          test_utils=("test_faketensor", "test_aot_dispatch_dynamic"))
    out, lse = lowprec.attention(q, k, v, quant="fp8", return_lse=True)
    torch.library.opcheck(torch.ops.lowprec.attention_backward.default,
                          (torch.randn_like(out), q.detach(), k, v, out.detach(), lse, False, 0.125),
                          test_utils=("test_faketensor", "test_aot_dispatch_dynamic"))


def test_compile_fullgraph_matches_eager_forward_and_backward():
    def step(q, k, v):
        out, lse = lowprec.attention(q, k, v, causal=True, quant="fp8", return_lse=True)
        return out, lse

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    for sq, sk in ((40, 70), (130, 130)):
        q, k, v = _qkv(sq=sq, sk=sk, dtype=torch.float32)
        leaves_e, leaves_c = _leaves(q, k, v)
        out_e, lse_e = step(*leaves_e)
        out_c, lse_c = compiled(*leaves_c)
        assert torch.equal(out_e, out_c) and torch.equal(lse_e, lse_c)
        _assert_same_grads(out_e, out_c, leaves_e, leaves_c)


def test_kernel_eligibility_reasons():
    q, k, v = _qkv(sq=40, sk=70, d=128, dtype=torch.bfloat16)
    x = quantize_qkv(q, k, v)

    def why(q, k, v_t, out_dtype):
        return attention_unsupported(q, x.q_scale, k, x.k_scale, v_t, x.v_scale, False, 1.0, out_dtype)

    assert why(x.q, x.k, x.v_t, torch.bfloat16) is None
    assert "head dims" in why(x.q[..., :48], x.k, x.v_t, torch.bfloat16)
    assert why(x.q[..., :64], x.k[..., :64], x.v_t[..., :64, :], torch.bfloat16) is None
    assert "Dv=64" in why(x.q, x.k, x.v_t[..., :64, :], torch.bfloat16)
    assert "output dtype" in why(x.q, x.k, x.v_t, torch.float32)
    assert "empty" in why(x.q, x.k[..., :0, :], x.v_t, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("causal,sq,sk,hkv", [(False, 300, 300, 8), (True, 300, 300, 2), (True, 77, 300, 8),
                                              (True, 300, 77, 2)])
@pytest.mark.parametrize("return_lse", [False, True])
def test_exact_cuda_is_sdpa_with_our_semantics(causal, sq, sk, hkv, return_lse):
    q, k, v = (t.to("cuda", torch.bfloat16) for t in _qkv(b=2, h=8, hkv=hkv, sq=sq, sk=sk, d=128))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    res = lowprec.attention(*leaves, causal=causal, return_lse=return_lse)
    out = res[0] if return_lse else res
    ref_out, grads = _exact_grads(q, k, v, torch.ones_like(q), causal)
    assert metrics.cos_sim(out, ref_out) > 0.9999 and metrics.rel_l2(out, ref_out) < 1e-2
    assert (out[..., : max(sq - sk, 0), :] == 0).all() if causal else True
    out.sum().backward()
    for leaf, g in zip(leaves, grads):
        assert metrics.cos_sim(leaf.grad, g) > 0.999
    if return_lse:
        _, lse_ref = lowprec.attention(q.float().cpu(), k.float().cpu(), v.float().cpu(), causal=causal,
                                       return_lse=True)
        lse = res[1].cpu()
        finite = torch.isfinite(lse_ref)
        assert torch.equal(torch.isfinite(lse), finite) and (lse[~finite] < 0).all()
        assert (lse[finite] - lse_ref[finite]).abs().max() < 2e-2


@pytest.mark.gpu
@pytest.mark.parametrize("causal,sq,sk,hkv", [(False, 256, 256, 8), (True, 300, 300, 2), (True, 300, 200, 8)])
def test_fp8_backward_on_cuda_uses_flash_and_is_close(causal, sq, sk, hkv):
    q, k, v = (t.to("cuda", torch.bfloat16) for t in _qkv(b=2, h=8, hkv=hkv, sq=sq, sk=sk, d=128, k_offset=2.0))
    dout = torch.randn(q.shape, device="cuda", dtype=torch.bfloat16)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = lowprec.attention(*leaves, causal=causal, quant="fp8", return_lse=True)
    out.backward(dout)
    _, grads = _exact_grads(q, k, v, dout, causal)
    for name, leaf, g in zip("qkv", leaves, grads):
        assert metrics.cos_sim(leaf.grad, g) >= 0.999, name
    # the aten flash backward agrees with the plain-torch one on the same saved tensors
    mean = k.float().mean(-2)
    ks = (k.float() - mean[:, :, None]).to(k.dtype)
    from lowprec.attention.reference import lse_correction
    lse_s = lse - lse_correction(q, mean, 128 ** -0.5)
    flash = ops._flash_backward(dout, q, ks, v, out.detach(), lse_s, causal, 128 ** -0.5)
    plain = attention_backward_reference(dout, q, ks, v, out.detach(), lse_s, causal, 128 ** -0.5)
    for a, b in zip(flash, plain):
        assert metrics.cos_sim(a, b) > 0.9999


@pytest.mark.gpu
@pytest.mark.parametrize("causal,sq,sk,hkv,d", [(True, 300, 300, 2, 128), (False, 256, 200, 8, 128),
                                                (True, 256, 256, 8, 64), (True, 128, 128, 4, 256)])
def test_the_cudnn_backward_is_the_flash_backward(causal, sq, sk, hkv, d):
    """Where the cuDNN backward serves (Sq == Sk or not causal) its gradients are the flash
    backward's and the plain-torch one's on the same saved tensors (GQA heads not expanded)."""
    from lowprec.attention.reference import lse_correction

    q, k, v = (t.to("cuda", torch.bfloat16) for t in _qkv(b=2, h=8, hkv=hkv, sq=sq, sk=sk, d=d, k_offset=2.0))
    dout = torch.randn(q.shape, device="cuda", dtype=torch.bfloat16)
    out, lse = lowprec.attention(q, k, v, causal=causal, quant="fp8", return_lse=True)
    mean = k.float().mean(-2)
    ks = (k.float() - mean[:, :, None]).to(k.dtype)
    lse_s = lse - lse_correction(q, mean, d ** -0.5)
    assert ops._cudnn_ok(q, ks, causal)
    cudnn = ops._cudnn_backward(dout, q, ks, v, out, lse_s, causal, d ** -0.5)
    flash = ops._flash_backward(dout, q, ks, v, out, lse_s, causal, d ** -0.5)
    plain = attention_backward_reference(dout, q, ks, v, out, lse_s, causal, d ** -0.5)
    for a, b, c in zip(cudnn, flash, plain, strict=True):
        assert a.shape == b.shape and metrics.cos_sim(a, b) > 0.9999 and metrics.cos_sim(a, c) > 0.9999
    got = ops.attention_backward(dout, q, ks, v, out, lse_s, causal, d ** -0.5)
    assert ops._cudnn_ok(q, ks, causal)  # the op took it (a refusal would be remembered)
    assert all(metrics.cos_sim(a, b) > 0.99999 for a, b in zip(got, cudnn, strict=True))


@pytest.mark.gpu
def test_transposed_views_take_the_one_pass_kernels(monkeypatch):
    """Q, K, V as transformers passes them (transposed views of [B, S, H, D]) run the one-pass
    kernels on copies (under LOWPREC_BACKEND=kernel a reference step would raise), the bits of
    contiguous inputs."""
    q, k, v = (t.to("cuda", torch.bfloat16) for t in _qkv(b=2, h=8, hkv=2, sq=256, sk=256, d=128))
    views = [t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v)]
    assert not any(t.is_contiguous() for t in views)
    monkeypatch.setenv("LOWPREC_BACKEND", "kernel")
    assert torch.equal(lowprec.attention(*views, causal=True, quant="fp8"), lowprec.attention(q, k, v, causal=True,
                                                                                              quant="fp8"))


@pytest.mark.gpu
def test_fp8_cuda_graph_capture_and_compile():
    q, k, v = (t.to("cuda", torch.bfloat16) for t in _qkv(b=1, h=4, hkv=2, sq=256, sk=256, d=128))
    eager = lowprec.attention(q, k, v, causal=True, quant="fp8")
    compiled = torch.compile(lambda a, b, c: lowprec.attention(a, b, c, causal=True, quant="fp8"), fullgraph=True)
    assert torch.equal(compiled(q, k, v), eager)
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        lowprec.attention(q, k, v, causal=True, quant="fp8")
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        captured = lowprec.attention(q, k, v, causal=True, quant="fp8")
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, eager)


def test_eager_call_is_the_custom_op():
    """lowprec.attention's eager path (no op dispatch) gives the op's results and gradients."""
    from lowprec.attention.ops import attention_fp8, attention_fp8_call

    q, k, v = _qkv(sq=40, sk=70, dtype=torch.float32)
    with torch.no_grad():
        direct = attention_fp8_call(q, k, v, True, 0.125, False)
    assert all(torch.equal(a, b) for a, b in zip(direct, attention_fp8(q, k, v, True, 0.125, False)))
    leaves_op, leaves_call = _leaves(q, k, v)
    out_op, lse_op, _ = attention_fp8(*leaves_op, True, 0.125, False)
    out_call, lse_call, k_mean = attention_fp8_call(*leaves_call, True, 0.125, False)
    assert torch.equal(out_op, out_call) and not lse_call.requires_grad and not k_mean.requires_grad
    _assert_same_grads(out_op, out_call, leaves_op, leaves_call)


def test_compiled_kv_cache_call_keeps_the_forward_op():
    """Traced by torch.compile, an FP8-KV-cache call keeps the forward custom op in the graph (the
    kernel runs there on Hopper); eager calls skip the op's dispatch. Same results either way."""
    from lowprec.attention.quantize import quantize_kv_cache

    q, k, v = _qkv(b=1, h=2, hkv=2, sq=16, sk=40, dtype=torch.float32)
    k_q, v_q = quantize_kv_cache(k, v)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm.code)
        return gm.forward

    compiled = torch.compile(lambda q: lowprec.attention(q, k_q, v_q, causal=True, quant="fp8"), backend=backend)
    assert torch.equal(compiled(q), lowprec.attention(q, k_q, v_q, causal=True, quant="fp8"))
    assert any("lowprec.attention_fp8_forward" in code for code in graphs)


def _transposed(*shape):
    return torch.randn(shape[0], shape[2], shape[1], shape[3]).transpose(1, 2)


def test_attention_backward_fake_strides_of_transposed_inputs():
    q, k, v = _transposed(1, 2, 20, 32), _transposed(1, 1, 30, 32), _transposed(1, 1, 30, 32)
    assert not q.is_contiguous()
    out, lse = lowprec.attention(q, k, v, causal=True, quant="fp8", return_lse=True)
    args = (torch.randn_like(out), q, k, v, out, lse, True, 0.2)
    torch.library.opcheck(torch.ops.lowprec.attention_backward.default, args,
                          test_utils=("test_faketensor", "test_aot_dispatch_dynamic"))
    real = torch.ops.lowprec.attention_backward.default(*args)
    assert all(g.is_contiguous() for g in real)
    empty = (torch.randn_like(out[..., :0, :]), q[..., :0, :], k, v, out[..., :0, :], lse[..., :0], True, 0.2)
    assert all(g.is_contiguous() for g in torch.ops.lowprec.attention_backward.default(*empty))


def _small_qkv():
    g = torch.Generator().manual_seed(0)
    return (torch.randn(1, 2, 9, 64, generator=g), torch.randn(1, 1, 5, 64, generator=g),
            torch.randn(1, 1, 5, 64, generator=g))


def test_compiled_incoherent_lse_and_gradients_are_eager():
    q, k, v = _small_qkv()
    torch._dynamo.reset()

    def f(q, k, v):
        return lowprec.attention(q, k, v, causal=True, quant="fp8", return_lse=True, incoherent=True)

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = compiled(*leaves)
    out.sum().backward()
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    ref_out, ref_lse = f(*ref)
    ref_out.sum().backward()
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)
    for a, b in zip(leaves, ref):
        assert torch.equal(a.grad, b.grad)
    # nothing traced stays cached: eager incoherent calls still run
    assert lowprec.attention(q, k, v, quant="fp8", incoherent=True).shape == q.shape


@pytest.mark.parametrize("incoherent", [False, True])
def test_fp8_attention_ignores_autocast(incoherent):
    """The scheme's own arithmetic (the rotation, the LSE correction of smoothed K, the emulation)
    ran in bf16 under torch.autocast: the LSE ~4x further from exact where K has a large bias.
    Now the same bits as without autocast (as the kernel, which autocast does not touch)."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 256, 128, generator=g).bfloat16()
    k = (torch.randn(1, 2, 256, 128, generator=g) + 8 * torch.randn(1, 1, 1, 128, generator=g)).bfloat16()
    v = torch.randn(1, 2, 256, 128, generator=g).bfloat16()
    want = lowprec.attention(q, k, v, quant="fp8", return_lse=True, incoherent=incoherent)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = lowprec.attention(q, k, v, quant="fp8", return_lse=True, incoherent=incoherent)
        varlen = lowprec.attention_varlen(q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1),
                                          torch.tensor([0, 256]), torch.tensor([0, 256]), 256, 256, quant="fp8",
                                          incoherent=incoherent)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert torch.equal(varlen, want[0][0].transpose(0, 1))


@pytest.mark.parametrize("incoherent", [False, True])
def test_fp8_backward_ignores_autocast(incoherent):
    """backward() under torch.autocast ran the custom backward's FP32 math in bf16 (the forward
    turns autocast off): other gradients than the same call's backward outside it."""
    q, k, v = _qkv(b=1, sq=128, sk=128, k_offset=3.0, dtype=torch.float32)
    grads = []
    for inside in (False, True):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = lowprec.attention(*leaves, quant="fp8", incoherent=incoherent)
            if inside:
                out.sum().backward()
        if not inside:
            out.sum().backward()
        grads.append([t.grad for t in leaves])
    assert all(torch.equal(a, b) for a, b in zip(*grads))
