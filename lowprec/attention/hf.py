"""lowprec's FP8 attention as a transformers attention implementation (transformers >= 5).

``register_transformers_attention()`` registers ``"lowprec_fp8"`` in transformers'
``AttentionInterface`` (and its mask interface, with SDPA's masks), so any model that dispatches
its attention through that interface (Llama, Qwen2/3, Mistral, Mixtral, Qwen3-MoE, ...) runs
:func:`lowprec.attention` with ``quant="fp8"``: Q, K in per-128-token blocks (K smoothed), V per
channel, P in FP8, differentiable (the backward is exact attention's gradient in bf16):

    from lowprec.attention import register_transformers_attention

    model.set_attn_implementation(register_transformers_attention())

The calls the FP8 forward does not compute run transformers' own ``sdpa`` implementation, with one
warning per reason: an attention mask (padding, sliding windows: transformers passes no mask for a
plain causal pattern), dropout, a softcap, an additive position bias (T5's relative positions),
chunked prefill over a cache (``1 < q_len != kv_len``), cross-attention (not causal, ``q_len !=
kv_len``: an encoder-decoder's queries over the encoder's keys), decode over transformers' bf16
cache (its whole K and V would be quantized again at every step: :func:`fp8_cache` below keeps
the cache in FP8), and on CUDA inputs the kernel does not
read (dtype other than bf16 / fp16, head dims other than 64 / 128 / 256, ``Dv != D``). Attention
sinks (``s_aux``: GPT-OSS; ``sinks``) and sparse key selections (``indices``: DeepSeek-V3.2's DSA;
``block_indices``), which models pass only to implementations other than eager / sdpa, are refused
with an error: neither path applies them.

Generation on an FP8 KV cache: :func:`fp8_cache` is a transformers ``Cache`` whose layers are
:class:`lowprec.attention.FP8KVCache` objects (each step's keys and values quantized once as they
are appended, attention reading the FP8 cache in place), for ``"lowprec_fp8"`` models::

    out = model.generate(ids, cache=fp8_cache(max_len=4096), max_new_tokens=256)  # past_key_values= before
                                                                                 # transformers' rename

Calls with an attention mask (padded batches) attend over the cache dequantized to the model's
dtype with ``sdpa`` (correct, slower; one warning).
"""

from __future__ import annotations

import functools

import torch

from ..runtime import warn_once
from .dense import attention
from .kv_cache import FP8KVCache, _check_v_headroom

__all__ = ["ATTENTION_IMPLEMENTATION", "register_transformers_attention", "transformers_attention_forward",
           "fp8_cache"]

ATTENTION_IMPLEMENTATION = "lowprec_fp8"
_KERNEL_DTYPES = (torch.bfloat16, torch.float16)
_KERNEL_HEAD_DIMS = (64, 128, 256)


def register_transformers_attention() -> str:
    """Register ``"lowprec_fp8"`` with transformers (>= 5) and return that name, for
    ``model.set_attn_implementation(name)`` or ``from_pretrained(..., attn_implementation=name)``."""
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    except ImportError as err:
        raise ImportError("register_transformers_attention: needs transformers >= 5 (its AttentionInterface)") from err
    AttentionInterface.register(ATTENTION_IMPLEMENTATION, transformers_attention_forward)
    # SDPA's masks: None for a plain causal pattern (the FP8 forward's causal flag), a tensor otherwise
    AttentionMaskInterface.register(ATTENTION_IMPLEMENTATION, sdpa_mask)
    return ATTENTION_IMPLEMENTATION


def _score_terms_reason(attention_mask, dropout: float, kwargs) -> str | None:
    """What this call adds to plain softmax(QKᵀ)V that the FP8 forward does not compute (None:
    nothing)."""
    if attention_mask is not None:
        return "an attention mask (padding, a sliding window or another pattern than plain causal)"
    if dropout:
        return "attention dropout"
    if kwargs.get("softcap") is not None:
        return "a logit softcap"
    if kwargs.get("position_bias") is not None:
        return "an additive position bias (relative positions, ALiBi)"
    return None


