"""Expert-parallel MoE on gloo (CPU processes) and NCCL (one GPU per rank, bf16, the FP8 kernels):
the ranks together compute what one process computes on the concatenated batch, forward and
backward."""

import datetime
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lowprec.moe import experts
from lowprec.moe.parallel import _kept, expert_parallel_experts
from lowprec.moe.routing import dispatch

from ..distributed import rank_body
from ..hopper import gpu

needs_two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")

H, F, E, K = 128, 64, 8, 2


def _problem(token_counts, seed=0, experts_used=E):
    g = torch.Generator().manual_seed(seed)
    total = sum(token_counts)
    x = torch.randn(total, H, generator=g)
    logits = torch.randn(total, E, generator=g)
    logits[:, experts_used:] = -float("inf")  # experts past experts_used get no slot
    weights, ids = torch.topk(torch.softmax(logits, -1), K, dim=-1)
    w1 = torch.randn(E, 2 * F, H, generator=g) * H ** -0.5
    w2 = torch.randn(E, H, F, generator=g) * F ** -0.5
    dy = torch.randn(total, H, generator=g)
    return x, weights, ids, w1, w2, dy


def _grads(fn, x, weights, w1, w2, dy):
    leaves = [t.detach().clone().requires_grad_() for t in (x, weights, w1, w2)]
    y = fn(*leaves)
    (y * dy).sum().backward()
    return y.detach(), [t.grad if t.grad is not None else torch.zeros_like(t) for t in leaves]


def _init(rank, world, init_file, backend):
    """Join the group; NCCL: this rank's GPU. Returns how to place the problem's tensors there
    (GPU: bf16, as the FP8 kernels take them) and the comparison tolerance (GPU: a few bf16 steps,
    the combine's sums in another order; a wrong route or scale is O(1))."""
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    if backend == "nccl":
        return (lambda t: t.to("cuda", torch.bfloat16) if t.is_floating_point() else t.to("cuda"),
                dict(rtol=2e-2, atol=2e-2))
    return (lambda t: t), dict(rtol=1e-5, atol=1e-5)


def _worker(rank, world, init_file, token_counts, recipe, capacity_factor, drop_policy, experts_used=E,
            backend="gloo", fp8_dispatch=True):
    place, tol = _init(rank, world, init_file, backend)
    with rank_body():
        x, weights, ids, w1, w2, dy = map(place, _problem(token_counts, experts_used=experts_used))
        kwargs = dict(recipe=recipe, capacity_factor=capacity_factor, drop_policy=drop_policy)
        y_ref, g_ref = _grads(lambda x, w, a, b: experts(x, w, ids, a, b, **kwargs), x, weights, w1, w2, dy)
        lo, hi = sum(token_counts[:rank]), sum(token_counts[: rank + 1])
        per = E // world
        mine = slice(rank * per, (rank + 1) * per)

        def ep(x_r, w_r, a, b):
            return expert_parallel_experts(x_r, w_r, ids[lo:hi], a, b, num_experts=E, fp8_dispatch=fp8_dispatch,
                                           **kwargs)

        y, g = _grads(ep, x[lo:hi], weights[lo:hi], w1[mine], w2[mine], dy[lo:hi])
        torch.testing.assert_close(y, y_ref[lo:hi], **tol)
        torch.testing.assert_close(g[0], g_ref[0][lo:hi], **tol)  # dx
        torch.testing.assert_close(g[1], g_ref[1][lo:hi], **tol)  # d topk_weights
        torch.testing.assert_close(g[2], g_ref[2][mine], **tol)  # d w1 of this rank's experts
        torch.testing.assert_close(g[3], g_ref[3][mine], **tol)


@pytest.mark.parametrize("token_counts", [(37, 20), (5, 0, 41, 13)], ids=["2 ranks", "4 ranks, one empty"])
@pytest.mark.parametrize("recipe", [None, "fp8_block"])
@pytest.mark.parametrize("capacity_factor,drop_policy", [(None, "probs"), (0.75, "probs"), (0.75, "position")])
def test_expert_parallel_equals_one_process(token_counts, recipe, capacity_factor, drop_policy):
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        mp.spawn(_worker, args=(len(token_counts), init_file, token_counts, recipe, capacity_factor, drop_policy),
                 nprocs=len(token_counts), join=True)


