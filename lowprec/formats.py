"""Element formats: E4M3, E5M2, E2M1 (FP4) and E8M0, with bit-exact encode/decode.

Encoding works on any float tensor (CPU or CUDA) and returns raw ``uint8`` codes; decoding
returns ``float32``. Rounding is round-to-nearest-even in every minifloat format. These functions
are the reference every kernel is checked against, so they are written from the bit layout, not
from torch's casts (the tests compare the two where torch has the format).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = [
    "ElementFormat",
    "E4M3",
    "E5M2",
    "E2M1",
    "get_format",
    "encode",
    "decode",
    "encode_e8m0",
    "decode_e8m0",
    "pack_fp4",
    "unpack_fp4",
    "E8M0_NAN",
    "pow2",
]


@dataclass(frozen=True)
class ElementFormat:
    """A sign + exponent + mantissa minifloat with IEEE-style subnormals."""

    name: str
    exp_bits: int
    man_bits: int
    bias: int
    max: float
    has_inf: bool
    nan_code: int | None  # code of +NaN; None when the format has no NaN
    torch_dtype: torch.dtype | None  # torch's dtype for one element, if torch has one

    @property
    def bits(self) -> int:
        return 1 + self.exp_bits + self.man_bits

    @property
    def emax(self) -> int:
        """Exponent of the largest power of two not above ``max`` (8 for E4M3, 2 for E2M1)."""
        return int(torch.tensor(self.max, dtype=torch.float64).frexp()[1].item()) - 1

    @property
    def min_normal(self) -> float:
        return 2.0 ** (1 - self.bias)

    @property
    def min_subnormal(self) -> float:
        return 2.0 ** (1 - self.bias - self.man_bits)

    def __repr__(self) -> str:
        return f"ElementFormat({self.name})"


E4M3 = ElementFormat("e4m3", 4, 3, 7, 448.0, False, 0x7F, torch.float8_e4m3fn)
E5M2 = ElementFormat("e5m2", 5, 2, 15, 57344.0, True, 0x7F, torch.float8_e5m2)
E2M1 = ElementFormat("e2m1", 2, 1, 1, 6.0, False, None, None)
_FORMATS = {f.name: f for f in (E4M3, E5M2, E2M1)}

E8M0_NAN = 0xFF


def get_format(fmt: str | ElementFormat) -> ElementFormat:
    """Look up an element format by name (``"e4m3"``, ``"e5m2"``, ``"e2m1"``)."""
    if isinstance(fmt, ElementFormat):
        return fmt
    try:
        return _FORMATS[fmt]
    except (KeyError, TypeError):  # TypeError: an unhashable fmt
        raise ValueError(f"fmt: unknown element format {fmt!r}; expected one of {sorted(_FORMATS)}") from None


def _floor_log2(a: torch.Tensor) -> torch.Tensor:
    """floor(log2(a)) for positive finite float64 ``a``, exactly (frexp, no transcendental)."""
    return torch.frexp(a)[1] - 1


def pow2(exp: torch.Tensor, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """``2^exp`` for integer ``exp`` in [-1022, 1023], exactly, as ``dtype`` (from FP64's bits).

    Not ``torch.ldexp``: on a CUDA device that is not the current one it gives wrong values
    (torch 2.11, 2x H200), and this is a shift and a bit view instead of a power and a multiply."""
    return ((exp.to(torch.int64) + 1023) << 52).view(torch.float64).to(dtype)


def encode(x: torch.Tensor, fmt: str | ElementFormat, saturate: bool | None = None) -> torch.Tensor:
    """Round ``x`` to nearest-even in ``fmt`` and return its codes as ``uint8``.

    ``saturate``: values beyond the largest finite value become ±max when True; when False they
    become Inf (E5M2) or NaN (E4M3), as IEEE-style overflow. Default: E4M3 saturates (Inf too,
    as torch ≥ 2.13's cast; older torch gives NaN), E5M2 overflows to Inf (as torch). E2M1 has neither Inf nor NaN and
    always saturates; NaN input to E2M1 becomes a zero code (check finiteness before, as
    ``lowprec.quantize`` does by default).
    """
    f = get_format(fmt)
    if not x.is_floating_point():
        raise TypeError(f"x: expected a floating-point tensor, got {x.dtype}")
    if saturate is None:
        saturate = f is not E5M2
    elif not isinstance(saturate, bool):  # "no" would be truthy
        raise TypeError(f"saturate: expected a bool or None, got {saturate!r}")
    if f.nan_code is None:
        saturate = True
    xd = x.detach().to(torch.float64)
    a = xd.abs()
    sign = torch.signbit(xd).to(torch.int64)  # of the FP64 copy: torch has no signbit for FP8 dtypes
    nan = torch.isnan(a)
    inf = torch.isinf(a)
    a = torch.where(nan | inf, torch.zeros_like(a), a)

    exp = _floor_log2(a).clamp(min=1 - f.bias)  # subnormals share the smallest exponent
    quantum = pow2(exp - f.man_bits)
    r = torch.round(a / quantum) * quantum  # exact: dividing by a power of two
    overflow = (r > f.max) | inf
    r = torch.where(overflow, torch.full_like(r, f.max), r)

    exp = _floor_log2(r).clamp(min=1 - f.bias)
    subnormal = r < f.min_normal
    exp_field = torch.where(subnormal, torch.zeros_like(exp), exp + f.bias)
    mantissa = torch.where(
        subnormal,
        r / f.min_subnormal,
        r / pow2(exp - f.man_bits) - 2**f.man_bits,
    ).to(torch.int64)
    code = (exp_field << f.man_bits) | mantissa
    if not saturate:
        overflow_code = 0x7C if f.has_inf else f.nan_code
        code = torch.where(overflow, torch.full_like(code, overflow_code), code)
    if f.nan_code is not None:
        code = torch.where(nan, torch.full_like(code, f.nan_code), code)
        sign = torch.where(nan, torch.zeros_like(sign), sign)
    code = code | (sign << (f.exp_bits + f.man_bits))
    return code.to(torch.uint8)


def _decode_table(f: ElementFormat) -> torch.Tensor:
    values = []
    for code in range(2**f.bits):
        sign = -1.0 if code >> (f.bits - 1) else 1.0
        e = (code >> f.man_bits) & ((1 << f.exp_bits) - 1)
        m = code & ((1 << f.man_bits) - 1)
        if not f.has_inf and f.nan_code is not None and (code & 0x7F) == f.nan_code:
            values.append(float("nan"))
        elif f.has_inf and e == (1 << f.exp_bits) - 1:
            values.append(sign * float("inf") if m == 0 else float("nan"))
        elif e == 0:
            values.append(sign * m * f.min_subnormal)
        else:
            values.append(sign * (1 + m / 2**f.man_bits) * 2.0 ** (e - f.bias))
    return torch.tensor(values, dtype=torch.float32)


_TABLES: dict[tuple[str, torch.device], torch.Tensor] = {}


def decode(codes: torch.Tensor, fmt: str | ElementFormat, *, check_range: bool = True) -> torch.Tensor:
    """Decode ``uint8`` codes of ``fmt`` (one element per byte) to ``float32``.

    ``check_range=False`` skips the check that sub-byte codes fit their bits (it reads the codes'
    maximum back to the host: a sync, not allowed under CUDA-graph capture); callers whose codes
    fit by construction (nibbles unpacked from bytes) pass it."""
    f = get_format(fmt)
    if codes.dtype != torch.uint8:
        raise TypeError(f"codes: expected uint8 codes, got {codes.dtype}")
    key = (f.name, codes.device)
    if key not in _TABLES:  # one table per device: no host-to-device copy per call
        _TABLES[key] = _decode_table(f).to(codes.device)
    # a meta tensor has no values to check (as quantize's check_finite)
    if check_range and f.bits < 8 and codes.numel() and codes.device.type != "meta" and int(codes.max()) >= 2**f.bits:
        raise ValueError(f"codes: {f.name} codes are {f.bits}-bit, got a value ≥ {2**f.bits}")
    return _TABLES[key][codes.long()]


def encode_e8m0(x: torch.Tensor, rounding: str = "ceil") -> torch.Tensor:
    """Encode positive values as E8M0 (2^(code-127)) codes, ``uint8``.

    ``rounding``: ``"ceil"`` (up to the next power of two: MX RCEIL), ``"floor"``, or
    ``"nearest"`` (ties up in linear space, as torch's cast for normal FP32 values; FP32
    subnormals in [2^-127, 1.5 * 2^-127) round to the nearer code 0 here, where torch's bit-level
    cast gives code 1). Values that round below 2^-127 clamp to code 0; values that round above
    2^127 (so "floor" keeps values below 2^128 at code 254), Inf, NaN and negative values give the
    NaN code 0xFF.
    """
    if rounding not in ("ceil", "floor", "nearest"):
        raise ValueError(f"rounding: expected 'ceil', 'floor' or 'nearest', got {rounding!r}")
    a = x.detach().to(torch.float64)
    bad = ~torch.isfinite(a) | (a < 0)
    a = torch.where(bad | (a == 0), torch.ones_like(a), a)
    mant, e = torch.frexp(a)  # a = mant * 2^e, mant in [0.5, 1)
    if rounding == "floor":
        exp = e - 1
    elif rounding == "ceil":
        exp = torch.where(mant == 0.5, e - 1, e)
    else:
        exp = torch.where(mant < 0.75, e - 1, e)
    exp = torch.where(x.detach() == 0, torch.full_like(exp, -127), exp)
    code = (exp + 127).clamp(min=0)
    code = torch.where(bad | (code > 254), torch.full_like(code, E8M0_NAN), code)
    return code.to(torch.uint8)


def decode_e8m0(codes: torch.Tensor) -> torch.Tensor:
    """Decode E8M0 codes (``uint8``) to ``float32``; 0xFF is NaN."""
    if codes.dtype != torch.uint8:
        raise TypeError(f"codes: expected uint8 codes, got {codes.dtype}")
    exp = codes.to(torch.int32) - 127
    out = pow2(exp, torch.float32)
    return torch.where(codes == E8M0_NAN, torch.full_like(out, float("nan")), out)


def pack_fp4(codes: torch.Tensor, *, check_range: bool = True) -> torch.Tensor:
    """Pack 4-bit codes pairwise along the last dim: element 2i in the low nibble, 2i+1 high.

    ``check_range=False`` skips the check that the codes fit 4 bits (a read-back to the host, as
    :func:`decode`'s); callers whose codes fit by construction pass it."""
    if codes.dtype != torch.uint8:
        raise TypeError(f"codes: expected uint8 codes, got {codes.dtype}")
    if codes.dim() == 0:
        raise ValueError("codes: expected ≥ 1 dim (pairs along the last), got a 0-dim tensor")
    if codes.shape[-1] % 2:
        raise ValueError(f"codes: last dim must be even to pack pairs, got {codes.shape[-1]}")
    if check_range and codes.numel() and codes.device.type != "meta" and int(codes.max()) >= 16:  # meta: no values
        raise ValueError(f"codes: FP4 codes are 4-bit, got a value ≥ 16 (max {int(codes.max())})")
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_fp4`: ``[..., n]`` packed bytes to ``[..., 2n]`` 4-bit codes."""
    if packed.dtype != torch.uint8:
        raise TypeError(f"packed: expected uint8, got {packed.dtype}")
    if packed.dim() == 0:
        raise ValueError("packed: expected ≥ 1 dim (pairs along the last), got a 0-dim tensor")
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2)
