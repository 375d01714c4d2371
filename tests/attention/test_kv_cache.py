"""FP8KVCache: a growing FP8 KV cache (CPU: the format and the semantics; GPU: the sm_90a kernel
reading the cache's buffers as strided views)."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

import lowprec
from lowprec.attention import FP8KVCache, quantize_kv_cache
from lowprec.attention import kv_cache as kv_cache_module
from lowprec.attention.quantize import kv_views, unpermute_v_keys

from ..hopper import gpu, needs_cutlass, needs_gpu

BF16 = torch.bfloat16


def _kv(b, hkv, s, d, device="cpu", seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    k = (torch.randn(b, hkv, s, d, generator=g, device=device) + 0.5).to(BF16)
    v = torch.randn(b, hkv, s, d, generator=g, device=device).to(BF16)
    return k, v


def _close(a, b):
    """Two runs of the CPU emulation: equal up to one bf16 step. Not torch.equal: a CPU GEMM's low
    bits may depend on its buffers' alignment (seen once in CI on another CPU emulation test)."""
    torch.testing.assert_close(a.float(), b.float(), rtol=8e-3, atol=1e-5)


def _fill(cache, k, v, cuts):
    for lo, hi in zip(cuts[:-1], cuts[1:], strict=True):
        cache.append(k[:, :, lo:hi], v[:, :, lo:hi])


CUTS = [[0, 300], [0, 1, 2, 127, 128, 129, 300], [0, 5, 130, 131, 256, 300], list(range(0, 301, 7)) + [300]]


@pytest.mark.parametrize("cuts", CUTS, ids=lambda c: f"{len(c) - 1}appends")
@pytest.mark.parametrize("d", [64, 128])
def test_codes_are_quantize_kv_cache_bits(cuts, d):
    """However the tokens arrive, K's codes and scales are quantize_kv_cache's, and so are V's given
    its scales (the partial K block is quantized again as it fills)."""
    b, hkv, s = 2, 3, 300
    k, v = _kv(b, hkv, s, d)
    kq, vq = quantize_kv_cache(k, v)
    cache = FP8KVCache(b, hkv, 512, d, v_scale=vq.scale.reshape(b, hkv, d))
    _fill(cache, k, v, sorted(set(cuts)))
    kc, ks, vt, vs = cache.operands()
    assert cache.length == s
    assert torch.equal(kc.view(torch.uint8), kq.data.view(torch.uint8))
    assert torch.equal(ks, kq.scale.reshape(b, hkv, -1))
    assert vt.shape[-1] == 304 and torch.equal(vt[..., :s].view(torch.uint8), vq.data.view(torch.uint8))
    assert (vt[..., s:].view(torch.uint8) == 0).all()  # padded keys read zeros
    assert torch.equal(vs, vq.scale.reshape(b, hkv, d))
    assert cache.saturated.item() == 0


def test_first_append_sets_v_scales_with_headroom():
    k, v = _kv(1, 2, 200, 64)
    _, vq = quantize_kv_cache(k, v)
    exact = FP8KVCache(1, 2, 256, 64, v_headroom=1)
    exact.append(k, v)
    assert torch.equal(exact.operands()[2][..., :200].view(torch.uint8), vq.data.view(torch.uint8))
    roomy = FP8KVCache(1, 2, 256, 64)  # headroom 4, a power of two: the scale times 4 exactly
    roomy.append(k, v)
    assert torch.equal(roomy.v_scale, exact.v_scale * 4)


def test_a_nan_in_the_first_append_moves_no_v_scale():
    """V's scales ignore NaN as quantize_kv_cache does (a NaN amax would have made the channel's
    scale 1 for the cache's life)."""
    k, v = _kv(1, 1, 128, 64)  # 128 tokens: per-channel scales (no floor of short prompts)
    v = v * 0.01
    v[0, 0, 3, 5] = float("nan")
    _, vq = quantize_kv_cache(k, v)
    cache = FP8KVCache(1, 1, 160, 64, v_headroom=1)
    cache.append(k, v)
    assert torch.equal(cache.v_scale, vq.scale.reshape(1, 1, 64))


def test_a_short_first_append_floors_v_scales_at_the_head_amax():
    """A channel near 0 in a few prompt tokens got a scale that later tokens saturated (a
    one-token prompt: hundreds of values per layer); a row of fewer than 128 tokens now takes at
    least its KV head's amax per channel, a row of 128 or more its channels' own."""
    k, v = _kv(2, 2, 130, 64)
    v[:, :, :128, 7] *= 1e-4  # a channel small in the prompt, ordinary later
    v[:, :, :, 9] = float("inf")  # an Inf channel moves no other channel's scale
    for tokens in (1, 127, 128):
        cache = FP8KVCache(2, 2, 256, 64)  # headroom 4, a power of two: the amax scale times 4 exactly
        lengths = [tokens, 128]  # row 1 is long either way: its channels keep their own scales
        cache.append(k[:, :, :128], v[:, :, :128], lengths=lengths)
        for row, n in enumerate(lengths):
            own = v[row, :, :n].float().abs().amax(dim=1)  # [Hkv, D]
            head = torch.cat([own[:, :9], own[:, 10:]], -1).amax(dim=-1, keepdim=True)  # the finite channels
            want = torch.maximum(own, head) if n < 128 else own
            assert torch.equal(cache.v_scale[row, :, :9], want[:, :9] / 448 * 4), (tokens, row)
        later = v[:, :, 128:].clone()
        later[..., 9] = 0
        cache.append(k[:, :, 128:], later)
        # channel 7 of the 2 later tokens of both heads saturates in the long rows only
        assert cache.saturated.item() == (4 if tokens < 128 else 8), tokens


