"""lowprec.attention.varlen_ops: the packed FP8 attention op (CPU: its per-sequence fallback and
plain-torch backward; the Hopper kernel path is in the GPU tests of test_varlen_sm90.py)."""

import pytest
import torch

import lowprec
from lowprec.attention.varlen_ops import attention_fp8_varlen, attention_fp8_varlen_call, packed_lse_correction

from .test_varlen import _packed as packed_sequences

LQ, LK = [5, 0, 130, 7, 3], [9, 4, 200, 0, 3]


def _packed(**kwargs):
    return packed_sequences(LQ, LK, **kwargs)


@pytest.mark.parametrize("causal", [False, True])
def test_op_is_the_dense_op_per_sequence(causal):
    q, k, v, cq, ck = _packed()
    out, lse, k_mean = attention_fp8_varlen(q, k, v, cq, ck, 130, 200, causal, 0.2, False)
    full_lse = lse + packed_lse_correction(q, k_mean, cq, 0.2)
    for i in range(len(LQ)):
        if not LQ[i] or not LK[i]:
            continue
        rq, rk = slice(cq[i], cq[i + 1]), slice(ck[i], ck[i + 1])
        dense, dense_lse = lowprec.attention(q[rq].transpose(0, 1)[None], k[rk].transpose(0, 1)[None],
                                             v[rk].transpose(0, 1)[None], causal=causal, scale=0.2, quant="fp8",
                                             return_lse=True)
        assert torch.equal(out[rq], dense[0].transpose(0, 1))
        torch.testing.assert_close(full_lse[:, rq], dense_lse[0], rtol=0, atol=1e-5)
    assert (out[cq[3]:cq[4]] == 0).all() and (lse[:, cq[3]:cq[4]] == float("-inf")).all()


@pytest.mark.parametrize("incoherent", [False, True])
def test_gradients_are_the_dense_ops(incoherent):
    q, k, v, cq, ck = _packed()
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = attention_fp8_varlen_call(*leaves, cq, ck, 130, 200, True, 0.2, incoherent)[0]
    (out * torch.linspace(-1, 1, out.numel()).view(out.shape)).sum().backward()
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    outs = []
    for i in range(len(LQ)):
        rq, rk = slice(cq[i], cq[i + 1]), slice(ck[i], ck[i + 1])
        if LQ[i] and LK[i]:
            o = lowprec.attention(ref[0][rq].transpose(0, 1)[None], ref[1][rk].transpose(0, 1)[None],
                                  ref[2][rk].transpose(0, 1)[None], causal=True, scale=0.2, quant="fp8",
                                  incoherent=incoherent)[0].transpose(0, 1)
        else:
            o = ref[0][rq].new_zeros(LQ[i], 4, 32)
        outs.append(o)
    dense = torch.cat(outs)
    (dense * torch.linspace(-1, 1, dense.numel()).view(dense.shape)).sum().backward()
    for a, b in zip(leaves, ref):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6)


def test_compiled_fullgraph_is_eager():
    q, k, v, cq, ck = _packed()

    def f(q, k, v):
        return attention_fp8_varlen(q, k, v, cq, ck, 130, 200, True, 0.2, False)

    eager = f(q, k, v)
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, v)
    for a, b in zip(eager, compiled):
        assert torch.equal(a, b)


def test_attention_varlen_backward_outputs_are_contiguous():
    """The flash (CUDA) path returns contiguous gradients: the CPU reference and the fake do too."""
    cq = torch.tensor([0, 5, 20], dtype=torch.int32)
    q = torch.randn(4, 20, 32).transpose(0, 1)  # [total_q, H, D], head-major storage
    k, v = torch.randn(20, 2, 32), torch.randn(20, 2, 32)
    out, lse, _ = attention_fp8_varlen(q, k, v, cq, cq, 15, 15, True, 0.2, False)
    args = (torch.randn_like(out), q, k, v, out, lse, cq, cq, 15, 15, True, 0.2)
    torch.library.opcheck(torch.ops.lowprec.attention_varlen_backward.default, args, test_utils=("test_faketensor",))
    assert all(g.is_contiguous() for g in torch.ops.lowprec.attention_varlen_backward.default(*args))
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode(allow_non_fake_inputs=True):
        fake = torch.ops.lowprec.attention_varlen_backward.default(*args)
    assert all(g.is_contiguous() for g in fake)