def _sdpa_reason(module, query, key, value, attention_mask, dropout: float, kwargs,
                 is_causal: bool | None = None) -> str | None:
    """Why this call runs transformers' SDPA instead of the FP8 forward (None: it does not)."""
    q_len, kv_len = query.shape[2], key.shape[2]
    if (why := _score_terms_reason(attention_mask, dropout, kwargs)) is not None:
        return why
    if q_len != kv_len and not (getattr(module, "is_causal", True) if is_causal is None else is_causal):
        # not a cache: an encoder-decoder's queries over the encoder's keys (Whisper, BART)
        return ("cross-attention (queries over another sequence's keys, not causal: the FP8 forward runs where "
                "q_len == kv_len)")
    if q_len == 1 < kv_len or (q_len <= 16 and q_len < kv_len):
        return ("decode over transformers' bf16 KV cache (the FP8 forward would quantize the whole cache at every "
                "step; cache=fp8_cache(max_len) (past_key_values= on older transformers), from "
                "lowprec.attention import fp8_cache, keeps it in FP8)")
    if q_len != kv_len:
        return "queries over a longer cache (chunked prefill)"
    if query.is_cuda:
        d, dv = query.shape[-1], value.shape[-1]
        if query.dtype not in _KERNEL_DTYPES:
            return f"{query.dtype} inputs (the FP8 kernel reads bf16 / fp16)"
        if d not in _KERNEL_HEAD_DIMS or dv != d:
            return f"head dims D={d}, Dv={dv} (the FP8 kernel serves D = Dv in {_KERNEL_HEAD_DIMS})"
    return None


def transformers_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                                   value: torch.Tensor, attention_mask: torch.Tensor | None, dropout: float = 0.0,
                                   scaling: float | None = None, is_causal: bool | None = None, **kwargs):
    """The ``"lowprec_fp8"`` attention implementation, with transformers' signature: ``query``
    ``[B, H, S, D]``, ``key`` / ``value`` ``[B, Hkv, S, D]`` (grouped heads are not repeated).
    Returns ``(attn_output [B, S, H, D], None)`` (no attention weights)."""
    _refuse_unsupported(kwargs)
    cache = getattr(key, _FP8_CACHE_ATTR, None)
    if cache is not None:
        return _attend_fp8_cache(cache, module, query, attention_mask, dropout, scaling, is_causal, kwargs)
    why = _sdpa_reason(module, query, key, value, attention_mask, dropout, kwargs, is_causal)
    if why is not None:
        if kwargs.get("softcap") is not None:  # sdpa refuses a softcap: the model's own eager attention computes it
            return _eager_with_softcap(module, query, key, value, attention_mask, dropout, scaling, is_causal,
                                       kwargs)
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        warn_once(f"lowprec: attn_implementation={ATTENTION_IMPLEMENTATION!r}: {why}; those calls run 'sdpa'")
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    out = attention(query, key, value, causal=_causal(module, is_causal, query), scale=scaling, quant="fp8")
    return out.transpose(1, 2).contiguous(), None


def _eager_with_softcap(module, query, key, value, attention_mask, dropout, scaling, is_causal, kwargs):
    """A call with a logit softcap (Gemma 2): transformers' ``sdpa`` refuses it, so it runs the
    ``eager_attention_forward`` of the module's own modeling file (which applies it), or raises."""
    import sys

    eager = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if eager is None:
        raise ValueError(f"softcap: attn_implementation={ATTENTION_IMPLEMENTATION!r} computes no logit softcap and "
                         f"found no eager attention for {type(module).__name__}; use 'eager'")
    warn_once(f"lowprec: attn_implementation={ATTENTION_IMPLEMENTATION!r}: a logit softcap; those calls run the "
              "model's 'eager' attention ('sdpa' does not apply a softcap)")
    # the masks are sdpa's (None for plain causal, else boolean: True attends); eager adds a float mask
    q_len, kv_len = query.shape[2], key.shape[2]
    if attention_mask is None and _causal(module, is_causal, query):
        attention_mask = torch.ones(q_len, kv_len, dtype=torch.bool, device=query.device).tril(kv_len - q_len)
    if attention_mask is not None and attention_mask.dtype == torch.bool:
        attention_mask = torch.zeros(attention_mask.shape, dtype=query.dtype, device=query.device).masked_fill(
            ~attention_mask, torch.finfo(query.dtype).min)
        attention_mask = attention_mask.expand(*(1,) * (4 - attention_mask.dim()), *attention_mask.shape)
    return eager(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)


# what neither the FP8 forward nor transformers' sdpa computes, and models pass only to attention
# implementations other than eager / sdpa (for those two they fold a sparse selection into the mask
# themselves): dropping it would silently run another model
_REFUSED_KWARGS = {
    "s_aux": "attention sinks are not supported by attn_implementation={impl!r} (nor by 'sdpa'); use 'eager'",
    "sinks": "attention sinks are not supported by attn_implementation={impl!r} (nor by 'sdpa'); use 'eager'",
    "indices": "sparse attention (top-k key indices, DSA) is not supported by attn_implementation={impl!r}; "
               "use 'sdpa' or 'eager' (the model then folds the selection into the mask)",
    "block_indices": "sparse attention (selected key blocks) is not supported by attn_implementation={impl!r}; "
                     "use 'sdpa' or 'eager' (the model then folds the selection into the mask)",
}