def test_values_past_the_headroom_saturate_and_are_counted():
    k, v = _kv(1, 1, 130, 64)
    cache = FP8KVCache(1, 1, 256, 64, v_headroom=2)
    cache.append(k[:, :, :128], v[:, :, :128])
    assert cache.saturated.item() == 0
    big = v[:, :, 128:].clone()
    big[0, 0, 0, :3] = v[..., :128, :3].abs().amax(dim=2)[0, 0] * 3  # past 2x the first amax
    big[0, 0, 1, 3] = v[..., :128, 3].abs().amax() * 1.5  # within the headroom
    before = big.clone()
    cache.append(k[:, :, 128:], big)
    assert torch.equal(big, before)  # the caller's tensor is untouched
    assert cache.saturated.item() == 3
    vt = cache.operands()[2].float()
    assert torch.isfinite(vt).all() and (vt[0, 0, :3, 128].abs() == 448).all()


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("b,h,hkv,sq,d", [(2, 4, 2, 1, 64), (1, 4, 4, 3, 128), (2, 8, 2, 16, 64)])
def test_attend_is_attention_on_the_same_codes(b, h, hkv, sq, d, causal):
    """attend matches lowprec.attention(q, *quantize_kv_cache(k, v), quant="fp8") on the same tokens."""
    k, v = _kv(b, hkv, 300, d)
    kq, vq = quantize_kv_cache(k, v)
    cache = FP8KVCache(b, hkv, 400, d, v_scale=vq.scale.reshape(b, hkv, d))
    _fill(cache, k, v, [0, 200, 299, 300])
    q = torch.randn(b, h, sq, d).to(BF16)
    out, lse = cache.attend(q, causal=causal, return_lse=True)
    ref, ref_lse = lowprec.attention(q, kq, vq, causal=causal, quant="fp8", return_lse=True)
    assert out.dtype == BF16
    _close(out, ref)
    _close(lse, ref_lse)
    exact = lowprec.attention(q.float(), k.float(), v.float(), causal=causal)
    assert torch.nn.functional.cosine_similarity(out.float().flatten(), exact.flatten(), dim=0) > 0.995


def test_empty_cache_and_reset():
    cache = FP8KVCache(1, 2, 64, 64)
    q = torch.randn(1, 2, 1, 64).to(BF16)
    out, lse = cache.attend(q, return_lse=True)
    assert (out == 0).all() and torch.isneginf(lse).all()
    k, v = _kv(1, 2, 40, 64)
    cache.append(k, v)
    first = cache.attend(q)
    cache.reset()
    assert cache.length == 0 and (cache.operands()[2].numel() == 0)
    cache.append(k, v)
    _close(cache.attend(q), first)


@pytest.mark.parametrize("given", ["constructor", "set_v_scale"])
def test_given_v_scales_stay_across_reset(given):
    """Calibrated V scales (a serving cache reset between requests) stay; chosen ones are chosen again."""
    k, v = _kv(1, 2, 40, 64)
    calibrated = torch.full((1, 2, 64), 0.05)
    if given == "constructor":
        cache = FP8KVCache(1, 2, 64, 64, v_scale=calibrated)
    else:
        cache = FP8KVCache(1, 2, 64, 64)
        cache.set_v_scale(calibrated)
    chosen = FP8KVCache(1, 2, 64, 64)
    for c in (cache, chosen):
        c.append(k, v)
        c.reset()
        c.append(k * 3, v * 3)
    assert torch.equal(cache.v_scale, calibrated)
    fresh = FP8KVCache(1, 2, 64, 64)
    fresh.append(k * 3, v * 3)
    assert torch.equal(chosen.v_scale, fresh.v_scale) and not torch.equal(fresh.v_scale, calibrated)


def test_the_cache_keeps_v_in_the_kernels_key_order():
    """Vᵀ's buffer holds the forward's permuted key order (no P shuffles); operands() gives key order
    and the paths without a kernel undo the permutation (the same result as on key-order operands)."""
    from lowprec.attention.dense import fp8_over_kv_operands
    from lowprec.attention.quantize import permuted_v_positions
    from lowprec.attention.sm90.config import V_KEY_PERM

    assert [V_KEY_PERM[p] for p in permuted_v_positions(torch.arange(16)).tolist()] == list(range(16))
    k, v = _kv(2, 2, 40, 64)
    cache = FP8KVCache(2, 2, 64, 64)
    cache.append(k[:, :, :33], v[:, :, :33])
    cache.append(k[:, :, 33:], v[:, :, 33:])
    plain = cache.operands()[2].view(torch.uint8)
    stored = cache._v_t.view(torch.uint8)[..., :48]
    for p in range(48):
        assert torch.equal(stored[..., p], plain[..., p - p % 16 + V_KEY_PERM[p % 16]])
    q = torch.randn(2, 4, 5, 64).to(BF16)
    views = kv_views(cache._k, cache._k_scale, cache._v_t, cache.length)
    out = fp8_over_kv_operands(q, *views, cache.v_scale, True, 0.125, v_keys_permuted=True)
    ref = fp8_over_kv_operands(q, *cache.operands(), True, 0.125)
    assert torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1])


def test_a_reset_cache_holds_what_a_new_one_holds():
    """After reset the last sequence's K is gone too: a shorter row's keys past its length (which
    operands and dequantize return) were its keys before, zeros in a new cache."""
    k, v = _kv(2, 2, 200, 64)
    used, new = FP8KVCache(2, 2, 256, 64), FP8KVCache(2, 2, 256, 64)
    used.append(k, v)
    used.reset()
    for cache in (used, new):
        cache.append(k[:, :, :150], v[:, :, :150], lengths=[150, 20])
    for a, b in zip(used.operands() + used.dequantize(), new.operands() + new.dequantize(), strict=True):
        assert torch.equal(a.view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a,
                           b.view(torch.uint8) if b.dtype == torch.float8_e4m3fn else b)


def test_bad_input_is_named():
    cache = FP8KVCache(2, 2, 128, 64)
    k, v = _kv(2, 2, 100, 64)
    with pytest.raises(ValueError, match="k: expected torch.bfloat16"):
        cache.append(k.float(), v)
    with pytest.raises(ValueError, match=r"v: expected \[B=2, Hkv=2, t, D=64\]"):
        cache.append(k, v[:1])
    with pytest.raises(ValueError, match="v: expected as many tokens"):
        cache.append(k, v[:, :, :5])
    cache.append(k, v)
    with pytest.raises(ValueError, match="overflow the cache: row 0 holds 100 of max_len=128"):
        cache.append(k, v)
    assert cache.length == 100  # a refused append changes nothing
    with pytest.raises(ValueError, match="v_scale: the cache already holds tokens"):
        cache.set_v_scale(torch.ones(2, 2, 64))
    with pytest.raises(ValueError, match="q: expected"):
        cache.attend(torch.randn(2, 3, 1, 64).to(BF16))
    with pytest.raises(ValueError, match="q: requires grad"):
        cache.attend(torch.randn(2, 2, 1, 64, requires_grad=True))
    with pytest.raises(ValueError, match="head_dim: expected a multiple of 16"):
        FP8KVCache(1, 1, 8, 40)
    with pytest.raises(ValueError, match="v_headroom"):
        FP8KVCache(1, 1, 8, 64, v_headroom=0.5)
    with pytest.raises(ValueError, match="v_scale: expected positive"):
        FP8KVCache(1, 1, 8, 64, v_scale=torch.zeros(1, 1, 64))
    with pytest.raises(ValueError, match="max_len"):
        FP8KVCache(1, 1, 0, 64)


