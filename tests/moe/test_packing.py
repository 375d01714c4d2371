import pytest
import torch

import lowprec
from lowprec.moe import dispatch, gather_rows, pack, unpack


def make_routing(tokens=40, k=2, num_experts=5, capacity_factor=0.75, policy="probs", seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(num_experts, generator=g)[:k] for _ in range(tokens)])
    weights = torch.rand(tokens, k, generator=g)
    return dispatch(weights, ids, num_experts, capacity_factor=capacity_factor, drop_policy=policy)


@pytest.mark.parametrize("recipe", ["fp8_block1x128", "fp8_rowwise", "mxfp8", "mxfp4"])
def test_pack_is_quantize_of_gathered_rows(recipe):
    r = make_routing()
    x = torch.randn(40, 320, generator=torch.Generator().manual_seed(1)) * 3
    x0 = x.clone()
    q, ends = pack(x, r, recipe)
    assert torch.equal(x, x0)
    assert torch.equal(ends, r.group_ends) and ends.dtype == torch.int32
    assert isinstance(q, lowprec.QuantizedTensor) and q.shape == (80, 320)
    # gathered rows, zero rows for padding, then quantized: the same bits
    src = [s // 2 if s >= 0 else None for s in r.row_slots.tolist()]
    gathered = torch.stack([x[t] if t is not None else torch.zeros(320) for t in src])
    ref = lowprec.quantize(gathered, recipe)
    assert torch.equal(q.data.view(torch.uint8), ref.data.view(torch.uint8))
    assert torch.equal(q.scale.view(torch.uint8), ref.scale.view(torch.uint8))
    assert int(ends[-1]) < 80  # some padding rows were exercised


def test_pack_plain_rows():
    r = make_routing()
    x = torch.randn(40, 16, requires_grad=True)
    rows, _ = pack(x, r, None)
    routed = int(r.group_ends[-1])
    assert torch.equal(rows[:routed], x.detach()[r.row_slots[:routed] // 2])
    assert (rows[routed:] == 0).all()
    rows.sum().backward()  # differentiable: each token gets one per kept slot
    assert torch.equal(x.grad[:, 0], r.kept.sum(1).float())


def test_round_trip_top1():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(33, 256, generator=g)
    r = dispatch(torch.ones(33, 1), torch.randint(0, 4, (33, 1), generator=g), 4)
    q, _ = pack(x, r)
    out = unpack(q, r, torch.ones(33, 1))
    assert out.dtype == torch.float32
    assert torch.equal(out, lowprec.quantize(x, "fp8_block1x128").dequantize(torch.float32))
    assert torch.equal(unpack(pack(x, r, None)[0], r), x)


@pytest.mark.parametrize("policy", ["probs", "position"])
def test_unpack_matches_loop(policy):
    r = make_routing(k=3, capacity_factor=0.6, policy=policy, seed=3)
    g = torch.Generator().manual_seed(4)
    rows = torch.randn(r.num_rows, 24, generator=g, dtype=torch.bfloat16)
    weights = torch.rand(40, 3, generator=g)
    out = unpack(rows, r, weights, out_dtype=torch.float32)
    for t in range(40):
        acc = torch.zeros(24)
        for j in range(3):  # slot order, FP32, product then sum: bit-exact
            row = int(r.slot_rows[t, j])
            if row >= 0:
                assert int(r.row_slots[row]) == t * 3 + j
                acc = acc + rows[row].float() * weights[t, j]
        assert torch.equal(out[t], acc)
    assert unpack(rows, r).dtype == torch.bfloat16
    dropped_all = (~r.kept).all(1)
    assert dropped_all.any() and (out[dropped_all] == 0).all()


def test_unpack_gradients():
    r = make_routing(seed=5)
    rows = torch.randn(r.num_rows, 8, requires_grad=True)
    weights = torch.rand(40, 2, requires_grad=True)
    dy = torch.randn(40, 8)
    (unpack(rows, r, weights) * dy).sum().backward()
    src = r.slot_rows.clamp(min=0)
    expected = torch.where(r.kept, (rows.detach()[src] * dy[:, None]).sum(-1), 0.0)
    torch.testing.assert_close(weights.grad, expected)
    assert (rows.grad[int(r.group_ends[-1]):] == 0).all()


def test_gather_rows_quantized_padding():
    r = make_routing(capacity_factor=0.5)
    q = gather_rows(lowprec.quantize(torch.randn(40, 128), "fp8_block1x128"), r)
    routed = int(r.group_ends[-1])
    assert (q.data[routed:].float() == 0).all() and (q.scale[routed:] == 1).all()


def test_errors():
    r = make_routing()
    x = torch.randn(40, 128)
    for recipe in ("fp8_block128x128", "fp8_tensorwise", "nvfp4"):
        with pytest.raises(ValueError, match="recipe: pack needs"):
            pack(x, r, recipe)
    with pytest.raises(ValueError, match=r"x: expected .*\[T=40, H\]"):
        pack(torch.randn(39, 128), r)
    with pytest.raises(ValueError, match="rows must be quantized independently"):
        gather_rows(lowprec.quantize(x, "fp8_block128x128"), r)
    with pytest.raises(ValueError, match="x:"):
        pack(torch.ones(40, 128, dtype=torch.int32), r)
    with pytest.raises(TypeError, match="routing"):
        pack(x, (r.topk_weights, r.topk_ids))
    with pytest.raises(ValueError, match=r"rows: expected a float tensor \[T·k=80, H\]"):
        unpack(torch.randn(40, 128), r)
    with pytest.raises(ValueError, match="weights"):
        unpack(torch.randn(80, 128), r, torch.rand(40, 3))


def test_unpack_of_quantized_rows_defaults_to_their_dtype():
    weights, ids = torch.rand(6, 2), torch.randint(0, 4, (6, 2), generator=torch.Generator().manual_seed(0))
    routing = dispatch(weights, ids, 4)
    rows, _ = pack(torch.randn(6, 128, dtype=torch.bfloat16), routing)
    assert rows.dtype == torch.bfloat16
    assert unpack(rows, routing).dtype == torch.bfloat16


@pytest.mark.parametrize("out_dtype", [torch.int32, "bfloat16"])
def test_unpack_refuses_an_out_dtype_that_is_not_a_float_dtype(out_dtype):
    """An int dtype used to truncate the combined rows silently; a string failed inside torch as a
    device name."""
    r = make_routing()
    with pytest.raises(TypeError, match="out_dtype: expected a float torch.dtype"):
        unpack(torch.randn(r.num_rows, 128), r, out_dtype=out_dtype)
