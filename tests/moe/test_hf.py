"""transformers' sparse MoE blocks through ``lowprec.convert`` (``lowprec.moe.hf``): stand-ins with
transformers 5's layout and forward (CI has no transformers), and the real classes when installed."""

import logging
import pickle
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import lowprec
from lowprec import metrics
from lowprec.moe import FP8InferenceMoE, MoE, NVFP4InferenceMoE
from lowprec.moe.hf import (
    experts_module_unsupported,
    hf_moe_hooked,
    hf_moe_unsupported,
    moe_from_hf,
    transformers_experts_forward,
    transformers_nvfp4_experts_forward,
)


class _Router(nn.Module):
    def __init__(self, experts, hidden, top_k, norm_topk_prob):
        super().__init__()
        self.top_k, self.norm_topk_prob = top_k, norm_topk_prob
        self.weight = nn.Parameter(torch.randn(experts, hidden) / hidden**0.5)

    def forward(self, x):
        probs = F.linear(x, self.weight).float().softmax(dim=-1)
        top, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            top = top / top.sum(dim=-1, keepdim=True)
        return top, ids


class _Experts(nn.Module):
    def __init__(self, experts, hidden, ffn):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.randn(experts, 2 * ffn, hidden) / hidden**0.5)
        self.down_proj = nn.Parameter(torch.randn(experts, hidden, ffn) / ffn**0.5)
        self.act_fn = nn.SiLU()

    def forward(self, x, ids, weights):
        out = torch.zeros_like(x)
        for t in range(x.shape[0]):
            for j in range(ids.shape[1]):
                e = int(ids[t, j])
                gate, up = F.linear(x[t], self.gate_up_proj[e]).chunk(2)
                out[t] += weights[t, j] * F.linear(self.act_fn(gate) * up, self.down_proj[e])
        return out


class Qwen3MoeSparseMoeBlock(nn.Module):
    """transformers 5's block: ``gate`` (the router) and ``experts`` (stacked weights)."""

    def __init__(self, experts=8, hidden=128, ffn=64, top_k=2, norm_topk_prob=True):
        super().__init__()
        self.gate = _Router(experts, hidden, top_k, norm_topk_prob)
        self.experts = _Experts(experts, hidden, ffn)

    def forward(self, x):
        flat = x.reshape(-1, x.shape[-1])
        weights, ids = self.gate(flat)
        return self.experts(flat, ids, weights).reshape(x.shape)


class MixtralSparseMoeBlock(Qwen3MoeSparseMoeBlock):
    def __init__(self, **kw):
        super().__init__(**kw)
        del self.gate.norm_topk_prob  # Mixtral always renormalizes
        self.gate.norm_topk_prob = True
        self.jitter_noise = 0.0


@pytest.mark.parametrize("cls,norm", [(Qwen3MoeSparseMoeBlock, True), (Qwen3MoeSparseMoeBlock, False),
                                      (MixtralSparseMoeBlock, True)])
def test_the_lowprec_moe_computes_the_block(cls, norm):
    torch.manual_seed(0)
    block = cls(norm_topk_prob=norm) if cls is Qwen3MoeSparseMoeBlock else cls()
    moe = moe_from_hf(block, recipe=None)
    assert moe.w1 is block.experts.gate_up_proj and moe.w2 is block.experts.down_proj
    assert moe.router.weight is block.gate.weight and moe.renormalize == norm and moe.top_k == 2
    x = torch.randn(3, 5, 128)
    torch.testing.assert_close(moe(x), block(x), rtol=1e-5, atol=1e-6)


class _TwoBlocks(nn.Module):
    """Both blocks on the same tokens (chained, the second's routing would follow the first's error)."""

    def __init__(self):
        super().__init__()
        self.qwen, self.mixtral = Qwen3MoeSparseMoeBlock(), MixtralSparseMoeBlock()

    def forward(self, x):
        return self.qwen(x) + self.mixtral(x)


def test_convert_swaps_the_blocks(caplog):
    torch.manual_seed(0)
    x = torch.randn(64, 128)
    model = _TwoBlocks()
    expected = model(x)
    with caplog.at_level(logging.INFO, logger="lowprec"):
        lowprec.convert(model)
    assert isinstance(model.qwen, MoE) and isinstance(model.mixtral, MoE) and model.qwen.recipe == "fp8_block"
    assert "2 MoE layers" in caplog.text
    # the formats' error on random weights (measured: FP8 0.998, NVFP4 0.985 per block, the same routing)
    assert metrics.cos_sim(model(x), expected) > 0.99
    for recipe, cls, cos in (("fp8_block", FP8InferenceMoE, 0.99), ("nvfp4", NVFP4InferenceMoE, 0.98)):
        torch.manual_seed(0)
        model = _TwoBlocks()
        expected = model(x)
        lowprec.convert(model, recipe, inference=True)
        assert isinstance(model.qwen, cls) and isinstance(model.mixtral, cls)
        with torch.no_grad():
            assert metrics.cos_sim(model(x), expected) > cos, recipe


