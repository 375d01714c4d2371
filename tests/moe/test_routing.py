import datetime
import math
import tempfile
from fractions import Fraction

import numpy as np
import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

import lowprec.moe as moe
from lowprec.moe import (
    FP8InferenceMoE,
    MoE,
    NVFP4InferenceMoE,
    Routing,
    dispatch,
    expert_capacity,
    route,
    select_experts,
)


def loop_dispatch(weights, ids, num_experts, capacity_factor, policy):
    """Plain-Python dispatch: (kept [T][k], packed slot order, counts)."""
    tokens, k = ids.shape
    w, e_of = weights.flatten().tolist(), ids.flatten().tolist()
    cap = expert_capacity(tokens, k, num_experts, capacity_factor)
    kept, order, counts = set(), [], []
    for e in range(num_experts):
        mine = [s for s in range(tokens * k) if e_of[s] == e]
        if cap is not None:
            if policy == "probs":
                mine = sorted(mine, key=lambda s: (-w[s], s))
            mine = sorted(mine[:cap])
        kept.update(mine)
        order += mine
        counts.append(len(mine))
    kept_mask = [[t * k + j in kept for j in range(k)] for t in range(tokens)]
    return kept_mask, order, counts


def check_against_loop(weights, ids, num_experts, capacity_factor, policy):
    r = dispatch(weights, ids, num_experts, capacity_factor=capacity_factor, drop_policy=policy)
    kept, order, counts = loop_dispatch(weights, ids, num_experts, capacity_factor, policy)
    n = ids.numel()
    assert r.kept.tolist() == kept
    assert r.counts.dtype == torch.int32 and r.counts.tolist() == counts
    assert r.group_ends.dtype == torch.int32 and r.group_ends.tolist() == list(torch.tensor(counts).cumsum(0))
    assert r.row_slots.tolist() == order + [-1] * (n - len(order))
    expected_rows = [-1] * n
    for row, slot in enumerate(order):
        expected_rows[slot] = row
    assert r.slot_rows.flatten().tolist() == expected_rows
    assert r.num_rows == n and r.capacity == expert_capacity(*ids.shape, num_experts, capacity_factor)
    return r


@pytest.mark.parametrize("policy", ["probs", "position"])
@pytest.mark.parametrize("capacity_factor", [None, 0.3, 1.0, 1.25, 4.0])
def test_dispatch_matches_loop(policy, capacity_factor):
    g = torch.Generator().manual_seed(0)
    tokens, k, num_experts = 37, 2, 5  # E does not divide T·k
    ids = torch.stack([torch.randperm(num_experts, generator=g)[:k] for _ in range(tokens)])
    # skewed load so that capacity bites
    ids = torch.where(torch.rand(tokens, k, generator=g) < 0.4, ids % 2, ids)
    weights = torch.rand(tokens, k, generator=g)
    r = check_against_loop(weights, ids, num_experts, capacity_factor, policy)
    if capacity_factor is None:
        assert r.kept.all()


@settings(max_examples=40, deadline=None)
@given(tokens=st.integers(0, 50), num_experts=st.integers(1, 8), data=st.data(), seed=st.integers(0, 2**16),
       capacity_factor=st.one_of(st.none(), st.floats(0.05, 3.0)), policy=st.sampled_from(["probs", "position"]))
def test_dispatch_matches_loop_random(tokens, num_experts, data, seed, capacity_factor, policy):
    k = data.draw(st.integers(1, num_experts))
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, num_experts, (tokens, k), generator=g)  # repeats within a token are allowed
    weights = torch.randint(0, 4, (tokens, k), generator=g).float()  # coarse: many ties
    check_against_loop(weights, ids, num_experts, capacity_factor, policy)


@pytest.mark.parametrize("policy", ["probs", "position"])
def test_ties_go_to_lower_slot(policy):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 3, (40, 2), generator=g, dtype=torch.int32)
    weights = torch.randint(0, 3, (40, 2), generator=g).float() / 4  # many equal weights
    check_against_loop(weights, ids, 3, 0.5, policy)
    # equal weights: "probs" degenerates to "position"
    same = torch.full((40, 2), 0.5)
    a = dispatch(same, ids, 3, capacity_factor=0.5, drop_policy="probs")
    b = dispatch(same, ids, 3, capacity_factor=0.5, drop_policy="position")
    assert torch.equal(a.kept, b.kept) and torch.equal(a.row_slots, b.row_slots)


def test_probs_keeps_highest_weights():
    ids = torch.zeros(6, 1, dtype=torch.int64)
    weights = torch.tensor([[0.1], [0.9], [0.5], [0.9], [0.2], [0.7]])
    r = dispatch(weights, ids, 2, capacity_factor=1.0, drop_policy="probs")  # C = ceil(6/2) = 3
    assert r.capacity == 3
    assert r.kept.flatten().tolist() == [False, True, False, True, False, True]
    assert r.row_slots.tolist() == [1, 3, 5, -1, -1, -1]  # kept rows in token order
    r = dispatch(weights, ids, 2, capacity_factor=1.0, drop_policy="position")
    assert r.kept.flatten().tolist() == [True, True, True, False, False, False]