@pytest.mark.parametrize("recipe", [None, "fp8_block"])
def test_rows_sent_in_bf16_give_the_same_result(recipe):
    """fp8_dispatch=False: the rows travel in x's dtype and are quantized on arrival, to the codes
    the FP8 dispatch sends (checked against one process, as the FP8 dispatch is)."""
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(2, os.path.join(tmp, "init"), (30, 26), recipe, 0.75, "probs", E, "gloo", False),
                 nprocs=2, join=True)


def _worker_no_requantization(rank, world, init_file):
    place, tol = _init(rank, world, init_file, "gloo")
    with rank_body():
        import lowprec.moe.core as core

        x, weights, ids, w1, w2, dy = _problem((30, 26))
        y_ref = experts(x, weights, ids, w1, w2, capacity_factor=0.75)
        lo, hi = (0, 30) if rank == 0 else (30, 56)
        per = E // world

        def no_requantization(*args, **kwargs):
            raise AssertionError("the experts quantized rows that arrived as FP8 codes")

        core.pack_tokens = no_requantization
        y = expert_parallel_experts(x[lo:hi].requires_grad_(), weights[lo:hi], ids[lo:hi],
                                    w1[rank * per:(rank + 1) * per], w2[rank * per:(rank + 1) * per], num_experts=E,
                                    capacity_factor=0.75)
        y.backward(dy[lo:hi])
        torch.testing.assert_close(y.detach(), y_ref[lo:hi], **tol)


def test_fp8_dispatch_computes_on_the_received_codes():
    """The experts take the codes and scales that arrived (no dequantization and second
    quantization on the experts' rank): the experts' own quantization is never called."""
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker_no_requantization, args=(2, os.path.join(tmp, "init")), nprocs=2, join=True)


def _worker_autocast(rank, world, init_file):
    _init(rank, world, init_file, "gloo")
    with rank_body():
        x, weights, ids, w1, w2, dy = _problem((30, 26))
        lo, hi = (0, 30) if rank == 0 else (30, 56)
        per = E // world
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y_ref = experts(x, weights, ids, w1, w2)
        for fp8_dispatch in (True, False):
            xr = x[lo:hi].clone().requires_grad_()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                y = expert_parallel_experts(xr, weights[lo:hi], ids[lo:hi], w1[rank * per:(rank + 1) * per],
                                            w2[rank * per:(rank + 1) * per], num_experts=E, fp8_dispatch=fp8_dispatch)
            assert y.dtype == torch.bfloat16 and y_ref.dtype == torch.bfloat16
            # the codes that travel are those of the bf16 tokens, as the one-process MoE's
            torch.testing.assert_close(y, y_ref[lo:hi], rtol=2e-2, atol=2e-2)
            y.float().backward(dy[lo:hi])
            assert xr.grad.dtype == torch.float32


def test_expert_parallel_follows_autocast():
    """Inside torch.autocast, FP32 tokens are cast before they are quantized and sent: bf16 out,
    as the one-process experts give under autocast; the gradient comes back in FP32."""
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker_autocast, args=(2, os.path.join(tmp, "init")), nprocs=2, join=True)


@gpu
@needs_two_gpus
@pytest.mark.parametrize("capacity_factor", [None, 0.75])
@pytest.mark.parametrize("fp8_dispatch", [True, False])
def test_expert_parallel_on_nccl(capacity_factor, fp8_dispatch):
    """Two GPUs, NCCL, bf16 tokens on the FP8 kernels: as one process on the whole batch."""
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(2, os.path.join(tmp, "init"), (300, 212), "fp8_block", capacity_factor, "probs", E,
                                "nccl", fp8_dispatch), nprocs=2, join=True)


def test_a_rank_whose_experts_get_no_slot():
    """All slots go to rank 0's experts: rank 1 computes on no rows and still takes part."""
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(2, os.path.join(tmp, "init"), (21, 17), "fp8_block", 1.0, "probs", E // 2),
                 nprocs=2, join=True)