def test_convert_filter_and_a_bare_block():
    torch.manual_seed(0)
    model = nn.Sequential(Qwen3MoeSparseMoeBlock(), Qwen3MoeSparseMoeBlock())
    lowprec.convert(model, filter_fn=lambda name, m: name != "1")
    assert isinstance(model[0], MoE) and isinstance(model[1], Qwen3MoeSparseMoeBlock)
    assert isinstance(lowprec.convert(Qwen3MoeSparseMoeBlock(), inference=True), FP8InferenceMoE)


def test_blocks_it_does_not_take_stay_as_they_are():
    block = MixtralSparseMoeBlock()
    block.jitter_noise = 0.1
    assert "jitter" in hf_moe_unsupported(block)
    block = Qwen3MoeSparseMoeBlock()
    block.experts.act_fn = nn.GELU()
    assert "activation GELU" in hf_moe_unsupported(block)
    block = Qwen3MoeSparseMoeBlock()
    block.experts.gate_up_proj_bias = nn.Parameter(torch.zeros(8, 128))
    assert "biases" in hf_moe_unsupported(block)
    block = Qwen3MoeSparseMoeBlock()
    block.experts.down_proj = nn.Parameter(torch.zeros(8, 128, 32))
    assert "do not match" in hf_moe_unsupported(block)
    block = Qwen3MoeSparseMoeBlock()
    del block.experts.gate_up_proj  # transformers 4: a module list of per-expert MLPs
    block.experts.experts = nn.ModuleList([nn.Linear(4, 4)])
    assert "transformers 5's layout" in hf_moe_unsupported(block)
    model = nn.Sequential(block)
    lowprec.convert(model)
    assert model[0] is block
    assert "not one of" in hf_moe_unsupported(nn.Linear(4, 4))
    with pytest.raises(ValueError, match="block: .*transformers 5"):
        moe_from_hf(block)


def test_convert_carries_the_blocks_hooks():
    """The block's hooks fire on the MoE (the same call and output), and on the inference MoE after
    converting again (were: silently dropped)."""
    torch.manual_seed(0)
    block, calls = Qwen3MoeSparseMoeBlock(), []
    pre = block.register_forward_pre_hook(lambda m, args: calls.append(("pre", type(m).__name__)))
    block.register_forward_hook(lambda m, args, y: calls.append(("forward", type(m).__name__)))
    block.register_full_backward_hook(lambda m, grad_in, grad_out: calls.append(("backward", type(m).__name__)))
    model = nn.Sequential(block)
    lowprec.convert(model)
    model(torch.randn(4, 128, requires_grad=True)).sum().backward()
    assert calls == [("pre", "MoE"), ("forward", "MoE"), ("backward", "MoE")]
    pre.remove()
    calls.clear()
    lowprec.convert(model, inference=True)
    with torch.no_grad():
        model(torch.randn(4, 128))
    assert calls == [("forward", "FP8InferenceMoE")]


@pytest.mark.parametrize("part", ["gate", "experts"])
def test_blocks_whose_gate_or_experts_have_hooks_stay_as_they_are(part, caplog):
    """The lowprec MoE reads the router's and the experts' weights and calls neither module: their
    hooks would be dropped (were: silently), so the block stays, with a warning naming it."""
    block, calls = Qwen3MoeSparseMoeBlock(), []
    getattr(block, part).register_forward_hook(lambda m, args, y: calls.append(part))
    assert part in hf_moe_hooked(block) and hf_moe_hooked(Qwen3MoeSparseMoeBlock()) is None
    model = nn.Sequential(block)
    with caplog.at_level(logging.WARNING, logger="lowprec"):
        lowprec.convert(model)
    assert model[0] is block
    assert f"keeping 0 as it is: forward or backward hooks on its {part}" in caplog.text
    model(torch.randn(4, 128))
    assert calls == [part]


