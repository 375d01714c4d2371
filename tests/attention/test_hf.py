"""``"lowprec_fp8"`` as a transformers attention implementation (``lowprec.attention.hf``): the
function on stand-in inputs (CI has no transformers), and tiny real models when transformers is
installed."""

from __future__ import annotations

import inspect
import math
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F

import lowprec
from lowprec.attention import register_transformers_attention
from lowprec.attention.hf import _sdpa_reason, transformers_attention_forward

from ..hopper import gpu


class _Attention(torch.nn.Module):
    is_causal = True


def _qkv(b=2, h=4, hkv=2, s=96, d=64, dtype=torch.float32, device="cpu"):
    g = torch.Generator(device=device).manual_seed(0)
    return tuple(torch.randn(b, n, s, d, generator=g, device=device).to(dtype) for n in (h, hkv, hkv))


class _Bidirectional(torch.nn.Module):
    is_causal = False


def test_a_position_bias_runs_sdpa_not_the_fp8_forward():
    """An additive position bias (T5's relative positions) is not dropped: the call runs sdpa with it."""
    pytest.importorskip("transformers", minversion="5.0")
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    q, k, v = _qkv(b=1, h=2, hkv=2, s=32)
    bias = torch.zeros(1, 2, 32, 32)
    bias[..., :16] = -1e4  # hides the first 16 keys
    assert "position bias" in _sdpa_reason(_Bidirectional(), q, k, v, None, 0.0, {"position_bias": bias})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out, _ = transformers_attention_forward(_Bidirectional(), q, k, v, None, position_bias=bias)
    ref, _ = sdpa_attention_forward(_Bidirectional(), q, k, v, None, position_bias=bias)
    torch.testing.assert_close(out, ref)


def test_attention_sinks_are_refused():
    """Attention sinks (``s_aux``, GPT-OSS) are added by neither path: a clear error, not a wrong result."""
    q, k, v = _qkv(b=1, h=2, hkv=2, s=32)
    with pytest.raises(ValueError, match="s_aux"):
        transformers_attention_forward(_Bidirectional(), q, k, v, None, s_aux=torch.full((2,), 3.0))


@pytest.mark.parametrize("is_causal", [None, True, False])
def test_the_fp8_forward_in_transformers_layout(is_causal):
    """No mask: lowprec.attention(quant="fp8") on the grouped heads as given, causal from the call or
    the module, returned [B, S, H, D] as transformers' implementations return it."""
    q, k, v = _qkv()
    out, weights = transformers_attention_forward(_Attention(), q, k, v, None, scaling=0.1, is_causal=is_causal)
    ref = lowprec.attention(q, k, v, causal=is_causal is not False, scale=0.1, quant="fp8")
    assert weights is None and out.shape == (2, 96, 4, 64) and out.is_contiguous()
    # not torch.equal: one CI run saw the two CPU emulation calls differ in low bits (not
    # reproduced in nine reruns); a wrong causal flag, scale or layout moves the output by far more
    torch.testing.assert_close(out, ref.transpose(1, 2), rtol=1e-5, atol=1e-6)


def test_gradients_flow_through_the_fp8_forward():
    q, k, v = (t.requires_grad_() for t in _qkv(s=40))
    out, _ = transformers_attention_forward(_Attention(), q, k, v, None)
    out.square().sum().backward()
    assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in (q, k, v))


def test_the_calls_it_leaves_to_sdpa():
    q, k, v = _qkv(s=32)
    m = _Attention()
    assert _sdpa_reason(m, q, k, v, None, 0.0, {}) is None
    assert "attention mask" in _sdpa_reason(m, q, k, v, torch.ones(2, 1, 32, 32, dtype=torch.bool), 0.0, {})
    assert "dropout" in _sdpa_reason(m, q, k, v, None, 0.1, {})
    assert "softcap" in _sdpa_reason(m, q, k, v, None, 0.0, {"softcap": 30.0})
    assert "decode" in _sdpa_reason(m, q[:, :, :1], k, v, None, 0.0, {})
    assert "decode" in _sdpa_reason(m, q[:, :, :8], k, v, None, 0.0, {})
    assert "chunked prefill" in _sdpa_reason(m, q[:, :, :20], k, v, None, 0.0, {})
    assert _sdpa_reason(m, q[:, :, :1], k[:, :, :1], v[:, :, :1], None, 0.0, {}) is None  # a one-token prompt



