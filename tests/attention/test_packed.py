"""lowprec.attention.packed: packed sequences in the padded layout, built without host reads.

The padded-layout operands are each sequence's own dense operands (bit for bit on dyadic data,
whose sums are exact in any order), and the tile table, read as the varlen kernel reads it, covers
every output row once with that sequence's operands.
"""

import math

import pytest
import torch

from lowprec.attention.packed import (
    SEQUENCE_FIELDS,
    longest_first,
    padded_layout,
    padded_rows,
    quantize_packed,
    sequence_plan,
)
from lowprec.attention.quantize import quantize_qkv
from lowprec.attention.reference import fp8_forward_reference
from lowprec.attention.sm90.config import V_KEY_PERM

LQ, LK = [5, 0, 130, 7, 300, 1], [9, 4, 200, 0, 300, 129]  # empty query / key sequences, tails


def _cu(lens):
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)


def _dyadic(rows, heads, d, shift, g):
    return ((torch.randint(-64, 64, (rows, heads, d), generator=g) / 32) + shift).bfloat16()


def _packed(lq=LQ, lk=LK, h=4, hkv=2, d=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (_dyadic(sum(lq), h, d, 0.0, g), _dyadic(sum(lk), hkv, d, 1.0, g), _dyadic(sum(lk), hkv, d, 0.0, g),
            _cu(lq), _cu(lk))


def test_padded_layout():
    cu = _cu(LQ)
    lay = padded_layout(cu, sum(LQ))
    assert lay.rows == padded_rows(sum(LQ), len(LQ)) and lay.rows % 128 == 0
    assert lay.start.tolist() == [0, 128, 128, 384, 512, 896]
    for i, n in enumerate(LQ):
        rows = torch.arange(lay.start[i], lay.start[i] + n)
        assert lay.valid[rows].all() and torch.equal(lay.src[rows], torch.arange(cu[i], cu[i] + n))
    assert int(lay.valid.sum()) == sum(LQ)


@pytest.mark.parametrize("permute", [False, True])
def test_operands_are_each_sequences_own(permute):
    q, k, v, cq, ck = _packed()
    x = quantize_packed(q, k, v, cq, ck, permute_v_keys=permute)
    sq0, sk0 = padded_layout(cq, q.shape[0]).start, padded_layout(ck, k.shape[0]).start
    u8 = torch.uint8
    v_t = x.v_t.view(u8)
    if permute:  # stored position p of each 16 holds key V_KEY_PERM[p]
        r = torch.arange(v_t.shape[-1])
        v_t = torch.empty_like(v_t).index_copy_(-1, r - r % 16 + torch.tensor(V_KEY_PERM)[r % 16], v_t)
    for i, (nq, nk) in enumerate(zip(LQ, LK)):
        if not nq or not nk:
            continue
        dense = quantize_qkv(q[cq[i]:cq[i + 1]].transpose(0, 1)[None], k[ck[i]:ck[i + 1]].transpose(0, 1)[None],
                             v[ck[i]:ck[i + 1]].transpose(0, 1)[None])
        a, b = int(sq0[i]), int(sk0[i])
        assert torch.equal(x.q[:, a:a + nq].view(u8), dense.q[0].view(u8))
        assert torch.equal(x.q_scale[:, a // 128:a // 128 + dense.q_scale.shape[-1]], dense.q_scale[0])
        assert torch.equal(x.k_mean[i], dense.k_mean[0])
        assert torch.equal(x.k[:, b:b + nk].view(u8), dense.k[0].view(u8))
        assert torch.equal(x.k_scale[:, b // 128:b // 128 + dense.k_scale.shape[-1]], dense.k_scale[0])
        assert torch.equal(x.v_scale[i], dense.v_scale[0])
        assert torch.equal(v_t[:, :, b:b + dense.v_t.shape[-1]], dense.v_t[0].view(u8))
    # padding rows are zeros (finite FP8: P = 0 times them is 0)
    lay = padded_layout(ck, k.shape[0])
    assert (x.k.view(u8)[:, ~lay.valid] == 0).all() and (v_t[:, :, ~lay.valid] == 0).all()


def _emulate_kernel(x, plan, tile_m, max_q, total_q, causal, scale):
    """The varlen kernel's reading of the sequence plan: grid (query blocks of the longest sequence,
    sequences); a block past its sequence's end writes nothing."""
    f = {name: i for i, name in enumerate(SEQUENCE_FIELDS)}
    h = x.q.shape[0]
    out = torch.full((total_q, h, x.v_t.shape[1]), float("nan"))
    lse = torch.full((h, total_q), float("nan"))
    for row in plan.tolist():
        batch = row[f["batch"]]
        sq, sk = row[f["q_len"]], row[f["k_len"]]
        a, b, o0 = row[f["q_row0"]], row[f["k_row0"]], row[f["q_first"]]
        for m_block in range(math.ceil(max_q / tile_m)):
            m0 = m_block * tile_m
            if m0 >= sq:
                continue
            o, l_ = fp8_forward_reference(
                x.q[None, :, a:a + sq], x.q_scale[None, :, a // 128:a // 128 + math.ceil(sq / 128)],
                x.k[None, :, b:b + sk], x.k_scale[None, :, b // 128:b // 128 + math.ceil(sk / 128)],
                x.v_t[None, :, :, b:b + -(-sk // 16) * 16], x.v_scale[None, batch], causal, scale)
            rows = slice(m0, min(m0 + tile_m, sq))
            assert torch.isnan(out[o0 + rows.start:o0 + rows.stop]).all(), "a row written twice"
            out[o0 + rows.start:o0 + rows.stop] = o[0, :, rows].transpose(0, 1)
            lse[:, o0 + rows.start:o0 + rows.stop] = l_[0, :, rows]
    return out, lse


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("tile_m", [128, 192])
def test_sequence_plan_covers_every_row_with_its_sequence(causal, tile_m):
    q, k, v, cq, ck = _packed()
    x = quantize_packed(q, k, v, cq, ck)
    plan = sequence_plan(cq, ck, q.shape[0], k.shape[0])
    assert plan.dtype == torch.int32 and plan.shape == (len(LQ), 8)
    plan = longest_first(plan)
    assert plan[:, SEQUENCE_FIELDS.index("batch")].tolist() == [4, 2, 5, 0, 1, 3]
    out, lse = _emulate_kernel(x, plan, tile_m, max(LQ), q.shape[0], causal, 0.125)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    for i, (nq, nk) in enumerate(zip(LQ, LK)):
        if not nq:
            continue
        rq = slice(cq[i], cq[i + 1])
        if not nk:
            assert (out[rq] == 0).all() and (lse[:, rq] == -math.inf).all()
            continue
        dense = quantize_qkv(q[rq].transpose(0, 1)[None], k[ck[i]:ck[i + 1]].transpose(0, 1)[None],
                             v[ck[i]:ck[i + 1]].transpose(0, 1)[None])
        o, l_ = fp8_forward_reference(dense.q, dense.q_scale, dense.k, dense.k_scale, dense.v_t, dense.v_scale,
                                      causal, 0.125)
        assert torch.equal(out[rq], o[0].transpose(0, 1)) and torch.equal(lse[:, rq], l_[0])


def test_sequence_plan_bounds():
    """Bad cu_seqlens (GPU ones are not checked): no sequence reaches past the output or the padded
    rows, and its columns are the pre-pass kernels' tables."""
    f = {n: i for i, n in enumerate(SEQUENCE_FIELDS)}
    for cq, ck in (([0, 5000], [0, 9000]), ([0, 60, 0, 100], [0, 50, 0, 50]), ([-5, 200, 30, 90], [0, 1, 2, 3])):
        plan = sequence_plan(torch.tensor(cq, dtype=torch.int32), torch.tensor(ck, dtype=torch.int32), 100, 50)
        assert (plan[:, f["q_first"]] >= 0).all() and (plan[:, f["q_first"]] + plan[:, f["q_len"]] <= 100).all()
        assert (plan[:, f["q_row0"]] + plan[:, f["q_len"]] <= padded_rows(100, len(cq) - 1)).all()
        assert (plan[:, f["k_row0"]] + plan[:, f["k_len"]] <= padded_rows(50, len(cq) - 1)).all()
        assert (plan[:, f["q_row0"]] % 128 == 0).all() and (plan[:, f["k_row0"]] % 128 == 0).all()


def test_incoherent_operands_are_each_sequences_own():
    """With the Hadamard rotation (incoherent processing), each sequence's operands are those of
    its dense call within FP32 rounding of the rotation (the same quantization blocks and mean)."""
    q, k, v, cq, ck = _packed()
    x = quantize_packed(q, k, v, cq, ck, incoherent=True)
    sq0, sk0 = padded_layout(cq, q.shape[0]).start, padded_layout(ck, k.shape[0]).start
    for i, (nq, nk) in enumerate(zip(LQ, LK)):
        if not nq or not nk:
            continue
        dense = quantize_qkv(q[cq[i]:cq[i + 1]].transpose(0, 1)[None], k[ck[i]:ck[i + 1]].transpose(0, 1)[None],
                             v[ck[i]:ck[i + 1]].transpose(0, 1)[None], incoherent=True)
        a, b = int(sq0[i]), int(sk0[i])
        torch.testing.assert_close(x.q_scale[:, a // 128:a // 128 + dense.q_scale.shape[-1]], dense.q_scale[0],
                                   rtol=1e-5, atol=0)
        torch.testing.assert_close(x.k_mean[i], dense.k_mean[0], rtol=1e-5, atol=1e-6)
        # codes: at most one E4M3 step apart where the rotated values round differently
        for got, want in ((x.q[:, a:a + nq], dense.q[0]), (x.k[:, b:b + nk], dense.k[0])):
            step = (got.float() - want.float()).abs() / want.float().abs().clamp(min=2 ** -6)
            assert step.max() <= 0.125 and (got.view(torch.uint8) != want.view(torch.uint8)).float().mean() < 0.01