def test_blocks_of_a_model_run_before_convert_are_converted():
    """transformers hooks the routers at the first forward recording outputs (capturing router logits,
    which converted blocks refuse to record): those hooks do not keep the blocks."""
    transformers = pytest.importorskip("transformers", minversion="5.0")
    for model in _tiny_moe_models(transformers):
        torch.manual_seed(0)
        model(torch.randint(0, 64, (2, 9)), output_hidden_states=True)
        assert model.model.layers[0].mlp.gate._forward_hooks
        lowprec.convert(model)
        assert type(model.model.layers[0].mlp) is MoE


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_real_transformers_models(family):
    """A tiny transformers model of each family: its MoE blocks become lowprec layers computing them."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    common = dict(vocab_size=64, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64)
    if family == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(**common, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
                                             norm_topk_prob=False, head_dim=32)
        model = transformers.Qwen3MoeForCausalLM(config)
    else:
        config = transformers.MixtralConfig(**common, num_local_experts=8, num_experts_per_tok=2)
        model = transformers.MixtralForCausalLM(config)
    model.eval()
    blocks = [m for m in model.modules() if type(m).__name__ in ("Qwen3MoeSparseMoeBlock", "MixtralSparseMoeBlock")]
    assert len(blocks) == 2 and all(hf_moe_unsupported(b) is None for b in blocks)
    x = torch.randn(2, 7, 128)
    for block in blocks:
        torch.testing.assert_close(moe_from_hf(block, recipe=None)(x), block(x), rtol=1e-5, atol=1e-5)
    ids = torch.randint(0, 64, (2, 9))
    with torch.no_grad():
        expected = model(ids).logits
        lowprec.convert(model, "nvfp4", inference=True, filter_fn=lambda name, m: hf_moe_unsupported(m) is None)
        got = model(ids).logits
    assert sum(isinstance(m, NVFP4InferenceMoE) for m in model.modules()) == 2
    assert metrics.cos_sim(got, expected) > 0.99


def test_real_deepseek_v3_dense_and_shared_expert_mlps_are_fused():
    """DeepSeek-V3's routed experts are not taken (group-limited sigmoid routing); its dense and
    shared-expert MLPs are SwiGLU MLPs that training conversion fuses."""
    transformers = pytest.importorskip("transformers")
    from lowprec.nn import FP8SwiGLUMLP

    torch.manual_seed(0)
    config = transformers.DeepseekV3Config(vocab_size=64, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                           num_attention_heads=4, num_key_value_heads=4, moe_intermediate_size=64,
                                           n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=2,
                                           topk_group=1, first_k_dense_replace=1, q_lora_rank=64, kv_lora_rank=32,
                                           qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=32,
                                           max_position_embeddings=64)
    model = transformers.DeepseekV3ForCausalLM(config)
    lowprec.convert(model, min_weight_numel=0)
    fused = [n for n, m in model.named_modules() if isinstance(m, FP8SwiGLUMLP)]
    assert fused == ["model.layers.0.mlp", "model.layers.1.mlp.shared_experts"]
    assert type(model.model.layers[1].mlp).__name__ == "DeepseekV3MoE"
    loss = model(torch.randint(0, 64, (2, 9)), labels=torch.randint(0, 64, (2, 9))).loss
    loss.backward()
    assert torch.isfinite(loss)


def test_experts_implementation_computes_the_experts_module():
    from lowprec.moe.hf import transformers_experts_forward

    torch.manual_seed(0)
    module = _Experts(8, 128, 64)
    x = torch.randn(40, 128)
    weights, ids = torch.rand(40, 2), torch.stack([torch.randperm(8)[:2] for _ in range(40)])
    y = transformers_experts_forward(module, x, ids, weights)
    assert metrics.cos_sim(y, module(x, ids, weights)) > 0.99  # FP8 (1x128 tokens, 128x128 weights)
    (y * torch.randn_like(y)).sum().backward()
    assert module.gate_up_proj.grad is not None and module.down_proj.grad is not None
    module.is_transposed = True
    module.__dict__.pop("_lowprec_unsupported")
    with pytest.raises(ValueError, match="lowprec_fp8.*is_transposed=True"):
        transformers_experts_forward(module, x, ids, weights)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "deepseek_v3"])
def test_real_transformers_models_on_the_lowprec_experts(family, monkeypatch):
    """``set_experts_implementation("lowprec_fp8")`` on tiny transformers models: the experts run on
    lowprec (each MoE layer's call counted), logits at FP8's distance, gradients for the experts."""
    transformers = pytest.importorskip("transformers")
    from lowprec.moe import layer as moe_layer

    name = lowprec.moe.register_transformers_experts()
    torch.manual_seed(0)
    common = dict(vocab_size=64, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=4, max_position_embeddings=64)
    if family == "qwen3_moe":
        model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
            **common, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, head_dim=32))
    elif family == "mixtral":
        model = transformers.MixtralForCausalLM(transformers.MixtralConfig(**common, num_local_experts=8,
                                                                           num_experts_per_tok=2))
    else:
        model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(
            **common, moe_intermediate_size=64, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
            n_group=2, topk_group=1, first_k_dense_replace=0, q_lora_rank=64, kv_lora_rank=32, qk_rope_head_dim=16,
            qk_nope_head_dim=16, v_head_dim=32))
    ids = torch.randint(0, 64, (2, 9))
    with torch.no_grad():
        expected = model(ids).logits
    calls = []
    experts = moe_layer.experts
    monkeypatch.setattr(moe_layer, "experts", lambda *a, **k: calls.append(1) or experts(*a, **k))
    model.set_experts_implementation(name)
    out = model(ids, labels=ids)
    assert len(calls) == 2
    assert metrics.cos_sim(out.logits, expected) > 0.99
    out.loss.backward()
    grads = [p.grad for n, p in model.named_parameters() if n.endswith(("mlp.experts.gate_up_proj",
                                                                       "mlp.experts.down_proj"))]
    assert len(grads) == 4 and all(g is not None and torch.isfinite(g).all() for g in grads)


def test_nvfp4_experts_implementation_packs_once_and_refuses_gradients():
    from lowprec.moe import hf

    torch.manual_seed(0)
    module = _Experts(8, 128, 64)
    x = torch.randn(40, 128)
    weights, ids = torch.rand(40, 2), torch.stack([torch.randperm(8)[:2] for _ in range(40)])
    with torch.no_grad():
        y = hf.transformers_nvfp4_experts_forward(module, x, ids, weights)
        packed = hf._NVFP4_PACKS[module].packs
        assert metrics.cos_sim(y, module(x, ids, weights)) > 0.98  # NVFP4 weights (measured 0.985 per block)
        assert torch.equal(hf.transformers_nvfp4_experts_forward(module, x, ids, weights), y)
        assert hf._NVFP4_PACKS[module].packs is packed  # packed once
        module.down_proj.mul_(2)  # an in-place update: packed again
        y2 = hf.transformers_nvfp4_experts_forward(module, x, ids, weights)
        assert hf._NVFP4_PACKS[module].packs is not packed
        torch.testing.assert_close(y2, 2 * y, rtol=0, atol=0)  # x2 is exact in NVFP4's scales
    with pytest.raises(RuntimeError, match="lowprec_nvfp4.*inference"):
        hf.transformers_nvfp4_experts_forward(module, x, ids, weights)
    with pytest.raises(ValueError, match="fmt"):
        lowprec.moe.register_transformers_experts("int4")


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_real_transformers_models_on_the_nvfp4_experts(family):
    transformers = pytest.importorskip("transformers")
    name = lowprec.moe.register_transformers_experts("nvfp4")
    assert name == "lowprec_nvfp4"
    torch.manual_seed(0)
    common = dict(vocab_size=64, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=4, max_position_embeddings=64)
    if family == "qwen3_moe":
        model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
            **common, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, head_dim=32))
    else:
        model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(
            **common, moe_intermediate_size=64, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
            n_group=2, topk_group=1, first_k_dense_replace=0, q_lora_rank=64, kv_lora_rank=32, qk_rope_head_dim=16,
            qk_nope_head_dim=16, v_head_dim=32))
    model.eval()
    ids = torch.randint(0, 64, (2, 9))
    with torch.no_grad():
        expected = model(ids).logits
        model.set_experts_implementation(name)
        got = model(ids).logits
    from lowprec.moe.hf import _NVFP4_PACKS

    packed = [m for m in model.modules() if m in _NVFP4_PACKS]
    assert len(packed) == 2
    assert metrics.cos_sim(got, expected) > 0.98


def test_experts_implementation_traces_with_fullgraph():
    """The first call traced by torch.compile (no eager call before): the layout check must not run
    the activation on data (a data-dependent branch breaks fullgraph)."""
    from lowprec.moe.hf import transformers_experts_forward

    torch.manual_seed(0)
    module = _Experts(8, 128, 64)
    x = torch.randn(16, 128)
    weights, ids = torch.rand(16, 2), torch.stack([torch.randperm(8)[:2] for _ in range(16)])
    torch._dynamo.reset()
    compiled = torch.compile(transformers_experts_forward, fullgraph=True)
    y = compiled(module, x, ids, weights)
    module.__dict__.pop("_lowprec_unsupported")
    torch.testing.assert_close(y, transformers_experts_forward(module, x, ids, weights))


def test_real_transformers_model_compiled_training_step():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    common = dict(vocab_size=64, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=4, max_position_embeddings=64)
    model = transformers.MixtralForCausalLM(transformers.MixtralConfig(**common, num_local_experts=8,
                                                                       num_experts_per_tok=2))
    model.set_experts_implementation(lowprec.moe.register_transformers_experts())
    ids = torch.randint(0, 64, (2, 9))
    torch._dynamo.reset()
    loss = torch.compile(model, fullgraph=True)(ids, labels=ids).loss
    loss.backward()
    for m in model.modules():
        m.__dict__.pop("_lowprec_unsupported", None)
    torch.testing.assert_close(loss, model(ids, labels=ids).loss, rtol=1e-4, atol=1e-4)
    assert torch.isfinite(model.model.layers[0].mlp.experts.gate_up_proj.grad).all()


def test_experts_with_their_own_gate_are_refused():
    """An experts class overriding transformers' ``_apply_gate`` (DeepSeek-V4's clamped SwiGLU) is
    not computed as silu(gate) · up; transformers' own default gate (by its name) is."""
    from lowprec.moe.hf import experts_module_unsupported

    class ClampedExperts(_Experts):
        def _apply_gate(self, gate_up):
            gate, up = gate_up.chunk(2, dim=-1)
            return self.act_fn(gate).clamp(max=10) * up.clamp(-10, 10)

    def _default_apply_gate(self, gate_up):  # transformers' name for the plain gate
        gate, up = gate_up.chunk(2, dim=-1)
        return self.act_fn(gate) * up

    class DefaultGateExperts(_Experts):
        _apply_gate = _default_apply_gate

    assert "_apply_gate" in experts_module_unsupported(ClampedExperts(4, 32, 16))
    assert experts_module_unsupported(DefaultGateExperts(4, 32, 16)) is None
    assert experts_module_unsupported(_Experts(4, 32, 16)) is None


