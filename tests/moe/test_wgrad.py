import pytest
import torch

import lowprec
from lowprec.moe import grouped_gemm_wgrad, quantize_k_grouped

ENDS = [5, 5, 140, 141, 300]  # an empty group, a 1-row group, groups across 128 boundaries


def test_quantize_k_grouped_layout():
    rows = torch.randn(310, 48, generator=torch.Generator().manual_seed(0))  # rows after 300: padding
    q, aligned = quantize_k_grouped(rows, torch.tensor(ENDS, dtype=torch.int32))
    assert aligned.dtype == torch.int32 and aligned.tolist() == [128, 128, 384, 512, 768]
    assert q.shape == (48, 384 + 128 * 5) and q.recipe.name == "fp8_block1x128"
    deq = q.dequantize(torch.float32)
    start, a_start = 0, 0
    for end, a_end in zip(ENDS, aligned.tolist()):
        # each group quantized on its own: 1x128 blocks start at the group's first token
        ref = lowprec.quantize(rows[start:end].T.contiguous(), "fp8_block1x128").dequantize(torch.float32)
        assert torch.equal(deq[:, a_start:a_start + end - start], ref)
        assert (deq[:, a_start + end - start:a_end] == 0).all()
        start, a_start = end, a_end
    assert (deq[:, a_start:] == 0).all()


def test_wgrad_matches_per_expert_products():
    g = torch.Generator().manual_seed(1)
    dy, x = torch.randn(300, 64, generator=g), torch.randn(300, 96, generator=g)
    ends = torch.tensor(ENDS, dtype=torch.int32)
    dy_t, aligned = quantize_k_grouped(dy, ends)
    x_t, aligned_x = quantize_k_grouped(x, ends)
    assert torch.equal(aligned, aligned_x)
    dw = grouped_gemm_wgrad(dy_t, x_t, aligned)
    assert dw.shape == (5, 64, 96) and dw.dtype == torch.float32
    dy_deq, x_deq = dy_t.dequantize(torch.float64), x_t.dequantize(torch.float64)
    start, a_start = 0, 0
    for e, (end, a_end) in enumerate(zip(ENDS, aligned.tolist())):
        ref = dy_deq[:, a_start:a_end] @ x_deq[:, a_start:a_end].T
        torch.testing.assert_close(dw[e].double(), ref, rtol=1e-5, atol=1e-5)
        exact = dy[start:end].T @ x[start:end]
        if end > start:
            assert lowprec.metrics.rel_l2(dw[e], exact) < 5e-2
        else:
            assert (dw[e] == 0).all()
        start, a_start = end, a_end
    assert grouped_gemm_wgrad(dy_t, x_t, aligned, out_dtype=torch.bfloat16).dtype == torch.bfloat16


def test_quantize_k_grouped_row_index_equals_gathering_first():
    g = torch.Generator().manual_seed(2)
    tokens = torch.randn(90, 48, generator=g)
    index = torch.randint(-1, 90, (300,), generator=g)  # -1: a zero row
    gathered = torch.where(index[:, None] >= 0, tokens[index.clamp(min=0)], 0.0)
    ends = torch.tensor(ENDS, dtype=torch.int32)
    ref, ref_ends = quantize_k_grouped(gathered, ends)
    out, out_ends = quantize_k_grouped(tokens, ends, row_index=index)
    assert torch.equal(out_ends, ref_ends) and out.shape == ref.shape
    assert torch.equal(out.data.view(torch.uint8), ref.data.view(torch.uint8))
    assert torch.equal(out.scale, ref.scale)
    with pytest.raises(ValueError, match="row_index: expected a 1-D int32/int64 tensor"):
        quantize_k_grouped(tokens, ends, row_index=index.float())


def test_quantize_k_grouped_refuses_a_bad_row_index():
    """A bool mask was taken as rows 0 and 1, an entry R as a zero row (the reference's appended
    one): silent wrong operands. Larger entries raised torch's IndexError, naming no argument."""
    tokens, ends = torch.randn(4, 128), torch.tensor([2, 5], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"row_index: expected a 1-D int32/int64 tensor on cpu, got torch.bool \(5,\)"):
        quantize_k_grouped(tokens, ends, row_index=torch.tensor([True, False, True, True, False]))
    for bad in (4, 9):
        with pytest.raises(ValueError, match=rf"row_index: expected entries below R=4 .*, got {bad}"):
            quantize_k_grouped(tokens, ends, row_index=torch.tensor([0, 1, -1, bad, 2]))


@pytest.mark.parametrize("ends", [[4, 2], [3, 11], [-1, 5]])
def test_quantize_k_grouped_refuses_group_ends_past_the_rows(ends):
    """Decreasing, negative or past M=10: silently zero rows or garbage groups before."""
    with pytest.raises(ValueError, match=r"group_ends: expected non-decreasing ends within \[0, M=10\]"):
        quantize_k_grouped(torch.randn(10, 128), torch.tensor(ends, dtype=torch.int32))


