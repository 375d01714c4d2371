"""Hopper token packing (fused 1x128 quantization), unpack, and the sync-free MoE permutation path.

The kernels compile for sm_90a on any machine (``tests/moe/test_kernels_sm90.py`` compiles every
entry of ``KERNELS``, ``pack_1x128`` included; the unpack kernel is compiled here); on the GPU they must
match ``pack`` / ``unpack`` on the reference backend bit for bit.
"""

import re

import pytest
import torch

import lowprec
from lowprec.moe import dispatch, pack, route, unpack
from lowprec.moe.packing import _UnpackKernel, pack_tokens
from lowprec.moe.sm90.config import UNPACK_DTYPES, pack_unsupported, unpack_unsupported
from lowprec.moe.sm90.interface import KERNELS, build_unpack_kernel
from lowprec.runtime import cubin_arch, local_memory_ops, sass_of

from ..quant.test_sm90 import _data as _tokens  # outliers, an all-zero row
from ..quant.test_sm90 import _poison_allocator


def _choices(tokens, k, num_experts, kind, seed=0):
    """CPU top-k choices ``(ids, weights)``, both [T, k], with a given load shape: ``balanced``
    (uniform), ``zipf`` (skewed popularity), ``one`` (every slot to expert 1, or 0 when E = 1: the
    others empty; a token lists it k times), ``few`` (experts 0 and E-1 only), ``repeats``
    (uniform, a token may list an expert twice)."""
    g = torch.Generator().manual_seed(seed)
    if kind == "balanced":
        ids = torch.rand(tokens, num_experts, generator=g).argsort(dim=1)[:, :k]
    elif kind == "zipf":
        popularity = 1.0 / torch.arange(1, num_experts + 1, dtype=torch.float64) ** 1.2
        ids = torch.multinomial(popularity.expand(tokens, -1), k, replacement=False, generator=g)
    elif kind == "one":
        ids = torch.full((tokens, k), min(1, num_experts - 1), dtype=torch.int64)
    elif kind == "few":
        ids = torch.where(torch.rand(tokens, k, generator=g) < 0.5, 0, num_experts - 1)
    else:
        ids = torch.randint(0, num_experts, (tokens, k), generator=g)
    return ids, torch.rand(tokens, k, generator=g)


def _routing(tokens, k, num_experts, kind, device, capacity_factor=None, policy="probs", seed=0):
    """The routing of :func:`_choices` on ``device``."""
    ids, weights = _choices(tokens, k, num_experts, kind, seed)
    return dispatch(weights.to(device), ids.to(device), num_experts, capacity_factor=capacity_factor,
                    drop_policy=policy)


def test_pack_kernel_is_shipped_and_compiled_in_ci():
    assert "pack_1x128" in KERNELS


def test_kernel_eligibility():
    r = _routing(8, 2, 4, "balanced", "cpu")
    x = torch.randn(8, 256, dtype=torch.bfloat16)
    r1x128 = lowprec.get_recipe("fp8_block1x128")
    assert pack_unsupported(x, r, r1x128, False) is None
    assert "no packing kernel" in pack_unsupported(x, r, lowprec.get_recipe("fp8_block1x128", pow2_scale=True), False)
    assert "no packing kernel" in pack_unsupported(x, r, lowprec.get_recipe("fp8_rowwise"), False)
    assert "multiple of 16" in pack_unsupported(x[:, :40], r, r1x128, False)


def test_cpu_takes_the_reference_and_kernel_mode_refuses(monkeypatch):
    r = _routing(8, 2, 4, "balanced", "cpu")
    x = torch.randn(8, 256)
    monkeypatch.setenv("LOWPREC_BACKEND", "auto")
    q, _ = pack(x, r)
    assert q.scale.is_contiguous()  # the reference's row-major scales
    monkeypatch.setenv("LOWPREC_BACKEND", "kernel")
    with pytest.raises(RuntimeError, match="pack cannot run a kernel"):
        pack(x, r)


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


