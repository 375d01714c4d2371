import gc
import threading
import weakref

import pytest
import torch

import lowprec
from lowprec.nn import FP8Linear, reuse_quantized_weights, weight_cache


@pytest.fixture
def quantize_calls(monkeypatch):
    """Records (weight id, with_transpose) for each weight actually quantized."""
    calls = []
    real = weight_cache._quantize

    def counting(weight, recipe, with_transpose):
        calls.append((id(weight), with_transpose))
        return real(weight, recipe, with_transpose)

    monkeypatch.setattr(weight_cache, "_quantize", counting)
    return calls


def _accumulate(layer, batches, reuse):
    layer.weight.grad = None
    outs = []
    ctx = reuse_quantized_weights() if reuse else _nothing()
    with ctx:
        for x in batches:
            y = layer(x)
            y.square().sum().backward()
            outs.append(y.detach())
    return outs, layer.weight.grad.clone()


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.mark.parametrize("recipe", ["fp8_block", "fp8_rowwise", "fp8_tensorwise"])
def test_micro_batches_quantize_once_and_match(recipe, quantize_calls, device):
    layer = FP8Linear(128, 64, bias=False, recipe=recipe, device=device)
    batches = [torch.randn(32, 128, device=device, requires_grad=True) for _ in range(3)]
    outs, grad = _accumulate(layer, batches, reuse=False)
    assert len(quantize_calls) == 3
    quantize_calls.clear()
    outs_reused, grad_reused = _accumulate(layer, batches, reuse=True)
    assert quantize_calls == [(id(layer.weight), True)]
    assert all(torch.equal(a, b) for a, b in zip(outs, outs_reused))
    assert torch.equal(grad, grad_reused)


def test_in_place_update_is_seen(quantize_calls):
    layer = FP8Linear(128, 64)
    opt = torch.optim.SGD(layer.parameters(), lr=0.5)
    x = torch.randn(16, 128)
    with reuse_quantized_weights():
        layer(x).sum().backward()
        opt.step()  # in place: bumps the weight's version
        y = layer(x)
    assert len(quantize_calls) == 2
    assert torch.equal(y, layer(x))  # as a fresh quantization of the updated weight


def test_block_end_drops_the_cache_and_blocks_nest(quantize_calls):
    layer = FP8Linear(128, 64)
    x = torch.randn(16, 128)
    with reuse_quantized_weights():
        layer(x)
        with reuse_quantized_weights():
            layer(x)
        layer(x)  # the inner block's end keeps the outer block's cache
    assert len(quantize_calls) == 1
    layer(x)
    assert len(quantize_calls) == 2


def test_eval_forward_then_training_forward(quantize_calls):
    """A copy made without the transpose is made again when a training forward needs it."""
    layer = FP8Linear(128, 64)
    x = torch.randn(16, 128, requires_grad=True)
    with reuse_quantized_weights():
        with torch.no_grad():
            y_eval = layer(x)
        y = layer(x)
        y.sum().backward()
        layer(x)
        with torch.no_grad():
            layer(x)
    assert quantize_calls == [(id(layer.weight), False), (id(layer.weight), True)]
    assert torch.equal(y_eval, y.detach())


def test_other_weights_and_threads_are_separate(quantize_calls):
    a, b = FP8Linear(128, 64), FP8Linear(128, 64)
    x = torch.randn(16, 128)
    with reuse_quantized_weights():
        a(x), b(x), a(x), b(x)
        worker = threading.Thread(target=lambda: (a(x), a(x)))  # no block in that thread
        worker.start()
        worker.join()
    assert sorted(quantize_calls) == sorted([(id(a.weight), False)] * 3 + [(id(b.weight), False)])