def _refuse_unsupported(kwargs) -> None:
    """A clear error for the score terms that no path of this implementation adds."""
    for name, why in _REFUSED_KWARGS.items():
        if kwargs.get(name) is not None:
            raise ValueError(f"{name}: " + why.format(impl=ATTENTION_IMPLEMENTATION))


def _causal(module, is_causal: bool | None, query: torch.Tensor) -> bool:
    """The call's causal flag (else the module's); one query sees every key."""
    causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    return bool(causal) and query.shape[2] > 1


# the attribute on the key tensor an FP8 cache layer returns, naming its FP8KVCache
_FP8_CACHE_ATTR = "_lowprec_fp8_kv_cache"


def _attend_fp8_cache(cache: FP8KVCache, module, query, attention_mask, dropout, scaling, is_causal, kwargs):
    """Attention of ``query`` over an FP8 cache layer: the FP8 forward reading it in place, or (a
    mask, dropout, a softcap or a position bias) ``sdpa`` over its dequantized keys and values."""
    _refuse_grad(query)
    why = _score_terms_reason(attention_mask, dropout, kwargs)
    if why is None:
        out = cache.attend(query, causal=_causal(module, is_causal, query), scale=scaling)
        return out.transpose(1, 2).contiguous(), None
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    key, value = cache.dequantize()
    if kwargs.get("softcap") is not None:
        return _eager_with_softcap(module, query, key, value, attention_mask, dropout, scaling, is_causal, kwargs)
    warn_once(f"lowprec: fp8_cache: calls with {why} attend over the cache dequantized, with 'sdpa'")
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  is_causal=is_causal, **kwargs)