def test_non_causal_cross_attention_is_named_as_such_not_decode():
    """Whisper's cross-attention (16 decoder queries over 32 encoder keys, no cache, not causal)
    still runs sdpa, but its warning names cross-attention: it said "decode over transformers'
    bf16 KV cache" (and suggested fp8_cache)."""
    q, k, v = _qkv(b=1, h=2, hkv=2, s=32)
    for m, q_len, is_causal in ((_Bidirectional(), 16, None), (_Bidirectional(), 1, None), (_Attention(), 16, False)):
        why = _sdpa_reason(m, q[:, :, :q_len], k, v, None, 0.0, {}, is_causal)
        assert "cross-attention" in why and "decode" not in why and "fp8_cache" not in why
    assert "decode" in _sdpa_reason(_Attention(), q[:, :, :16], k, v, None, 0.0, {}, True)  # causal: unchanged
    assert _sdpa_reason(_Bidirectional(), q, k, v, None, 0.0, {}) is None  # an encoder's self-attention
    pytest.importorskip("transformers", minversion="5.0")
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    with pytest.warns(RuntimeWarning, match="cross-attention") as record:
        out, _ = transformers_attention_forward(_Bidirectional(), q[:, :, :16], k, v, None)
    assert not any("decode" in str(r.message) for r in record)
    torch.testing.assert_close(out, sdpa_attention_forward(_Bidirectional(), q[:, :, :16], k, v, None)[0])


def _tiny_llama(attn_implementation, device, dtype):
    transformers = pytest.importorskip("transformers", minversion="5.0")
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                      attn_implementation=attn_implementation)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).to(device=device, dtype=dtype)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=gpu)])
def test_a_real_llama_on_lowprec_fp8(device):
    """A tiny transformers Llama on "lowprec_fp8": logits within the FP8 scheme's error of sdpa's,
    padded batches through sdpa (the same logits), training gradients, generation."""
    pytest.importorskip("transformers", minversion="5.0")
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    name = register_transformers_attention()
    model = _tiny_llama("sdpa", device, dtype)
    ids = torch.randint(0, 256, (2, 256), device=device)
    with torch.no_grad():
        ref = model(ids).logits.float()
        model.set_attn_implementation(name)
        out = model(ids).logits.float()
        assert F.cosine_similarity(out.flatten(), ref.flatten(), dim=0) > 0.99
        mask = torch.ones_like(ids)
        mask[0, :17] = 0  # left padding: a mask tensor, so sdpa runs
        padded = model(ids, attention_mask=mask).logits
        model.set_attn_implementation("sdpa")
        assert torch.equal(padded, model(ids, attention_mask=mask).logits)
    model.set_attn_implementation(name)
    model(ids, labels=ids).loss.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)
    with torch.no_grad():  # prefill on the FP8 forward, decode steps on sdpa over transformers' cache
        generated = model.generate(ids[:, :64], max_new_tokens=4, do_sample=False)
    assert generated.shape == (2, 68)


