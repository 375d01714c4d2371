"""Hopper token packing (fused 1x128 quantization) and the sync-free MoE permutation path.

The kernel compiles for sm_90a on any machine (``tests/quant/test_sm90.py`` compiles every entry
of ``KERNELS``, ``pack_1x128`` included); on the GPU it must match ``pack`` on the reference
backend bit for bit.
"""

import pytest
import torch

import lowprec
from lowprec.moe import dispatch, pack, route, unpack
from lowprec.moe.packing import _pack_kernel_unsupported
from lowprec.quant.sm90.interface import KERNELS


def _routing(tokens, k, num_experts, kind, device, capacity_factor=None, policy="probs", seed=0):
    """A routing with a given load shape: ``balanced`` (uniform), ``zipf`` (skewed popularity),
    ``one`` (every slot to expert 1: the others empty), ``few`` (experts 0 and E-1 only)."""
    g = torch.Generator().manual_seed(seed)
    if kind == "balanced":
        ids = torch.rand(tokens, num_experts, generator=g).argsort(dim=1)[:, :k]
    elif kind == "zipf":
        popularity = 1.0 / torch.arange(1, num_experts + 1, dtype=torch.float64) ** 1.2
        ids = torch.multinomial(popularity.expand(tokens, -1), k, replacement=False, generator=g)
    elif kind == "one":
        ids = torch.ones(tokens, k, dtype=torch.int64)  # a token may list an expert twice
    else:
        ids = torch.where(torch.rand(tokens, k, generator=g) < 0.5, 0, num_experts - 1)
    weights = torch.rand(tokens, k, generator=g)
    return dispatch(weights.to(device), ids.to(device), num_experts, capacity_factor=capacity_factor,
                    drop_policy=policy)


def test_pack_kernel_is_shipped_and_compiled_in_ci():
    assert "pack_1x128" in KERNELS


def test_kernel_eligibility():
    r = _routing(8, 2, 4, "balanced", "cpu")
    x = torch.randn(8, 256, dtype=torch.bfloat16)
    assert _pack_kernel_unsupported(x, r, lowprec.get_recipe("fp8_block1x128")) is None
    assert "no packing kernel" in _pack_kernel_unsupported(x, r, lowprec.get_recipe("fp8_block1x128",
                                                                                     pow2_scale=True))
    assert "no packing kernel" in _pack_kernel_unsupported(x, r, lowprec.get_recipe("fp8_rowwise"))
    assert "multiple of 16" in _pack_kernel_unsupported(x[:, :40], r, lowprec.get_recipe("fp8_block1x128"))


def test_cpu_takes_the_reference_and_kernel_mode_refuses(monkeypatch):
    r = _routing(8, 2, 4, "balanced", "cpu")
    x = torch.randn(8, 256)
    monkeypatch.setenv("LOWPREC_BACKEND", "auto")
    q, _ = pack(x, r)
    assert q.scale.is_contiguous()  # the reference's row-major scales
    monkeypatch.setenv("LOWPREC_BACKEND", "kernel")
    with pytest.raises(RuntimeError, match="pack cannot run a kernel"):
        pack(x, r)


def _poison_allocator():
    """Leave NaN bytes in the caching allocator so an unwritten output element cannot pass."""
    torch.empty(64 << 20, dtype=torch.uint8, device="cuda").fill_(0x7F)


def _tokens(tokens, hidden, dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(tokens, hidden, device="cuda", generator=g)
    x = x * torch.exp(torch.randn(tokens, 1, device="cuda", generator=g))
    x[0, : min(hidden, 5)] *= 100  # outliers
    if tokens > 2:
        x[2] = 0  # an all-zero token
    return x.to(dtype)


def _pack_both(x, r, monkeypatch):
    monkeypatch.setenv("LOWPREC_BACKEND", "reference")
    ref, ref_ends = pack(x, r, "fp8_block1x128")
    monkeypatch.setenv("LOWPREC_BACKEND", "kernel")
    _poison_allocator()
    out, ends = pack(x, r, "fp8_block1x128")
    return out, ref, ends, ref_ends


def _assert_same(out, ref):
    assert out.shape == ref.shape and out.dtype == ref.dtype and out.recipe == ref.recipe
    assert torch.equal(out.data.view(torch.uint8), ref.data.view(torch.uint8))
    assert torch.equal(out.scale, ref.scale)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("kind", ["balanced", "zipf", "one", "few"])
@pytest.mark.parametrize("capacity_factor", [None, 0.5])
def test_pack_kernel_matches_reference(kind, capacity_factor, dtype, monkeypatch):
    r = _routing(300, 4, 16, kind, "cuda", capacity_factor, seed=len(kind))
    x = _tokens(300, 1040, dtype, seed=7)  # H = 8·128 + 16: a partial last block
    out, ref, ends, ref_ends = _pack_both(x, r, monkeypatch)
    _assert_same(out, ref)
    assert torch.equal(ends, ref_ends)
    assert out.scale.stride(0) == 1  # MN-major, as the GEMM reads it
    routed = int(ends[-1])
    assert (out.data[routed:].view(torch.uint8) == 0).all() and (out.scale[routed:] == 1).all()
    if capacity_factor is not None and kind != "balanced":
        assert routed < r.num_rows  # padding rows exercised


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(1, 1, 1, 16), (7, 2, 8, 128), (4096, 8, 64, 7168), (8192, 8, 128, 2048),
                                   (1000, 2, 8, 4096)])