@pytest.mark.parametrize("policy", ["probs", "position"])
def test_all_tokens_to_one_expert_and_empty_experts(policy):
    tokens = 16
    weights = torch.rand(tokens, 1, generator=torch.Generator().manual_seed(2))
    ids = torch.full((tokens, 1), 3)
    r = check_against_loop(weights, ids, 8, 2.0, policy)  # C = ceil(16/8 · 2) = 4
    assert r.counts.tolist() == [0, 0, 0, 4, 0, 0, 0, 0]
    assert r.group_ends.tolist() == [0, 0, 0, 4, 4, 4, 4, 4]
    r = check_against_loop(weights, ids, 8, None, policy)
    assert r.counts.tolist() == [0, 0, 0, 16, 0, 0, 0, 0]


def test_stats():
    ids = torch.tensor([[0, 1]] * 6 + [[2, 0]] * 2)
    r = dispatch(torch.rand(8, 2), ids, 4, capacity_factor=1.0, drop_policy="position")  # C = 4; tokens 4, 5 lose both
    assert r.counts.tolist() == [4, 4, 2, 0]
    s = r.stats()
    assert s == {"dropped": 6.0, "dropped_tokens": 2.0, "padding_rows": 6.0, "max_load": 4.0, "mean_load": 2.5,
                 "capacity": 4.0}
    assert dispatch(torch.rand(8, 2), ids, 4).stats()["capacity"] == math.inf


def test_combine_weights_zero_dropped():
    weights = torch.rand(8, 1, requires_grad=True)
    r = dispatch(weights, torch.zeros(8, 1, dtype=torch.int64), 2, capacity_factor=0.5, drop_policy="position")
    cw = r.combine_weights
    assert torch.equal(cw[:2], weights[:2].detach()) and (cw[2:] == 0).all()
    cw.sum().backward()
    assert weights.grad.flatten().tolist() == [1, 1] + [0] * 6


def test_expert_capacity():
    assert expert_capacity(10, 1, 4, 1.2) == 3  # float math would give ceil(3.0000000000000004) = 4
    assert expert_capacity(10, 1, 4, 1.0) == 3  # E does not divide T
    assert expert_capacity(8, 2, 4, 1) == 4
    assert expert_capacity(100, 1, 10, 0.1) == 1
    assert expert_capacity(5, 1, 8, 0.01) == 1
    assert expert_capacity(5, 1, 8, None) is None


@pytest.mark.parametrize(("args", "name"), [((10, 1, 0, 1.0), "num_experts"), ((10, 1, 0, None), "num_experts"),
                                            ((10, 1, 4.0, 1.0), "num_experts"), ((10, 1, True, 1.0), "num_experts"),
                                            ((10, 0, 4, 1.0), "top_k"), ((-1, 1, 4, 1.0), "num_tokens")])
def test_expert_capacity_rejects_bad_sizes(args, name):
    with pytest.raises(ValueError, match=f"{name}: expected an int"):  # not a bare ZeroDivisionError
        expert_capacity(*args)


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
@pytest.mark.parametrize("renormalize", [True, False])
def test_select_experts(score_func, renormalize):
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(20, 6, generator=g, dtype=torch.float64)
    weights, ids = select_experts(logits, 3, score_func=score_func, renormalize=renormalize)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int64 and ids.shape == (20, 3)
    scores = logits.softmax(-1) if score_func == "softmax" else logits.sigmoid()
    for t in range(20):
        best = sorted(range(6), key=lambda e: (-scores[t, e].item(), e))[:3]
        assert ids[t].tolist() == best
        expected = scores[t, best]
        if renormalize:
            expected = expected / expected.sum()
        torch.testing.assert_close(weights[t].double(), expected, rtol=1e-6, atol=0)


def test_select_experts_ties_lower_id_first():
    logits = torch.tensor([[1.0, 2.0, 2.0, 0.0], [0.0, 0.0, 0.0, 0.0], [3.0, 1.0, 3.0, 3.0]])
    _, ids = select_experts(logits, 2)
    assert ids.tolist() == [[1, 2], [0, 1], [0, 2]]


def test_select_experts_gradient_and_route():
    logits = torch.randn(12, 4, generator=torch.Generator().manual_seed(4), requires_grad=True)
    r = route(logits, 2, capacity_factor=1.0, drop_policy="position")
    weights, ids = select_experts(logits, 2)
    ref = dispatch(weights, ids, 4, capacity_factor=1.0, drop_policy="position")
    assert isinstance(r, Routing) and torch.equal(r.topk_ids, ids) and torch.equal(r.kept, ref.kept)
    assert torch.equal(r.row_slots, ref.row_slots)
    (r.topk_weights * torch.arange(2.0)).sum().backward()
    assert logits.grad is not None and logits.grad.abs().sum() > 0