def _worker_plain_empty_x(rank, world, init_file, recipe):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=30))  # the bug was a hang: fail soon
    with rank_body():
        x, weights, ids, w1, w2, dy = _problem((20, 0))
        y_ref, g_ref = _grads(lambda x, w, a, b: experts(x, w, ids, a, b, recipe=recipe), x, weights, w1, w2, dy)
        lo, hi = (0, 20) if rank == 0 else (20, 20)
        per = E // world
        xr = x[lo:hi].clone().requires_grad_(rank == 0)  # rank 1: a plain empty x, as the docstring allows
        w1r = w1[rank * per:(rank + 1) * per].clone().requires_grad_()
        y = expert_parallel_experts(xr, weights[lo:hi], ids[lo:hi], w1r, w2[rank * per:(rank + 1) * per],
                                    num_experts=E, recipe=recipe)
        (y * dy[lo:hi]).sum().backward()
        torch.testing.assert_close(y.detach(), y_ref[lo:hi], rtol=1e-5, atol=1e-5)
        if rank == 0:
            torch.testing.assert_close(xr.grad, g_ref[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(w1r.grad, g_ref[2][rank * per:(rank + 1) * per], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("recipe", [None, "fp8_block"])
def test_a_rank_with_a_plain_empty_x_takes_part_in_backward(recipe):
    """Rank 1 has no tokens and passes an empty x without grad; rank 0's x needs its gradient, part
    of which comes back from rank 1's experts: rank 1's backward skipped that exchange (a hang)."""
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker_plain_empty_x, args=(2, os.path.join(tmp, "init"), recipe), nprocs=2, join=True)


def _module_worker(rank, world, init_file, token_counts, recipe, backend="gloo"):
    from lowprec.moe import MoE
    from lowprec.moe.parallel import ExpertParallelMoE

    place, tol = _init(rank, world, init_file, backend)
    with rank_body():
        torch.manual_seed(0)
        full = MoE(H, F, E, K, capacity_factor=1.0, recipe=recipe)
        if backend == "nccl":
            full = full.to("cuda", torch.bfloat16)
        g = torch.Generator().manual_seed(1)
        x = place(torch.randn(sum(token_counts), H, generator=g))
        dy = place(torch.randn(sum(token_counts), H, generator=g))
        xr = x.clone().requires_grad_()
        (full(xr) * dy).sum().backward()
        layer = ExpertParallelMoE.from_moe(full, group=None)
        lo, hi = sum(token_counts[:rank]), sum(token_counts[: rank + 1])
        mine = x[lo:hi].clone().requires_grad_()
        y = layer(mine)
        (y * dy[lo:hi]).sum().backward()
        dist.all_reduce(layer.router.weight.grad)  # the replicated router: data parallel
        per = E // world
        torch.testing.assert_close(mine.grad, xr.grad[lo:hi], **tol)
        torch.testing.assert_close(layer.w1.grad, full.w1.grad[rank * per:(rank + 1) * per], **tol)
        torch.testing.assert_close(layer.w2.grad, full.w2.grad[rank * per:(rank + 1) * per], **tol)
        if backend == "nccl":  # bf16: two rounded partial gradients summed; where they cancel, a few steps of
            # their own size (H200: 1 of 1024 entries 0.026 off at 2e-2): compared as a whole
            diff = (layer.router.weight.grad.float() - full.router.weight.grad.float()).norm()
            assert diff <= 1e-2 * full.router.weight.grad.float().norm(), diff
        else:
            torch.testing.assert_close(layer.router.weight.grad, full.router.weight.grad, **tol)
        with torch.no_grad():
            torch.testing.assert_close(y, full(x)[lo:hi], **tol)


@pytest.mark.parametrize("recipe", [None, "fp8_block"])
def test_expert_parallel_module_equals_moe(recipe):
    """ExpertParallelMoE.from_moe on 2 ranks: the full MoE's outputs and gradients (the router's
    summed over the ranks), with a capacity limit."""
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_module_worker, args=(2, os.path.join(tmp, "init"), (29, 35), recipe), nprocs=2, join=True)


@gpu
@needs_two_gpus
def test_expert_parallel_module_on_nccl():
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_module_worker, args=(2, os.path.join(tmp, "init"), (290, 350), "fp8_block", "nccl"), nprocs=2,
                 join=True)