@pytest.mark.parametrize("policy", ["probs", "position"])
def test_pack_kernel_model_shapes(shape, policy, monkeypatch):
    tokens, k, num_experts, hidden = shape
    for capacity_factor in (None, 1.0):
        r = _routing(tokens, k, num_experts, "zipf", "cuda", capacity_factor, policy, seed=tokens)
        out, ref, _, _ = _pack_both(_tokens(tokens, hidden, torch.bfloat16, seed=hidden), r, monkeypatch)
        _assert_same(out, ref)


@pytest.mark.gpu
def test_pack_without_kernel_shape_falls_back(monkeypatch):
    r = _routing(50, 2, 4, "zipf", "cuda", 0.75)
    x = _tokens(50, 40, torch.bfloat16, seed=1)  # H not a multiple of 16
    monkeypatch.setenv("LOWPREC_BACKEND", "reference")
    ref, _ = pack(x, r)
    monkeypatch.setenv("LOWPREC_BACKEND", "auto")
    _assert_same(pack(x, r)[0], ref)
    monkeypatch.setenv("LOWPREC_BACKEND", "kernel")
    with pytest.raises(RuntimeError, match="multiple of 16"):
        pack(x, r)


@pytest.mark.gpu
def test_pack_kernel_empty_and_deterministic(monkeypatch):
    monkeypatch.setenv("LOWPREC_BACKEND", "kernel")
    r = _routing(0, 2, 4, "balanced", "cuda")
    q, _ = pack(torch.zeros(0, 256, device="cuda"), r)
    assert q.shape == (0, 256)
    r = _routing(512, 2, 8, "zipf", "cuda", 1.0)
    x = _tokens(512, 2048, torch.bfloat16, seed=3)
    before = x.clone()
    a, b = pack(x, r)[0], pack(x, r)[0]
    _assert_same(a, b)
    assert torch.equal(x, before)


@pytest.mark.gpu
def test_unpack_on_cuda_matches_cpu_bitwise():
    r_cpu = _routing(300, 4, 16, "zipf", "cpu", 0.8)
    r = _routing(300, 4, 16, "zipf", "cuda", 0.8)
    g = torch.Generator().manual_seed(5)
    rows = torch.randn(r.num_rows, 96, generator=g, dtype=torch.bfloat16)
    weights = torch.rand(300, 4, generator=g)
    expected = unpack(rows, r_cpu, weights, out_dtype=torch.float32)
    for _ in range(2):
        assert torch.equal(unpack(rows.cuda(), r, weights.cuda(), out_dtype=torch.float32).cpu(), expected)


@pytest.mark.gpu
@pytest.mark.parametrize("capacity_factor", [None, 1.0])
@pytest.mark.parametrize("policy", ["probs", "position"])
def test_dispatch_on_cuda_matches_cpu(capacity_factor, policy):
    g = torch.Generator().manual_seed(6)
    ids = torch.randint(0, 16, (500, 4), generator=g)
    weights = torch.randint(0, 4, (500, 4), generator=g).float()  # many ties
    a = dispatch(weights, ids, 16, capacity_factor=capacity_factor, drop_policy=policy)
    b = dispatch(weights.cuda(), ids.cuda(), 16, capacity_factor=capacity_factor, drop_policy=policy)
    for name in ("kept", "slot_rows", "row_slots", "counts", "group_ends"):
        assert torch.equal(getattr(a, name), getattr(b, name).cpu()), name


def _moe_permutation(logits, x, capacity_factor):
    r = route(logits, 4, capacity_factor=capacity_factor)
    q, _ = pack(x, r)
    return unpack(q, r, r.combine_weights, out_dtype=torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("capacity_factor", [None, 1.25])
def test_route_pack_unpack_do_not_sync(capacity_factor, monkeypatch):
    monkeypatch.setenv("LOWPREC_BACKEND", "kernel")
    g = torch.Generator(device="cuda").manual_seed(8)
    logits = torch.randn(1024, 32, device="cuda", generator=g)
    x = torch.randn(1024, 512, device="cuda", generator=g, dtype=torch.bfloat16)
    expected = _moe_permutation(logits, x, capacity_factor)  # compiles the kernel, warms up torch
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        y = _moe_permutation(logits, x, capacity_factor)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(y, expected)


@pytest.mark.gpu
def test_route_pack_unpack_capture_in_a_cuda_graph(monkeypatch):
    monkeypatch.setenv("LOWPREC_BACKEND", "kernel")
    g = torch.Generator(device="cuda").manual_seed(9)
    logits = torch.randn(1024, 32, device="cuda", generator=g)
    x = torch.randn(1024, 512, device="cuda", generator=g, dtype=torch.bfloat16)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        _moe_permutation(logits, x, 1.0)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = _moe_permutation(logits, x, 1.0)
    logits.copy_(torch.randn(1024, 32, device="cuda", generator=g))  # new routing, same buffers
    x.copy_(torch.randn(1024, 512, device="cuda", generator=g))
    graph.replay()
    assert torch.equal(y, _moe_permutation(logits, x, 1.0))