class _RowCaches:
    """One single-row cache per batch row, fed each row's live tokens: what a ragged cache's rows
    must equal."""

    def __init__(self, like: FP8KVCache):
        self.rows = [FP8KVCache(1, like.kv_heads, like.max_len, like.head_dim, dtype=like.dtype, device=like.device)
                     for _ in range(like.batch)]

    def append(self, k, v, counts):
        for b, (row, n) in enumerate(zip(self.rows, counts, strict=True)):
            row.append(k[b:b + 1, :, :n], v[b:b + 1, :, :n])

    def check_operands(self, cache):
        assert cache.lengths.tolist() == [r.length for r in self.rows]
        for b, row in enumerate(self.rows):
            n = row.length
            whole = (cache._k[b:b + 1, :, :n], cache._k_scale[b:b + 1, :, :-(-n // 128)],
                     unpermute_v_keys(cache._v_t[b:b + 1])[..., :n], cache._v_scale[b:b + 1])
            own = row.operands()
            for name, x, y in zip(("k", "k_scale", "v_t", "v_scale"), whole, (*own[:2], own[2][..., :n], own[3]),
                                  strict=True):
                x, y = (t.view(torch.uint8) if t.dtype != torch.float32 else t for t in (x, y))
                assert torch.equal(x, y), (b, name)

    def attend(self, q, causal=False):
        return torch.cat([row.attend(q[b:b + 1], causal=causal) for b, row in enumerate(self.rows)])


def test_rows_of_different_lengths_are_each_their_own_cache():
    """Ragged rows (prompts of different lengths, right-padded): codes, scales and attention of
    each row equal those of a one-row cache fed that row's tokens, through ragged prefills, appends
    at each row's own length and decode steps."""
    b, hkv, d = 3, 2, 64
    k, v = _kv(b, hkv, 400, d)
    cache = FP8KVCache(b, hkv, 512, d)
    rows = _RowCaches(cache)
    cache.append(k[:, :, :300], v[:, :, :300], lengths=[300, 5, 130])
    rows.append(k[:, :, :300], v[:, :, :300], [300, 5, 130])
    assert cache.ragged and cache.length == 300 and "length=[300, 5, 130]" in repr(cache)
    rows.check_operands(cache)  # V's scales from each row's live tokens only
    steps = [(slice(300, 301), None), (slice(301, 304), None), (slice(304, 310), torch.tensor([0, 6, 2])),
             (slice(310, 311), [1, 1, 1])]
    for sl, lengths in steps:
        cache.append(k[:, :, sl], v[:, :, sl], lengths=lengths)
        counts = [sl.stop - sl.start] * b if lengths is None else list(map(int, lengths))
        rows.append(k[:, :, sl], v[:, :, sl], counts)
        rows.check_operands(cache)
    for sq, causal in ((1, False), (1, True), (3, True), (3, False)):
        q = torch.randn(b, 4, sq, d).to(BF16)
        _close(cache.attend(q, causal=causal), rows.attend(q, causal=causal))
    q = torch.randn(b, 4, 1, d).to(BF16)
    out = cache.decode_step(q, k[:, :, 311:312], v[:, :, 311:312])
    rows.append(k[:, :, 311:312], v[:, :, 311:312], [1] * b)
    rows.check_operands(cache)
    _close(out, rows.attend(q))
    assert cache.lengths.tolist() == [306, 17, 138]
    cache.append(k[:, :, :4], v[:, :, :4], lengths=[0, 0, 0])  # nothing to add
    assert cache.lengths.tolist() == [306, 17, 138]


def test_ragged_padding_is_never_read():
    """Padding past each row's length (here NaN and huge values) does not reach the codes or V's
    scales; a row given no token at the first append takes the other rows' V amax."""
    k, v = _kv(3, 2, 50, 64)
    k2, v2 = k.clone(), v.clone()
    k2[0, :, 20:], v2[0, :, 20:] = float("nan"), 1e4
    k2[1], v2[1] = float("nan"), float("nan")
    a, b = FP8KVCache(3, 2, 128, 64), FP8KVCache(3, 2, 128, 64)
    a.append(k2, v2, lengths=[20, 0, 50])
    b.append(k, v, lengths=[20, 0, 50])
    assert torch.equal(a.v_scale, b.v_scale) and torch.isfinite(a.v_scale).all()
    assert torch.equal(a.v_scale[1], torch.maximum(a.v_scale[0], a.v_scale[2]))
    for x, y in zip(a.operands(), b.operands(), strict=True):
        assert torch.equal(x.view(torch.uint8) if x.dtype != torch.float32 else x,
                           y.view(torch.uint8) if y.dtype != torch.float32 else y)
    assert not k2.isfinite().all()  # the caller's tensors untouched


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[gpu, needs_gpu])])
def test_padding_is_never_read_when_every_row_gives_the_same_count(device, monkeypatch):
    """``lengths`` all equal but short of the tokens given: only those tokens enter the cache (the
    padding, NaN and huge here, moves no K scale and no code), and the lengths advance by them (on
    sm_90a the second append is the append kernel's, on a token-strided view)."""
    if device == "cuda":
        monkeypatch.setenv("LOWPREC_BACKEND", "kernel")  # every append on the kernel, or raise
    k, v = _kv(2, 2, 40, 64, device=device)
    k2, v2 = k.clone(), v.clone()
    k2[:, :, 30:], v2[:, :, 30:] = float("nan"), 1e4
    a, b = (FP8KVCache(2, 2, 128, 64, device=device) for _ in range(2))
    a.append(k2, v2, lengths=[30, 30])
    b.append(k[:, :, :30], v[:, :, :30])
    a.append(k2[:, :, :5], v2[:, :, :5], lengths=torch.tensor([3, 3]))
    b.append(k[:, :, :3], v[:, :, :3])
    assert a.lengths.tolist() == b.lengths.tolist() == [33, 33] and a.length == 33
    for x, y in zip(a.operands(), b.operands(), strict=True):
        assert torch.equal(x.view(torch.uint8) if x.dtype != torch.float32 else x,
                           y.view(torch.uint8) if y.dtype != torch.float32 else y)
    assert torch.equal(a.dequantize()[0], b.dequantize()[0])


def test_dequantize_decodes_the_codes():
    """dequantize: each code times its scale (K per 128 tokens, V per channel), within E4M3's
    rounding of the appended tokens."""
    k, v = _kv(2, 2, 300, 64)
    cache = FP8KVCache(2, 2, 512, 64)
    _fill(cache, k, v, [0, 130, 131, 300])
    keys, values = cache.dequantize()
    kc, ks, vt, vs = cache.operands()
    assert keys.shape == values.shape == (2, 2, 300, 64) and keys.dtype == values.dtype == BF16
    assert torch.equal(keys[:, :, 128:256], (kc[:, :, 128:256].float() * ks[:, :, 1, None, None]).to(BF16))
    assert torch.equal(values[:, :, 7], (vt[..., 7].float() * vs).to(BF16))
    for got, want in ((keys, k), (values, v)):
        assert ((got.float() - want.float()).abs() <= want.float().abs() / 16 + 4e-2).all()