def test_errors():
    q = lowprec.quantize(torch.randn(8, 256), "fp8_block1x128")
    ends = torch.tensor([128, 256], dtype=torch.int32)
    with pytest.raises(ValueError, match="start at a multiple of the block width"):
        grouped_gemm_wgrad(q, q, torch.tensor([100, 256], dtype=torch.int32))
    with pytest.raises(ValueError, match="non-decreasing"):
        grouped_gemm_wgrad(q, q, torch.tensor([128, 300], dtype=torch.int32))
    with pytest.raises(ValueError, match="K mismatch"):
        grouped_gemm_wgrad(q, lowprec.quantize(torch.randn(8, 384), "fp8_block1x128"), ends)
    with pytest.raises(ValueError, match="1 x N blocks"):
        grouped_gemm_wgrad(q, lowprec.quantize(torch.randn(8, 256), "fp8_block128x128"), ends)
    with pytest.raises(TypeError, match="QuantizedTensor"):
        grouped_gemm_wgrad(torch.randn(8, 256), q, ends)
    with pytest.raises(ValueError, match="group_ends"):
        grouped_gemm_wgrad(q, q, [128, 256])
    with pytest.raises(ValueError, match="recipe"):
        quantize_k_grouped(torch.randn(10, 8), torch.tensor([10], dtype=torch.int32), "fp8_rowwise")
    with pytest.raises(ValueError, match="rows"):
        quantize_k_grouped(torch.randn(10), torch.tensor([10], dtype=torch.int32))


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)),
                    reason="needs an sm_90 GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("ends", [[0, 1, 130, 130, 500], [256], [5, 5, 5], [37, 300, 301, 900]])
def test_quantize_k_grouped_kernel_matches_reference(ends, dtype, monkeypatch):
    """The gathering kernel against the zero-filled scatter + dual quantization, bit for bit:
    empty groups, groups of 1, groups not a multiple of 128, rows past the last end."""
    g = torch.Generator(device="cuda").manual_seed(len(ends) + ends[-1])
    rows = (torch.randn(ends[-1] + 40, 272, device="cuda", generator=g)
            * torch.exp(torch.randn(ends[-1] + 40, 1, device="cuda", generator=g))).to(dtype)
    group_ends = torch.tensor(ends, dtype=torch.int32, device="cuda")
    before = rows.clone()
    monkeypatch.setenv("LOWPREC_BACKEND", "reference")
    ref, ref_ends = quantize_k_grouped(rows, group_ends)
    monkeypatch.setenv("LOWPREC_BACKEND", "kernel")
    torch.empty(64 << 20, dtype=torch.uint8, device="cuda").fill_(0x7F)  # poison the allocator
    out, out_ends = quantize_k_grouped(rows, group_ends)
    assert torch.equal(out_ends, ref_ends)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert torch.equal(out.data.view(torch.uint8), ref.data.view(torch.uint8))
    assert torch.equal(out.scale, ref.scale)
    assert torch.equal(rows, before)
    # through a row map (token-level rows, as the MoE backward passes them): the same bits
    tokens, index = rows[::2].contiguous(), torch.arange(rows.shape[0], device="cuda") // 2
    index[::7] = -1
    gathered = torch.where(index[:, None] >= 0, tokens[index.clamp(min=0)], 0.0).to(dtype)
    out, _ = quantize_k_grouped(tokens, group_ends, row_index=index)
    monkeypatch.setenv("LOWPREC_BACKEND", "reference")
    ref, _ = quantize_k_grouped(gathered, group_ends)
    assert torch.equal(out.data.view(torch.uint8), ref.data.view(torch.uint8))
    assert torch.equal(out.scale, ref.scale)


def _wgrad_dtype_operands():
    ends = torch.tensor([100, 200], dtype=torch.int32)
    a, aligned = quantize_k_grouped(torch.randn(200, 32), ends)
    b, _ = quantize_k_grouped(torch.randn(200, 16), ends)
    return a, b, aligned


@pytest.mark.parametrize("out_dtype", [torch.int32, torch.float8_e4m3fn, torch.float64])
def test_wgrad_rejects_unsupported_out_dtype(out_dtype):
    a, b, aligned = _wgrad_dtype_operands()
    with pytest.raises(TypeError, match="out_dtype"):
        grouped_gemm_wgrad(a, b, aligned, out_dtype=out_dtype)


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_wgrad_takes_the_gemm_out_dtypes(out_dtype):
    a, b, aligned = _wgrad_dtype_operands()
    assert grouped_gemm_wgrad(a, b, aligned, out_dtype=out_dtype).dtype == out_dtype
