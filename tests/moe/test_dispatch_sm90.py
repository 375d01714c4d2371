"""Hopper dispatch-plan kernels (dropless and "position" drops): they compile for sm_90a on any
machine (no spills); on the GPU the plan is the torch form's, field for field."""

import dataclasses

import pytest
import torch

from lowprec.moe import dispatch, route
from lowprec.moe.sm90.config import MAX_EXPERTS, MAX_SLOTS, dispatch_unsupported
from lowprec.moe.sm90.interface import build_dispatch_kernel
from lowprec.runtime import cubin_arch, local_memory_ops, sass_of

from .test_packing_sm90 import _choices


@pytest.mark.parametrize("num_experts", [1, 8, 60, 128, 256, 384, 512])
def test_dispatch_kernels_compile_for_sm90a_without_spills(num_experts):
    sass = sass_of(build_dispatch_kernel(num_experts))
    assert cubin_arch(sass) == "sm_90a"
    assert local_memory_ops(sass) == 0
    assert "MATCH.ANY" in sass  # the in-warp ranking


def test_dispatch_unsupported_names_the_limit():
    def ids(n):
        return torch.empty(n, dtype=torch.int64)

    assert dispatch_unsupported(ids(MAX_SLOTS), MAX_EXPERTS, None) is None
    assert f"E={MAX_EXPERTS + 1}" in dispatch_unsupported(ids(8), MAX_EXPERTS + 1, None)
    assert f"{MAX_SLOTS + 1} slots" in dispatch_unsupported(ids(MAX_SLOTS + 1), 8, None)


def _both(weights, ids, num_experts, monkeypatch, **kw):
    monkeypatch.setenv("LOWPREC_BACKEND", "reference")
    ref = dispatch(weights, ids, num_experts, **kw)
    monkeypatch.setenv("LOWPREC_BACKEND", "kernel")
    return dispatch(weights, ids, num_experts, **kw), ref


def _assert_same_plan(out, ref):
    for f in dataclasses.fields(ref):
        a, b = getattr(out, f.name), getattr(ref, f.name)
        if isinstance(b, torch.Tensor):
            assert a.dtype == b.dtype and a.shape == b.shape, f.name
            assert torch.equal(a, b), f.name
        else:
            assert a == b, f.name


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["balanced", "zipf", "one", "repeats"])
@pytest.mark.parametrize("shape", [(1, 1, 1), (5, 2, 4), (333, 3, 60), (1000, 8, 128), (4096, 8, 64),
                                   (8192, 8, 128), (16384, 8, 256), (2048, 8, 384), (1000, 8, 512)])
def test_dispatch_kernel_is_the_torch_plan(shape, kind, monkeypatch):
    tokens, k, num_experts = shape
    if k > num_experts and kind in ("balanced", "zipf"):
        pytest.skip("top-k without repeats needs k <= E")
    ids, weights = _choices(tokens, k, num_experts, kind, seed=tokens + k)
    out, ref = _both(weights.cuda(), ids.cuda(), num_experts, monkeypatch)
    _assert_same_plan(out, ref)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["balanced", "zipf", "one", "repeats"])
@pytest.mark.parametrize("capacity_factor", [0.25, 1.0, 1.25, 100.0])
@pytest.mark.parametrize("shape", [(5, 2, 4), (333, 3, 60), (4096, 8, 64), (16384, 8, 256)])
def test_dispatch_kernel_position_drops_are_the_torch_plan(shape, capacity_factor, kind, monkeypatch):
    tokens, k, num_experts = shape
    ids, weights = _choices(tokens, k, num_experts, kind, seed=tokens + 7)
    out, ref = _both(weights.cuda(), ids.cuda(), num_experts, monkeypatch, capacity_factor=capacity_factor,
                     drop_policy="position")
    _assert_same_plan(out, ref)
    if capacity_factor < 1 or (kind == "one" and capacity_factor < 100):
        assert not bool(out.kept.all())  # drops exercised


@pytest.mark.gpu
def test_dispatch_kernel_int32_ids_empty_and_route(monkeypatch):
    ids, weights = _choices(700, 4, 32, "zipf", seed=1)
    out, ref = _both(weights.cuda(), ids.int().cuda(), 32, monkeypatch)
    _assert_same_plan(out, ref)
    out, ref = _both(torch.zeros(0, 2, device="cuda"), torch.zeros(0, 2, dtype=torch.int64, device="cuda"), 8,
                     monkeypatch)
    _assert_same_plan(out, ref)
    logits = torch.randn(2048, 64, device="cuda")
    monkeypatch.setenv("LOWPREC_BACKEND", "reference")
    ref = route(logits, 6)
    monkeypatch.setenv("LOWPREC_BACKEND", "kernel")
    _assert_same_plan(route(logits, 6), ref)


@pytest.mark.gpu
def test_dispatch_kernel_drops_ids_out_of_range():
    """check_ids=False promises ids in [0, E); where that is broken the slots are dropped, with no
    out-of-bounds access and a consistent plan."""
    ids = torch.tensor([[0, 9], [-1, 1], [1, 0]], device="cuda")
    r = dispatch(torch.ones(3, 2, device="cuda"), ids, 2, check_ids=False)
    assert r.kept.tolist() == [[True, False], [False, True], [True, True]]
    assert r.counts.tolist() == [2, 2] and r.group_ends.tolist() == [2, 4]
    assert r.row_slots.tolist() == [0, 5, 3, 4, -1, -1]
    assert r.slot_rows.tolist() == [[0, -1], [-1, 2], [3, 1]]


@pytest.mark.gpu
def test_dispatch_kernel_in_a_cuda_graph(monkeypatch):
    monkeypatch.setenv("LOWPREC_BACKEND", "kernel")
    ids, weights = _choices(4096, 8, 128, "zipf", seed=3)
    ids, weights = ids.cuda(), weights.cuda()
    ref = dispatch(weights, ids, 128, check_ids=False)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = dispatch(weights, ids, 128, check_ids=False)
    graph.replay()
    torch.cuda.synchronize()
    _assert_same_plan(captured, ref)