def test_convert_keeps_moe_blocks_whose_sizes_fp8_cannot_take(caplog):
    """Sizes not multiples of 16: the block (transformers') or the MoE (recipe=None, inference) stays
    as it is with a log line, as linear layers do, instead of raising mid-conversion."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.Qwen3MoeConfig(vocab_size=64, hidden_size=128, intermediate_size=256, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                         num_experts=8, num_experts_per_tok=2, moe_intermediate_size=40, head_dim=32)
    model = transformers.Qwen3MoeForCausalLM(config)
    ids = torch.randint(0, 64, (2, 5))
    with torch.no_grad():
        expected = model(ids).logits
        lowprec.convert(model, inference=True)
        got = model(ids).logits
    assert type(model.model.layers[0].mlp).__name__ == "Qwen3MoeSparseMoeBlock"
    assert "multiples of 16" in caplog.text
    assert lowprec.metrics.cos_sim(got, expected) > 0.99
    moe = nn.Sequential(MoE(40, 24, 4, 2, recipe=None))
    lowprec.convert(moe, inference=True)
    assert type(moe[0]) is MoE


def test_blocks_of_a_model_recording_router_logits_stay_as_they_are():
    """output_router_logits=True: transformers hooks the router module for the load-balancing loss;
    the block is not swapped (the lowprec MoE has no router module to hook), and the model still runs."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.Qwen3MoeConfig(vocab_size=64, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                         num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, head_dim=32,
                                         output_router_logits=True, router_aux_loss_coef=0.01)
    model = transformers.Qwen3MoeForCausalLM(config)
    ids = torch.randint(0, 64, (2, 9))
    expected = model(ids, labels=ids)
    block = model.model.layers[0].mlp
    assert "output_router_logits" in hf_moe_unsupported(block)
    lowprec.convert(model)
    assert type(model.model.layers[0].mlp).__name__ == "Qwen3MoeSparseMoeBlock"
    out = model(ids, labels=ids)
    torch.testing.assert_close(out.aux_loss, expected.aux_loss)
    torch.testing.assert_close(out.loss, expected.loss)