def test_pack_tokens_is_pack_and_quantize():
    r = _routing(40, 3, 6, "zipf", "cpu", 0.75)
    x = torch.randn(40, 384, generator=torch.Generator().manual_seed(3))
    rows, tokens, ends = pack_tokens(x, r)
    _assert_same(rows, pack(x, r)[0])
    _assert_same(tokens, lowprec.quantize(x, "fp8_block1x128"))
    assert ends is r.group_ends
    with pytest.raises(ValueError, match="recipe"):
        pack_tokens(x, r, "fp8_block128x128")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(300, 4, 16, 1040), (4096, 8, 64, 7168), (1, 1, 1, 16)])
def test_pack_tokens_kernel_matches_reference(shape, dtype, monkeypatch):
    tokens, k, num_experts, hidden = shape
    r = _routing(tokens, k, num_experts, "zipf", "cuda", 0.75, seed=tokens)
    x = _tokens(tokens, hidden, dtype, seed=hidden)
    monkeypatch.setenv("LOWPREC_BACKEND", "reference")
    ref_rows, ref_tokens, _ = pack_tokens(x, r)
    monkeypatch.setenv("LOWPREC_BACKEND", "kernel")
    _poison_allocator()
    rows, toks, _ = pack_tokens(x, r)
    _assert_same(rows, ref_rows)
    _assert_same(toks, ref_tokens)
    assert rows.scale.stride(0) == 1 and toks.scale.stride(0) == 1  # MN-major, as the GEMM reads them
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        again = pack_tokens(x, r)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    _assert_same(again[1], ref_tokens)


@pytest.mark.gpu
def test_unpack_on_cuda_matches_cpu_bitwise(monkeypatch):
    r_cpu = _routing(300, 4, 16, "zipf", "cpu", 0.8)
    r = _routing(300, 4, 16, "zipf", "cuda", 0.8)
    g = torch.Generator().manual_seed(5)
    rows = torch.randn(r.num_rows, 96, generator=g, dtype=torch.bfloat16)
    weights = torch.rand(300, 4, generator=g)
    with monkeypatch.context() as m:  # the CPU side is the reference even under LOWPREC_BACKEND=kernel
        m.setenv("LOWPREC_BACKEND", "reference")
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


# ---------------------------------------------------------------------------------------------- unpack
@pytest.mark.parametrize("dtype, out_dtype, top_k", [(torch.bfloat16, torch.bfloat16, 8),
                                                     (torch.float32, torch.float32, 1),
                                                     (torch.float16, torch.bfloat16, 2),
                                                     (torch.bfloat16, torch.float32, 4)])
def test_unpack_kernel_compiles_for_sm90a_unfused_and_without_spills(dtype, out_dtype, top_k):
    sass = sass_of(build_unpack_kernel(dtype, out_dtype, top_k))
    assert cubin_arch(sass) == "sm_90a"
    assert local_memory_ops(sass) == 0
    loads = 8 * dtype.itemsize // 16  # 16-byte loads per row and thread
    assert len(re.findall(r"LDG\.E\.128", sass)) == top_k * loads  # each slot's row read once
    # weight · row then + acc, each rounded: FMUL and FADD per element and slot, never FFMA
    assert "FFMA" not in sass
    assert len(re.findall(r"\bFMUL\b", sass)) == 8 * top_k
    assert len(re.findall(r"\bFADD\b", sass)) == 8 * top_k
    assert "ACQBULK" in sass  # griddepcontrol.wait: safe under programmatic dependent launch


def test_unpack_kernel_eligibility():
    r = _routing(8, 2, 4, "balanced", "cpu")
    rows = torch.randn(16, 256, dtype=torch.bfloat16)
    assert unpack_unsupported(rows, r, None, torch.float32) is None
    assert "takes" in unpack_unsupported(rows.double(), r, None, torch.float32)
    assert "takes" in unpack_unsupported(rows, r, None, torch.float64)
    assert "multiple of 16" in unpack_unsupported(rows[:, :40], r, None, torch.bfloat16)
    assert set(UNPACK_DTYPES) == {torch.bfloat16, torch.float16, torch.float32}


def test_unpack_cpu_takes_the_reference_and_kernel_mode_refuses(monkeypatch):
    r = _routing(8, 2, 4, "balanced", "cpu")
    rows = torch.randn(16, 256)
    monkeypatch.setenv("LOWPREC_BACKEND", "auto")
    assert unpack(rows, r).shape == (8, 256)
    monkeypatch.setenv("LOWPREC_BACKEND", "kernel")
    with pytest.raises(RuntimeError, match="unpack cannot run a kernel"):
        unpack(rows, r)


