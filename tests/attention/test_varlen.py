"""attention_varlen on packed sequences, and decode (Sq = 1..16): the dense call's semantics."""

import pytest
import torch

import lowprec
from lowprec import metrics
from lowprec.attention import attention_varlen


def _packed(lq, lk, h=4, hkv=2, d=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(lq), h, d, generator=g)
    k = torch.randn(sum(lk), hkv, d, generator=g) + 1.0
    v = torch.randn(sum(lk), hkv, d, generator=g)
    cu = lambda lens: torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)  # noqa: E731
    return q, k, v, cu(lq), cu(lk)


@pytest.mark.parametrize("quant", [None, "fp8"])
@pytest.mark.parametrize("causal", [False, True])
def test_each_sequence_is_the_dense_call(quant, causal):
    lq, lk = [5, 0, 130, 7, 3], [9, 4, 200, 0, 3]  # an empty query sequence, an empty key sequence
    q, k, v, cq, ck = _packed(lq, lk)
    out, lse = attention_varlen(q, k, v, cq, ck, 130, 200, causal=causal, quant=quant, return_lse=True)
    assert out.shape == (sum(lq), 4, 32) and lse.shape == (4, sum(lq))
    for i in range(len(lq)):
        rq, rk = slice(cq[i], cq[i + 1]), slice(ck[i], ck[i + 1])
        dense, dense_lse = lowprec.attention(q[rq].transpose(0, 1)[None], k[rk].transpose(0, 1)[None],
                                             v[rk].transpose(0, 1)[None], causal=causal, quant=quant, return_lse=True)
        assert torch.equal(out[rq], dense[0].transpose(0, 1))
        assert torch.equal(lse[:, rq], dense_lse[0])
    # sequence 3 has no keys: 0 and -inf
    assert (out[cq[3]:cq[4]] == 0).all() and (lse[:, cq[3]:cq[4]] == float("-inf")).all()


def test_varlen_gradients_flow_per_sequence():
    q, k, v, cq, ck = _packed([6, 9], [6, 12])
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    attention_varlen(*leaves, cq, ck, 9, 12, causal=True, quant="fp8").square().sum().backward()
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    attention_varlen(*ref, cq, ck, 9, 12, causal=True).square().sum().backward()
    for a, b in zip(leaves, ref):
        assert metrics.cos_sim(a.grad, b.grad) > 0.99
    # keys of sequence 0 get no gradient from sequence 1's queries
    only_first = [t.clone().requires_grad_() for t in (q, k, v)]
    out = attention_varlen(*only_first, cq, ck, 9, 12)
    out[6:].sum().backward()
    assert (only_first[1].grad[:6] == 0).all() and (only_first[0].grad[:6] == 0).all()


def test_all_empty():
    q, k, v, cq, ck = _packed([0, 0], [0, 3])
    out, lse = attention_varlen(q, k, v, cq, ck, 0, 3, return_lse=True)
    assert out.shape == (0, 4, 32) and lse.shape == (4, 0)



def test_max_seqlen_takes_numpy_and_tensor_integers_not_bools_or_floats():
    """FlashAttention's callers pass max_seqlen as numpy integers or 0-d tensors (was refused)."""
    import numpy as np

    q, k, v, cq, ck = _packed([5, 6], [5, 6])
    want = attention_varlen(q, k, v, cq, ck, 6, 6)
    for longest in (np.int64(6), np.int32(6), torch.tensor(6)):
        torch.testing.assert_close(attention_varlen(q, k, v, cq, ck, longest, longest), want, rtol=0, atol=0)
    for bad in (True, 6.0, torch.tensor(True), torch.tensor([6, 6])):
        with pytest.raises(ValueError, match="max_seqlen_q: expected an int"):
            attention_varlen(q, k, v, cq, ck, bad, 6)

def test_bad_inputs_are_named():
    q, k, v, cq, ck = _packed([5, 6], [5, 6])
    cases = [
        (dict(cu_seqlens_q=cq.float()), r"cu_seqlens_q: expected a 1-D int32/int64 tensor \[B \+ 1\], got torch.float"),
        (dict(cu_seqlens_k=ck.short()), r"cu_seqlens_k: expected a 1-D int32/int64 tensor"),
        (dict(cu_seqlens_q=torch.tensor([0, 12, 11], dtype=torch.int32)), "cu_seqlens_q: must be non-decreasing"),
        (dict(cu_seqlens_q=torch.tensor([1, 3, 11], dtype=torch.int32)), "cu_seqlens_q: must start at 0"),
        (dict(cu_seqlens_k=torch.tensor([0, 5, 10], dtype=torch.int32)), "cu_seqlens_k: must start at 0 and end at"),
        (dict(cu_seqlens_k=torch.tensor([0, 11], dtype=torch.int32), max_seqlen_k=11), "cu_seqlens_k: 1 sequences"),
        (dict(max_seqlen_q=5), "max_seqlen_q: expected an int"),
        (dict(q=q[None]), "q: expected a 3-D"),
        (dict(k=k[:, :0]), "k: expected"),
        (dict(v=v[:-1]), "v: expected"),
        (dict(q=q[..., :0], k=k[..., :0]), "q: expected a head dim D ≥ 1"),
    ]
    for change, message in cases:
        args = dict(q=q, k=k, v=v, cu_seqlens_q=cq, cu_seqlens_k=ck, max_seqlen_q=6, max_seqlen_k=6)
        args.update(change)
        with pytest.raises(ValueError, match=message):
            attention_varlen(**args)
    # what the message says is accepted is: int64 gives the int32 result
    torch.testing.assert_close(attention_varlen(q, k, v, cq.long(), ck.long(), 6, 6),
                               attention_varlen(q, k, v, cq, ck, 6, 6), rtol=0, atol=0)


