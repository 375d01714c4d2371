"""An FP8 KV cache that grows: decode steps append keys and values, attention reads them in place.

:func:`~lowprec.attention.quantize_kv_cache` quantizes a whole cache at once (V per channel over the
whole sequence), so a generation loop would have to quantize it again at every step.
:class:`FP8KVCache` keeps the FP8 kernel's operands in buffers of ``max_len`` tokens and quantizes
only what each step adds:

- **K**: E4M3 codes with one FP32 scale per 128 tokens (per batch row and KV head), not smoothed,
  as ``quantize_kv_cache``. The last, partial block's tokens are also kept in the cache's float
  dtype and that block is quantized again at each append, so K's codes and scales are bit for bit
  those ``quantize_kv_cache`` gives the same tokens.
- **V**: Vᵀ codes, one FP32 scale per channel **fixed when the cache is first filled**: the
  channel's amax over the first append times ``v_headroom``, over 448 (or the ``v_scale`` given).
  A row whose first append is shorter than 128 tokens takes for each channel at least its KV head's
  amax: a channel near 0 in a few tokens says nothing of its range, and later values would
  saturate (a tiny random Llama decoding from one token: 2880 values saturated, 56% of its
  argmax tokens as exact attention's; with the floor none, 96%, as from a whole prompt). The
  floor costs no precision that matters: E4M3's exponent keeps values down to ~2⁻¹³ of the
  head's amax at full relative precision.
  E4M3 is a floating-point format, so the headroom costs no relative precision above the format's
  subnormals (2⁻⁶ of the range); later values past ``448 · scale`` saturate, and
  :attr:`FP8KVCache.saturated` counts those clipped by more than E4M3's rounding (past
  ``464 · scale``) on the device (no host sync). With the scale of the whole
  sequence (``v_headroom=1`` and one append of at least 128 tokens, or that scale passed in) the
  codes are ``quantize_kv_cache``'s.

:meth:`FP8KVCache.attend` runs the FP8 forward over the first :attr:`~FP8KVCache.length` tokens
without copying them (on Hopper the sm_90a kernel reads the buffers in place; elsewhere the FP8
scheme's emulation); its length is a host integer, so a CUDA graph of ``append`` + ``attend``
captures one length. Eager decode calls are cheap on the host: the cache binds the append and
decode-attention kernels to its buffers at first use, so a call is its launches.
:meth:`FP8KVCache.decode_step` (one token and its query per row) keeps every length on the device
instead: one graph of it replays at each next length.

Rows may hold different lengths (a batch of prompts of different lengths): ``append(k, v,
lengths=...)`` takes each row's count from right-padded tokens; later appends and decode steps add
to each row at its own length, and ``attend`` has each row attend over its own keys.
"""

from __future__ import annotations

import math

import torch

from ..quant.reference import ieee_div, scale_from_amax
from ..recipes import get_recipe
from ..runtime import backend_mode, kernel_failed, registry
from .dense import FLOAT_DTYPES, check_flag, fp8_over_kv_operands, softmax_scale
from .quantize import ATTN_BLOCK, V_PAD, _blocks, kv_views, permuted_v_positions, unpermute_v_keys
from .reference import _dequant_blocks

__all__ = ["FP8KVCache"]

_E4M3_MAX = 448.0
# past this (448 plus half of E4M3's top step, 32) a value is clipped by more than its rounding
_SATURATES_PAST = 464.0
_ROWWISE = get_recipe("fp8_rowwise")
_FLOATS = (torch.float16, torch.bfloat16, torch.float32)
_FP32_TINY = torch.finfo(torch.float32).tiny
_UNSET = object()


def _check_v_headroom(v_headroom: float) -> None:
    if not isinstance(v_headroom, (int, float)) or not math.isfinite(v_headroom) or v_headroom < 1:
        raise ValueError(f"v_headroom: expected a finite number ≥ 1, got {v_headroom!r}")


