"""lowprec.attention.packed: packed sequences in the padded layout, built without host reads.

The padded-layout operands are each sequence's own dense operands (bit for bit on dyadic data,
whose sums are exact in any order), and the tile table, read as the varlen kernel reads it, covers
every output row once with that sequence's operands.
"""

import math

import pytest
import torch

from lowprec.attention.packed import TILE_FIELDS, padded_layout, padded_rows, quantize_packed, tile_table
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


def _emulate_kernel(x, tiles, tile_m, total_q, causal, scale):
    """The varlen kernel's reading of the table (rows of out written per tile)."""
    f = {name: i for i, name in enumerate(TILE_FIELDS)}
    h = x.q.shape[0]
    out = torch.full((total_q, h, x.v_t.shape[1]), float("nan"))
    lse = torch.full((h, total_q), float("nan"))
    for row in tiles.tolist():
        sq, sk = row[f["seqlen_q"]], row[f["seqlen_k"]]
        m0 = row[f["m_block"]] * tile_m
        if m0 >= sq:
            continue
        a, b, o0 = row[f["q_row0"]], row[f["k_row0"]], row[f["out_row0"]]
        sl = slice(a, a + sq)
        o, l_ = fp8_forward_reference(x.q[None, :, sl], x.q_scale[None, :, a // 128:a // 128 + math.ceil(sq / 128)],
                                      x.k[None, :, b:b + sk], x.k_scale[None, :, b // 128:b // 128 + math.ceil(sk / 128)],
                                      x.v_t[None, :, :, b:b + -(-sk // 16) * 16], x.v_scale[None, row[f["batch"]]],
                                      causal, scale)
        rows = slice(m0, min(m0 + tile_m, sq))
        assert torch.isnan(out[o0 + rows.start:o0 + rows.stop]).all(), "a row written twice"
        out[o0 + rows.start:o0 + rows.stop] = o[0, :, rows].transpose(0, 1)
        lse[:, o0 + rows.start:o0 + rows.stop] = l_[0, :, rows]
    return out, lse


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("tile_m", [128, 192])
def test_tile_table_covers_every_row_with_its_sequence(causal, tile_m):
    q, k, v, cq, ck = _packed()
    x = quantize_packed(q, k, v, cq, ck)
    tiles = tile_table(cq, ck, q.shape[0], k.shape[0], tile_m, causal)
    assert tiles.dtype == torch.int32 and tiles.shape == (math.ceil(sum(LQ) / tile_m) + len(LQ), 8)
    out, lse = _emulate_kernel(x, tiles, tile_m, q.shape[0], causal, 0.125)
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


def test_tile_table_order_and_bounds():
    cq, ck = _cu([10, 1000, 0, 300]), _cu([10, 1000, 5, 300])
    tiles = tile_table(cq, ck, 1310, 1315, 128, causal=True)
    sq = tiles[:, TILE_FIELDS.index("seqlen_q")]
    used = sq > 0
    assert int(used.sum()) == 1 + 8 + 3 and not used[int(used.sum()):].any()  # unused rows last
    # the longest causal rows first: the last block of the 1000-token sequence
    first = tiles[0].tolist()
    assert first[TILE_FIELDS.index("batch")] == 1 and first[TILE_FIELDS.index("m_block")] == 7
    # bad cu_seqlens (not checked in graphs): no tile reaches past the output or the padded keys
    bad = tile_table(torch.tensor([0, 5000], dtype=torch.int32), torch.tensor([0, 9000], dtype=torch.int32),
                     100, 50, 128, causal=False)
    f = {n: i for i, n in enumerate(TILE_FIELDS)}
    assert (bad[:, f["out_row0"]] + bad[:, f["seqlen_q"]] <= 100).all()
    assert (bad[:, f["k_row0"]] + bad[:, f["seqlen_k"]] <= padded_rows(50, 1)).all()