@pytest.mark.filterwarnings("ignore::FutureWarning")  # newer transformers call past_key_values "cache"
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=gpu)])
def test_generation_on_an_fp8_cache(device):
    """fp8_cache: a tiny Llama's prefill and decode steps over FP8KVCache layers (codes read in
    place) stay within the FP8 scheme's error of sdpa over transformers' bf16 cache; generate runs
    (greedy); a masked (padded) batch attends over the dequantized cache with sdpa."""
    transformers = pytest.importorskip("transformers", minversion="5.0")
    from lowprec.attention import FP8KVCache, fp8_cache

    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    name = register_transformers_attention()
    model = _tiny_llama(name, device, dtype)
    ids = torch.randint(0, 256, (2, 200), device=device)

    def cos(a, b):
        return F.cosine_similarity(a.float().flatten(), b.float().flatten(), dim=0).item()

    with torch.no_grad():
        fp8, bf16 = fp8_cache(300), transformers.DynamicCache()
        got = model(ids[:, :190], past_key_values=fp8, use_cache=True).logits
        model.set_attn_implementation("sdpa")
        ref = model(ids[:, :190], past_key_values=bf16, use_cache=True).logits
        assert cos(got, ref) > 0.99 and fp8.get_seq_length() == 190
        for i in range(190, 200):  # decode steps: one query over each cache
            model.set_attn_implementation(name)
            got = model(ids[:, i:i + 1], past_key_values=fp8, use_cache=True).logits
            model.set_attn_implementation("sdpa")
            ref = model(ids[:, i:i + 1], past_key_values=bf16, use_cache=True).logits
            assert cos(got, ref) > 0.99, i
        assert fp8.get_seq_length() == 200 and isinstance(fp8.layers[0].fp8, FP8KVCache)
        model.set_attn_implementation(name)
        generated = model.generate(ids[:, :64], past_key_values=fp8_cache(128), max_new_tokens=6, do_sample=False)
        assert generated.shape == (2, 70)
        if "cache" in inspect.signature(transformers.LlamaModel.forward).parameters:  # the README's form since
            # transformers renamed past_key_values (5.24 here): the same tokens
            assert torch.equal(model.generate(ids[:, :64], cache=fp8_cache(128), max_new_tokens=6,
                                              do_sample=False), generated)
        mask = torch.ones_like(ids[:, :64])
        mask[0, :9] = 0
        with pytest.warns(RuntimeWarning, match="dequantized"):
            padded = model(ids[:, :64], attention_mask=mask, past_key_values=fp8_cache(128), use_cache=True).logits
        model.set_attn_implementation("sdpa")
        ref = model(ids[:, :64], attention_mask=mask).logits
        assert cos(padded[1], ref[1]) > 0.99 and cos(padded[0, 9:], ref[0, 9:]) > 0.99


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_fp8_cache_on_another_attention_implementation_fails():
    """README: fp8_cache's keys and values are FP8 codes, which only "lowprec_fp8" reads with their
    scales; on "sdpa" the forward fails on their dtype (never a result from the raw codes)."""
    pytest.importorskip("transformers", minversion="5.0")
    from lowprec.attention import fp8_cache

    model = _tiny_llama("sdpa", "cpu", torch.float32)
    with torch.no_grad(), pytest.raises((RuntimeError, ValueError), match="dtype"):
        model(torch.randint(0, 256, (1, 16)), past_key_values=fp8_cache(32), use_cache=True)


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_fp8_cache_from_a_one_token_prompt():
    """Decoding from one prompt token (BOS): V's scales came from that token's channels, and a
    channel near 0 there saturated later (2880 values, 56% of greedy tokens kept, on this model).
    Now a short first append floors each channel at the head's amax."""
    pytest.importorskip("transformers", minversion="5.0")
    from lowprec.attention import fp8_cache

    name = register_transformers_attention()
    model = _tiny_llama(name, "cpu", torch.float32)
    ids = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        model.set_attn_implementation("sdpa")
        ref = model(ids).logits
        model.set_attn_implementation(name)
        cache = fp8_cache(64)
        got = torch.cat([model(ids[:, i:i + 1], past_key_values=cache, use_cache=True).logits for i in range(40)], 1)
    assert sum(layer.fp8.saturated.item() for layer in cache.layers) == 0
    cos = F.cosine_similarity(got.flatten(2), ref.flatten(2), dim=-1)
    assert cos.min() > 0.998  # as a whole-prompt prefill here (0.9989); 0.89 before


def test_fp8_cache_refuses_what_it_cannot_do():
    transformers = pytest.importorskip("transformers", minversion="5.0")
    from lowprec.attention import fp8_cache

    with pytest.raises(ValueError, match="max_len"):
        fp8_cache(0)
    cache = fp8_cache(64)
    k = torch.randn(1, 2, 8, 64)
    cache.update(k, k.clone(), 0)
    assert cache.get_seq_length() == 8 and isinstance(cache, transformers.Cache)
    for call in (lambda: cache.crop(4), lambda: cache.reorder_cache(torch.tensor([0])),
                 lambda: cache.batch_repeat_interleave(2)):
        with pytest.raises(NotImplementedError, match="fp8_cache"):
            call()