def test_ragged_lengths_are_checked():
    cache = FP8KVCache(2, 2, 128, 64)
    k, v = _kv(2, 2, 100, 64)
    for bad in ([1], [1, 2, 3], [-1, 2], [1, 101], [1.5, 2], torch.tensor([1.0, 2.0]), "ab"):
        with pytest.raises(ValueError, match="lengths: expected"):
            cache.append(k, v, lengths=bad)
    cache.append(k, v, lengths=[100, 10])
    with pytest.raises(ValueError, match="overflow the cache: row 0 holds 100 of max_len=128"):
        cache.append(k[:, :, :29], v[:, :, :29], lengths=[29, 29])
    cache.append(k[:, :, :29], v[:, :, :29], lengths=[28, 29])
    assert cache.lengths.tolist() == [128, 39] and cache.length == 128
    with pytest.raises(ValueError, match="1 more token overflows the cache: it holds 128"):
        cache.decode_step(torch.randn(2, 2, 1, 64).to(BF16), k[:, :, :1], v[:, :, :1])


def test_kernel_operands_may_be_views_of_longer_buffers():
    """The sm_90a forward's checks take the cache's length-L views (one stride per (batch, head)
    pair, rows contiguous) and still refuse layouts the kernel cannot index."""
    from lowprec.attention.sm90.config import head_stride, operands_unsupported

    f8 = torch.float8_e4m3fn
    cache = FP8KVCache(2, 2, 512, 128)
    cache.append(*_kv(2, 2, 200, 128))
    kc, ks, vt = kv_views(cache._k, cache._k_scale, cache._v_t, cache.length)  # what the kernels get
    vs = cache.v_scale
    q = torch.zeros(2, 4, 1, 128).to(f8)
    qs = torch.ones(2, 4, 1)
    assert head_stride(kc) == 512 * 128 and head_stride(vt) == 128 * 512
    assert operands_unsupported(q, qs, kc, ks, vt, vs) is None
    k_heads_apart = torch.zeros(2, 4, 200, 128, dtype=f8)[:, :2]  # batch stride != Hkv x head stride
    assert head_stride(k_heads_apart) is None
    assert "k must be" in operands_unsupported(q, qs, k_heads_apart, ks, vt, vs)
    assert "v_t must be" in operands_unsupported(q, qs, kc, ks, vt.transpose(0, 1), vs)


@needs_cutlass
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("with_q", [False, True], ids=["append", "append_and_q"])
def test_append_kernel_compiles_sm90a(dtype, d, with_q):
    """The decode-step append kernel (and decode_step's, which quantizes the query too: a warp's
    shuffle reduction per query row) compiles for sm_90a: E4M3 conversions, one 64-bit reduction
    for the saturation count, the arrival count that lets a row's last CTA advance its length, no
    local memory."""
    from lowprec.attention.sm90.interface import build_kv_append_kernel
    from lowprec.runtime.compile import local_memory_ops, nvdisasm_path, sass_of

    compiled = build_kv_append_kernel(dtype, d, "sm_90a", with_q=with_q)
    assert ("shfl.sync.bfly.b32" in compiled.__ptx__) or not with_q
    assert "cvt.rn.satfinite.e4m3x2.f32" in compiled.__ptx__
    assert "red.relaxed.gpu.global.add.u64" in compiled.__ptx__
    assert "atom.global.acq_rel.add.u32" in compiled.__ptx__
    if nvdisasm_path() is None:
        pytest.skip("nvdisasm not found")
    sass = sass_of(compiled)
    assert "F2FP" in sass and local_memory_ops(sass) == 0
    assert "ACQBULK" in sass  # griddepcontrol.wait: safe under programmatic dependent launch


def test_append_kernel_constraints():
    """Which appends the kernel takes; the others go through torch ops (same bits)."""
    from lowprec.attention.sm90.config import kv_append_unsupported

    cache = FP8KVCache(2, 2, 512, 128)
    bufs = cache._buffers()
    k, v = _kv(2, 2, 200, 128)
    assert kv_append_unsupported(k[:, :, :1], v[:, :, :1], *bufs, 127) is None
    assert kv_append_unsupported(k[:, :, :1], v[:, :, :1], *bufs, 128) is None
    assert "cross a 128-token block" in kv_append_unsupported(k[:, :, :2], v[:, :, :2], *bufs, 127)
    assert "cross a 128-token block" in kv_append_unsupported(k, v, *bufs, 0)  # a prefill
    assert kv_append_unsupported(k[:, :, :128], v[:, :, :128], *bufs, 0) is None
    token_major = torch.randn(2, 3, 2, 128).to(BF16).transpose(1, 2)  # [B, t, Hkv, D] viewed as [B, Hkv, t, D]
    assert kv_append_unsupported(token_major, token_major, *bufs, 5) is None
    assert "not contiguous" in kv_append_unsupported(k[:, :, :1, ::2], v[:, :, :1, ::2], *bufs, 5)
    assert kv_append_unsupported(k[:, :, :1], v[:, :, :1], *bufs, None) is None  # decode_step: one token
    assert "known only on the device" in kv_append_unsupported(k[:, :, :2], v[:, :, :2], *bufs, None)
    # the kernel declares even leading strides in elements: float32 rows 129 values apart are refused
    from lowprec.attention.sm90.config import kv_append_tokens_unsupported

    odd = torch.randn(2, 4, 1, 129)[..., :128]
    assert "even number of values apart" in kv_append_tokens_unsupported(odd, odd, 5)
    assert kv_append_tokens_unsupported(torch.randn(2, 4, 1, 130)[..., :128], odd.contiguous(), 5) is None


def test_cache_attention_constraints():
    """Which queries the kernels bound to a cache take (decode: Sq <= 16, not causal, a kernel head
    dim and dtype); the others take attend's general path."""
    from lowprec.attention.sm90.config import cache_attention_unsupported

    cache = FP8KVCache(2, 2, 512, 128)
    args = (cache._k, cache._k_scale, cache._v_t, cache._v_scale, 128 ** -0.5, cache._plan)
    assert cache_attention_unsupported(torch.randn(2, 8, 1, 128).to(BF16), *args) is None
    assert cache_attention_unsupported(torch.randn(2, 8, 16, 128).to(BF16), *args) is None
    assert "Sq <= 16" in cache_attention_unsupported(torch.randn(2, 8, 17, 128).to(BF16), *args)
    assert "dtype" in cache_attention_unsupported(torch.randn(2, 8, 1, 128), *args)
    small = FP8KVCache(2, 2, 512, 32)
    why = cache_attention_unsupported(torch.randn(2, 8, 1, 32).to(BF16), small._k, small._k_scale, small._v_t,
                                      small._v_scale, 32 ** -0.5, small._plan)
    assert "(64, 128, 256)" in why