class _MetaModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(64, 64)
        self.moe = MoE(64, 32, num_experts=4, top_k=2)

    def forward(self, x):
        return self.moe(self.proj(x))


@pytest.mark.parametrize("recipe", ["fp8_block", "nvfp4"])
def test_meta_skeleton_with_moe_converts_and_loads_with_assign(recipe):
    torch.manual_seed(0)
    trained = lowprec.convert(_MetaModel(), recipe, inference=True)
    with torch.device("meta"):
        skeleton = _MetaModel()
    lowprec.convert(skeleton, recipe, inference=True)  # crashed: Tensor.item() cannot be called on meta tensors
    assert type(skeleton.moe) is type(trained.moe)
    skeleton.load_state_dict(trained.state_dict(), assign=True)
    assert not any(t.is_meta for t in list(skeleton.parameters()) + list(skeleton.buffers()))
    x = torch.randn(8, 64)
    with torch.no_grad():
        assert torch.equal(skeleton(x), trained(x))


@pytest.mark.parametrize("recipe", ["fp8_block", "nvfp4"])
def test_meta_transformers_mixtral_converts_and_loads_with_assign(recipe):
    transformers = pytest.importorskip("transformers", minversion="5.0")
    cfg = transformers.MixtralConfig(vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                                     num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                     num_experts_per_tok=2)
    torch.manual_seed(0)
    trained = lowprec.convert(transformers.MixtralForCausalLM(cfg).eval(), recipe, inference=True)
    with torch.device("meta"):
        skeleton = transformers.MixtralForCausalLM(cfg).eval()
    lowprec.convert(skeleton, recipe, inference=True)
    skeleton.load_state_dict(trained.state_dict(), assign=True)
    for name, b in trained.named_buffers():  # non-persistent buffers (rotary) are not in the state dict
        if skeleton.get_buffer(name).is_meta:
            mod, _, leaf = name.rpartition(".")
            skeleton.get_submodule(mod)._buffers[leaf] = b.clone()
    ids = torch.randint(0, 128, (2, 16))
    with torch.no_grad():
        assert torch.equal(skeleton(input_ids=ids).logits, trained(input_ids=ids).logits)


class _FunctionalSiluExperts(_Experts):
    """LFM2-MoE's experts: ``act_fn`` is ``F.silu`` itself, not a module."""

    def __init__(self, experts=8, hidden=128, ffn=64):
        super().__init__(experts, hidden, ffn)
        del self.act_fn  # a child module: a function cannot replace it in place
        self.act_fn = F.silu


def test_functional_silu_experts_are_taken():
    torch.manual_seed(0)
    module = _FunctionalSiluExperts()
    assert experts_module_unsupported(module) is None
    assert experts_module_unsupported(module, probe=False) is None
    x = torch.randn(24, 128)
    weights, ids = torch.rand(24, 2), torch.stack([torch.randperm(8)[:2] for _ in range(24)])
    y = transformers_experts_forward(module, x, ids, weights)
    assert metrics.cos_sim(y, module(x, ids, weights)) > 0.99


