"""The sm_90a varlen FP8 attention kernel (packed sequences; lowprec.attention.packed's padded layout).

Compile tests are in test_sm90.py (the varlen configs are among ``variant_configs``). GPU tests
(``-m gpu``): the varlen kernel gives each sequence the bits of the dense kernel on the same
operands; ``attention_varlen(..., quant="fp8")`` is the dense call per sequence within FP32
rounding, differentiable, CUDA-graph capturable and ``torch.compile(fullgraph=True)``-traceable.
"""

import math

import pytest
import torch

import lowprec
from lowprec import metrics
from lowprec.attention import attention_varlen

from ..hopper import gpu, needs_gpu

pytestmark = [gpu, needs_gpu]

# (lengths of the query sequences, of the key sequences, H, Hkv, D)
CASES = [
    ([5, 0, 130, 7, 300, 1], [9, 4, 200, 0, 300, 129], 4, 2, 128),  # empty sequences, tails, GQA
    ([256, 640, 1], [256, 700, 1000], 2, 2, 64),
    ([384, 100], [384, 513], 4, 1, 256),  # MQA
    ([1] * 16, [1000 + 13 * i for i in range(16)], 8, 2, 128),  # a decode batch
]


def _packed(lq, lk, h, hkv, d, dtype=torch.bfloat16, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(sum(lq), h, d, device="cuda", generator=g).to(dtype)
    k = (torch.randn(sum(lk), hkv, d, device="cuda", generator=g) + 0.5).to(dtype)
    v = torch.randn(sum(lk), hkv, d, device="cuda", generator=g).to(dtype)
    cu = lambda lens: torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32,  # noqa: E731
                                   device="cuda")
    return q, k, v, cu(lq), cu(lk)