def test_decode_step_is_append_then_attend():
    """decode_step (here: no kernels, so append then attend) and the host path of the device-side
    lengths (each row over its own length, read back) give attend's bits."""
    from lowprec.attention.dense import fp8_over_kv_operands

    k, v = _kv(2, 2, 300, 64)
    q = torch.randn(2, 4, 1, 64).to(BF16)
    a, b = FP8KVCache(2, 2, 512, 64), FP8KVCache(2, 2, 512, 64)
    for cache in (a, b):
        cache.append(k[:, :, :290], v[:, :, :290])
    for i in range(290, 300):
        out = a.decode_step(q, k[:, :, i:i + 1], v[:, :, i:i + 1])
        b.append(k[:, :, i:i + 1], v[:, :, i:i + 1])
        _close(out, b.attend(q))
    assert a.length == 300 and a.lengths.tolist() == [300, 300]
    full = fp8_over_kv_operands(q, a._k, a._k_scale, a._v_t, a._v_scale, False, 0.125, kv_lengths=a._plan,
                                v_keys_permuted=True)
    _close(full[0], b.attend(q))
    with pytest.raises(ValueError, match="one token per row"):
        a.decode_step(q, k[:, :, :2], v[:, :, :2])
    with pytest.raises(ValueError, match="one query per row"):
        a.decode_step(torch.randn(2, 4, 2, 64).to(BF16), k[:, :, :1], v[:, :, :1])
    with pytest.raises(ValueError, match="v_scale: decode_step needs"):
        FP8KVCache(2, 2, 512, 64).decode_step(q, k[:, :, :1], v[:, :, :1])


@needs_cutlass
@pytest.mark.parametrize("config", __import__("lowprec.attention.sm90.config", fromlist=["x"]).kv_lengths_configs(),
                         ids=str)
def test_device_length_configs_compile_sm90a(config):
    """The decode kernels that read each row's length from the device (decode_step) compile with
    no local memory."""
    from lowprec.attention.sm90.interface import build_kernel
    from lowprec.runtime.compile import local_memory_ops, nvdisasm_path, sass_of

    compiled = build_kernel(config, "sm_90a", tvm_ffi=False)
    if nvdisasm_path() is None:
        pytest.skip("nvdisasm not found")
    assert local_memory_ops(sass_of(compiled)) == 0


@gpu
@needs_gpu
@pytest.mark.parametrize("dtype,d", [(BF16, 128), (torch.float16, 64), (torch.float32, 256)])
def test_append_kernel_is_the_torch_ops(dtype, d, monkeypatch):
    """A decode loop through the append kernel leaves the bits of the torch ops (and of
    quantize_kv_cache on the same tokens): codes, scales, kept tokens, saturation count."""
    b, hkv, sk = 3, 2, 700
    g = torch.Generator(device="cuda").manual_seed(1)
    k = (torch.randn(b, hkv, sk, d, device="cuda", generator=g) + 0.5).to(dtype)
    v = torch.randn(b, hkv, sk, d, device="cuda", generator=g).to(dtype)
    v[0, 1, 600:, 3] *= 10  # past the headroom: saturated
    cuts = [0, 300, 301, 383, 384, 385, 400, 511, 512, 600] + list(range(601, sk + 1))
    caches = []
    for backend in ("kernel", "reference"):
        monkeypatch.setenv("LOWPREC_BACKEND", "auto")
        cache = FP8KVCache(b, hkv, 1024, d, dtype=dtype, device="cuda", v_headroom=2)
        _fill(cache, k, v, cuts[:2])  # a prefill: several blocks, torch ops and the quantize kernel
        monkeypatch.setenv("LOWPREC_BACKEND", backend)  # "kernel": every later append on the kernel, or raise
        _fill(cache, k, v, cuts[1:])
        caches.append(cache)
    fast, slow = caches
    for name, x, y in zip(("k", "k_scale", "v_t", "v_scale"), fast.operands(), slow.operands(), strict=True):
        x, y = (t.view(torch.uint8) if t.dtype != torch.float32 else t for t in (x, y))
        bad = (x != y).nonzero()
        assert not len(bad), (name, len(bad), bad[:4].tolist(), x[tuple(bad[0])].item(), y[tuple(bad[0])].item())
    assert fast.saturated.item() == slow.saturated.item() > 0
    # the kernel advanced the device-side lengths itself, and left its arrival count at 0
    assert torch.equal(fast._plan, slow._plan) and fast.lengths.tolist() == [sk] * b
    kq, _ = quantize_kv_cache(k, v)
    assert torch.equal(fast.operands()[0].view(torch.uint8), kq.data.view(torch.uint8))


@gpu
@needs_gpu
@pytest.mark.parametrize("b,h,hkv,sq,d,causal", [
    (4, 32, 8, 1, 128, False),     # packed GQA decode, split keys
    (2, 16, 16, 1, 128, False),    # MHA decode: one warpgroup
    (2, 8, 8, 4, 256, True),       # d256 MHA decode
    (2, 8, 8, 4, 256, False),
    (1, 8, 2, 16, 64, True),
    (1, 8, 2, 16, 64, False),
    (64, 8, 8, 1, 128, False),     # a wave of heads: no split
    (1, 4, 2, 333, 128, True),     # a prefill chunk over the cache
])
def test_kernel_reads_the_cache_in_place(b, h, hkv, sq, d, causal):
    """On sm_90a attend gives the kernel's bits on contiguous copies of the same operands (the
    views are read in place), within the scheme's error of exact attention. Decode calls (not
    causal, Sq <= 16) run the kernels bound to the cache (its whole buffers at the device-side
    lengths, splits for the host length): the same bits; a query they cannot read (not
    contiguous) takes the general path, with the same bits again."""
    from lowprec.attention.quantize import quantize_q
    from lowprec.attention.sm90.interface import fp8_attention_forward

    sk = 3000
    k, v = _kv(b, hkv, sk, d, device="cuda")
    cache = FP8KVCache(b, hkv, 4096, d, device="cuda")
    _fill(cache, k, v, [0, sk - 200, sk - 70, sk - 1, sk])
    q = torch.randn(b, h, sq, d, device="cuda").to(BF16)
    out, lse = cache.attend(q, causal=causal, return_lse=True)
    kc, ks, vt, vs = cache.operands()
    qc, qs = quantize_q(q)
    ref, ref_lse = fp8_attention_forward(qc, qs, kc.contiguous(), ks.contiguous(), vt.contiguous(), vs,
                                         causal=causal, softmax_scale=d ** -0.5, out_dtype=BF16)
    assert torch.equal(out, ref) and torch.equal(lse, ref_lse)
    bound = [key[:2] for op, key in cache._prepared if op == "attention_fp8_cache_attend"]
    assert bound == ([] if causal or sq > 16 else [(q.shape, BF16)])
    if sq > 1:
        strided = q.transpose(1, 2).contiguous().transpose(1, 2)
        assert not strided.is_contiguous() and torch.equal(cache.attend(strided, causal=causal), ref)
    exact = lowprec.attention(q.float(), k.float(), v.float(), causal=causal)
    cos = torch.nn.functional.cosine_similarity(out.float().flatten(), exact.flatten(), dim=0)
    assert cos > 0.995, cos.item()
    assert cache.saturated.item() == 0 and math.isfinite(out.float().abs().max().item())