def test_real_lfm2_moe_on_the_lowprec_experts():
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "Lfm2MoeConfig"):
        pytest.skip("no LFM2-MoE in this transformers")
    name = lowprec.moe.register_transformers_experts()
    cfg = transformers.Lfm2MoeConfig(vocab_size=128, hidden_size=128, intermediate_size=128, moe_intermediate_size=64,
                                     num_hidden_layers=1, num_dense_layers=0, layer_types=["full_attention"],
                                     num_attention_heads=4, num_key_value_heads=2, num_experts=8, num_experts_per_tok=2)
    torch.manual_seed(0)
    model = transformers.Lfm2MoeForCausalLM(cfg)
    ids = torch.randint(0, 128, (2, 16))
    with torch.no_grad():
        expected = model(ids).logits
    model.set_experts_implementation(name)
    out = model(ids, labels=ids)
    assert metrics.cos_sim(out.logits, expected) > 0.99
    out.loss.backward()
    assert torch.isfinite(model.model.layers[0].feed_forward.experts.gate_up_proj.grad).all()


class _LayoutExperts(nn.Module):
    def __init__(self, experts=8, hidden=128, ffn=64, transposed=False):
        super().__init__()
        self.is_transposed = transposed
        up = (experts, hidden, 2 * ffn) if transposed else (experts, 2 * ffn, hidden)
        down = (experts, ffn, hidden) if transposed else (experts, hidden, ffn)
        self.gate_up_proj, self.down_proj = nn.Parameter(torch.zeros(up)), nn.Parameter(torch.zeros(down))
        self.act_fn = nn.SiLU()


def test_transposed_experts_are_refused_for_being_transposed():
    assert "is_transposed=True" in experts_module_unsupported(_LayoutExperts(transposed=True))


def test_transposed_experts_with_biases_name_the_biases():
    module = _LayoutExperts(transposed=True)
    module.has_bias = True
    module.gate_up_proj_bias = nn.Parameter(torch.zeros(8, 128))
    assert "biases" in experts_module_unsupported(module)


def test_ungated_experts_are_refused_for_having_no_gate():
    module = _LayoutExperts()
    del module.gate_up_proj
    module.up_proj = nn.Parameter(torch.zeros(8, 64, 128))
    module.has_gate = False
    assert "has_gate=False" in experts_module_unsupported(module)


class _ActCheckedExperts(nn.Module):
    def __init__(self, e=4, h=128, f=64):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.randn(e, 2 * f, h) / h**0.5)
        self.down_proj = nn.Parameter(torch.randn(e, h, f) / f**0.5)
        self.act_fn = nn.SiLU()


class _ClassNameUnknownSiLU(nn.Module):  # computes SiLU; not a class name the traced check knows
    def forward(self, x):
        return F.silu(x)


def _act_checked_inputs():
    g = torch.Generator().manual_seed(0)
    return (torch.randn(8, 128, generator=g), torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(8)]),
            torch.rand(8, 2, generator=g))


def test_replaced_activation_is_checked_again():
    torch.manual_seed(0)
    m = _ActCheckedExperts()
    x, ids, w = _act_checked_inputs()
    transformers_experts_forward(m, x, ids, w)
    m.act_fn = nn.GELU()
    with pytest.raises(ValueError, match="lowprec_fp8.*activation GELU"):
        transformers_experts_forward(m, x, ids, w)
    m.act_fn = nn.SiLU()  # and back
    transformers_experts_forward(m, x, ids, w)


def test_an_act_fn_with_hooks_is_refused_before_any_probe():
    """lowprec computes SiLU itself: a hook on act_fn would never fire (nor on the SiLU probe)."""
    m = _ActCheckedExperts()
    calls = []
    m.act_fn.register_forward_hook(lambda *args: calls.append(1))
    assert "hooks" in experts_module_unsupported(m)
    with pytest.raises(ValueError, match="lowprec_fp8.*act_fn must have no forward or backward hooks"):
        transformers_experts_forward(m, *_act_checked_inputs())
    assert calls == []


def test_replaced_weights_and_flags_are_checked_again():
    torch.manual_seed(0)
    m = _ActCheckedExperts()
    x, ids, w = _act_checked_inputs()
    transformers_experts_forward(m, x, ids, w)
    m.is_transposed = True
    with pytest.raises(ValueError, match="is_transposed=True"):
        transformers_experts_forward(m, x, ids, w)


def test_a_verdict_by_class_name_is_not_kept_for_eager_calls(monkeypatch):
    """A traced first call knows SiLU by class name only; a later eager call probes the activation.
    (The traced call is simulated: is_compiling() True for the check.)"""
    torch.manual_seed(0)
    m = _ActCheckedExperts()
    m.act_fn = _ClassNameUnknownSiLU()
    x, ids, w = _act_checked_inputs()
    with monkeypatch.context() as patch:
        patch.setattr(torch.compiler, "is_compiling", lambda: True)
        with pytest.raises(ValueError, match="_ClassNameUnknownSiLU"):
            transformers_experts_forward(m, x, ids, w)
    y = transformers_experts_forward(m, x, ids, w)  # eager: probed, SiLU
    assert y.shape == x.shape