class FP8KVCache:
    """A growing FP8 KV cache for :func:`lowprec.attention`'s FP8 scheme (decode).

    Args:
        batch, kv_heads, max_len, head_dim: the cache's ``[B, Hkv, max_len, D]`` extent (K and V
            share ``D``).
        dtype: the float dtype of the appended keys and values (the partial K block is kept in it).
        device: where the buffers live.
        v_headroom: V's per-channel scale is the first append's channel amax (at least the KV
            head's amax where that append is shorter than 128 tokens) times this, over 448 (≥ 1; a
            power of two keeps the scale the plain amax scale times it exactly).
        v_scale: ``[B, Hkv, D]`` FP32 V scales to use instead (e.g. from a calibration run: the
            choice when the cache starts from a short prompt or empty).

    Example (a decode loop)::

        cache = FP8KVCache(B, Hkv, 8192, 128, device="cuda")
        cache.append(k_prompt, v_prompt)               # [B, Hkv, S, D]
        out = cache.attend(q_prompt, causal=True)
        for step in range(n):
            cache.append(k_new, v_new)                 # [B, Hkv, 1, D]
            out = cache.attend(q_new, causal=True)     # [B, H, 1, D]

    Prompts of different lengths, right-padded to the longest::

        cache.append(k_padded, v_padded, lengths=prompt_lengths)   # row b keeps its first lengths[b]
        out = cache.decode_step(q_new, k_new, v_new)               # each row at its own length
    """

    def __init__(self, batch: int, kv_heads: int, max_len: int, head_dim: int, *,
                 dtype: torch.dtype = torch.bfloat16, device: torch.device | str | None = None,
                 v_headroom: float = 4.0, v_scale: torch.Tensor | None = None):
        for name, value, low in (("batch", batch, 1), ("kv_heads", kv_heads, 1), ("max_len", max_len, 1),
                                 ("head_dim", head_dim, 1)):
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"{name}: expected an int ≥ {low}, got {value!r}")
        if head_dim % 16:
            raise ValueError(f"head_dim: expected a multiple of 16 (16-byte FP8 rows), got {head_dim}")
        if dtype not in _FLOATS:
            raise ValueError(f"dtype: expected one of {_FLOATS}, got {dtype}")
        _check_v_headroom(v_headroom)
        device = torch.empty(0, device=device).device  # "cuda" -> "cuda:0", as tensors report it
        self.batch, self.kv_heads, self.max_len, self.head_dim = batch, kv_heads, max_len, head_dim
        self.dtype, self.device, self.v_headroom = dtype, device, float(v_headroom)
        u8 = torch.uint8
        blocks, padded = -(-max_len // ATTN_BLOCK), -(-max_len // V_PAD) * V_PAD
        # zero codes are 0: the keys past the length that a view's padding reads are zeros
        # codes as E4M3 (the forward's operands, sliced per call) and as bytes (what kernels write)
        self._k = torch.zeros(batch, kv_heads, max_len, head_dim, dtype=torch.float8_e4m3fn, device=device)
        self._k_u8 = self._k.view(u8)
        self._k_scale = torch.ones(batch, kv_heads, blocks, dtype=torch.float32, device=device)
        self._k_tail = torch.zeros(batch, kv_heads, ATTN_BLOCK, head_dim, dtype=dtype, device=device)
        self._k_tail_amax = torch.zeros(batch, kv_heads, dtype=torch.float32, device=device)
        # Vᵀ with its keys in the kernel's permuted order (quantize.permuted_v_positions): P needs no
        # shuffles, 8-15% of a prefill's forward on the H200 (attention NOTES, session 59)
        self._v_t = torch.zeros(batch, kv_heads, head_dim, padded, dtype=torch.float8_e4m3fn, device=device)
        self._v_t_u8 = self._v_t.view(u8)
        self._v_scale = torch.ones(batch, kv_heads, head_dim, dtype=torch.float32, device=device)
        self._v_inv = torch.ones_like(self._v_scale)
        self._v_scale_set = False
        self._v_scale_given = False  # by v_scale or set_v_scale: kept across reset
        # on the device: [values saturated, row-tokens dropped past max_len]
        self._counts = torch.zeros(2, dtype=torch.int64, device=device)
        #: V values clipped by more than E4M3's rounding (past ``464 · scale``) since the cache was
        #: created or reset; int64, on the device
        self.saturated = self._counts[0]
        #: tokens a replayed :meth:`decode_step` could not store, past ``max_len`` (summed over the
        #: batch rows; nothing else is written for them); int64, on the device
        self.dropped = self._counts[1]
        # each batch row's length on the device, field 5 of a [B, 8] plan (the varlen kernels' Sk
        # field): the kernels read it and the append kernel advances it (field 7: its arrival count,
        # 0 between launches), so a CUDA graph of decode_step replays at any length
        self._plan = torch.zeros(batch, 8, dtype=torch.int32, device=device)
        self._device_lengths = self._plan[:, 5]
        # the kernels' objects bound to these buffers (registry ops ``attention_fp8_cache_*``), made on
        # first use per key: an eager decode call skips the registry's per-call dispatch
        self._prepared: dict[tuple, object] = {}
        # the append kernel's query-quantizing variant failed (built at the first decode step): the
        # plain append kernel keeps serving, decode steps quantize Q in the attention's pre-pass
        self._fused_q_failed = False
        # each row's length on the host; None: known only on the device (after a captured decode_step)
        self._lengths: list[int] | None = [0] * batch
        if v_scale is not None:
            self.set_v_scale(v_scale)

    @property
    def length(self) -> int:
        """How many tokens the cache holds: the longest row's count (every row's unless
        :meth:`append` was given ``lengths``). After :meth:`decode_step` ran in a CUDA graph it is
        read from the device once (a sync)."""
        return max(self._host_lengths())

    @property
    def lengths(self) -> torch.Tensor:
        """Each batch row's length, int32 ``[B]`` on the device (a copy: the plan the kernels read
        counts replayed steps past ``max_len`` too)."""
        return self._device_lengths.clamp(max=self.max_len)

    @property
    def ragged(self) -> bool:
        """Whether the rows hold different lengths (a sync after a captured :meth:`decode_step`)."""
        return len(set(self._host_lengths())) > 1

    def _host_lengths(self) -> list[int]:
        if self._lengths is None:
            self._lengths = [min(n, self.max_len) for n in self._device_lengths.tolist()]
        return self._lengths

    @property
    def v_scale(self) -> torch.Tensor:
        """V's per-channel scales ``[B, Hkv, D]``: the ones given (``v_scale``, :meth:`set_v_scale`),
        else ones until the first append chooses them (after :meth:`reset`, the last ones until the
        next append chooses new ones)."""
        return self._v_scale

    def set_v_scale(self, v_scale: torch.Tensor) -> None:
        """Fix V's per-channel scales ``[B, Hkv, D]`` (positive, finite) before any token is added;
        they stay across :meth:`reset`."""
        if self.length:
            raise ValueError("v_scale: the cache already holds tokens quantized with its scales; reset() it first")
        shape = (self.batch, self.kv_heads, self.head_dim)
        if not isinstance(v_scale, torch.Tensor) or tuple(v_scale.shape) != shape or not v_scale.is_floating_point():
            raise ValueError(f"v_scale: expected a float tensor of shape {shape}, got "
                             f"{getattr(v_scale, 'dtype', type(v_scale))} {tuple(getattr(v_scale, 'shape', ()))}")
        v_scale = v_scale.detach().to(device=self.device, dtype=torch.float32)
        # at least FP32's smallest normal, as the quantizers' scales: below it 1 / scale overflows to
        # Inf (zeros would decode to NaN, every other value saturate)
        if not bool(torch.isfinite(v_scale).all() and (v_scale >= _FP32_TINY).all()):
            raise ValueError(f"v_scale: expected positive finite scales of at least {_FP32_TINY:.3g} (FP32's "
                             "smallest normal: their inverses must be finite)")
        self._fix_v_scale(v_scale)
        self._v_scale_given = True

    def _fix_v_scale(self, v_scale: torch.Tensor) -> None:
        self._v_scale.copy_(v_scale)
        self._v_inv.copy_(ieee_div(torch.ones_like(self._v_scale), self._v_scale))
        self._v_scale_set = True

    def reset(self) -> None:
        """Empty the cache: its buffers stay allocated and hold what a new cache's hold, but for
        :attr:`v_scale`: given ones (``v_scale``, :meth:`set_v_scale`) stay; ones the first append
        chose are chosen again at the next append (they hold the last ones until then)."""
        self._lengths = [0] * self.batch
        # all of K too: a shorter row's keys past its length (operands, dequantize) read zeros, not
        # the last sequence's (V past the length must be zeros: the kernels read it under P = 0)
        for buffer in (self._plan, self._k_u8, self._k_tail, self._k_tail_amax, self._v_t_u8, self._counts):
            buffer.zero_()
        self._k_scale.fill_(1.0)
        self._v_scale_set = self._v_scale_given

    def append(self, k: torch.Tensor, v: torch.Tensor, lengths=None) -> None:
        """Add ``t`` tokens to each row: ``k``, ``v`` ``[B, Hkv, t, D]`` of the cache's dtype and
        device, each row after its own last token.

        ``lengths``: ``B`` token counts (a sequence of ints or an integer tensor; each ``0..t``):
        row ``b`` adds only its first ``lengths[b]`` tokens, the rest being padding (prompts of
        different lengths, right-padded; never read into the cache). V's scales, when this append
        sets them, come from those tokens only (a row given none takes the other rows' amax). The
        caller's tensors are read, never modified (nor tied into their autograd graph: the cache
        holds no gradients)."""
        self._check_kv(k, v)
        k, v = k.detach(), v.detach()
        t = k.shape[2]
        counts = self._counts_of(lengths, t)
        starts = self._host_lengths()
        for b, (start, n) in enumerate(zip(starts, counts, strict=True)):
            if start + n > self.max_len:
                raise ValueError(f"k: {n} more tokens overflow the cache: row {b} holds {start} of "
                                 f"max_len={self.max_len}")
        if not any(counts):
            return
        sets_v_scale = not self._v_scale_set
        if sets_v_scale:
            amax = self._floor_short_rows(self._v_amax(v, counts), counts)
            # a finite amax times the headroom may pass FP32's max: keep the largest finite scale (an
            # Inf scale decodes every code of its channel to NaN, 0 · Inf, for the cache's life)
            room = torch.where(amax.isfinite(), (amax * self.v_headroom).clamp(max=torch.finfo(torch.float32).max),
                               amax)
            self._fix_v_scale(scale_from_amax(room, _ROWWISE))
        same_count = len(set(counts)) == 1
        if same_count and counts[0] < t:  # every row's padding at the same place: never read
            k, v, t = k[:, :, :counts[0]], v[:, :, :counts[0]], counts[0]
        by_kernel = False  # the append kernel also advances the device-side lengths
        try:
            if same_count and len(set(starts)) == 1:
                start, end = starts[0], starts[0] + t
                # a decode step on Hopper: one kernel (sm90/kv_append.py), the same bits as the torch ops
                by_kernel = self._append_kernel(k, v, start)
                if not by_kernel:
                    self._append_torch(k, v, start, end)
            elif t == 1 and same_count:  # one token at each row's own length (on the device)
                by_kernel = self._append_kernel(k, v, None)
                if not by_kernel:
                    self._append_rows(k, v, starts, counts)
            else:
                self._append_rows(k, v, starts, counts)
        except BaseException:
            # nothing was added: the next first append chooses V's scales again (else they stay fixed
            # from tokens the cache never held)
            if sets_v_scale:
                self._v_scale_set = False
            raise
        self._lengths = [s + n for s, n in zip(starts, counts, strict=True)]
        if same_count and not by_kernel:
            self._device_lengths.add_(counts[0])  # one kernel: no host-to-device copy in a decode loop
        elif not same_count:
            self._device_lengths.copy_(torch.tensor(self._lengths, dtype=torch.int32))

    def _kernel_object(self, op: str, key: tuple, *args):
        """The registry's ``op`` object bound to this cache, made on first use per ``key`` from
        ``args``; None where no kernel serves ``args`` (asked again next call: the reason may be
        those inputs) or the object failed to build (not asked again). The backend policy is asked
        on every call."""
        if backend_mode() == "reference" or torch.compiler.is_compiling():
            return None
        made = self._prepared.get((op, key), _UNSET)
        if made is not _UNSET:
            return made
        factory = registry.kernel_for(op, self.device, *args)
        if factory is None:
            return None
        try:
            made = factory(*args)
        except Exception as err:
            kernel_failed(op, err)
            made = None
        self._prepared[op, key] = made
        return made

    def _append_kernel(self, k: torch.Tensor, v: torch.Tensor, start: int | None, q: torch.Tensor | None = None,
                       q_destination: tuple | None = None) -> bool:
        """Append ``k``, ``v`` with the append kernel at the plan's lengths (``start``: their host
        value where known), which the kernel advances; False where no kernel takes them (nothing
        written, the lengths unchanged). With ``q`` the launch also quantizes a decode step's query
        into ``q_destination``."""
        op = "attention_fp8_cache_append"
        append = self._kernel_object(op, (), k, v, *self._buffers(), start)
        if append is None:
            return False
        try:
            why = append(k, v, start, q, q_destination)
        except Exception as err:
            if q is not None:  # the fused variant (nothing launched): the plain append, Q left to the attention
                kernel_failed(f"{op} (quantizing the query)", err)
                self._fused_q_failed = True
                return self._append_kernel(k, v, start)
            kernel_failed(op, err)
            self._prepared[op, ()] = None
            return False
        if why is not None and backend_mode() == "kernel":
            raise RuntimeError(f"LOWPREC_BACKEND=kernel but {op} cannot run a kernel: {why}")
        return why is None

    def _attend_object(self, q: torch.Tensor, scale: float):
        """The cache-attention kernels bound to this cache for queries shaped as ``q``, or None."""
        return self._kernel_object("attention_fp8_cache_attend", (q.shape, q.dtype, scale), q, self._k,
                                   self._k_scale, self._v_t, self._v_scale, scale, self._plan, True)

    def _attend_kernel(self, q: torch.Tensor, scale: float, length: int, want_lse: bool, q_quantized: bool = False,
                       attend=_UNSET):
        """``(out, lse)`` of float ``q`` over the whole buffers at the device-side lengths, on the
        cache-attention kernels with their splits chosen for ``length`` tokens (the LSE a workspace
        without ``want_lse``); None where they do not serve ``q``. ``q_quantized``: the append
        kernel quantized ``q`` already. ``attend``: :meth:`_attend_object`'s, where known."""
        attend = self._attend_object(q, scale) if attend is _UNSET else attend
        if attend is None:
            return None
        try:
            return attend(q, length, want_lse, q_quantized)
        except Exception as err:
            kernel_failed("attention_fp8_cache_attend", err)
            self._prepared["attention_fp8_cache_attend", (q.shape, q.dtype, scale)] = None
            return None

    def _counts_of(self, lengths, t: int) -> list[int]:
        """The tokens each row adds: ``t`` each, or ``lengths`` checked."""
        if lengths is None:
            return [t] * self.batch
        if isinstance(lengths, torch.Tensor):
            if lengths.is_floating_point() or lengths.is_complex() or lengths.dim() != 1:
                raise ValueError(f"lengths: expected a 1-D integer tensor of {self.batch} counts, got "
                                 f"{lengths.dtype} {tuple(lengths.shape)}")
            lengths = lengths.tolist()
        try:
            counts = [int(n) for n in lengths]
            exact = all(int(n) == n and not isinstance(n, bool) for n in lengths)
        except (TypeError, ValueError):
            raise ValueError(f"lengths: expected {self.batch} integer counts, got {lengths!r}") from None
        if len(counts) != self.batch or not exact or any(n < 0 or n > t for n in counts):
            raise ValueError(f"lengths: expected {self.batch} integer counts in 0..{t} (the tokens given per row), "
                             f"got {lengths!r}")
        return counts

    def _v_amax(self, v: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """V's channel amax ``[B, Hkv, D]`` over each row's first ``counts[b]`` tokens; a row given
        none takes the other rows' (per KV head and channel)."""
        mag = v.float().abs().nan_to_num(nan=0.0, posinf=torch.inf)  # NaN ignored, as the quantizers do
        if min(counts) == v.shape[2]:
            return mag.amax(dim=2)
        live = torch.arange(v.shape[2], device=v.device) < torch.tensor(counts, device=v.device)[:, None]
        amax = torch.where(live[:, None, :, None], mag, 0.0).amax(dim=2)  # padding may hold anything
        empty = torch.tensor([n == 0 for n in counts], device=v.device)[:, None, None]
        return torch.where(empty, amax.amax(dim=0, keepdim=True), amax)

    @staticmethod
    def _floor_short_rows(amax: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """``amax`` [B, Hkv, D], each channel of a row given fewer than 128 tokens raised to its KV
        head's finite amax (module docstring: few tokens say little of a channel's range)."""
        if min(counts) >= ATTN_BLOCK:
            return amax
        head = torch.where(amax.isfinite(), amax, 0.0).amax(dim=-1, keepdim=True)
        short = torch.tensor([n < ATTN_BLOCK for n in counts], device=amax.device)[:, None, None]
        return torch.where(short, torch.maximum(amax, head), amax)

    def _append_rows(self, k: torch.Tensor, v: torch.Tensor, starts: list[int], counts: list[int]) -> None:
        """The torch append, row by row (rows at different lengths or adding different counts)."""
        for b, (start, n) in enumerate(zip(starts, counts, strict=True)):
            if n:
                row = slice(b, b + 1)
                self._append_torch(k[row, :, :n], v[row, :, :n], start, start + n, row)

    def _buffers(self) -> tuple[torch.Tensor, ...]:
        """The append kernel's arguments that follow the new tokens' ``k`` and ``v``."""
        return (self._k_tail, self._k_tail_amax, self._k_u8, self._k_scale, self._v_t_u8, self._v_inv, self._counts,
                self._plan)

    def decode_step(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    scale: float | None = None) -> torch.Tensor:
        """One decode step, capturable in a CUDA graph that then replays at every length: append one
        token (``k``, ``v`` ``[B, Hkv, 1, D]``) and attend with its query (``q`` ``[B, H, 1, D]``).

        On Hopper the kernels read the length from the device (:attr:`lengths`) and advance it: each
        replay computes ``append(k, v); attend(q)`` with no host value of the length (the append's
        bits exactly; the attention's split of the keys is chosen for ``max_len``, so its bits may
        differ from ``attend``'s in the last places). The append's launch quantizes ``q`` too where
        ``q`` has the cache's dtype and is contiguous and 16-byte aligned. V's scales must be set
        (by an earlier append, or ``v_scale``). A replay past ``max_len`` stores nothing and counts
        the token in :attr:`dropped`; its output then attends over the tokens held. Elsewhere the
        same steps in torch ops and the emulation, reading the length back (a sync)."""
        self._check_kv(k, v)
        k, v = k.detach(), v.detach()
        if k.shape[2] != 1:
            raise ValueError(f"k: decode_step appends one token per row, got {k.shape[2]}")
        if not self._v_scale_set:
            raise ValueError("v_scale: decode_step needs V's scales: append a prompt first, or pass v_scale")
        self._check_q(q)
        if q.shape[2] != 1:
            raise ValueError(f"q: decode_step attends with one query per row, got {q.shape[2]}")
        if self._lengths is not None and max(self._lengths) + 1 > self.max_len:
            raise ValueError(f"k: 1 more token overflows the cache: it holds {max(self._lengths)} of "
                             f"max_len={self.max_len}")
        scale = softmax_scale(scale, self.head_dim)
        # the append kernel quantizes the query too where the attention kernels read it (one launch less)
        attend = self._attend_object(q, scale)
        fuse_q = attend is not None and not self._fused_q_failed and q.dtype == self.dtype and attend.reads(q)
        # past max_len the kernels store nothing (the append counts the token in ``dropped``) and read
        # max_len keys; the host reads clamp. The append kernel advances the lengths itself.
        if not self._append_kernel(k, v, None, *((q, attend.q_destination()) if fuse_q else ())):
            fuse_q = False
            self._append_rows(k, v, self._host_lengths(), [1] * self.batch)
            self._device_lengths.add_(1)
        fuse_q = fuse_q and not self._fused_q_failed  # a failed fused launch was retried without the query
        capturing = self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        self._lengths = None if capturing or self._lengths is None else [n + 1 for n in self._lengths]
        # splits for max_len: a graph of this step replays at every length
        result = self._attend_kernel(q, scale, self.max_len, False, fuse_q, attend)
        if result is None:
            result = fp8_over_kv_operands(q, self._k, self._k_scale, self._v_t, self._v_scale, False, scale,
                                          kv_lengths=self._plan, v_keys_permuted=True)
        return result[0]

    def _append_torch(self, k: torch.Tensor, v: torch.Tensor, start: int, end: int,
                      rows: slice = slice(None)) -> None:
        """The append of ``k``, ``v`` at ``start`` to the batch ``rows`` (all: every row) in torch ops."""
        self._append_k(k, start, end, rows)
        scaled = v.float() * self._v_inv[rows, :, None, :]
        self.saturated += (scaled.abs() > _SATURATES_PAST).sum()
        codes = scaled.clamp(-_E4M3_MAX, _E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
        positions = permuted_v_positions(torch.arange(start, end, device=self.device))
        self._v_t_u8[rows, :, :, positions] = codes.transpose(-1, -2)

    def _append_k(self, k: torch.Tensor, start: int, end: int, rows: slice) -> None:
        # from the first token of the block being filled: its earlier tokens (kept in float) then k
        first = start - start % ATTN_BLOCK
        kept = start - first
        tokens = torch.cat([self._k_tail[rows, :, :kept], k], dim=2) if kept else k
        full = (end - first) // ATTN_BLOCK * ATTN_BLOCK  # tokens in complete blocks: final
        # the complete blocks, then the partial one (its own 128-token block), as quantize_kv_cache
        for lo, hi in ((0, full), (full, end - first)):
            if hi > lo:
                codes, scales = _blocks(tokens[:, :, lo:hi])
                self._k_u8[rows, :, first + lo:first + hi] = codes.view(torch.uint8)
                b0 = (first + lo) // ATTN_BLOCK
                self._k_scale[rows, :, b0:b0 + scales.shape[-1]] = scales
        if end - first > full:
            part = tokens[:, :, full:]
            # kept for the next append, as the kernel keeps it (NaN ignored, as the quantizers do)
            self._k_tail_amax[rows] = part.float().abs().nan_to_num(nan=0.0, posinf=torch.inf).amax(dim=(2, 3))
            self._k_tail[rows, :, :end - first - full] = part

    def _check_kv(self, k, v) -> None:
        for name, t in (("k", k), ("v", v)):
            if not isinstance(t, torch.Tensor) or t.dim() != 4:
                raise ValueError(f"{name}: expected a [B, Hkv, t, D] tensor, got {type(t).__name__} "
                                 f"{tuple(getattr(t, 'shape', ()))}")
            lead = (self.batch, self.kv_heads)
            if tuple(t.shape[:2]) != lead or t.shape[3] != self.head_dim:
                raise ValueError(f"{name}: expected [B={self.batch}, Hkv={self.kv_heads}, t, D={self.head_dim}], "
                                 f"got {tuple(t.shape)}")
            if t.dtype != self.dtype:
                raise ValueError(f"{name}: expected {self.dtype} (the cache's dtype), got {t.dtype}")
            if t.device != self.device:
                raise ValueError(f"{name}: on {t.device}, but the cache is on {self.device}")
        if k.shape[2] != v.shape[2]:
            raise ValueError(f"v: expected as many tokens as k ({k.shape[2]}), got {v.shape[2]}")

    def operands(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The FP8 forward's K-side operands over the current length: ``(k [B, Hkv, L, D] E4M3,
        k_scale [B, Hkv, ceil(L/128)], v_t [B, Hkv, D, round_up(L, 16)] E4M3, v_scale [B, Hkv, D])``
        (``sm90/CONTRACT.md``), views of the buffers but for ``v_t``, a copy in key order (the cache
        keeps the kernel's permuted order). With rows of different lengths ``L`` is the longest; row
        ``b``'s tokens past ``lengths[b]`` are not its keys (:meth:`attend` knows)."""
        k, k_scale, v_t = kv_views(self._k, self._k_scale, self._v_t, self.length)
        return k, k_scale, unpermute_v_keys(v_t), self._v_scale

    def dequantize(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The cached keys and values ``[B, Hkv, L, D]`` decoded from their codes, in the cache's
        dtype (a copy; ``L`` as in :meth:`operands`)."""
        k, k_scale, v_t, v_scale = self.operands()
        keys = _dequant_blocks(k, k_scale, ATTN_BLOCK)
        values = (v_t[..., :k.shape[2]].float() * v_scale[..., None]).transpose(-1, -2)
        return keys.to(self.dtype), values.to(self.dtype)

    def attend(self, q: torch.Tensor, causal: bool = False, scale: float | None = None, return_lse: bool = False):
        """FP8 attention of ``q`` ``[B, H, Sq, D]`` (``H`` a multiple of the KV heads) over the
        cached tokens, as ``lowprec.attention(q, k, v, causal, scale, quant="fp8")`` on them
        (``causal``: the queries are the last ``Sq`` positions). Q is quantized per call. Returns
        ``out`` in q's dtype (and the LSE ``[B, H, Sq]`` FP32 with ``return_lse``). No gradients.
        With rows of different lengths each row attends over its own tokens (its queries the last
        ``Sq`` positions of them when ``causal``): a right-padded ``q`` of a ragged prefill puts a
        shorter row's real queries first, where ``causal`` would align them wrongly; attend such a
        prefill row by row, or left-pad ``q`` (each row's real queries last)."""
        check_flag("causal", causal)
        self._check_q(q)
        scale = softmax_scale(scale, self.head_dim)
        causal = causal and q.shape[2] > 1  # one query sees every key
        length = self.length
        # decode (a few queries, not causal): the kernels bound to this cache, splits for the length
        result = self._attend_kernel(q, scale, length, return_lse) if length and not causal else None
        if result is not None:
            out, lse = result
        elif self.ragged:  # the lengths on the device: the decode kernels read them, else row by row
            out, lse = fp8_over_kv_operands(q, self._k, self._k_scale, self._v_t, self._v_scale, causal, scale,
                                            kv_lengths=self._plan, v_keys_permuted=True)
        else:
            out, lse = fp8_over_kv_operands(q, *kv_views(self._k, self._k_scale, self._v_t, length), self._v_scale,
                                            causal, scale, v_keys_permuted=True)
        return (out, lse) if return_lse else out

    def _check_q(self, q) -> None:
        if not isinstance(q, torch.Tensor) or q.dtype not in FLOAT_DTYPES or q.dim() != 4:
            raise ValueError(f"q: expected a 4-D float16/bfloat16/float32/float64 tensor [B, H, Sq, D], got "
                             f"{getattr(q, 'dtype', type(q))} {tuple(getattr(q, 'shape', ()))}")
        b, h, _, d = q.shape
        if b != self.batch or d != self.head_dim or h % self.kv_heads:
            raise ValueError(f"q: expected [B={self.batch}, H a multiple of {self.kv_heads}, Sq, D={self.head_dim}], "
                             f"got {tuple(q.shape)}")
        if q.device != self.device:
            raise ValueError(f"q: on {q.device}, but the cache is on {self.device}")
        if q.requires_grad and torch.is_grad_enabled():
            raise ValueError("q: requires grad, but attention over an FP8 KV cache has no gradients")

    def __repr__(self) -> str:
        length = "on the device" if self._lengths is None else (self._lengths if self.ragged else self.length)
        return (f"FP8KVCache(batch={self.batch}, kv_heads={self.kv_heads}, length={length}, "
                f"max_len={self.max_len}, head_dim={self.head_dim}, dtype={self.dtype}, device={self.device})")