@gpu
@needs_gpu
def test_a_decode_step_replays_from_a_cuda_graph():
    """One length's attend captured in a CUDA graph replays the eager bits for new queries."""
    k, v = _kv(2, 2, 1000, 128, device="cuda")
    cache = FP8KVCache(2, 2, 2048, 128, device="cuda")
    cache.append(k, v)
    q = torch.randn(2, 8, 1, 128, device="cuda").to(BF16)
    cache.attend(q)  # compile and warm up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = cache.attend(q)
    q.copy_(torch.randn_like(q))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, cache.attend(q))


@gpu
@needs_gpu
@pytest.mark.parametrize("dtype", [BF16, torch.float16])
@pytest.mark.parametrize("b,h,hkv,d", [(4, 32, 8, 128), (2, 16, 16, 128), (2, 16, 2, 256), (1, 8, 2, 64),
                                       (3, 64, 1, 128)])
def test_decode_step_quantizes_q_in_the_append_launch(b, h, hkv, d, dtype):
    """decode_step's append kernel quantizes the query too (no Q pre-pass launch): the codes and
    scales are quantize_q's bits, and the step's output is the bits of the append kernel followed by
    the cache attention with its own Q pre-pass, on a twin cache."""
    from lowprec.attention.quantize import quantize_q

    sk, max_len = 700, 2048
    k, v = (t.to(dtype) for t in _kv(b, hkv, sk + 3, d, device="cuda"))
    cache, twin = (FP8KVCache(b, hkv, max_len, d, dtype=dtype, device="cuda") for _ in range(2))
    for c in (cache, twin):
        c.append(k[:, :, :sk], v[:, :, :sk])
    scale = 1.0 / math.sqrt(d)
    for t in range(sk, sk + 3):
        q = (3 * torch.randn(b, h, 1, d, device="cuda")).to(dtype)
        q[0, 0] = 0  # an all-zero row: scale 1
        attend = cache._attend_object(q, scale)

        def no_q_prepass(*args):
            raise AssertionError("the Q pre-pass kernel ran in decode_step")

        attend.q_kernel, q_kernel = no_q_prepass, attend.q_kernel
        out = cache.decode_step(q, k[:, :, t:t + 1], v[:, :, t:t + 1])
        attend.q_kernel = q_kernel
        codes, scales = quantize_q(q)
        q_codes, q_scale = attend.q_destination()
        assert torch.equal(q_codes, codes.view(torch.uint8))
        assert torch.equal(q_scale.view(b, h), scales.view(b, h))
        twin.append(k[:, :, t:t + 1], v[:, :, t:t + 1])
        ref, _ = twin._attend_kernel(q, scale, max_len, False)
        assert torch.equal(out, ref), t
    assert cache.length == twin.length == sk + 3


@gpu
@needs_gpu
@pytest.mark.parametrize("b,h,hkv,d", [(4, 32, 8, 128), (2, 16, 16, 128), (2, 8, 8, 256), (1, 8, 2, 64),
                                       (64, 8, 8, 128)])
def test_decode_step_replays_from_one_cuda_graph(b, h, hkv, d):
    """One CUDA graph of decode_step captured at one length replays 150 steps (across 128-token
    blocks): each replay gives the bits of an eager decode_step on a twin cache, and attend's
    result within the FP8 scheme's last places; past max_len tokens are dropped and counted."""
    sk, steps, max_len = 2940, 150, 3085  # 2940 % 128 = 124: a block boundary after 4 steps
    k, v = _kv(b, hkv, sk + steps, d, device="cuda")
    qs = torch.randn(steps, b, h, 1, d, device="cuda").to(BF16)
    cache, twin = (FP8KVCache(b, hkv, max_len, d, device="cuda") for _ in range(2))
    for c in (cache, twin):
        c.append(k[:, :, :sk], v[:, :, :sk])
    q_in, k_in, v_in = qs[0].clone(), k[:, :, sk:sk + 1].clone(), v[:, :, sk:sk + 1].clone()
    assert torch.equal(cache.decode_step(q_in, k_in, v_in), twin.decode_step(q_in, k_in, v_in))  # compiles
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = cache.decode_step(q_in, k_in, v_in)
    for i in range(1, steps):
        q_in.copy_(qs[i])
        k_in.copy_(k[:, :, sk + i:sk + i + 1])
        v_in.copy_(v[:, :, sk + i:sk + i + 1])
        graph.replay()
        if sk + i < max_len:
            assert torch.equal(out, twin.decode_step(q_in, k_in, v_in)), i
        if i % 37 == 0 and sk + i < max_len:
            ref = twin.attend(q_in)
            assert torch.nn.functional.cosine_similarity(out.float().flatten(), ref.float().flatten(), dim=0) > 0.9999
    assert cache.length == twin.length == max_len
    assert cache.dropped.item() == b * (sk + steps - max_len)
    for x, y in zip(cache.operands(), twin.operands(), strict=True):
        assert torch.equal(x.view(torch.uint8) if x.dtype != torch.float32 else x,
                           y.view(torch.uint8) if y.dtype != torch.float32 else y)