def _refuse_grad(*tensors) -> None:
    """The cache holds no gradients: its keys and values are detached codes (the masked path's
    dequantized ones too), so a call that would train through it must fail, not lose K / V grads."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        raise ValueError("fp8_cache: attention over an FP8 KV cache has no gradients; call the model under "
                         "torch.no_grad() or torch.inference_mode() (generate does), or train without fp8_cache")


def fp8_cache(max_len: int, *, v_headroom: float = 4.0):
    """A transformers (>= 5) ``Cache`` keeping every layer's keys and values in FP8: one
    :class:`~lowprec.attention.FP8KVCache` of ``max_len`` tokens per layer, made at the layer's
    first update (its batch, KV heads, head dim, dtype and device from the keys; V's scales from
    the prompt times ``v_headroom``, as :class:`~lowprec.attention.FP8KVCache` chooses them). For
    models on ``"lowprec_fp8"`` (:func:`register_transformers_attention`) only: the keys and values
    it returns are FP8 codes, which only that implementation reads with their scales (another one
    fails on their dtype). Pass it as ``cache`` to ``generate`` or a
    forward (``past_key_values`` on transformers releases before that rename); ``max_len`` bounds
    the prompt plus the new tokens (more raises). Greedy and sampled generation; beam search and
    cropping are not supported. A filled cache copies (``copy.deepcopy``, to reuse a prompt's) and
    saves (``torch.save``; ``torch.load(..., weights_only=False)``).
    Encoder-decoder models take it as transformers' caches are taken there, one per attention kind:
    ``EncoderDecoderCache(fp8_cache(max_len), fp8_cache(encoder_len))`` (or a ``DynamicCache`` for
    the cross-attention)."""
    if not isinstance(max_len, int) or isinstance(max_len, bool) or max_len < 1:
        raise ValueError(f"max_len: expected an int ≥ 1, got {max_len!r}")
    _check_v_headroom(v_headroom)  # here, not at the first layer's update deep inside generate
    layer_class, cache_class = _fp8_cache_classes()
    return cache_class(functools.partial(layer_class, max_len, v_headroom))


@functools.cache
def _fp8_cache_classes():
    try:
        from transformers.cache_utils import Cache, CacheLayerMixin
    except ImportError as err:
        raise ImportError("fp8_cache: needs transformers >= 5 (its Cache layers)") from err

    class FP8CacheLayer(CacheLayerMixin):
        """One model layer's FP8KVCache (transformers' cache-layer interface)."""

        is_compileable = False
        is_sliding = False
        is_croppable = False

        def __init__(self, max_len: int, v_headroom: float):
            super().__init__()
            self.max_len, self.v_headroom = max_len, v_headroom
            self.fp8: FP8KVCache | None = None

        def lazy_initialization(self, key_states, value_states):
            b, hkv, _, d = key_states.shape
            if value_states.shape[-1] != d:  # else FP8KVCache.append's shape error, naming neither
                raise NotImplementedError(f"fp8_cache: keys and values of different head dims (K {d}, V "
                                          f"{value_states.shape[-1]}: MLA models, DeepSeek-V3) are not supported "
                                          "(an FP8KVCache holds K and V of one head dim)")
            self.dtype, self.device = key_states.dtype, key_states.device
            self.fp8 = FP8KVCache(b, hkv, self.max_len, d, dtype=key_states.dtype, device=key_states.device,
                                  v_headroom=self.v_headroom)
            # the whole code buffers, values as [B, Hkv, max_len', D] (keys in the kernel's permuted order: only
            # the cache reads them): each update slices them once
            self._keys, self._values = self.fp8._k, self.fp8._v_t.transpose(-1, -2)
            self.is_initialized = True

        def update(self, key_states, value_states, *args, **kwargs):
            _refuse_grad(key_states, value_states)
            if self.is_initialized and not self._holds(key_states):
                fp8 = self.fp8
                if fp8.length:  # else append's error, naming its own "k"
                    raise ValueError(f"fp8_cache: key_states: expected [B={fp8.batch}, Hkv={fp8.kv_heads}, t, "
                                     f"D={fp8.head_dim}] {fp8.dtype} on {fp8.device} (those of the {fp8.length} "
                                     f"tokens it holds; reset() it before another batch), got "
                                     f"{tuple(key_states.shape)} {key_states.dtype} on {key_states.device}")
                # empty (reset): it takes the new batch's shape, dtype and device, as transformers' dynamic
                # layers do (generate with another batch size after reset())
                self.is_initialized = False
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            if self.fp8.length + key_states.shape[2] > self.max_len:  # else append's error, naming its own "k"
                raise ValueError(f"fp8_cache: max_len={self.max_len} tokens cannot take {key_states.shape[2]} more "
                                 f"after {self.fp8.length}: make it with max_len ≥ the prompt's length plus "
                                 "max_new_tokens")
            self.fp8.append(key_states, value_states)
            # what attention receives: the FP8 codes as [B, Hkv, L, D] views (one slice each, of views
            # made once), the key naming the cache
            length = self.fp8.length
            keys = self._keys[:, :, :length]
            setattr(keys, _FP8_CACHE_ATTR, self.fp8)
            # kept as transformers' layers keep them: encoder-decoder models reuse a cross-attention
            # layer's ``keys`` / ``values`` at later steps instead of calling update again
            self.keys, self.values = keys, self._values[:, :, :length]
            return self.keys, self.values

        def _holds(self, key_states) -> bool:
            """Whether the FP8KVCache takes ``key_states``' rows, heads, head dim, dtype and device."""
            fp8 = self.fp8
            b, hkv, _, d = key_states.shape
            return ((b, hkv, d, key_states.dtype, key_states.device)
                    == (fp8.batch, fp8.kv_heads, fp8.head_dim, fp8.dtype, fp8.device))

        def get_seq_length(self) -> int:
            return self.fp8.length if self.is_initialized else 0

        def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
            return self.get_seq_length() + query_length, 0

        def get_max_length(self) -> int:
            return self.max_len

        def get_max_cache_shape(self) -> int:
            return self.max_len

        def reset(self) -> None:
            if self.is_initialized:
                self.fp8.reset()
            self.keys = self.values = None

        def _unsupported(self, *args, **kwargs):
            raise NotImplementedError("fp8_cache: beam search, cropping and batch reordering are not supported "
                                      "(an FP8KVCache only grows)")

        reorder_cache = crop = batch_repeat_interleave = batch_select_indices = offload = prefetch = _unsupported

    class FP8Cache(Cache):
        """transformers' ``Cache`` over one FP8KVCache per layer (see :func:`fp8_cache`)."""

        def __init__(self, make_layer):
            super().__init__(layer_class_to_replicate=make_layer)

        def _no_linear_layers(self, *args, **kwargs):
            # its layers are all FP8 attention layers: a hybrid model's conv / recurrent states have none
            # (transformers then fails on an empty or attention layer: IndexError, "non linear attention")
            raise NotImplementedError("fp8_cache: models with linear-attention layers (conv / recurrent states: "
                                      "Qwen3-Next, Mamba hybrids, ...) are not supported; use transformers' "
                                      "DynamicCache(config=model.config)")

        get_conv_state = update_conv_state = get_recurrent_state = update_recurrent_state = _no_linear_layers
        has_previous_state = _no_linear_layers

    for cls in (FP8CacheLayer, FP8Cache):  # pickled by name: this module's __getattr__ finds them
        cls.__qualname__ = cls.__name__
    return FP8CacheLayer, FP8Cache


def __getattr__(name: str):
    # the cache classes subclass transformers' (imported at their first use); a pickled cache names them here
    if name in ("FP8CacheLayer", "FP8Cache"):
        return dict(zip(("FP8CacheLayer", "FP8Cache"), _fp8_cache_classes()))[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