def _reference_unpack_rows(rows, routing, weights, out_dtype):
    """The kernel's contract in torch (for testing the autograd wrapper without a GPU)."""
    slot_rows = routing.slot_rows
    acc = torch.zeros(slot_rows.shape[0], rows.shape[1])
    for j in range(slot_rows.shape[1]):
        term = rows[slot_rows[:, j].clamp(min=0)].float() * weights[:, j, None]
        acc = acc + torch.where(slot_rows[:, j, None] >= 0, term, 0.0)
    return acc.to(out_dtype)


@pytest.mark.parametrize("weighted", [True, False])
def test_unpack_kernel_gradients_match_the_reference(weighted):
    r = _routing(60, 3, 5, "zipf", "cpu", 0.5, seed=4)
    assert (~r.kept).all(1).any()  # a token with every slot dropped
    g = torch.Generator().manual_seed(3)
    rows = torch.randn(r.num_rows, 32, generator=g, dtype=torch.bfloat16)
    weights = torch.rand(60, 3, generator=g, dtype=torch.float64) if weighted else None
    dout = torch.randn(60, 32, generator=g)
    grads = []
    for fn in (lambda a, w: _UnpackKernel.apply(_reference_unpack_rows, a, w, r, torch.float32),
               lambda a, w: unpack(a, r, w, out_dtype=torch.float32)):
        leaves = [rows.clone().requires_grad_(), None if weights is None else weights.clone().requires_grad_()]
        out = fn(*leaves)
        out.backward(dout)
        grads.append((out.detach(), leaves[0].grad, None if weights is None else leaves[1].grad))
    (out, drows, dweights), (ref, ref_drows, ref_dweights) = grads
    assert torch.equal(out, ref)
    assert drows.dtype == torch.bfloat16 and torch.equal(drows, ref_drows)
    if weighted:
        assert dweights.dtype == torch.float64
        torch.testing.assert_close(dweights, ref_dweights, rtol=1e-5, atol=1e-6)
        assert (dweights[~r.kept] == 0).all()



@pytest.mark.parametrize("first", ["rows", "weights"])
def test_unpack_kernel_double_backward_is_an_error(first):
    """The backward uses the weights detached (as FP32): a second derivative through it would be
    partial, so it is an error, as for the experts."""
    r = _routing(12, 2, 4, "balanced", "cpu", seed=1)
    g = torch.Generator().manual_seed(5)
    rows = torch.randn(r.num_rows, 16, generator=g, requires_grad=True)
    weights = torch.rand(12, 2, generator=g, requires_grad=True)
    out = _UnpackKernel.apply(_reference_unpack_rows, rows, weights, r, torch.float32)
    (grad,) = torch.autograd.grad(out.pow(2).sum(), rows if first == "rows" else weights, create_graph=True)
    with pytest.raises(RuntimeError, match="differentiate twice"):
        grad.pow(2).sum().backward()


@pytest.mark.parametrize("first", ["rows", "weights"])
def test_unpack_kernel_second_derivative_through_computed_inputs_is_an_error(first):
    """Rows and weights computed from leaves, a gradient from a loss (constant incoming gradient):
    a second derivative w.r.t. the other input's leaf must fail, not silently lack this term."""
    r = _routing(12, 2, 4, "balanced", "cpu", seed=1)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(r.num_rows, 16, generator=g, requires_grad=True)
    logits = torch.randn(12, 2, generator=g, requires_grad=True)
    out = _UnpackKernel.apply(_reference_unpack_rows, x * 1.5, logits.softmax(-1), r, torch.float32)
    wrt, other = (x, logits) if first == "rows" else (logits, x)
    (grad,) = torch.autograd.grad(out.sum(), wrt, create_graph=True)
    with pytest.raises(RuntimeError, match="differentiate twice"):
        torch.autograd.grad(grad.pow(2).sum() + other.sum(), other)


def _unpack_both(rows, r, weights, out_dtype, monkeypatch):
    monkeypatch.setenv("LOWPREC_BACKEND", "reference")
    ref = unpack(rows, r, weights, out_dtype=out_dtype)
    monkeypatch.setenv("LOWPREC_BACKEND", "kernel")
    _poison_allocator()
    return unpack(rows, r, weights, out_dtype=out_dtype), ref


