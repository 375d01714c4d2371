import math

import pytest
import torch

from lowprec.formats import (
    E2M1,
    E4M3,
    E5M2,
    decode,
    decode_e8m0,
    encode,
    encode_e8m0,
    get_format,
    pack_fp4,
    pow2,
    unpack_fp4,
)


def _wide_values(n=200_000, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g) * 6)
    specials = [0.0, -0.0, 448.0, 464.0, 480.0, 57344.0, 61440.0, 61441.0, 1e30, -1e30,
                math.inf, -math.inf, 2**-10, 2**-9 * 0.5, 2**-9 * 0.51, 2**-9 * 1.5, 2**-17, 2**-16 * 1.5]
    return torch.cat([x, torch.tensor(specials)])


@pytest.mark.parametrize("fmt,dtype", [(E4M3, torch.float8_e4m3fn), (E5M2, torch.float8_e5m2)])
@pytest.mark.parametrize("src", [torch.float32, torch.bfloat16, torch.float16])
def test_encode_matches_torch_cast(fmt, dtype, src, device):
    """Every in-range value rounds as torch's cast does (overflow handling differs across torch versions)."""
    x = _wide_values().to(src)
    half_step_at_max = 2.0 ** (fmt.emax - fmt.man_bits - 1)
    x = x[x.abs().double() < fmt.max + half_step_at_max].to(device)
    ours = encode(x, fmt)
    theirs = x.to(dtype).view(torch.uint8)
    assert torch.equal(ours, theirs)


@pytest.mark.parametrize("fmt,dtype", [(E4M3, torch.float8_e4m3fn), (E5M2, torch.float8_e5m2)])
def test_decode_matches_torch_for_every_code(fmt, dtype):
    codes = torch.arange(256, dtype=torch.uint8)
    ours = decode(codes, fmt)
    theirs = codes.view(dtype).float()
    assert torch.equal(ours.isnan(), theirs.isnan())
    assert torch.equal(ours.nan_to_num(0.0), theirs.nan_to_num(0.0))


def test_nan_codes():
    nan = torch.tensor([math.nan])
    assert encode(nan, E4M3).item() == 0x7F
    assert encode(nan, E5M2).item() == 0x7F
    assert math.isnan(decode(torch.tensor([0xFF], dtype=torch.uint8), E4M3).item())


def test_saturation_modes():
    big = torch.tensor([1e6, -1e6, math.inf])
    assert encode(big, E4M3, saturate=True).tolist() == [0x7E, 0xFE, 0x7E]
    assert encode(big, E4M3, saturate=False).tolist() == [0x7F, 0xFF, 0x7F]
    assert encode(big, E5M2, saturate=True).tolist() == [0x7B, 0xFB, 0x7B]
    assert encode(big, E5M2, saturate=False).tolist() == [0x7C, 0xFC, 0x7C]
    # top of the range: 464 ties to even (448); 465 overflows; E5M2's tie at 61440 rounds to Inf
    assert encode(torch.tensor([464.0, 465.0]), E4M3, saturate=False).tolist() == [0x7E, 0x7F]
    assert encode(torch.tensor([465.0]), E4M3).item() == 0x7E
    assert encode(torch.tensor([61439.0, 61440.0]), E5M2).tolist() == [0x7B, 0x7C]


def test_e2m1_decode_table():
    values = decode(torch.arange(16, dtype=torch.uint8), E2M1).tolist()
    mags = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    assert values == mags + [-m for m in mags]


@pytest.mark.parametrize("x,code", [
    (0.25, 0), (0.26, 1), (0.75, 2), (1.25, 2), (1.26, 3), (1.75, 4), (2.5, 4), (2.51, 5),
    (3.5, 6), (5.0, 6), (5.01, 7), (6.0, 7), (100.0, 7), (-0.25, 8), (-3.5, 14), (-7.0, 15), (0.0, 0),
])
def test_e2m1_round_to_nearest_even_and_saturate(x, code, device):
    assert encode(torch.tensor([x], device=device), E2M1).item() == code


def test_e2m1_roundtrip_every_value():
    codes = torch.arange(16, dtype=torch.uint8)
    values = decode(codes, E2M1)
    back = encode(values, E2M1)
    assert torch.equal(back[1:], codes[1:]) and back[0] == 0  # -0.0 keeps its sign bit, +0 is code 0
    assert encode(torch.tensor([-0.0]), E2M1).item() == 8


@pytest.mark.parametrize("x,ceil,floor,nearest", [
    (1.0, 127, 127, 127), (1.5, 128, 127, 128), (1.25, 128, 127, 127), (3.0, 129, 128, 129),
    (0.75, 127, 126, 127), (2.0**-127, 0, 0, 0), (2.0**-130, 0, 0, 0), (2.0**127, 254, 254, 254),
    (2.0**127 * 1.5, 255, 254, 255),
])
def test_e8m0_rounding_table(x, ceil, floor, nearest):
    t = torch.tensor([x], dtype=torch.float64)
    assert encode_e8m0(t, "ceil").item() == ceil
    assert encode_e8m0(t, "floor").item() == floor
    assert encode_e8m0(t, "nearest").item() == nearest


def test_e8m0_nearest_matches_torch_cast():
    x = _wide_values().abs()
    x = x[(x > 0) & torch.isfinite(x)]
    assert torch.equal(encode_e8m0(x, "nearest"), x.to(torch.float8_e8m0fnu).view(torch.uint8))