@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.parametrize("arch", ["Qwen3", "Mistral", "Mistral-sliding"])
def test_fp8_cache_in_other_architectures(arch):
    """fp8_cache in other transformers decoders: Qwen3 (Q / K norms before the cache) and Mistral
    (a sliding window gives a mask: those calls attend over the dequantized cache): prefill and a
    decode step within the FP8 scheme's error of sdpa, and generate runs."""
    transformers = pytest.importorskip("transformers", minversion="5.0")
    from lowprec.attention import fp8_cache

    family = arch.split("-")[0]
    extra = {"sliding_window": 48} if arch.endswith("sliding") else {}
    name = register_transformers_attention()
    config = getattr(transformers, f"{family}Config")(
        vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, attn_implementation=name, **extra)
    torch.manual_seed(0)
    model = getattr(transformers, f"{family}ForCausalLM")(config)
    ids = torch.randint(0, 256, (2, 101))
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the masked calls' sdpa notice
        cache = fp8_cache(128)
        got = torch.cat([model(ids[:, :100], past_key_values=cache, use_cache=True).logits,
                         model(ids[:, 100:], past_key_values=cache, use_cache=True).logits], dim=1)
        assert model.generate(ids[:, :20], past_key_values=fp8_cache(32), max_new_tokens=4,
                              do_sample=False).shape == (2, 24)
        model.set_attn_implementation("sdpa")
        ref = model(ids).logits
    assert F.cosine_similarity(got.flatten(), ref.flatten(), dim=0) > 0.99


def test_fp8_cache_names_what_it_needs(monkeypatch):
    """Without transformers (as in CI), fp8_cache says what it needs."""
    from lowprec.attention import hf

    monkeypatch.setitem(sys.modules, "transformers", None)
    monkeypatch.setitem(sys.modules, "transformers.cache_utils", None)
    hf._fp8_cache_classes.cache_clear()
    try:
        with pytest.raises(ImportError, match="fp8_cache: needs transformers >= 5"):
            hf.fp8_cache(16)
    finally:
        hf._fp8_cache_classes.cache_clear()


@pytest.mark.parametrize("name,value", [
    ("indices", torch.zeros(1, 32, 1, dtype=torch.int32)),  # DSA top-k keys (DeepSeek-V3.2, GLM-DSA, ...)
    ("block_indices", torch.zeros(1, 2, 32, 1, dtype=torch.int32)),  # MiniMax-M3's selected key blocks
    ("sinks", torch.full((1, 2, 32, 1), 5.0)),  # per-token sinks
    ("s_aux", torch.full((2,), 3.0)),
])
@pytest.mark.parametrize("masked", [False, True])
def test_sparse_selections_and_sinks_are_refused_not_dropped(name, value, masked):
    """Models pass a sparse key selection (``indices``, ``block_indices``) or sinks only to attention
    implementations other than eager / sdpa (for those they fold it into the mask): neither the FP8
    forward nor the sdpa fallback applies them, so the call must fail, not run dense attention."""
    q, k, v = _qkv(b=1, h=2, hkv=2, s=32)
    mask = torch.ones(32, 32, dtype=torch.bool).tril()[None, None] if masked else None
    with pytest.raises(ValueError, match=name):
        transformers_attention_forward(_Attention(), q, k, v, mask, **{name: value})


def _gemma2(transformers):
    cfg = transformers.Gemma2Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=16,
                                    max_position_embeddings=128)
    torch.manual_seed(0)
    return transformers.Gemma2ForCausalLM(cfg).eval()


