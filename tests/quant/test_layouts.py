import pytest
import torch

from lowprec.quant.layouts import (
    blocked_offset,
    empty_mn_major_tma_aligned,
    from_blocked,
    is_mn_major_tma_aligned,
    to_blocked,
    to_mn_major_tma_aligned,
    to_row_major,
)


@pytest.mark.parametrize("shape", [(7, 3), (128, 56), (4096, 1), (1, 5), (3, 10, 4)])
def test_mn_major_roundtrip(shape, device):
    s = torch.randn(*shape, device=device)
    m = to_mn_major_tma_aligned(s)
    assert m.shape == s.shape and torch.equal(m, s)
    rows = shape[-2]
    assert m.stride(-2) == 1 or rows == 1
    assert shape[-1] == 1 or m.stride(-1) == (rows + 3) // 4 * 4
    assert is_mn_major_tma_aligned(m)
    assert to_mn_major_tma_aligned(m) is m
    back = to_row_major(m)
    assert back.is_contiguous() and torch.equal(back, s)


@pytest.mark.parametrize("rows,cols", [(7, 3), (4096, 56), (1, 5), (5, 1), (1, 1)])
def test_empty_mn_major_has_the_layout_kernels_write(rows, cols, device):
    e = empty_mn_major_tma_aligned(rows, cols, device)
    assert e.shape == (rows, cols) and e.dtype == torch.float32 and e.device.type == torch.device(device).type
    assert is_mn_major_tma_aligned(e)
    assert e.stride() == to_mn_major_tma_aligned(torch.empty(rows, cols)).stride()


def test_row_major_is_not_mn_major():
    assert not is_mn_major_tma_aligned(torch.randn(8, 4))


@pytest.mark.parametrize("rows,cols", [(128, 4), (300, 17), (1, 1), (256, 8)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float8_e8m0fnu, torch.float8_e4m3fn])
def test_blocked_roundtrip_and_offsets(rows, cols, dtype):
    s = (torch.rand(rows, cols) * 4 + 0.25).to(dtype)
    b = to_blocked(s)
    assert b.dim() == 1 and b.numel() == -(-rows // 128) * 128 * -(-cols // 4) * 4
    assert torch.equal(from_blocked(b, rows, cols).float(), s.float())
    flat = b.float()
    for r in range(rows):
        for c in range(cols):
            assert flat[blocked_offset(r, c, cols)] == s[r, c].float()


def test_offset_formula_inside_one_tile():
    for r in range(128):
        for c in range(4):
            assert blocked_offset(r, c, 4) == (r % 32) * 16 + (r // 32) * 4 + c
    assert blocked_offset(0, 4, 8) == 512  # second tile along columns
    assert blocked_offset(128, 0, 8) == 1024  # tiles are row-tile major


def test_blocked_matches_torchao_style_formula():
    s = torch.randn(256, 8)
    ref = s.view(2, 128, 2, 4).permute(0, 2, 1, 3).reshape(-1, 4, 32, 4).transpose(1, 2).reshape(-1)
    assert torch.equal(to_blocked(s), ref)


def test_blocked_padding_is_zero_and_errors():
    b = to_blocked(torch.ones(3, 2))
    assert b.sum() == 6
    with pytest.raises(ValueError, match="rows, cols"):
        to_blocked(torch.ones(4))
    stacked = torch.randn(2, 3, 4)  # a stack of grids: their layouts one after the other
    assert torch.equal(to_blocked(stacked), torch.cat([to_blocked(stacked[0]), to_blocked(stacked[1])]))
    with pytest.raises(ValueError, match="512 elements"):
        from_blocked(torch.ones(100), 3, 2)
    with pytest.raises(ValueError, match="≥ 2 dims"):
        to_mn_major_tma_aligned(torch.ones(5))


def test_to_blocked_of_an_empty_grid():
    import lowprec

    s = lowprec.quantize(torch.randn(0, 256), "mxfp8").scale  # no rows: a [0, 8] grid
    blocked = to_blocked(s)
    assert blocked.dim() == 1 and blocked.numel() == 0
    assert from_blocked(blocked, 0, 8).shape == (0, 8)


def test_from_blocked_inverts_a_stack_of_grids():
    stacked = torch.randn(2, 3, 130, 6)
    blocked = to_blocked(stacked)
    assert torch.equal(from_blocked(blocked, 130, 6, batch=(2, 3)), stacked)
    with pytest.raises(ValueError, match="6 130x6 grids"):
        from_blocked(blocked[:-1], 130, 6, batch=(2, 3))