def _ids(case):
    return f"n{len(case[0])}_h{case[2]}kv{case[3]}_d{case[4]}"


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_each_sequence_has_the_dense_kernels_bits(case, causal, monkeypatch):
    from lowprec.attention.packed import longest_first, padded_layout, quantize_packed, sequence_plan
    from lowprec.attention.sm90 import interface
    from lowprec.attention.sm90.interface import fp8_attention_forward, fp8_attention_varlen_forward

    # the dense kernels the varlen one mirrors: no split KV, no packed GQA heads (packed decode rows run
    # the two-level kernel, whose P scale differs: config.rescale_slack)
    monkeypatch.setattr(interface, "SPLIT_KV_DECODE", False)
    monkeypatch.setattr(interface, "PACK_GQA", False)

    lq, lk, h, hkv, d = case
    q, k, v, cq, ck = _packed(lq, lk, h, hkv, d)
    x = quantize_packed(q, k, v, cq, ck, permute_v_keys=True)
    plan = longest_first(sequence_plan(cq, ck, q.shape[0], k.shape[0]))
    out, lse = fp8_attention_varlen_forward(x.q, x.q_scale, x.k, x.k_scale, x.v_t, x.v_scale, plan, q.shape[0],
                                            max(lq), causal=causal, softmax_scale=0.1, out_dtype=q.dtype,
                                            v_keys_permuted=True)
    sq0, sk0 = padded_layout(cq, q.shape[0]).start.tolist(), padded_layout(ck, k.shape[0]).start.tolist()
    for i, (nq, nk) in enumerate(zip(lq, lk)):
        rq = slice(int(cq[i]), int(cq[i + 1]))
        if not nq:
            continue
        if not nk:
            assert (out[rq] == 0).all() and (lse[:, rq] == -math.inf).all()
            continue
        a, b, nkp = sq0[i], sk0[i], -(-nk // 16) * 16
        o, l_ = fp8_attention_forward(x.q[None, :, a:a + nq].contiguous(),
                                      x.q_scale[None, :, a // 128:a // 128 + -(-nq // 128)].contiguous(),
                                      x.k[None, :, b:b + nk].contiguous(),
                                      x.k_scale[None, :, b // 128:b // 128 + -(-nk // 128)].contiguous(),
                                      x.v_t[None, :, :, b:b + nkp].contiguous(), x.v_scale[i:i + 1].contiguous(),
                                      causal=causal, softmax_scale=0.1, out_dtype=q.dtype, v_keys_permuted=True)
        assert torch.equal(out[rq], o[0].transpose(0, 1)), i
        assert torch.equal(lse[:, rq], l_[0]), i


@pytest.mark.parametrize("causal, incoherent", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("case", CASES[:3], ids=_ids)
def test_attention_varlen_is_the_dense_call_per_sequence(case, causal, incoherent, monkeypatch):
    from lowprec.attention.sm90 import interface

    monkeypatch.setattr(interface, "SPLIT_KV_DECODE", False)  # the varlen kernel never splits KV
    lq, lk, h, hkv, d = case
    q, k, v, cq, ck = _packed(lq, lk, h, hkv, d)
    out, lse = attention_varlen(q, k, v, cq, ck, max(lq), max(lk), causal=causal, quant="fp8", return_lse=True,
                                incoherent=incoherent)
    for i in range(len(lq)):
        rq, rk = slice(int(cq[i]), int(cq[i + 1])), slice(int(ck[i]), int(ck[i + 1]))
        if not lq[i] or not lk[i]:
            continue
        dense, dense_lse = lowprec.attention(q[rq].transpose(0, 1)[None], k[rk].transpose(0, 1)[None],
                                             v[rk].transpose(0, 1)[None], causal=causal, quant="fp8",
                                             return_lse=True, incoherent=incoherent)
        # the K mean's FP32 sum order differs (the dense pre-pass sums in its cluster's order)
        assert metrics.cos_sim(out[rq], dense[0].transpose(0, 1)) > 0.99999
        torch.testing.assert_close(lse[:, rq], dense_lse[0], rtol=0, atol=2e-3)


def test_gradients_are_the_dense_calls():
    lq, lk, h, hkv, d = CASES[0]
    q, k, v, cq, ck = _packed(lq, lk, h, hkv, d)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = attention_varlen(*leaves, cq, ck, max(lq), max(lk), causal=True, quant="fp8")
    w = torch.randn_like(out)
    (out.float() * w).sum().backward()
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    for i in range(len(lq)):
        rq, rk = slice(int(cq[i]), int(cq[i + 1])), slice(int(ck[i]), int(ck[i + 1]))
        if not lq[i] or not lk[i]:
            continue
        o = lowprec.attention(ref[0][rq].transpose(0, 1)[None], ref[1][rk].transpose(0, 1)[None],
                              ref[2][rk].transpose(0, 1)[None], causal=True, quant="fp8")
        (o[0].transpose(0, 1).float() * w[rq]).sum().backward()
    for a, b in zip(leaves, ref):
        assert metrics.cos_sim(a.grad, b.grad) > 0.9999


def test_cuda_graph_capture_and_compile():
    lq, lk, h, hkv, d = CASES[0]
    q, k, v, cq, ck = _packed(lq, lk, h, hkv, d)

    def call(q, k, v):
        return attention_varlen(q, k, v, cq, ck, max(lq), max(lk), causal=True, quant="fp8", return_lse=True)

    eager = call(q, k, v)
    compiled = torch.compile(call, fullgraph=True)(q, k, v)
    assert torch.equal(eager[0], compiled[0])
    # the LSE's smoothing correction is a reduction inductor may fuse in another order
    torch.testing.assert_close(eager[1], compiled[1], rtol=0, atol=1e-5)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        call(q, k, v)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = call(q, k, v)
    graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(eager, captured))
    # deterministic: a second call gives the same bits
    assert all(torch.equal(a, b) for a, b in zip(eager, call(q, k, v)))


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_packed_prepass_kernels_are_the_torch_prepass(case):
    """The three packed pre-pass kernels write the bits of ``quantize_packed`` (torch ops) over every
    sequence's padded rows; dyadic inputs make K's mean exact in either summation order."""
    from lowprec.attention.packed import padded_layout, quantize_packed, sequence_plan
    from lowprec.attention.sm90.interface import packed_prepass

    lq, lk, h, hkv, d = case
    g = torch.Generator(device="cuda").manual_seed(3)
    dy = lambda n, heads, shift: ((torch.randint(-64, 64, (n, heads, d), device="cuda", generator=g) / 32)  # noqa: E731
                                  + shift).bfloat16()
    q, k, v = dy(sum(lq), h, 0.0), dy(sum(lk), hkv, 1.0), dy(sum(lk), hkv, 0.0)
    _, _, _, cq, ck = _packed(lq, lk, h, hkv, d)
    got = packed_prepass(q, k, v, sequence_plan(cq, ck, q.shape[0], k.shape[0]), max(lq), max(lk))
    want = quantize_packed(q, k, v, cq, ck, permute_v_keys=True)
    u8 = torch.uint8
    end_q = padded_layout(cq, q.shape[0]).start[-1].item() + -(-lq[-1] // 128) * 128
    end_k = padded_layout(ck, k.shape[0]).start[-1].item() + -(-lk[-1] // 128) * 128
    assert torch.equal(got.q.view(u8)[:, :end_q], want.q.view(u8)[:, :end_q])
    assert torch.equal(got.q_scale[:, :end_q // 128], want.q_scale[:, :end_q // 128])
    assert torch.equal(got.k_mean, want.k_mean)
    assert torch.equal(got.k.view(u8)[:, :end_k], want.k.view(u8)[:, :end_k])
    assert torch.equal(got.k_scale[:, :end_k // 128], want.k_scale[:, :end_k // 128])
    assert torch.equal(got.v_scale, want.v_scale)
    assert torch.equal(got.v_t.view(u8)[..., :end_k], want.v_t.view(u8)[..., :end_k])


def test_cpu_cu_seqlens_are_checked_then_sent():
    lq, lk, h, hkv, d = CASES[0]
    q, k, v, cq, ck = _packed(lq, lk, h, hkv, d)
    on_gpu = attention_varlen(q, k, v, cq, ck, max(lq), max(lk), causal=True, quant="fp8")
    assert torch.equal(attention_varlen(q, k, v, cq.cpu(), ck.cpu(), max(lq), max(lk), causal=True, quant="fp8"),
                       on_gpu)
    bad = cq.cpu().clone()
    bad[2] = bad[1] - 1
    with pytest.raises(ValueError, match="cu_seqlens_q: must be non-decreasing"):
        attention_varlen(q, k, v, bad, ck, max(lq), max(lk), quant="fp8")
    with pytest.raises(ValueError, match="max_seqlen_k"):
        attention_varlen(q, k, v, cq.cpu(), ck.cpu(), max(lq), 3, quant="fp8")


@pytest.mark.parametrize("causal", [False, True])
def test_exact_varlen_is_pytorchs_varlen_flash_attention(causal):
    """quant=None on CUDA: one varlen flash call (no host read), the per-sequence SDPA results within
    bf16 rounding, differentiable; rows of a causal sequence with Sq > Sk that see no key: 0, -inf."""
    lq, lk, h, hkv, d = [5, 0, 130, 7, 300, 40], [9, 4, 200, 0, 300, 20], 4, 2, 64
    q, k, v, cq, ck = _packed(lq, lk, h, hkv, d)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = attention_varlen(*leaves, cq, ck, max(lq), max(lk), causal=causal, return_lse=True)
    w = torch.randn_like(out)
    (out.float() * w).sum().backward()
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    for i in range(len(lq)):
        rq, rk = slice(int(cq[i]), int(cq[i + 1])), slice(int(ck[i]), int(ck[i + 1]))
        if not lq[i]:
            continue
        if not lk[i]:
            assert (out[rq] == 0).all() and (lse[:, rq] == -math.inf).all()
            continue
        o, l_ = lowprec.attention(ref[0][rq].transpose(0, 1)[None], ref[1][rk].transpose(0, 1)[None],
                                  ref[2][rk].transpose(0, 1)[None], causal=causal, return_lse=True)
        torch.testing.assert_close(out[rq], o[0].transpose(0, 1), rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(lse[:, rq], l_[0], rtol=0, atol=1e-3)
        (o[0].transpose(0, 1).float() * w[rq]).sum().backward()
    for a, b in zip(leaves, ref):
        assert metrics.cos_sim(a.grad, b.grad) > 0.999