@pytest.fixture
def one_rank_group():
    """A gloo process group of this process alone."""
    with tempfile.TemporaryDirectory() as d:
        dist.init_process_group("gloo", init_method=f"file://{d}/init", rank=0, world_size=1)
        try:
            yield
        finally:
            dist.destroy_process_group()


def test_from_moe_keeps_an_fp32_router(one_rank_group):
    """A bf16 MoE with an FP32 router routes in the expert-parallel layer as in the MoE."""
    from lowprec.moe import MoE
    from lowprec.moe.parallel import ExpertParallelMoE

    torch.manual_seed(0)
    moe = MoE(128, 64, 8, 2, recipe=None, dtype=torch.bfloat16)
    moe.router.float()
    with torch.no_grad():
        moe.router.weight.normal_()
    layer = ExpertParallelMoE.from_moe(moe)
    assert layer.router.weight.dtype == torch.float32
    x = torch.randn(256, 128, dtype=torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(layer(x), moe(x))


def test_bad_expert_ids_are_named(one_rank_group):
    x, w = torch.randn(4, 128), torch.rand(4, 2)
    w1, w2 = torch.randn(4, 128, 128), torch.randn(4, 128, 64)
    for ids in (torch.tensor([[0.9, 1.7]] * 4), torch.tensor([[0, 4]] * 4), torch.tensor([[0, -1]] * 4)):
        with pytest.raises(ValueError, match="topk_ids"):
            expert_parallel_experts(x, w, ids, w1, w2, num_experts=4, recipe=None)


def test_expert_parallel_module_built_directly_has_trainable_experts(one_rank_group):
    """Built directly, its experts are initialised as MoE's (not zeros, which never get a gradient)."""
    from lowprec.moe.parallel import ExpertParallelMoE

    torch.manual_seed(0)
    layer = ExpertParallelMoE(128, 64, 4, 2, recipe=None)
    bound1, bound2 = 128 ** -0.5, 64 ** -0.5
    assert layer.w1.abs().max() <= bound1 and layer.w1.std() > bound1 / 4
    assert layer.w2.abs().max() <= bound2 and layer.w2.std() > bound2 / 4
    y = layer(torch.randn(16, 128))
    (y * torch.randn_like(y)).sum().backward()
    assert y.abs().sum() > 0
    assert layer.w1.grad.abs().sum() > 0 and layer.w2.grad.abs().sum() > 0


@pytest.mark.parametrize("policy", ["probs", "position"])
def test_a_huge_capacity_factor_drops_nothing_across_ranks(one_rank_group, policy):
    """capacity_factor=1e30 (C past int64): every slot kept, as the dropless experts, no OverflowError."""
    torch.manual_seed(0)
    w, ids = torch.rand(8, 2), torch.randint(0, 4, (8, 2))
    x, w1, w2 = torch.randn(8, 32), torch.randn(4, 32, 32), torch.randn(4, 32, 16)
    got = expert_parallel_experts(x, w, ids, w1, w2, num_experts=4, recipe=None, capacity_factor=1e30,
                                  drop_policy=policy)
    torch.testing.assert_close(got, experts(x, w, ids, w1, w2, recipe=None))


def test_top_k_above_num_experts_is_refused_as_experts_refuses_it(one_rank_group):
    x, w1, w2 = torch.randn(3, 128), torch.randn(4, 256, 128), torch.randn(4, 128, 128)
    ids, w = torch.zeros(3, 5, dtype=torch.long), torch.rand(3, 5)
    for recipe in ("fp8_block", None):
        with pytest.raises(ValueError, match="top_k: 5 is more than num_experts=4"):
            expert_parallel_experts(x, w, ids, w1, w2, num_experts=4, recipe=recipe)


@pytest.mark.parametrize("dtype", [torch.float64, torch.int64])
@pytest.mark.parametrize("recipe", ["fp8_block", None])
def test_x_of_another_dtype_is_named_with_its_own_shape(one_rank_group, dtype, recipe):
    x = torch.randn(3, 128).to(dtype)
    w1, w2 = torch.randn(4, 256, 128), torch.randn(4, 128, 128)
    ids, w = torch.zeros(3, 2, dtype=torch.long), torch.rand(3, 2)
    with pytest.raises(ValueError, match=rf"^x: .*{dtype}.*\(3, 128\)"):
        expert_parallel_experts(x, w, ids, w1, w2, num_experts=4, recipe=recipe)


@pytest.mark.parametrize("seed", range(4))
def test_expert_parallel_keeps_the_slots_dispatch_keeps_with_nan_weights(seed):
    """One rank's view (every slot local, global slot numbers 0..T·k-1) is the one-process plan."""
    g = torch.Generator().manual_seed(seed)
    tokens, k, e = 24, 2, 4
    w = torch.rand(tokens, k, generator=g)
    w[torch.rand(tokens, k, generator=g) < 0.25] = float("nan")
    w[0, 0] = w[5, 1] = 0.5  # ties too
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(tokens)])
    r = dispatch(w, ids, e, capacity_factor=0.5, drop_policy="probs")
    ep = _kept(ids.flatten(), torch.arange(tokens * k), w.flatten(), e, r.capacity, "probs")
    assert torch.equal(ep, r.kept.flatten())