def test_softcap_calls_compute_the_softcap():
    from lowprec.attention import fp8_cache

    transformers = pytest.importorskip("transformers", minversion="5.0")
    ref = _gemma2(transformers)  # eager: transformers' only implementation with a softcap
    assert ref.config.attn_logit_softcapping
    model = _gemma2(transformers)
    model.set_attn_implementation(register_transformers_attention())
    ids = torch.randint(0, 128, (2, 32))
    mask = torch.ones(2, 32, dtype=torch.long)
    mask[0, :5] = 0
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        for n in (8, 32):  # plain causal (no mask), and the sliding window's mask
            torch.testing.assert_close(model(input_ids=ids[:, :n]).logits, ref(input_ids=ids[:, :n]).logits)
        out, exp = model(input_ids=ids, attention_mask=mask).logits, ref(input_ids=ids, attention_mask=mask).logits
        torch.testing.assert_close(out[0, 5:], exp[0, 5:])
        torch.testing.assert_close(out[1], exp[1])
        expected = ref.generate(ids[:, :8], max_new_tokens=4, do_sample=False)
        assert torch.equal(model.generate(ids[:, :8], max_new_tokens=4, do_sample=False), expected)
        model.generate(ids[:, :8], max_new_tokens=4, do_sample=False, past_key_values=fp8_cache(64))


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_fp8_cache_as_a_cross_attention_cache():
    """transformers reads a cross-attention layer's ``keys`` / ``values`` back at later steps."""
    transformers = pytest.importorskip("transformers", minversion="5.0")
    from lowprec.attention import fp8_cache

    cfg = transformers.BartConfig(vocab_size=128, d_model=64, encoder_layers=2, decoder_layers=2,
                                  encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128,
                                  decoder_ffn_dim=128, max_position_embeddings=128)
    torch.manual_seed(0)
    model = transformers.BartForConditionalGeneration(cfg).eval()
    model.set_attn_implementation(register_transformers_attention())
    ids, dec = torch.randint(3, 128, (2, 24)), torch.randint(3, 128, (2, 6))
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        enc = model.get_encoder()(ids)
        ref = model(encoder_outputs=enc, decoder_input_ids=dec).logits
        cache = transformers.EncoderDecoderCache(fp8_cache(64), fp8_cache(64))
        got = [model(encoder_outputs=enc, decoder_input_ids=dec[:, :3], past_key_values=cache, use_cache=True).logits]
        for i in range(3, 6):  # decode steps: the cross-attention layers are read back, not updated
            got.append(model(encoder_outputs=enc, decoder_input_ids=dec[:, i:i + 1], past_key_values=cache,
                             use_cache=True).logits)
    got = torch.cat(got, dim=1)
    assert cache.get_seq_length() == 6 and cache.cross_attention_cache.get_seq_length() == 24
    assert F.cosine_similarity(got.flatten(), ref.flatten(), dim=0) > 0.999


def _llama_on_fp8_attention(transformers):
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                   attn_implementation=register_transformers_attention())
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.parametrize("masked", [False, True])
def test_grad_enabled_forward_over_fp8_cache_is_refused(masked):
    """The cache holds no gradients: a forward that would train through it fails clearly (with a
    mask it silently dropped the K / V projections' gradients)."""
    transformers = pytest.importorskip("transformers", minversion="5.0")
    from lowprec.attention import fp8_cache

    model = _llama_on_fp8_attention(transformers)
    ids = torch.randint(0, 128, (2, 20))
    mask = torch.ones_like(ids)
    if masked:
        mask[0, :3] = 0  # left padding: the call attends over the dequantized cache with sdpa
    with warnings.catch_warnings(), pytest.raises(ValueError, match="fp8_cache.*no gradients"):
        warnings.simplefilter("ignore", RuntimeWarning)
        model(ids, attention_mask=mask, past_key_values=fp8_cache(64), use_cache=True).logits.sum().backward()
    with torch.no_grad(), warnings.catch_warnings():  # inference still runs
        warnings.simplefilter("ignore", RuntimeWarning)
        assert model(ids, attention_mask=mask, past_key_values=fp8_cache(64), use_cache=True).logits.isfinite().all()


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_fp8_cache_refuses_linear_attention_layers():
    transformers = pytest.importorskip("transformers", minversion="5.0")
    from lowprec.attention import fp8_cache

    cfg = transformers.Qwen3NextConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
        linear_value_head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=32, layer_types=["linear_attention", "full_attention"])
    torch.manual_seed(0)
    model = transformers.Qwen3NextForCausalLM(cfg).eval()
    model.set_attn_implementation(register_transformers_attention())
    with torch.no_grad(), warnings.catch_warnings(), pytest.raises(NotImplementedError, match="fp8_cache.*linear"):
        warnings.simplefilter("ignore", RuntimeWarning)
        model(torch.randint(3, 128, (2, 20)), past_key_values=fp8_cache(64), use_cache=True)
    cache = fp8_cache(64)
    for call in (lambda: cache.get_conv_state(0), lambda: cache.update_recurrent_state(torch.zeros(1), 0)):
        with pytest.raises(NotImplementedError, match="fp8_cache"):
            call()


def test_fp8_cache_refuses_a_value_head_dim_other_than_the_keys():
    pytest.importorskip("transformers", minversion="5.0")
    from lowprec.attention import fp8_cache

    cache = fp8_cache(64)
    k, v = torch.randn(2, 1, 8, 32), torch.randn(2, 1, 8, 16)  # DeepSeek-V3's MLA: qk 32, v 16
    with pytest.raises(NotImplementedError, match="fp8_cache.*head dims"):
        cache.update(k, v, 0)