def test_inputs_not_modified():
    weights, ids = torch.rand(9, 2), torch.randint(0, 3, (9, 2))
    w0, i0 = weights.clone(), ids.clone()
    dispatch(weights, ids, 3, capacity_factor=0.5)
    assert torch.equal(weights, w0) and torch.equal(ids, i0)


def test_empty_batch():
    r = dispatch(torch.zeros(0, 2), torch.zeros(0, 2, dtype=torch.int64), 4, capacity_factor=1.0)
    assert r.num_rows == 0 and r.counts.tolist() == [0] * 4 and r.stats()["dropped"] == 0


def test_errors():
    ids, weights = torch.zeros(4, 2, dtype=torch.int64), torch.rand(4, 2)
    with pytest.raises(ValueError, match="top_k: 3 is more than num_experts=2"):
        select_experts(torch.randn(4, 2), 3)
    with pytest.raises(ValueError, match="top_k"):
        select_experts(torch.randn(4, 2), 0)
    with pytest.raises(ValueError, match="top_k: 2 is more than num_experts=1"):
        dispatch(weights, ids, 1)
    for bad in (0, -1.0, float("nan"), float("inf"), "1", True):
        with pytest.raises(ValueError, match="capacity_factor"):
            dispatch(weights, ids, 4, capacity_factor=bad)
    with pytest.raises(ValueError, match="drop_policy"):
        dispatch(weights, ids, 4, capacity_factor=1.0, drop_policy="random")
    with pytest.raises(ValueError, match="score_func"):
        select_experts(torch.randn(4, 4), 2, score_func="tanh")
    with pytest.raises(ValueError, match="logits"):
        select_experts(torch.randn(4), 1)
    with pytest.raises(ValueError, match=r"topk_ids: expert ids must be in \[0, 4\)"):
        dispatch(weights, torch.tensor([[0, 4]] * 4), 4)
    with pytest.raises(ValueError, match="topk_ids"):
        dispatch(weights, ids.float(), 4)
    with pytest.raises(ValueError, match="topk_weights"):
        dispatch(torch.rand(4, 3), ids, 4)
    with pytest.raises(ValueError, match="num_experts"):
        dispatch(weights, ids, 0)


def test_expert_capacity_reads_a_numpy_float32_as_it_prints():
    import numpy as np

    assert str(np.float32(1.2)) == "1.2"
    assert expert_capacity(10, 1, 4, np.float32(1.2)) == expert_capacity(10, 1, 4, 1.2) == 3


@pytest.mark.parametrize("policy", ["probs", "position"])
def test_a_huge_capacity_factor_drops_nothing(policy):
    """C = ceil(T·k/E · factor) past int64 (factor 1e30): every slot kept, as dropless, no OverflowError."""
    torch.manual_seed(0)
    w, ids = torch.rand(8, 2), torch.randint(0, 4, (8, 2))
    routing = dispatch(w, ids, 4, capacity_factor=1e30, drop_policy=policy)
    dropless = dispatch(w, ids, 4)
    assert routing.kept.all() and routing.capacity == 4 * 10**30
    assert torch.equal(routing.row_slots, dropless.row_slots) and torch.equal(routing.counts, dropless.counts)


def test_stats_of_a_capacity_past_the_largest_float():
    """capacity_factor=1e308 (finite, accepted): C = 4e308 is no float; stats() reports inf, not an OverflowError."""
    torch.manual_seed(0)
    routing = dispatch(torch.rand(8, 2), torch.randint(0, 4, (8, 2)), 4, capacity_factor=1e308)
    assert routing.capacity > 10**308 and routing.kept.all()
    assert routing.stats()["capacity"] == math.inf


@pytest.mark.parametrize("factor", [10**400, Fraction(10**400, 3)])
def test_an_exact_capacity_factor_past_the_largest_float_is_accepted(factor):
    """An int or Fraction is finite whatever its size (expert_capacity reads it exactly): it used to
    raise OverflowError from the finiteness check, in the layers' constructors too."""
    torch.manual_seed(0)
    assert expert_capacity(8, 2, 4, factor) == math.ceil(Fraction(4) * factor)
    layer = MoE(32, 32, 4, 2, capacity_factor=factor, recipe=None)
    x = torch.randn(8, 32)
    y, routing = layer(x, return_routing=True)
    assert routing.kept.all()
    layer.capacity_factor = None
    assert torch.equal(y, layer(x))
    with pytest.raises(ValueError, match="capacity_factor"):
        expert_capacity(8, 2, 4, -factor)