@gpu
@needs_gpu
@pytest.mark.parametrize("length", [100, 300])
@pytest.mark.parametrize("b,h,hkv,d", [(4, 32, 8, 128), (2, 16, 16, 128), (2, 8, 8, 256), (1, 8, 2, 64)])
def test_decode_step_over_a_short_length_in_a_long_buffer(b, h, hkv, d, length, monkeypatch):
    """A short prompt in a cache sized for a long context: decode_step splits the keys for max_len,
    so most splits hold no live token. Each step (on the kernels) matches the FP8 scheme's
    emulation over the live tokens, as closely as any kernel run does."""
    max_len, steps = 32768, 3
    k, v = _kv(b, hkv, length + steps, d, device="cuda")
    cache = FP8KVCache(b, hkv, max_len, d, device="cuda")
    cache.append(k[:, :, :length], v[:, :, :length])
    for i in range(steps):
        t = length + i
        q = torch.randn(b, h, 1, d, device="cuda").to(BF16)
        monkeypatch.setenv("LOWPREC_BACKEND", "kernel")  # the kernels or raise
        out = cache.decode_step(q, k[:, :, t:t + 1], v[:, :, t:t + 1])
        host_length = cache.attend(q)  # the kernel, its splits chosen for the live length
        monkeypatch.setenv("LOWPREC_BACKEND", "reference")
        emulated = cache.attend(q)
        monkeypatch.setenv("LOWPREC_BACKEND", "auto")
        exact = lowprec.attention(q.float(), k[:, :, :t + 1].float(), v[:, :, :t + 1].float())
        err, emulated_err = ((x.float() - exact).abs().mean().item() for x in (out, emulated))
        assert err <= 2 * emulated_err + 1e-4, (i, err, emulated_err)
        # a live block lost or an empty split counted would move the output far past this
        cos = torch.nn.functional.cosine_similarity(out.float().flatten(), host_length.float().flatten(), dim=0)
        assert cos > 0.9995, (i, cos.item())
    assert cache.length == length + steps and cache.lengths.tolist() == [length + steps] * b


@gpu
@needs_gpu
@pytest.mark.parametrize("b,h,hkv,d", [(3, 32, 8, 128), (3, 16, 16, 128), (2, 8, 8, 256), (3, 8, 2, 64)])
def test_ragged_rows_on_the_kernels(b, h, hkv, d, monkeypatch):
    """Ragged rows on sm_90a: one-token appends on the append kernel (each row at its own length,
    read on the device) leave the bits of one-row caches fed each row's tokens; attend (the decode
    kernels over the device lengths, or row by row) and a CUDA graph of decode_step match them."""
    lengths, max_len = [2900, 7, 1000][:b], 4096
    k, v = _kv(b, hkv, 3100, d, device="cuda")
    cache = FP8KVCache(b, hkv, max_len, d, device="cuda")
    rows = _RowCaches(cache)
    cache.append(k[:, :, :3000], v[:, :, :3000], lengths=lengths)
    rows.append(k[:, :, :3000], v[:, :, :3000], lengths)
    monkeypatch.setenv("LOWPREC_BACKEND", "kernel")  # the kernels or raise
    for i in range(3000, 3006):
        cache.append(k[:, :, i:i + 1], v[:, :, i:i + 1])
        rows.append(k[:, :, i:i + 1], v[:, :, i:i + 1], [1] * b)
    rows.check_operands(cache)
    # each row's length advanced on the device by its own CTAs (the host's copy agrees)
    assert cache.lengths.tolist() == [n + 6 for n in lengths] and cache._plan[:, 7].tolist() == [0] * b
    assert cache._lengths == [n + 6 for n in lengths]

    def close(x, y):
        cos = torch.nn.functional.cosine_similarity(x.float().flatten(), y.float().flatten(), dim=0)
        assert cos > 0.9995, cos.item()

    for sq in (1, 4):
        q = torch.randn(b, h, sq, d, device="cuda").to(BF16)
        close(cache.attend(q), rows.attend(q))
    monkeypatch.setenv("LOWPREC_BACKEND", "auto")
    q = torch.randn(b, h, 4, d, device="cuda").to(BF16)
    assert torch.equal(cache.attend(q, causal=True), rows.attend(q, causal=True))  # row by row: the same launches
    q_in, k_in, v_in = (torch.empty_like(x[:, :, :1]) for x in (q, k, v))
    q_in.copy_(q[:, :, :1])
    k_in.copy_(k[:, :, 3006:3007])
    v_in.copy_(v[:, :, 3006:3007])
    cache.decode_step(q_in, k_in, v_in)  # compiles outside the capture
    rows.append(k_in, v_in, [1] * b)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = cache.decode_step(q_in, k_in, v_in)
    for i in range(3007, 3012):
        q_in.copy_(torch.randn_like(q_in))
        k_in.copy_(k[:, :, i:i + 1])
        v_in.copy_(v[:, :, i:i + 1])
        graph.replay()
        rows.append(k_in, v_in, [1] * b)
        close(out, rows.attend(q_in))
    rows.check_operands(cache)
    assert cache.lengths.tolist() == [n + 12 for n in lengths]


def test_appending_tensors_that_require_grad_keeps_the_cache_out_of_autograd():
    """Keys / values from a forward outside no_grad: the cache reads them (it holds no gradients);
    its buffers never join the caller's graph, and attend's output carries no gradient."""
    g = torch.Generator().manual_seed(0)
    k = torch.randn(2, 2, 5, 64, generator=g, requires_grad=True)
    v = torch.randn(2, 2, 5, 64, generator=g, requires_grad=True)
    q_step = torch.randn(2, 4, 1, 64, generator=g)
    cache = FP8KVCache(2, 2, 256, 64, dtype=torch.float32)
    cache.append(k, v)
    cache.decode_step(q_step, k[:, :, :1], v[:, :, :1])
    assert not cache.v_scale.requires_grad and not cache._k_tail.requires_grad
    out, lse = cache.attend(torch.randn(2, 4, 3, 64, generator=g), causal=True, return_lse=True)
    assert not out.requires_grad and not lse.requires_grad
    fixed = FP8KVCache(1, 1, 16, 64, v_scale=torch.ones(1, 1, 64, requires_grad=True))
    assert not fixed.v_scale.requires_grad
    ref = FP8KVCache(2, 2, 256, 64, dtype=torch.float32)  # the same codes as from detached inputs
    ref.append(k.detach(), v.detach())
    ref.decode_step(q_step, k[:, :, :1].detach(), v[:, :, :1].detach())
    for a, b in zip(cache.operands(), ref.operands()):
        assert torch.equal(a.view(torch.uint8) if a.dtype != torch.float32 else a,
                           b.view(torch.uint8) if b.dtype != torch.float32 else b)


@pytest.mark.parametrize("tiny", [1e-39, 1e-44])
def test_a_v_scale_whose_inverse_overflows_is_refused(tiny):
    """Below FP32's smallest normal 1 / scale is Inf: zeros decoded to NaN and values that fit
    saturated. The smallest normal itself is taken."""
    scales = torch.full((1, 1, 64), 1e-3)
    scales[0, 0, 5] = tiny
    with pytest.raises(ValueError, match="v_scale: expected positive finite scales of at least"):
        FP8KVCache(1, 1, 16, 64, dtype=torch.float32, v_scale=scales)
    cache = FP8KVCache(1, 1, 16, 64, dtype=torch.float32,
                       v_scale=torch.full((1, 1, 64), torch.finfo(torch.float32).tiny))
    cache.append(torch.randn(1, 1, 1, 64), torch.zeros(1, 1, 1, 64))
    assert (cache.dequantize()[1] == 0).all()