@pytest.mark.parametrize("bad", [0.5, math.inf, math.nan, "4", None])
def test_fp8_cache_checks_v_headroom_at_once(bad):
    pytest.importorskip("transformers", minversion="5.0")
    from lowprec.attention import fp8_cache

    with pytest.raises(ValueError, match="v_headroom"):
        fp8_cache(64, v_headroom=bad)


def test_fp8_cache_takes_a_valid_v_headroom():
    pytest.importorskip("transformers", minversion="5.0")
    from lowprec.attention import fp8_cache

    fp8_cache(64, v_headroom=1)
    fp8_cache(64, v_headroom=8.0)


@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.parametrize("how", ["torch.save", "deepcopy"])
def test_a_filled_fp8_cache_is_saved_or_copied_and_decodes_on(how):
    """A prompt's cache saved (torch.save: was "Can't pickle local object ...FP8Cache") or copied
    (transformers' prompt-reuse pattern) decodes on as the original does, which it leaves untouched."""
    import copy
    import io

    pytest.importorskip("transformers", minversion="5.0")
    from lowprec.attention import fp8_cache

    model = _tiny_llama(register_transformers_attention(), "cpu", torch.float32)
    ids = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        cache = fp8_cache(64)
        model(ids[:, :32], past_key_values=cache, use_cache=True)
        if how == "deepcopy":
            other = copy.deepcopy(cache)
        else:
            buffer = io.BytesIO()
            torch.save(cache, buffer)
            buffer.seek(0)
            other = torch.load(buffer, weights_only=False)
        assert other.get_seq_length() == 32
        got = model(ids[:, 32:], past_key_values=other, use_cache=True).logits
        assert cache.get_seq_length() == 32  # the original did not grow with the copy
        expected = model(ids[:, 32:], past_key_values=cache, use_cache=True).logits
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_generating_past_the_fp8_caches_max_len_names_max_len():
    """generate past fp8_cache's max_len: the error names fp8_cache's max_len (was FP8KVCache's "k: 1
    more tokens overflow the cache", an argument the caller never passed)."""
    pytest.importorskip("transformers", minversion="5.0")
    from lowprec.attention import fp8_cache

    model = _tiny_llama(register_transformers_attention(), "cpu", torch.float32)
    ids = torch.randint(0, 256, (2, 12))
    with torch.no_grad(), pytest.raises(ValueError, match="fp8_cache: max_len=16 .* 1 more after 16"):
        model.generate(ids, past_key_values=fp8_cache(16), max_new_tokens=10, do_sample=False)


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_a_reset_fp8_cache_generates_for_another_batch_size():
    """reset() then generate with another batch size (or dtype) generates as a new cache does (was
    FP8KVCache's "k: expected [B=2, ...]": the layers kept the first batch's shape); without reset()
    the error names fp8_cache's key_states and says to reset it."""
    pytest.importorskip("transformers", minversion="5.0")
    from lowprec.attention import fp8_cache

    model = _tiny_llama(register_transformers_attention(), "cpu", torch.float32)
    ids = torch.randint(0, 256, (3, 24), generator=torch.Generator().manual_seed(0))
    cache = fp8_cache(64)
    with torch.no_grad():
        for prompt in (ids[:2], ids, ids[:2]):
            cache.reset()
            got = model.generate(prompt, past_key_values=cache, max_new_tokens=4, do_sample=False)
            assert torch.equal(got, model.generate(prompt, past_key_values=fp8_cache(64), max_new_tokens=4,
                                                   do_sample=False))
        cache.reset()
        model.to(torch.bfloat16)
        got = model.generate(ids, past_key_values=cache, max_new_tokens=4, do_sample=False)
        assert cache.layers[0].fp8.dtype == torch.bfloat16
        assert torch.equal(got, model.generate(ids, past_key_values=fp8_cache(64), max_new_tokens=4, do_sample=False))
        with pytest.raises(ValueError, match=r"fp8_cache: key_states: expected \[B=3, .* reset\(\) it"):
            model.generate(ids[:2], past_key_values=cache, max_new_tokens=4, do_sample=False)