@pytest.mark.parametrize("factor", [np.float32(1.2), np.float64(0.75), Fraction(3, 4)])
def test_a_numpy_or_fraction_capacity_factor_compiles_fullgraph(factor):
    """A capacity factor MoE accepts keeps fullgraph=True (the docstring's promise) and its capacity."""
    torch.manual_seed(0)
    moe = MoE(128, 128, 4, 2, capacity_factor=factor, recipe=None)
    assert expert_capacity(10, 1, 4, moe.capacity_factor) == expert_capacity(10, 1, 4, factor)
    x = torch.randn(10, 128)
    try:
        with torch.no_grad():
            assert torch.equal(torch.compile(moe, backend="eager", fullgraph=True)(x), moe(x))
        xr = x.clone().requires_grad_()
        torch.compile(moe, backend="eager", fullgraph=True)(xr).sum().backward()
        assert xr.grad is not None
    finally:
        torch._dynamo.reset()


def test_the_capacity_read_as_printed_is_kept():
    """np.float32(1.2) is 1.2 for expert_capacity (T=10, k=1, E=4: 3, not float32's 4): the layers keep that."""
    moe = FP8InferenceMoE(128, 128, 4, 1, capacity_factor=np.float32(1.2))
    assert expert_capacity(10, 1, 4, moe.capacity_factor) == 3
    assert MoE(128, 128, 4, 2, capacity_factor=Fraction(1, 3)).capacity_factor == Fraction(1, 3)  # 1/3 has no float
    assert MoE(128, 128, 4, 2, capacity_factor=1.2).capacity_factor == 1.2


@pytest.mark.parametrize("bad", ["false", "no", None, 2, torch.ones(2)])
def test_renormalize_that_is_not_a_bool_is_refused_by_name(bad):
    with pytest.raises(ValueError, match="renormalize: expected a bool"):
        select_experts(torch.randn(4, 8), 2, renormalize=bad)
    for cls in (MoE, FP8InferenceMoE, NVFP4InferenceMoE):
        with pytest.raises(ValueError, match="renormalize: expected a bool"):
            cls(128, 128, 4, 2, renormalize=bad)


def test_a_numpy_bool_is_a_bool_and_compiles_fullgraph():
    torch.manual_seed(0)
    moe = MoE(128, 128, 4, 2, recipe=None, renormalize=np.False_)
    assert type(moe.renormalize) is bool and moe.renormalize is False
    x = torch.randn(5, 128)
    try:
        with torch.no_grad():
            assert torch.equal(torch.compile(moe, backend="eager", fullgraph=True)(x), moe(x))
    finally:
        torch._dynamo.reset()
    w, _ = select_experts(torch.randn(4, 8), 2, renormalize=np.True_)
    torch.testing.assert_close(w.sum(-1), torch.ones(4))


def test_numpy_integer_sizes_are_ints():
    w, ids = select_experts(torch.randn(6, 8), np.int64(2))
    assert ids.shape == (6, 2)
    r = dispatch(w, ids, np.int64(8), capacity_factor=1.0)
    assert r.kept.shape == (6, 2)
    layer = moe.MoE(np.int64(16), np.int64(32), np.int64(4), np.int32(2), recipe=None)
    assert all(type(v) is int for v in (layer.hidden_size, layer.ffn_size, layer.num_experts, layer.top_k))
    assert layer(torch.randn(5, 16)).shape == (5, 16)


def test_expert_capacity_of_numpy_int32_sizes_does_not_wrap_around():
    """T·k past int32 (numpy's int32 product wraps to a negative capacity): computed on Python ints."""
    capacity = expert_capacity(np.int32(300_000_000), np.int32(8), np.int32(4), 1.0)
    assert type(capacity) is int and capacity == 600_000_000


@pytest.mark.parametrize("bad", [True, 2.0, "2", 0])
def test_bad_sizes_still_refused_by_name(bad):
    with pytest.raises(ValueError, match="top_k"):
        select_experts(torch.randn(6, 8), bad)
    with pytest.raises(ValueError, match="num_experts"):
        moe.MoE(16, 32, bad, 1, recipe=None)


def test_expert_parallel_moe_string_num_experts_is_a_value_error():
    with tempfile.TemporaryDirectory() as d:
        dist.init_process_group("gloo", init_method=f"file://{d}/init", rank=0, world_size=1,
                                timeout=datetime.timedelta(seconds=60))
        try:
            from lowprec.moe.parallel import ExpertParallelMoE
            with pytest.raises(ValueError, match="num_experts"):
                ExpertParallelMoE(16, 32, "4", 2, recipe=None)
            layer = ExpertParallelMoE(16, 32, np.int64(4), 2, recipe=None)
            assert type(layer.num_experts) is int and layer.w1.shape[0] == 4
        finally:
            dist.destroy_process_group()