@pytest.mark.parametrize("big,headroom", [(1e38, 4.0), (3.0e38, 2.0)])
def test_large_finite_values_keep_a_finite_v_scale(big, headroom):
    """The first append's amax times v_headroom past FP32's max made the scale Inf, and every
    code of the channel (later tokens' too) decoded to NaN."""
    torch.manual_seed(0)
    cache = FP8KVCache(1, 1, 16, 64, dtype=torch.float32, v_headroom=headroom)
    v = torch.randn(1, 1, 4, 64)
    v[0, 0, 0, 0] = big
    cache.append(torch.randn(1, 1, 4, 64), v)
    later = torch.randn(1, 1, 1, 64) * 0.1
    later[0, 0, 0, 0] = big / 4
    cache.append(torch.randn(1, 1, 1, 64), later)
    assert torch.isfinite(cache.v_scale).all()
    _, values = cache.dequantize()
    assert torch.isfinite(values).all()
    torch.testing.assert_close(values[0, 0, 0, 0], torch.tensor(big), rtol=0.07, atol=0)
    torch.testing.assert_close(values[0, 0, 4, 0], torch.tensor(big / 4), rtol=0.07, atol=0)
    assert cache.saturated.item() == 0
    assert not cache.attend(torch.randn(1, 1, 1, 64)).isnan().any()
    huge = FP8KVCache(1, 1, 16, 64, v_headroom=1e39)  # any finite headroom >= 1
    huge.append(torch.randn(1, 1, 4, 64).bfloat16(), torch.randn(1, 1, 4, 64).bfloat16())
    assert torch.isfinite(huge.v_scale).all() and not huge.dequantize()[1].isnan().any()
    v[0, 0, 0, 0] = float("inf")  # an Inf amax keeps quantize_kv_cache's Inf scale
    inf = FP8KVCache(1, 1, 16, 64, dtype=torch.float32, v_headroom=1)
    inf.append(torch.randn(1, 1, 4, 64), v)
    assert torch.isinf(inf.v_scale[0, 0, 0]) and torch.isfinite(inf.v_scale[0, 0, 1:]).all()


class _FusedAppendFailing:
    """Stands in for sm90.interface.CacheAppend: the plain append works; the fused one (q given)
    fails as a compile or a TVM-FFI argument check of the new kernel would."""

    def __init__(self, cache):
        self.cache, self.plain_calls = cache, 0

    def __call__(self, k, v, start, q=None, q_destination=None):
        if q is not None:
            raise RuntimeError("kv_append_with_q: failed to build")
        self.plain_calls += 1
        c = self.cache
        starts = c._host_lengths() if start is None else [start] * c.batch
        c._append_rows(k, v, starts, [k.shape[2]] * c.batch)
        c._device_lengths.add_(k.shape[2])
        return None


class _AttendStub:
    """Stands in for sm90.interface.CacheAttention: reads any q, but serves no call (None: the
    cache's general path computes the output)."""

    def reads(self, q):
        return True

    def q_destination(self):
        return None, None

    def __call__(self, q, length, want_lse=True, q_quantized=False):
        return None


def test_failed_fused_append_keeps_the_plain_append_kernel(monkeypatch):
    torch.manual_seed(0)
    b, hkv, h, d = 1, 2, 4, 64
    cache = FP8KVCache(b, hkv, 256, d, dtype=torch.bfloat16, device="cpu")
    append = _FusedAppendFailing(cache)

    def kernel_for(op, device, *args, **kwargs):
        if op == "attention_fp8_cache_append":
            return lambda *a: append
        if op == "attention_fp8_cache_attend":
            return lambda *a: _AttendStub()
        return None

    monkeypatch.setattr(kv_cache_module.registry, "kernel_for", kernel_for)
    monkeypatch.setenv("LOWPREC_BACKEND", "auto")
    k, v = torch.randn(b, hkv, 10, d, dtype=torch.bfloat16), torch.randn(b, hkv, 10, d, dtype=torch.bfloat16)
    cache.append(k, v)
    assert append.plain_calls == 1
    q = torch.randn(b, h, 1, d, dtype=torch.bfloat16)
    k1, v1 = torch.randn(b, hkv, 1, d, dtype=torch.bfloat16), torch.randn(b, hkv, 1, d, dtype=torch.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        out = cache.decode_step(q, k1, v1)
    assert cache.length == 11 and out.shape == (b, h, 1, d)
    # the step's append ran once (on the plain kernel or the torch ops), and the next append still
    # takes the plain kernel: the failed fused variant did not disable it
    cache.append(k1, v1)
    assert cache.length == 12
    assert append.plain_calls >= 2, "the plain append kernel was dropped after the fused variant failed"


def test_a_failed_first_append_leaves_v_scales_unset(monkeypatch):
    """The append fixed V's scales before writing the codes: when the write failed (here a kernel
    required where none serves, LOWPREC_BACKEND=kernel on CPU; on a GPU also an out-of-memory), the
    empty cache kept them, and the next first append was quantized with the failed call's scales
    (values 1000x larger here: saturated), and decode_step took the empty cache as filled."""
    g = torch.Generator().manual_seed(0)
    cache = FP8KVCache(1, 1, 64, 64, dtype=torch.float32)
    monkeypatch.setenv("LOWPREC_BACKEND", "kernel")
    with pytest.raises(RuntimeError, match="LOWPREC_BACKEND=kernel"):
        cache.append(torch.randn(1, 1, 4, 64, generator=g), torch.randn(1, 1, 4, 64, generator=g) * 1e-3)
    monkeypatch.setenv("LOWPREC_BACKEND", "auto")
    assert cache.length == 0
    with pytest.raises(ValueError, match="v_scale: decode_step needs"):
        cache.decode_step(torch.randn(1, 1, 1, 64), torch.randn(1, 1, 1, 64), torch.randn(1, 1, 1, 64))
    k, v = torch.randn(1, 1, 4, 64, generator=g), torch.randn(1, 1, 4, 64, generator=g)
    cache.append(k, v)
    fresh = FP8KVCache(1, 1, 64, 64, dtype=torch.float32)
    fresh.append(k, v)
    assert torch.equal(cache.v_scale, fresh.v_scale)
    assert cache.saturated.item() == 0
    assert torch.equal(cache.dequantize()[1], fresh.dequantize()[1])