_TINY_MOE_CONFIG = dict(vocab_size=64, hidden_size=128, intermediate_size=128, num_hidden_layers=1,
                        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64)


def _tiny_moe_models(transformers):
    yield transformers.MixtralForCausalLM(transformers.MixtralConfig(**_TINY_MOE_CONFIG, num_local_experts=4,
                                                                     num_experts_per_tok=2))
    yield transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        **_TINY_MOE_CONFIG, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=128, head_dim=32))


@pytest.mark.parametrize("inference", [False, True])
def test_per_call_output_router_logits_on_converted_blocks_is_refused(inference):
    transformers = pytest.importorskip("transformers", minversion="5.0")
    for model in _tiny_moe_models(transformers):
        torch.manual_seed(0)
        ids = torch.randint(0, 64, (2, 9))
        lowprec.convert(model, "fp8_block", inference=inference)
        assert "MoE" in type(model.model.layers[0].mlp).__name__
        model(ids)  # without recording: runs
        with pytest.raises(ValueError, match="output_router_logits"):
            model(ids, output_router_logits=True)
        model(ids)  # and again after the refusal


def test_compiled_model_asking_for_router_logits_over_converted_blocks_is_refused():
    """A whole model compiled after convert: output_router_logits=True (per call or set in the config
    afterwards) is refused with lowprec's error (was: transformers' IndexError, its collector set
    outside the graph where the layers' hook could not read it); calls without it run."""
    transformers = pytest.importorskip("transformers", minversion="5.0")
    for model in _tiny_moe_models(transformers):
        torch.manual_seed(0)
        ids = torch.randint(0, 64, (2, 9))
        lowprec.convert(model)
        torch._dynamo.reset()
        compiled = torch.compile(model, backend="eager")
        with pytest.raises(ValueError, match="output_router_logits=True"):
            compiled(ids, labels=ids, output_router_logits=True)
        assert torch.isfinite(compiled(ids, labels=ids).loss)
        model.config.output_router_logits = True
        with pytest.raises(ValueError, match="output_router_logits=True"):
            compiled(ids, labels=ids)


def test_converted_hf_moe_block_compiles_alone_fullgraph():
    """Regional compilation (a converted block alone, fullgraph): its router-logits pre-hook traces."""
    transformers = pytest.importorskip("transformers", minversion="5.0")
    torch.manual_seed(0)
    config = transformers.MixtralConfig(vocab_size=64, hidden_size=128, intermediate_size=128, num_hidden_layers=1,
                                        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
                                        num_local_experts=4, num_experts_per_tok=2)
    model = transformers.MixtralForCausalLM(config)
    lowprec.convert(model, "fp8_block", inference=False)
    mlp = model.model.layers[0].mlp
    assert "MoE" in type(mlp).__name__
    x = torch.randn(2, 9, 128)
    expected = mlp(x)
    torch._dynamo.reset()
    got = torch.compile(mlp, fullgraph=True, backend="aot_eager")(x)
    torch.testing.assert_close(got, expected)


def test_nvfp4_experts_of_an_inference_mode_model_follow_a_load():
    """A model made under torch.inference_mode holds inference tensors (no version counter): a
    load_state_dict into it repacks the 'lowprec_nvfp4' experts (was: the old experts, silently)."""
    transformers = pytest.importorskip("transformers", minversion="5.0")
    cfg = transformers.MixtralConfig(vocab_size=64, hidden_size=128, intermediate_size=128, num_hidden_layers=1,
                                     num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
                                     num_local_experts=4, num_experts_per_tok=2)
    name = lowprec.moe.register_transformers_experts("nvfp4")
    torch.manual_seed(0)
    other = transformers.MixtralForCausalLM(cfg).bfloat16()
    other.set_experts_implementation(name)
    ids = torch.randint(0, 64, (2, 9))
    with torch.inference_mode():
        model = transformers.MixtralForCausalLM(cfg).bfloat16()
        model.set_experts_implementation(name)
        before = model(ids).logits
        model.load_state_dict(other.state_dict())
        after = model(ids).logits
        assert not torch.equal(after, before)
        assert torch.equal(after, other(ids).logits)


@pytest.mark.parametrize("recipe", [None, "nvfp4"])
def test_blocks_converted_for_training_then_inference_still_refuse_router_logits(recipe):
    """The README's flow (convert to train, then convert(..., inference=True)): the inference MoE
    layers made from the training ones still refuse a forward recording router logits (was:
    transformers' IndexError, or a load-balancing loss from the blocks filter_fn kept only)."""
    transformers = pytest.importorskip("transformers", minversion="5.0")
    cfg = transformers.MixtralConfig(vocab_size=64, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                     num_experts_per_tok=2)
    keep_layer1 = lambda name, m: not name.startswith("model.layers.1.mlp")  # noqa: E731
    ids = torch.randint(0, 64, (2, 9))
    for filter_fn in (None, keep_layer1):
        torch.manual_seed(0)
        model = transformers.MixtralForCausalLM(cfg)
        lowprec.convert(model, filter_fn=filter_fn)
        lowprec.convert(model, recipe, filter_fn=filter_fn, inference=True)
        assert "InferenceMoE" in type(model.model.layers[0].mlp).__name__
        with torch.no_grad():  # NVFP4 layers: inference only
            model(ids)
            with pytest.raises(ValueError, match="output_router_logits"):
                model(ids, labels=ids, output_router_logits=True)