def test_e8m0_decode_matches_torch_and_specials():
    codes = torch.arange(256, dtype=torch.uint8)
    ours = decode_e8m0(codes)
    theirs = codes.view(torch.float8_e8m0fnu).float()
    assert torch.equal(ours.nan_to_num(0.0), theirs.nan_to_num(0.0))
    assert math.isnan(ours[255].item()) and ours[127].item() == 1.0
    assert encode_e8m0(torch.tensor([-1.0, math.nan, math.inf]), "ceil").tolist() == [255, 255, 255]


def test_fp4_packing_low_nibble_first():
    codes = torch.tensor([[1, 2, 3, 4], [0xF, 0, 7, 8]], dtype=torch.uint8)
    packed = pack_fp4(codes)
    assert packed.tolist() == [[0x21, 0x43], [0x0F, 0x87]]
    assert torch.equal(unpack_fp4(packed), codes)


def test_fp4_pack_errors():
    with pytest.raises(ValueError, match="even"):
        pack_fp4(torch.zeros(3, dtype=torch.uint8))
    with pytest.raises(TypeError, match="uint8"):
        pack_fp4(torch.zeros(4))


def test_format_properties_and_errors():
    assert (E4M3.emax, E5M2.emax, E2M1.emax) == (8, 15, 2)
    assert E4M3.min_subnormal == 2**-9 and E2M1.min_normal == 1.0
    assert get_format("e4m3") is E4M3
    with pytest.raises(ValueError, match="unknown element format"):
        get_format("e3m4")
    with pytest.raises(TypeError, match="floating-point"):
        encode(torch.arange(3), E4M3)
    with pytest.raises(ValueError, match="4-bit"):
        decode(torch.tensor([16], dtype=torch.uint8), E2M1)


def test_pack_fp4_refuses_codes_wider_than_4_bits():
    """As decode() does: codes ≥ 16 would spill into the neighbouring nibble (pack_fp4([3, 17])
    unpacked to [3, 1])."""
    with pytest.raises(ValueError, match="codes: FP4 codes are 4-bit"):
        pack_fp4(torch.tensor([3, 17], dtype=torch.uint8))
    ok = torch.tensor([[15, 0, 7, 8]], dtype=torch.uint8)
    assert torch.equal(unpack_fp4(pack_fp4(ok)), ok)
    assert pack_fp4(torch.zeros(0, 2, dtype=torch.uint8)).shape == (0, 1)
    # callers whose codes fit by construction skip the host read-back
    unchecked = pack_fp4(torch.tensor([3, 1], dtype=torch.uint8), check_range=False)
    assert torch.equal(unchecked, torch.tensor([0x13], dtype=torch.uint8))


VALUES = torch.tensor([0.0, -0.0, 0.5, -1.5, 3.0, -4.0, 6.0, -448.0, 0.001953125, 57344.0 / 128])


@pytest.mark.parametrize("src", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("fmt", ["e2m1", "e4m3", "e5m2"])
def test_encode_takes_fp8_inputs(src, fmt):
    x = VALUES.to(src)
    got = encode(x, fmt)
    assert torch.equal(got, encode(x.float(), fmt))  # same codes as from the exact FP32 values
    assert torch.equal(torch.signbit(decode(got, fmt)), torch.signbit(x.float()))  # -0.0 keeps its sign


def test_pack_fp4_and_decode_e2m1_on_meta_with_default_checks():
    codes = torch.zeros(2, 8, dtype=torch.uint8, device="meta")
    packed = pack_fp4(codes)
    assert packed.device.type == "meta" and packed.shape == (2, 4) and packed.dtype == torch.uint8
    assert unpack_fp4(packed).shape == (2, 8)
    out = decode(codes, "e2m1")
    assert out.device.type == "meta" and out.shape == (2, 8) and out.dtype == torch.float32


def test_range_checks_still_apply_off_meta():
    import pytest
    with pytest.raises(ValueError, match="codes"):
        pack_fp4(torch.tensor([16, 0], dtype=torch.uint8))
    with pytest.raises(ValueError, match="codes"):
        decode(torch.tensor([16], dtype=torch.uint8), "e2m1")


def test_unhashable_format_names_the_argument():
    with pytest.raises(ValueError, match="^fmt: unknown element format"):
        get_format(["e4m3"])
    with pytest.raises(ValueError, match="^fmt: unknown element format"):
        encode(torch.randn(4), ["e4m3"])


def test_pow2_is_exact_over_fp64_normal_exponents():
    exp = torch.arange(-1022, 1024)
    want = torch.tensor([math.ldexp(1.0, int(e)) for e in exp], dtype=torch.float64)
    assert torch.equal(pow2(exp), want)
    assert torch.equal(pow2(exp.to(torch.int32)[1022 - 149:1022 + 129], torch.float32),
                       want[1022 - 149:1022 + 129].float())  # FP32: subnormals to 2^128 = Inf


@pytest.mark.parametrize("saturate", ["no", 0, 1])
def test_encode_refuses_a_saturate_that_is_not_a_bool(saturate):
    """encode(x, E4M3, saturate="no") saturated: any truthy value did."""
    with pytest.raises(TypeError, match="saturate: expected a bool or None"):
        encode(torch.tensor([1e6]), E4M3, saturate=saturate)


def test_fp4_packing_of_a_0_dim_tensor_names_the_argument():
    """A 0-dim tensor has no last dim: pack_fp4 raised IndexError, unpack_fp4 torch's "Dimension out of range"."""
    with pytest.raises(ValueError, match="codes: expected ≥ 1 dim"):
        pack_fp4(torch.tensor(3, dtype=torch.uint8))
    with pytest.raises(ValueError, match="packed: expected ≥ 1 dim"):
        unpack_fp4(torch.tensor(3, dtype=torch.uint8))
