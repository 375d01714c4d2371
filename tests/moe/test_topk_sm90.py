"""The router's top-k ids kernel (``lowprec.moe.sm90.topk``): compiles for sm_90a on any machine;
on the GPU its ids are those of the stable descending sort, ties, NaN and -0 included (torch, CPU and
CUDA: NaN first, -0 equal to +0)."""

import re

import pytest
import torch

from lowprec.moe.routing import select_experts
from lowprec.moe.sm90.config import topk_unsupported
from lowprec.moe.sm90.interface import build_topk_kernel
from lowprec.runtime import cubin_arch, local_memory_ops, sass_of

needs_gpu = pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)),
                               reason="needs an sm_90 GPU")


@pytest.mark.parametrize("num_experts,top_k", [(8, 2), (60, 4), (128, 8), (512, 8), (16, 16)])
def test_compiles_for_sm90a_in_registers(num_experts, top_k):
    sass = sass_of(build_topk_kernel(num_experts, top_k))
    assert cubin_arch(sass) == "sm_90a"
    assert local_memory_ops(sass) == 0
    assert re.search(r"SHFL\.BFLY", sass)
    assert "ACQBULK" in sass  # griddepcontrol.wait: safe under programmatic dependent launch


def test_eligibility():
    scores = torch.rand(4, 64)
    assert topk_unsupported(scores, 8) is None
    assert "float32" in topk_unsupported(scores.double(), 8)
    assert "contiguous" in topk_unsupported(scores.t(), 2)
    assert "experts" in topk_unsupported(torch.rand(2, 513), 2)
    assert "top_k" in topk_unsupported(scores, 65)


def _sorted_ids(scores, k):
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :k]


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("tokens,num_experts,top_k", [(1, 128, 8), (1000, 64, 8), (37, 60, 4), (5, 8, 8),
                                                      (300, 512, 8), (64, 16, 1), (0, 64, 2)])
def test_ids_are_the_stable_sort(tokens, num_experts, top_k, monkeypatch):
    from lowprec.moe.sm90.interface import topk_ids

    g = torch.Generator(device="cuda").manual_seed(num_experts + tokens)
    scores = torch.rand(tokens, num_experts, device="cuda", generator=g).softmax(-1)
    ties = (torch.randint(0, 4, (tokens, num_experts), device="cuda", generator=g) / 4).float()  # many equal
    special = ties.clone()
    if tokens > 3:
        special[0] = float("nan")  # all NaN: ids 0..k-1
        special[1, ::3] = float("nan")  # NaN above everything, in id order
        special[2] = 0.0
        special[2, 1::2] = -0.0  # -0 equal to +0
        special[3] = torch.tensor([-1.0, float("-inf"), float("inf")] * num_experts, device="cuda")[:num_experts]
    for name, s in (("scores", scores), ("ties", ties), ("special", special)):
        ids, expected = topk_ids(s, top_k), _sorted_ids(s, top_k)
        bad = (ids != expected).any(dim=1).nonzero().flatten()[:4].tolist()
        assert not bad, (name, bad, [ids[i].tolist() for i in bad], [expected[i].tolist() for i in bad])


@pytest.mark.gpu
@needs_gpu
def test_select_experts_runs_the_kernel(monkeypatch):
    logits = torch.randn(33, 128, device="cuda")
    expected = select_experts(logits.cpu(), 8)
    monkeypatch.setenv("LOWPREC_BACKEND", "kernel")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        weights, ids = select_experts(logits, 8)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(ids.cpu(), expected[1])
    torch.testing.assert_close(weights.cpu(), expected[0])


def test_topk_refuses_more_than_2_31_scores():
    """The kernel reads [T, E] of a static row stride E with an Int32 row count: row·E + e is 32-bit."""
    assert topk_unsupported(torch.empty((1 << 23) + 1, 256, device="meta"), 8) is not None
    assert topk_unsupported(torch.empty(1 << 23, 256, device="meta"), 8) is None