class _PlainExperts(nn.Module):
    def __init__(self, experts=4, hidden=128, ffn=64):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.randn(experts, 2 * ffn, hidden))
        self.down_proj = nn.Parameter(torch.randn(experts, hidden, ffn))
        self.act_fn = nn.SiLU()


def _in_storage_of(old: torch.Tensor, values: torch.Tensor) -> nn.Parameter:
    """A new weight holding ``values`` in ``old``'s storage at ``old``'s version: what the allocator
    gives a weight assigned after ``old`` was freed (same address, a fresh tensor's version 0)."""
    new = torch.empty(0, dtype=old.dtype)
    with torch.no_grad():
        new.set_(old.untyped_storage(), old.storage_offset(), old.shape, old.stride())
        new.copy_(values)
    torch._C._autograd._unsafe_set_version_counter((new,), (0,))
    return nn.Parameter(new)


def test_nvfp4_experts_follow_weights_assigned_anew():
    """A weight assigned anew can land in the freed storage of the packed one, with the same version
    and shape: the NVFP4 copy must still be made again (was: the old experts, silently)."""
    torch.manual_seed(0)
    module = _PlainExperts()
    x = torch.randn(8, 128)
    weights, ids = torch.rand(8, 2), torch.stack([torch.randperm(4)[:2] for _ in range(8)])
    with torch.no_grad():
        old = transformers_nvfp4_experts_forward(module, x, ids, weights)
        new_weight = torch.randn(module.gate_up_proj.shape)
        module.gate_up_proj = _in_storage_of(module.gate_up_proj, new_weight)
        assert module.gate_up_proj._version == 0
        got = transformers_nvfp4_experts_forward(module, x, ids, weights)
        fresh = _PlainExperts()
        fresh.gate_up_proj, fresh.down_proj = nn.Parameter(new_weight), module.down_proj
        torch.testing.assert_close(got, transformers_nvfp4_experts_forward(fresh, x, ids, weights), rtol=0, atol=0)
        assert not torch.equal(got, old)


def _nvfp4_inputs():
    g = torch.Generator().manual_seed(0)
    return (torch.randn(8, 128, generator=g), torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(8)]),
            torch.rand(8, 2, generator=g))


def test_nvfp4_experts_follow_a_weight_given_new_storage_at_the_old_address():
    """model.cpu(); param.data = new; model.cuda(): the caching allocator can hand the new weight the
    old one's address, with the parameter, its version and shape unchanged (simulated here with new
    storage over the old memory): the NVFP4 copy must be made again (was: the old experts, silently)."""
    torch.manual_seed(0)
    module = _PlainExperts()
    x, ids, weights = _nvfp4_inputs()
    new_values = torch.randn(module.gate_up_proj.shape)
    with torch.no_grad():
        old = transformers_nvfp4_experts_forward(module, x, ids, weights)
        fresh = _PlainExperts()
        fresh.gate_up_proj, fresh.down_proj = nn.Parameter(new_values.clone()), module.down_proj
        expected = transformers_nvfp4_experts_forward(fresh, x, ids, weights)
        same_address = torch.from_numpy(module.gate_up_proj.detach().numpy())  # another storage, one address
        same_address.copy_(new_values)
        module.gate_up_proj.data = same_address
        got = transformers_nvfp4_experts_forward(module, x, ids, weights)
    assert not torch.equal(got, old)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


@pytest.mark.parametrize("change", ["cast", "move"])
def test_nvfp4_copy_is_freed_with_the_weights_it_came_from(change, monkeypatch):
    """module.to(dtype) / model.cpu() free the weights the NVFP4 copy was packed from: the copy goes
    with them (was: kept until the next forward, on a GPU its memory held after model.cpu()), and
    the next call packs the new weights."""
    from lowprec.gemm import weight_only

    packed = []
    pack = weight_only.pack_nvfp4_experts
    monkeypatch.setattr(weight_only, "pack_nvfp4_experts",
                        lambda *args: packed.append(weakref.ref((out := pack(*args)).data)) or out)
    torch.manual_seed(0)
    module = _PlainExperts()
    x, ids, weights = _nvfp4_inputs()
    with torch.no_grad():
        transformers_nvfp4_experts_forward(module, x, ids, weights)
        pickle.loads(pickle.dumps(module))  # the copy (beside the module, weakly keyed) does not block pickling
        assert len(packed) == 2 and all(ref() is not None for ref in packed)
        if change == "cast":
            module.to(torch.bfloat16)
        else:  # a move on CPU: new storage for each weight, as .cpu() from a GPU gives
            module._apply(lambda t: t.clone())
        assert all(ref() is None for ref in packed)
        y = transformers_nvfp4_experts_forward(module, x.to(module.down_proj.dtype), ids, weights)
    assert len(packed) == 4 and torch.isfinite(y).all()