def test_moe_micro_batches_quantize_once_and_match(quantize_calls):
    torch.manual_seed(0)
    moe = lowprec.MoE(64, 32, num_experts=4, top_k=2)
    batches = [torch.randn(24, 64, requires_grad=True) for _ in range(2)]

    def run(reuse):
        moe.zero_grad(set_to_none=True)
        with reuse_quantized_weights() if reuse else _nothing():
            outs = []
            for x in batches:
                y = moe(x)
                y.square().sum().backward()
                outs.append(y.detach())
        return outs, moe.w1.grad.clone(), moe.w2.grad.clone()

    plain = run(reuse=False)
    assert len(quantize_calls) == 4
    quantize_calls.clear()
    reused = run(reuse=True)
    assert sorted(quantize_calls) == sorted([(id(moe.w1), True), (id(moe.w2), True)])
    assert all(torch.equal(p, r) for p, r in zip(plain[0], reused[0]))
    assert torch.equal(plain[1], reused[1]) and torch.equal(plain[2], reused[2])


def test_top_level_name():
    assert lowprec.reuse_quantized_weights is reuse_quantized_weights


def test_compiled_step_inside_a_block():
    """torch.compile traces the plain path (no cache) and gives the eager result."""
    torch.manual_seed(4)
    layer = FP8Linear(128, 64)
    x = torch.randn(33, 128, requires_grad=True)
    compiled = torch.compile(lambda x: layer(x).square().sum(), fullgraph=True, backend="aot_eager")
    with reuse_quantized_weights():
        compiled(x).backward()
    g_compiled = layer.weight.grad.clone()
    layer.weight.grad = None
    layer(x).square().sum().backward()
    torch.testing.assert_close(g_compiled, layer.weight.grad)


@pytest.mark.parametrize("foreach", [True, False])
def test_in_place_updates_inside_the_block_are_seen_with_fp8_all_gather_weights(foreach):
    """The FSDP FP8 all-gather wrapper runs in-place ops below autograd; it bumps the master
    weight's version itself, so the block quantizes an updated weight again (as without it)."""
    from lowprec.nn import enable_fp8_all_gather

    torch.manual_seed(0)
    layer = FP8Linear(256, 128, recipe="fp8_block")
    enable_fp8_all_gather(layer)  # outside FSDP: nothing changes
    opt = torch.optim.SGD(layer.parameters(), lr=0.5, foreach=foreach)
    x = torch.randn(16, 256)
    with reuse_quantized_weights():
        layer(x).sum().backward()
        opt.step()
        after_step = layer(x)
    assert torch.equal(after_step, layer(x))
    with reuse_quantized_weights():
        layer(x)
        with torch.no_grad():
            layer.weight.copy_(torch.zeros(128, 256))
        after_copy = layer(x)
    torch.testing.assert_close(after_copy, layer.bias.detach().expand(16, -1), rtol=0, atol=0)


def test_module_cast_inside_reuse_block_requantizes():
    """A module cast inside the block (param.data swapped, no version bump) is seen: the layer
    multiplies by its current weight, as outside the block."""
    torch.manual_seed(0)
    layer = FP8Linear(128, 128, recipe="fp8_rowwise")
    x = torch.randn(4, 128, dtype=torch.float16)
    with lowprec.reuse_quantized_weights():
        layer(x.float())
        layer.half()
        inside = layer(x)
    assert torch.equal(inside, layer(x))


def test_reuse_block_still_reuses_an_unchanged_weight(monkeypatch):
    from lowprec.nn import weight_cache

    layer = FP8Linear(128, 128)
    calls = []
    real = weight_cache._quantize
    monkeypatch.setattr(weight_cache, "_quantize", lambda *a: calls.append(1) or real(*a))
    with lowprec.reuse_quantized_weights():
        for _ in range(3):
            layer(torch.randn(4, 128, requires_grad=True)).sum().backward()
    assert len(calls) == 1


def test_reuse_quantized_weights_takes_inference_tensors(monkeypatch):
    """A model made under torch.inference_mode holds inference tensors, which have no version
    counter: the block quantizes each of their weights once instead of raising."""
    calls = []
    real = weight_cache._quantize
    monkeypatch.setattr(weight_cache, "_quantize", lambda *a: calls.append(a) or real(*a))
    with torch.inference_mode():
        layer = FP8Linear(64, 32)
        x = torch.randn(4, 64)
        plain = layer(x)
        calls.clear()
        with reuse_quantized_weights():
            outs = [layer(x), layer(x)]
    assert all(torch.equal(y, plain) for y in outs) and len(calls) == 1