def test_a_0d_x_and_a_w1_that_is_not_3d_are_named(one_rank_group):
    """A 0-d x used to raise IndexError (its shape[-1]); a 2-D w1 was reported as a wrong expert
    count (its rows), a list as an AttributeError."""
    from lowprec.moe.parallel import ExpertParallelMoE

    with pytest.raises(ValueError, match=r"x: expected \[\.\.\., H=32\]"):
        ExpertParallelMoE(32, 32, 4, 2, recipe=None)(torch.tensor(1.0))
    x, w, ids, w2 = torch.randn(3, 32), torch.rand(3, 2), torch.zeros(3, 2, dtype=torch.long), torch.randn(4, 32, 32)
    for w1 in (torch.randn(64, 32), [1]):
        with pytest.raises(ValueError, match=r"w1: expected this rank's experts \[4, 2F, H\]"):
            expert_parallel_experts(x, w, ids, w1, w2, num_experts=4, recipe=None)


def test_from_moe_of_something_else_is_named(one_rank_group):
    """As FP8InferenceMoE.from_moe: a TypeError naming moe, not an AttributeError (an inference layer has no recipe)."""
    from lowprec.moe import FP8InferenceMoE, MoE
    from lowprec.moe.parallel import ExpertParallelMoE

    for other in (FP8InferenceMoE.from_moe(MoE(32, 32, 4, 2)), torch.nn.Linear(4, 4)):
        with pytest.raises(TypeError, match="moe: expected a lowprec.moe.MoE"):
            ExpertParallelMoE.from_moe(other)


@pytest.mark.parametrize("recipe", ["fp8_block", None])
def test_enable_fp8_all_gather_wraps_the_expert_weights_as_moes(one_rank_group, recipe):
    """As MoE's: the fp8_block experts all-gather in FP8 under FSDP2 (EP x FSDP); outside it the
    wrapped weights compute as the master weights."""
    from lowprec.moe.parallel import ExpertParallelMoE
    from lowprec.nn import FP8AllGatherWeight, enable_fp8_all_gather

    torch.manual_seed(0)
    layer = ExpertParallelMoE(128, 64, 4, 2, recipe=recipe)
    x = torch.randn(16, 128)
    expect = layer(x)
    assert enable_fp8_all_gather(layer) == (2 if recipe else 0)
    assert all(isinstance(w, FP8AllGatherWeight) == (recipe is not None) for w in (layer.w1, layer.w2))
    assert torch.equal(layer(x), expect)
