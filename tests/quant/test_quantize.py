"""quantize / dequantize semantics, checked against an independent per-block implementation."""

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import lowprec
from lowprec import QuantizedTensor, dequantize, quantize
from lowprec.recipes import RECIPE_NAMES

F32 = np.float32
E2M1_MAGS = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def _e4m3(v: np.ndarray) -> np.ndarray:
    return torch.from_numpy(np.ascontiguousarray(v, dtype=F32)).to(torch.float8_e4m3fn).float().numpy()


def _e2m1(v: float) -> float:
    """Nearest E2M1 magnitude, ties to the even code, sign kept."""
    a = abs(v)
    best = min(range(8), key=lambda c: (abs(E2M1_MAGS[c] - a), c % 2))
    return math.copysign(E2M1_MAGS[best], v)


def _pow2(v: float, mode: str) -> float:
    m, e = math.frexp(v)  # v = m * 2^e, m in [0.5, 1)
    if mode == "floor":
        return 2.0 ** (e - 1)
    return v if m == 0.5 else 2.0 ** e


def independent(x: np.ndarray, name: str, **opts):
    """Dequantized values and per-block scales, block by block, in float32 numpy."""
    rows, cols = x.shape
    br, bc = {"fp8_tensorwise": (rows, cols), "fp8_rowwise": (1, cols), "fp8_block1x128": (1, 128),
              "fp8_block16x128": (16, 128), "fp8_block128x128": (128, 128), "mxfp8": (1, 32), "mxfp4": (1, 32),
              "nvfp4": (16, 16) if opts.get("weight_2d") else (1, 16)}[name]
    out = np.zeros_like(x)
    scales = np.zeros((-(-rows // br), -(-cols // bc)), dtype=np.float64)
    glob = None
    if name == "nvfp4":
        amax_t = F32(np.abs(x).max())
        glob = F32(amax_t / F32(2688.0)) if amax_t > 0 else F32(1.0)
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            blk = x[i * br:(i + 1) * br, j * bc:(j + 1) * bc]
            amax = F32(np.abs(blk).max())
            if name.startswith("fp8"):
                if amax == 0:
                    s = F32(1.0)
                else:
                    s = F32(amax / F32(448.0))
                    if opts.get("pow2_scale"):
                        s = F32(_pow2(float(s), "ceil"))
                q = _e4m3(np.clip(blk * (F32(1) / s), -448, 448))
                deq = q * s
            elif name in ("mxfp8", "mxfp4"):
                elem_max, emax = (448.0, 8) if name == "mxfp8" else (6.0, 2)
                if amax == 0:
                    s = 2.0**-127
                elif opts.get("rounding") == "floor":
                    s = _pow2(float(amax), "floor") * 2.0**-emax
                else:
                    s = _pow2(float(F32(amax / F32(elem_max))), "ceil")
                s = F32(s)
                v = np.clip(blk * (F32(1) / s), -elem_max, elem_max).astype(F32)
                q = _e4m3(v) if name == "mxfp8" else np.vectorize(_e2m1)(v).astype(F32)
                deq = q.astype(np.float64) * float(s)
            else:  # nvfp4
                sb = F32(np.clip(F32(F32(amax / F32(6.0)) / glob), 2.0**-9, 448.0))
                sb = F32(_e4m3(np.array([sb]))[0])
                div = F32(sb * glob)
                v = np.clip(blk * (F32(1) / div), -6, 6).astype(F32)
                q = np.vectorize(_e2m1)(v).astype(F32)
                deq = q * div
                s = sb
            out[i * br:(i + 1) * br, j * bc:(j + 1) * bc] = deq
            scales[i, j] = s
    return out, scales, glob


CASES = [(name, {}) for name in RECIPE_NAMES] + [
    ("fp8_block1x128", {"pow2_scale": True}), ("fp8_block128x128", {"pow2_scale": True}),
    ("fp8_rowwise", {"pow2_scale": True}), ("mxfp8", {"rounding": "floor"}), ("mxfp4", {"rounding": "floor"}),
    ("nvfp4", {"weight_2d": True}),
]


def _data(rows, cols, seed, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g) * torch.exp(torch.randn(rows, 1, generator=g))
    x[0, :5] *= 50  # outliers
    if rows > 3:
        x[3] = 0.0  # an all-zero row: all-zero blocks in row-block recipes
    return x.to(device)


@pytest.mark.parametrize("name,opts", CASES, ids=[f"{n}{o}" for n, o in CASES])
def test_matches_independent_implementation(name, opts, device):
    x = _data(140, 300, seed=len(name) + len(opts), device=device)  # not multiples of any block
    qt = quantize(x, name, **opts)
    assert qt.shape == x.shape and qt.device == x.device
    expected, scales, glob = independent(x.cpu().numpy(), name, **opts)
    got = qt.dequantize(torch.float32).cpu().numpy()  # the FP32 product of the scales, as the independent code
    np.testing.assert_array_equal(got.astype(np.float32), expected.astype(np.float32))
    np.testing.assert_array_equal(qt.scale.float().cpu().numpy().reshape(scales.shape), scales.astype(np.float32))
    if glob is None:
        assert qt.global_scale is None
    else:
        assert qt.global_scale.item() == float(glob)


@pytest.mark.parametrize("name,opts", CASES, ids=[f"{n}{o}" for n, o in CASES])
def test_storage_dtypes_and_shapes(name, opts):
    x = _data(33, 70, seed=1)
    qt = quantize(x, name, **opts)
    r = qt.recipe
    if r.is_fp4:
        assert qt.data.dtype == torch.uint8 and qt.data.shape == (33, 35)
    else:
        assert qt.data.dtype == torch.float8_e4m3fn and qt.data.shape == (33, 70)
    expected_scale_dtype = {"fp32": torch.float32, "e8m0": torch.float8_e8m0fnu, "e4m3": torch.float8_e4m3fn}
    assert qt.scale.dtype == expected_scale_dtype[r.scale_format]
    br, bc = r.block
    nr = 1 if br == -1 else -(-33 // br)
    nc = 1 if bc == -1 else -(-70 // bc)
    assert tuple(qt.scale.shape) == (nr, nc)
    assert qt.scale.is_contiguous()


def test_all_zero_blocks_get_finite_nonzero_scales(device):
    for name in RECIPE_NAMES:
        qt = quantize(torch.zeros(64, 256, device=device), name)
        s = qt.scale.float()
        assert torch.isfinite(s).all() and (s > 0).all(), name
        assert (qt.dequantize() == 0).all(), name


def test_tiny_values_do_not_underflow_the_scale():
    x = torch.full((1, 128), 1e-40)  # subnormal fp32: amax / 448 would flush to zero
    qt = quantize(x, "fp8_block1x128")
    assert qt.scale.item() > 0 and torch.isfinite(qt.dequantize()).all()


def test_pow2_scales_are_powers_of_two_and_cover_the_block():
    x = _data(128, 512, seed=5)
    qt = quantize(x, "fp8_block1x128", pow2_scale=True)
    s = qt.scale.double()
    assert torch.equal(torch.frexp(s)[0], torch.full_like(s, 0.5))
    amax = x.abs().reshape(128, 4, 128).amax(-1).double()
    assert (s * 448 >= amax).all()


def test_bf16_fp16_inputs_and_dtype_roundtrip(device):
    for dtype in (torch.bfloat16, torch.float16):
        x = _data(16, 256, seed=2, device=device).to(dtype)
        qt = quantize(x, "fp8_block1x128")
        assert qt.dtype == dtype and qt.dequantize().dtype == dtype
        assert dequantize(qt, torch.float32).dtype == torch.float32


def test_batched_and_1d_inputs():
    x = torch.randn(3, 5, 260)
    qt = quantize(x, "fp8_block1x128")
    assert qt.scale.shape == (3, 5, 3)
    ref = torch.stack([quantize(x[i], "fp8_block1x128").dequantize() for i in range(3)])
    assert torch.equal(qt.dequantize(), ref)
    w = torch.randn(4, 130, 260)  # [experts, N, K]: per-expert 128x128 blocks
    qw = quantize(w, "fp8_block128x128")
    assert qw.scale.shape == (4, 2, 3)
    assert torch.equal(qw.dequantize()[2], quantize(w[2], "fp8_block128x128").dequantize())
    v = torch.randn(300)
    qv = quantize(v, "fp8_block1x128")
    assert qv.shape == (300,) and qv.scale.shape == (3,)
    assert torch.equal(qv.dequantize(), quantize(v[None], "fp8_block1x128").dequantize()[0])
    odd = quantize(torch.randn(4, 33), "nvfp4")
    assert odd.data.shape == (4, 17) and odd.dequantize().shape == (4, 33)
    assert quantize(torch.randn(2, 3, 40), "fp8_tensorwise").scale.shape == (1, 1, 1)


def test_input_not_mutated():
    x = _data(64, 256, seed=3)
    before = x.clone()
    for name in RECIPE_NAMES:
        quantize(x, name)
    assert torch.equal(x, before)


def test_non_finite_input_raises_unless_told():
    x = torch.randn(4, 128)
    x[1, 7] = math.nan
    with pytest.raises(ValueError, match="NaN or Inf"):
        quantize(x, "fp8_block1x128")
    x[1, 7] = math.inf
    with pytest.raises(ValueError, match="check_finite=False"):
        quantize(x, "mxfp8")
    assert quantize(x, "fp8_block1x128", check_finite=False).shape == x.shape


def test_bad_input_errors():
    with pytest.raises(TypeError, match="x: expected one of"):
        quantize(torch.arange(128), "fp8_block1x128")
    with pytest.raises(ValueError, match="needs ≥ 2 dims"):
        quantize(torch.randn(128), "fp8_block128x128")
    with pytest.raises(ValueError, match="0-dim"):
        quantize(torch.tensor(1.0), "fp8_tensorwise")
    with pytest.raises(ValueError, match="unknown recipe"):
        quantize(torch.randn(4, 4), "int8")
    with pytest.raises(TypeError, match="QuantizedTensor"):
        dequantize(torch.randn(3))


def test_quantized_tensor_api():
    x = _data(32, 256, seed=4)
    qt = lowprec.quantize(x, "nvfp4")
    assert isinstance(qt, QuantizedTensor) and qt.recipe.name == "nvfp4"
    assert qt.bits_per_element == pytest.approx(4 + 8 / 16 + 32 / x.numel())
    assert "nvfp4" in repr(qt)
    assert torch.equal(qt.to("cpu").dequantize(), qt.dequantize())
    with pytest.raises(ValueError, match="global_scale"):
        QuantizedTensor(qt.data, qt.scale, qt.recipe, qt.shape, qt.dtype, None)


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 40), cols=st.integers(1, 300), seed=st.integers(0, 2**16),
       name=st.sampled_from(["fp8_tensorwise", "fp8_rowwise", "fp8_block1x128", "fp8_block128x128", "mxfp8"]))
def test_fp8_error_bound_property(rows, cols, seed, name):
    """Every element is within half an E4M3 step of its value (relative 2^-4, or the subnormal step)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g) * torch.exp(2 * torch.randn(rows, cols, generator=g))
    qt = quantize(x, name)
    deq = qt.dequantize(torch.float64)
    r = qt.recipe
    br = rows if r.block[0] == -1 else r.block[0]
    bc = cols if r.block[1] == -1 else r.block[1]
    s = qt.scale.double().repeat_interleave(br, 0).repeat_interleave(bc, 1)[:rows, :cols]
    bound = torch.maximum(x.double().abs() * 2.0**-4, s * 2.0**-10) * (1 + 1e-6)
    assert ((deq - x.double()).abs() <= bound).all()


@pytest.mark.parametrize("recipe", ["fp8_block128x128", "fp8_tensorwise"])
@pytest.mark.parametrize("shape", [(256, 384), (130, 272), (3, 128, 256)])
def test_quantize_with_transpose_is_both_quantizations(recipe, shape, device):
    from lowprec.quant import quantize_with_transpose

    x = torch.randn(shape, device=device, generator=torch.Generator(device=device).manual_seed(sum(shape))) * 10
    q, qt = quantize_with_transpose(x, recipe)
    ref, ref_t = lowprec.quantize(x, recipe), lowprec.quantize(x.transpose(-1, -2).contiguous(), recipe)
    for a, b in ((q, ref), (qt, ref_t)):
        assert a.shape == b.shape and a.recipe == b.recipe
        assert torch.equal(a.data.view(torch.uint8), b.data.view(torch.uint8))
        assert torch.equal(a.scale, b.scale)


def test_quantize_with_transpose_rejects_non_square_blocks():
    from lowprec.quant import quantize_with_transpose

    with pytest.raises(ValueError, match="recipe.*not transposable"):
        quantize_with_transpose(torch.randn(128, 128), "fp8_block1x128")
    with pytest.raises(ValueError, match="x: expected"):
        quantize_with_transpose(torch.randn(128), "fp8_block128x128")


@pytest.mark.parametrize("scale_format, rounding", [("fp32", "exact"), ("fp32", "pow2"), ("e8m0", "rceil")])
def test_e5m2_elements_are_stored_as_e5m2_codes(scale_format, rounding, tmp_path):
    from lowprec.recipes import WHOLE, ScaleRecipe

    r = ScaleRecipe("e5m2_rows", (1, WHOLE) if scale_format == "fp32" else (1, 32), "e5m2", scale_format, rounding)
    x = _data(8, 64, seed=6)
    qt = quantize(x, r)
    assert qt.data.dtype == torch.float8_e5m2
    deq = qt.dequantize(torch.float64)
    # E5M2 keeps 2 mantissa bits: within 2^-3 of every value, the largest included (E4M3 codes
    # saturated at 448 gave them back at ~1/128 of their size)
    assert ((deq - x.double()).abs() <= x.double().abs() * 2.0**-3 + qt.scale.double().max() * 2.0**-16).all()
    inv = (1 / qt.scale.float()).repeat_interleave(x.shape[1] // qt.scale.shape[1], 1)
    codes = (x * inv).clamp(-57344, 57344).to(torch.float8_e5m2)
    assert torch.equal(qt.data.view(torch.uint8), codes.view(torch.uint8))
    lowprec.save(qt, tmp_path / "e5m2.safetensors")
    back = lowprec.load(tmp_path / "e5m2.safetensors")
    assert back.recipe == r and back.data.dtype == torch.float8_e5m2
    assert torch.equal(back.dequantize(), qt.dequantize())


@pytest.mark.parametrize("name", RECIPE_NAMES)
def test_float64_beyond_fp32_range_is_an_error_not_nan(name):
    x = torch.tensor([[1e300, 1.0]], dtype=torch.float64).expand(16, 2).contiguous()
    with pytest.raises(ValueError, match="x: .*beyond FP32's range"):
        quantize(x, name)
    x = torch.tensor([[3e38, -1.0]], dtype=torch.float64).expand(16, 2).contiguous()  # within FP32's range
    deq = quantize(x, name).dequantize()
    assert torch.isfinite(deq).all() and deq[0, 0] > 1e38


@pytest.mark.parametrize("scale", [1e-39, 1e-42, 1e-45])
def test_nvfp4_tiny_and_subnormal_inputs(scale):
    """FP32 subnormal inputs: no NaN, zeros stay +0, and the error is no worse than mxfp4's
    (``1 / (scale · global_scale)`` overflowed FP32: relative error 1.6, or all NaN)."""
    x = torch.randn(8, 64) * scale
    x[2] = 0.0
    qt = quantize(x, "nvfp4")
    deq = qt.dequantize()
    assert not deq.isnan().any()
    assert not torch.signbit(deq[2]).any()
    err = lowprec.metrics.rel_l2(deq, x)
    assert err < 1 and err <= lowprec.metrics.rel_l2(quantize(x, "mxfp4").dequantize(), x) + 1e-6
    if scale >= 1e-39:  # ~20 bits of subnormal precision left: as accurate as normal inputs
        assert err < 0.15


@pytest.mark.parametrize("name", RECIPE_NAMES)
def test_unchecked_nan_keeps_the_scale_of_the_finite_values(name):
    """With check_finite=False a NaN's block takes its scale from the finite values (the NaN made
    it 1: 1e6 saturated to 448). The NaN stays NaN where the element format has one."""
    x = torch.ones(2, 64)
    x[0, :3] = torch.tensor([math.nan, 1e6, 1.0])
    deq = quantize(x, name, check_finite=False).dequantize()
    assert deq[0, 1] == pytest.approx(1e6, rel=0.25)
    assert deq[0, 0].isnan() != lowprec.get_recipe(name).is_fp4  # E2M1 has no NaN


def test_dequantize_dtype_must_be_a_float_dtype():
    qt = quantize(torch.randn(4, 64), "mxfp8")
    for bad in (torch.int32, "float32", torch.float8_e4m3fn):
        with pytest.raises(TypeError, match="dtype: expected one of"):
            qt.dequantize(bad)


@pytest.mark.parametrize("name, opts", [("fp8_block1x128", {"pow2_scale": True}), ("fp8_rowwise", {"pow2_scale": True}),
                                        ("fp8_tensorwise", {"pow2_scale": True}), ("mxfp8", {"rounding": "floor"}),
                                        ("mxfp4", {"rounding": "floor"})])
def test_unchecked_inf_makes_its_block_nan_with_pow2_and_floor_scales(name, opts):
    """quantize's docstring: with check_finite=False an Inf makes its whole block NaN. pow2 scales
    made the block's scale 1 (Inf and 1000 both dequantized to 448), OCP 'floor' E8M0 scales
    2^(254 - emax) (Inf, then zeros)."""
    x = torch.ones(2, 128)
    x[0, :2] = torch.tensor([math.inf, 1000.0])
    qt = quantize(x, name, check_finite=False, **opts)
    deq = qt.dequantize()
    assert deq[0, :32].isnan().all()  # the Inf's block (every recipe here has ≥ 32 columns per block)
    if not qt.recipe.tensorwise:
        assert torch.equal(deq[1], torch.ones(128))  # other blocks untouched


@pytest.mark.parametrize("shape", [(3, 0), (2, 3, 0)])
def test_quantize_dual_of_a_tensor_without_columns(shape):
    """quantize() takes a [T, 0] tensor; quantize_dual failed reshaping it to [-1, 0]."""
    rows_q, cols_q = lowprec.quant.quantize_dual(torch.randn(shape))
    t = shape[0] * (shape[1] if len(shape) == 3 else 1)
    assert rows_q.shape == (t, 0) and cols_q.shape == (0, -(-t // 16) * 16)


@pytest.mark.parametrize("call", [
    lambda: lowprec.quantize(torch.randn(3, 0), "fp8_block1x128"),
    lambda: lowprec.quantize(torch.randn(0), "fp8_rowwise"),
    lambda: lowprec.quant.quantize_dual(torch.randn(3, 0)),
    lambda: lowprec.quant.quantize_with_transpose(torch.randn(0, 256)),
    lambda: lowprec.quant.quantize_with_transpose(torch.randn(4, 0, 256)),
    lambda: lowprec.quant.quantize_with_transpose(torch.randn(256, 0)),
])
def test_compiled_path_takes_empty_tensors(call, monkeypatch):
    """The custom-op path (torch.compile tracing CUDA inputs, simulated on CPU) viewed empty inputs
    as [-1, cols] / [-1, rows, cols], which fails; an empty tensor gives what eager gives."""
    eager = call()
    monkeypatch.setattr(lowprec.quant, "_traced_on_cuda", lambda x: True)
    traced = call()
    eager, traced = (r if isinstance(r, tuple) else (r,) for r in (eager, traced))
    for a, b in zip(eager, traced, strict=True):
        assert a.shape == b.shape and a.scale.shape == b.scale.shape


def test_hopper_transposing_kernel_refuses_a_matrix_without_rows():
    """The sm_90a constraint took [0, K] matrices, whose wrapper then computed R % 0."""
    from lowprec.quant.sm90 import config, interface

    r = lowprec.get_recipe("fp8_block128x128")
    assert "no rows" in config.transpose_unsupported(torch.zeros(0, 256), r)
    assert "no rows" in config.transpose_unsupported(torch.zeros(4, 0, 256), r)
    with pytest.raises(ValueError, match="n: expected a positive multiple of 16"):
        interface.quantize_128x128_t(torch.zeros(0, 256), 0)


@pytest.mark.parametrize("name", ["fp8_tensorwise", "fp8_block1x128", "fp8_block128x128", "mxfp8", "mxfp4", "nvfp4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_quantize_meta_tensor_with_default_check(name, dtype):
    x = torch.empty(3, 200, 130, device="meta", dtype=dtype)
    q = lowprec.quantize(x, name)
    ref = lowprec.quantize(torch.zeros(3, 200, 130, dtype=dtype), name)
    assert q.device.type == "meta" and q.shape == x.shape
    assert q.data.shape == ref.data.shape and q.data.dtype == ref.data.dtype
    assert q.scale.shape == ref.scale.shape and q.scale.dtype == ref.scale.dtype
    assert q.dequantize().shape == x.shape


def test_quantize_still_checks_real_tensors():
    with pytest.raises(ValueError, match="NaN or Inf"):
        lowprec.quantize(torch.tensor([[float("nan")] * 128]), "fp8_block1x128")


def test_nvfp4_scale_from_amax_names_missing_global_scale():
    from lowprec.quant.reference import scale_from_amax
    from lowprec.recipes import get_recipe

    with pytest.raises(ValueError, match="^global_scale: .*nvfp4"):
        scale_from_amax(torch.tensor([1.0, 2.0]), get_recipe("nvfp4"))


def test_nvfp4_scale_from_amax_with_global_scale():
    from lowprec.quant.reference import scale_from_amax
    from lowprec.recipes import get_recipe

    amax = torch.tensor([1.0, 2.0])
    g = torch.tensor(2.0 / 2688.0)
    s = scale_from_amax(amax, get_recipe("nvfp4"), g)
    assert torch.equal(s, (amax / 6 / g).clamp(max=448).to(torch.float8_e4m3fn).float())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("recipe, shape", [("fp8_block16x128", (256, 512)), ("fp8_block16x128", (130, 260)),
                                           ("fp8_block128x128", (3, 8, 200)), ("nvfp4", (256, 512)),
                                           ("nvfp4", (3, 8, 200))])
def test_compiled_reference_quantize_is_eager_bits_on_cuda(recipe, shape):
    """Recipes and shapes without a kernel run the reference inside the compiled graph, in
    inductor's Triton, whose FP32 division is approximate: scales and NVFP4 global scales came out
    an ulp off eager's, so every value of their blocks did (ieee_div now divides in FP64)."""
    x = torch.randn(*shape, device="cuda", generator=torch.Generator("cuda").manual_seed(0)) * 10

    def quantize(t):
        q = lowprec.quantize(t, recipe, check_finite=False)  # the check reads the device: a graph break
        return q.data.view(torch.uint8), q.scale.float(), q.global_scale

    torch._dynamo.reset()
    for got, want in zip(torch.compile(quantize, fullgraph=True)(x), quantize(x)):
        assert (got is None and want is None) or torch.equal(got, want)