@pytest.mark.parametrize("sq", [1, 4, 16])
def test_decode_rows_are_the_prefill_rows(sq):
    """Decode (a few new queries over a long KV, causal bottom-right) = the last rows of the prefill."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 8, 300, 64, generator=g)
    k = torch.randn(2, 2, 300, 64, generator=g)
    v = torch.randn(2, 2, 300, 64, generator=g)
    full, lse = lowprec.attention(q, k, v, causal=True, return_lse=True)
    dec, dec_lse = lowprec.attention(q[..., -sq:, :], k, v, causal=True, return_lse=True)
    torch.testing.assert_close(dec, full[..., -sq:, :], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dec_lse, lse[..., -sq:], rtol=1e-5, atol=1e-5)
    fp8 = lowprec.attention(q[..., -sq:, :], k, v, causal=True, quant="fp8")
    assert metrics.cos_sim(fp8, dec) > 0.998


@pytest.mark.parametrize("causal", [False, True])
def test_split_kv_combine_is_the_whole_attention(causal):
    """Decode by split-KV: partial attentions over key ranges, combined by their LSEs, give the whole
    call (causal bottom-right: a split of keys [a, b) is the last rows' view of those keys)."""
    from lowprec.attention.reference import combine_kv_splits

    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 8, 4, 64, generator=g)
    k = torch.randn(2, 2, 1000, 64, generator=g)
    v = torch.randn(2, 2, 1000, 64, generator=g)
    whole, lse = lowprec.attention(q, k, v, causal=causal, return_lse=True)
    bounds = [0, 256, 512, 900, 997, 1000]
    outs, lses = [], []
    for a, b in zip(bounds, bounds[1:]):
        if causal:  # query i (of 4) sees keys j <= 996 + i; the last split is empty for query 0
            s = q @ k[..., a:b, :].repeat_interleave(4, 1).transpose(-1, -2) / 8
            j = torch.arange(a, b)[None, :]
            s = s.masked_fill(j > torch.arange(4)[:, None] + 996, float("-inf"))
            l_ = torch.logsumexp(s, -1)
            o = torch.softmax(s, -1).nan_to_num() @ v[..., a:b, :].repeat_interleave(4, 1)
        else:
            o, l_ = lowprec.attention(q, k[..., a:b, :], v[..., a:b, :], return_lse=True)
        outs.append(o)
        lses.append(l_)
    out, lse_c = combine_kv_splits(torch.stack(outs), torch.stack(lses))
    torch.testing.assert_close(out, whole, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse_c, lse, rtol=1e-5, atol=1e-5)


def test_bad_options_are_refused_even_when_no_sequence_has_queries():
    q, k, v = torch.zeros(0, 4, 32), torch.randn(3, 2, 32), torch.randn(3, 2, 32)
    cq, ck = torch.tensor([0, 0], dtype=torch.int32), torch.tensor([0, 3], dtype=torch.int32)
    with pytest.raises(ValueError, match="quant"):
        attention_varlen(q, k, v, cq, ck, 0, 3, quant="int8")
    with pytest.raises(ValueError, match="incoherent"):
        attention_varlen(q, k, v, cq, ck, 0, 3, incoherent=True)
    # no rotation is built for no queries: a head dim it cannot rotate was taken
    with pytest.raises(ValueError, match="incoherent: the Hadamard rotation needs a power-of-two head dim, got D=24"):
        attention_varlen(q[..., :24], k[..., :24], v, cq, ck, 0, 3, quant="fp8", incoherent=True)


@pytest.mark.parametrize("quant", [None, "fp8"])
@pytest.mark.parametrize("cu_q", [[0, 0], [0, 0, 0]])
def test_varlen_no_queries_gives_zero_gradients(quant, cu_q):
    q = torch.randn(0, 2, 16, requires_grad=True)
    k = torch.randn(5, 1, 16, requires_grad=True)
    v = torch.randn(5, 1, 8, requires_grad=True)
    cu_k = [0, 5] if len(cu_q) == 2 else [0, 2, 5]
    out = attention_varlen(q, k, v, torch.tensor(cu_q), torch.tensor(cu_k), 0, 3 if len(cu_q) == 3 else 5,
                           quant=quant)
    assert out.shape == (0, 2, 8)
    gq, gk, gv = torch.autograd.grad(out.sum(), (q, k, v))
    for g, t in ((gq, q), (gk, k), (gv, v)):
        assert g.shape == t.shape and not g.any()


@pytest.mark.parametrize("quant", [None, "fp8"])
def test_host_cu_seqlens_serve_q_on_another_device(quant):
    """CPU cu_seqlens are taken for q on any device, as the docstring promises for CUDA: the
    per-sequence path (exact fp32 attention on CUDA, say) reads them on the host; it refused them.
    The meta device stands in for the accelerator. cu_seqlens on a third device are refused by name."""
    q, k, v, cq, ck = _packed([5, 0, 7], [6, 3, 9])
    out, lse = attention_varlen(*(t.to("meta") for t in (q, k, v)), cq, ck, 7, 9, causal=True, quant=quant,
                                return_lse=True)
    assert out.device.type == "meta" and out.shape == (12, 4, 32) and lse.shape == (4, 12)
    with pytest.raises(ValueError, match=r"cu_seqlens_k: on meta, but q is on cpu \(expected q's device or the CPU\)"):
        attention_varlen(q, k, v, cq, ck.to("meta"), 7, 9, quant=quant)