def test_inference_mode_evaluation_inside_the_block_then_training():
    """An evaluation under torch.inference_mode inside the block cached inference tensors (the fused
    MLP's forward makes the transposed down weight even without gradients); the next training forward
    took them and raised ("Inference tensors cannot be saved for backward"). Steps equal those
    without the block."""
    from lowprec.nn import SwiGLUMLP

    def train(reuse):
        torch.manual_seed(0)
        model = lowprec.convert(torch.nn.Sequential(torch.nn.Linear(128, 128), SwiGLUMLP(128, 256),
                                                    lowprec.MoE(128, 64, num_experts=4, top_k=2)),
                                min_weight_numel=0)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x = torch.randn(8, 128, generator=torch.Generator().manual_seed(1))
        outs = []
        with reuse_quantized_weights() if reuse else _nothing():
            for _ in range(2):
                with torch.inference_mode():
                    outs += [model(x), model(x)]
                y = model(x)
                y.square().sum().backward()
                opt.step()
                opt.zero_grad()
                outs.append(y.detach())
        return outs

    assert all(torch.equal(a, b) for a, b in zip(train(reuse=True), train(reuse=False)))


def test_inference_mode_forwards_share_their_copies(quantize_calls):
    layer = FP8Linear(128, 64)
    x = torch.randn(16, 128, requires_grad=True)
    with reuse_quantized_weights():
        with torch.inference_mode():
            layer(x), layer(x)
        layer(x).sum().backward()
        with torch.inference_mode():
            layer(x)
    # the training forward quantizes again (with the transpose); its copy then serves the evaluation
    assert quantize_calls == [(id(layer.weight), False), (id(layer.weight), True)]


@pytest.mark.parametrize("swap", ["cast_back", "data"])
def test_new_storage_of_the_same_dtype_inside_the_block_is_seen(swap):
    """A cast there and back (model.bfloat16().float()) or ``weight.data = t`` gives the weight new
    values in the same dtype without a version bump: the block quantizes it again (was: the FP8
    copy of the old values)."""
    torch.manual_seed(0)
    layer = FP8Linear(128, 128, bias=False, recipe="fp8_rowwise")
    x = torch.randn(4, 128)
    with reuse_quantized_weights():
        layer(x)
        if swap == "cast_back":
            layer.bfloat16().float()
        else:
            layer.weight.data = torch.randn(128, 128)
        inside = layer(x)
    assert torch.equal(inside, layer(x))


@pytest.mark.parametrize("free", ["temporary", "cast"])
def test_copies_of_a_freed_weight_are_freed_inside_the_block(free, monkeypatch):
    """A weight made per call (fp8_linear(x, w * s)) or a module cast frees the old weight or its
    storage: its FP8 copies go with it (were kept until the block's end, one per micro-batch)."""
    copies = []
    real = weight_cache._quantize

    def recording(*args):
        out = real(*args)
        copies.append(weakref.ref(out[0].data))
        return out

    monkeypatch.setattr(weight_cache, "_quantize", recording)
    layer = FP8Linear(128, 128)
    x = torch.randn(4, 128)
    gc.disable()  # freed by reference counting, at once (not by a later gc pass)
    try:
        with reuse_quantized_weights():
            if free == "temporary":
                lowprec.nn.fp8_linear(x, layer.weight.detach() * 2)
            else:
                layer(x)
                layer.half()
            assert copies[0]() is None
            layer(x.half())
        assert copies[1]() is None  # the block's end frees the copies of live weights
    finally:
        gc.enable()


def test_a_weight_shared_under_two_recipes_keeps_both_copies(quantize_calls):
    """Tied layers quantizing one weight under two recipes reuse a copy each (they evicted each
    other's, so every forward quantized again)."""
    a = FP8Linear(128, 64, bias=False, recipe="fp8_block")
    b = FP8Linear(128, 64, bias=False, recipe="fp8_rowwise")
    b.weight = a.weight
    x = torch.randn(16, 128)
    with reuse_quantized_weights():
        for _ in range(3):
            ya, yb = a(x), b(x)
    assert quantize_calls == [(id(a.weight), False)] * 2
    assert torch.equal(ya, a(x)) and torch.equal(yb, b(x))