def _packed_rows(r, hidden, dtype, seed):
    """Rows with a wide range of magnitudes; padding rows NaN (a kernel reading them would show)."""
    rows = _tokens(r.num_rows, hidden, torch.float32, seed)
    rows[r.row_slots < 0] = float("nan")
    return rows.to(dtype)


def _assert_bits(out, ref):
    assert out.shape == ref.shape and out.dtype == ref.dtype
    ints = {2: torch.int16, 4: torch.int32}[out.itemsize]
    assert torch.equal(out.view(ints), ref.view(ints))  # -0 and +0 differ too


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, out_dtype", [(torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32),
                                              (torch.float32, torch.float32), (torch.float32, torch.bfloat16),
                                              (torch.float16, torch.float16)])
@pytest.mark.parametrize("kind", ["balanced", "zipf", "one", "few"])
@pytest.mark.parametrize("capacity_factor", [None, 0.5])
def test_unpack_kernel_matches_reference(kind, capacity_factor, dtype, out_dtype, monkeypatch):
    r = _routing(300, 4, 16, kind, "cuda", capacity_factor, seed=len(kind))
    rows = _packed_rows(r, 1040, dtype, seed=11)  # H = 8·128 + 16: a partly used CTA
    g = torch.Generator(device="cuda").manual_seed(12)
    for weights in (None, torch.rand(300, 4, device="cuda", generator=g) * 2 - 0.5,
                    torch.rand(300, 4, device="cuda", generator=g).to(torch.bfloat16)):
        out, ref = _unpack_both(rows, r, weights, out_dtype, monkeypatch)
        _assert_bits(out, ref)
    if capacity_factor is not None and kind in ("one", "few"):
        dropped_all = (~r.kept).all(1)
        assert dropped_all.any() and (out[dropped_all] == 0).all()


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(1, 1, 1, 16), (7, 2, 8, 128), (4096, 8, 64, 7168), (8192, 8, 128, 2048),
                                   (4096, 2, 8, 4096), (1000, 6, 8, 272)])
def test_unpack_kernel_model_shapes(shape, monkeypatch):
    tokens, k, num_experts, hidden = shape
    for capacity_factor in (None, 1.0):
        r = _routing(tokens, k, num_experts, "zipf", "cuda", capacity_factor, seed=tokens)
        rows = _packed_rows(r, hidden, torch.bfloat16, seed=hidden)
        out, ref = _unpack_both(rows, r, r.combine_weights, torch.bfloat16, monkeypatch)
        _assert_bits(out, ref)


@pytest.mark.gpu
def test_unpack_kernel_gradients_on_gpu(monkeypatch):
    r = _routing(500, 4, 16, "zipf", "cuda", 0.75, seed=2)
    rows = _tokens(r.num_rows, 512, torch.bfloat16, seed=5)
    weights = torch.rand(500, 4, device="cuda")
    dout = torch.randn(500, 512, device="cuda")
    grads = {}
    for mode in ("reference", "kernel"):
        monkeypatch.setenv("LOWPREC_BACKEND", mode)
        leaves = (rows.clone().requires_grad_(), weights.clone().requires_grad_())
        out = unpack(*leaves[:1], r, leaves[1], out_dtype=torch.float32)
        out.backward(dout)
        grads[mode] = (out.detach(), leaves[0].grad, leaves[1].grad)
    (ref, ref_drows, ref_dw), (out, drows, dw) = grads["reference"], grads["kernel"]
    assert torch.equal(out, ref) and torch.equal(drows, ref_drows)
    torch.testing.assert_close(dw, ref_dw, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
def test_unpack_kernel_does_not_sync(monkeypatch):
    monkeypatch.setenv("LOWPREC_BACKEND", "kernel")
    r = _routing(1024, 4, 32, "zipf", "cuda", 1.0, seed=6)
    rows = _tokens(r.num_rows, 512, torch.bfloat16, seed=6).requires_grad_()
    weights = torch.rand(1024, 4, device="cuda", requires_grad=True)

    def step():
        plain = unpack(rows.detach(), r, out_dtype=torch.float32)
        out = unpack(rows, r, weights, out_dtype=torch.float32)
        out.backward(plain)
        return out.detach()

    expected = step()  # compiles the kernel, warms up torch
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(out, expected)
