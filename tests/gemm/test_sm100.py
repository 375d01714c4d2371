"""Compile tests of the sm_100a block-scaled GEMM (lowprec.gemm.sm100), CPU only.

Every shipped config compiles for sm_100a; its SASS has the block-scaled tcgen05 MMA of its
format (UTCQMMA for mxf8, UTCOMMA for mxf4 and nvf4), the scale-factor copies to TMEM (UTCCP), the
commits that free stages (UTCBAR), the accumulator loads (LDTM) and no local memory. No test
runs the kernel: there is no Blackwell GPU here.
"""

from __future__ import annotations

import re

import pytest
import torch

import lowprec
from lowprec.gemm.reference import grouped_gemm_contiguous_reference, grouped_gemm_masked_reference
from lowprec.gemm.sm100 import interface

from ..hopper import HAS_CUTLASS, needs_cutlass

_MMA_SASS = {"mxf8": "UTCQMMA", "mxf4": "UTCOMMA", "nvf4": "UTCOMMA"}


def _shipped():
    from lowprec.gemm.sm100.config import shipped_configs

    return shipped_configs() if HAS_CUTLASS else ()


@needs_cutlass
@pytest.mark.parametrize("config", _shipped(), ids=str)
def test_compile_shipped_config(config):
    from lowprec.gemm.sm100.interface import build_kernel
    from lowprec.runtime.compile import local_memory_ops, nvdisasm_path, sass_of

    compiled = build_kernel(config, arch="sm_100a")
    if nvdisasm_path() is None:
        pytest.skip("no nvdisasm available (pip install nvidia-cuda-nvdisasm)")
    sass = sass_of(compiled)
    for op in (_MMA_SASS[config.element_format], "UTCCP", "UTCBAR", "LDTM"):
        assert op in sass, f"no {op} in the SASS"
    if config.cta_group == 2:  # the pair's MMA, scale copies, TMA loads and the commits to both CTAs
        for op in (rf"{_MMA_SASS[config.element_format]}\.2CTA", r"UTCCP\.T\.S\.2CTA", r"UTCBAR\.2CTA\.MULTICAST",
                   r"UTMALDG\.\dD\.2CTA", r"UTCATOMSWS\.2CTA"):
            assert re.search(op, sass), f"no {op} in the SASS of a CTA pair"
        # B multicast: across the cluster's two pairs (else only SFB, the 4-D load, is multicast)
        assert bool(re.search(r"UTMALDG\.3D\.MULTICAST\.2CTA", sass)) == (config.cluster_pairs == 2)
    else:
        assert ".2CTA" not in sass
    spills = local_memory_ops(sass)
    assert not spills, f"local-memory traffic in SASS: {spills} LDL/STL"


def test_probes_run_the_configuration_they_prove():
    """The self-check's probe of a configuration is a problem that configuration serves: dense
    256x256 CTA pairs where M and N fill them, grouped calls on one CTA (their rows per launch are
    known only after a host read)."""
    import torch

    from lowprec.gemm.sm100 import config as cfg
    from lowprec.gemm.sm100.interface import grouped_probe, probe

    if not HAS_CUTLASS:
        pytest.skip("nvidia-cutlass-dsl not installed")
    cpu = torch.device("cpu")
    for pair, config in cfg.check_configs():
        a, b, out, bias = probe((pair, config), cpu)
        assert cfg.config_for(a, b, out, bias) == config, (pair, config)
    for layout, pair, config in cfg.grouped_check_configs():
        assert config.cta_group == 1
        a, b, out, ends, counts = grouped_probe((layout, pair, config), cpu)
        assert cfg.grouped_check_config(a, b, out, ends, counts) == (layout, pair, config)
    assert any(config.cta_group == 2 for _, config in cfg.check_configs())


def test_config_rejects_unsupported_values():
    from lowprec.gemm.sm100.config import GemmConfig

    with pytest.raises(ValueError, match="element_format"):
        GemmConfig(element_format="mxf6")
    with pytest.raises(ValueError, match="out_dtype"):
        GemmConfig(out_dtype="float64")
    with pytest.raises(ValueError, match="tile_n"):
        GemmConfig(tile_n=64)


@needs_cutlass
@pytest.mark.parametrize("rows, k, vec", [(160, 192, 32), (96, 224, 16), (256, 1024, 32)])
def test_scale_layout_the_kernel_reads_is_to_blocked(rows, k, vec):
    """The kernel addresses scale (row, k-block) through CuTe's blocked layout
    (``tile_atom_to_shape_SF``); ``lowprec.quant.layouts.to_blocked`` must put it at that same
    offset, tails (rows past 128-multiples, k-blocks past 4-multiples) included."""
    import cutlass
    import cutlass.cute as cute
    import cutlass.utils.blockscaled_layout as blockscaled_utils
    import torch

    from lowprec.quant.layouts import to_blocked

    blocks = k // vec
    offsets = {}

    @cute.jit
    def trace():  # evaluated while tracing: static coordinates give Python ints
        layout = blockscaled_utils.tile_atom_to_shape_SF((rows, k, 1), vec)
        for row in cutlass.range_constexpr(rows):
            for kb in cutlass.range_constexpr(blocks):
                offsets[row, kb] = cute.crd2idx((row, kb * vec, 0), layout)

    cute.compile[cute.GPUArch("sm_100a")](trace)
    ids = torch.arange(1, 1 + rows * blocks, dtype=torch.float64).view(rows, blocks)  # 0 marks padding
    where = {int(v): i for i, v in enumerate(to_blocked(ids).tolist()) if v}
    assert len(offsets) == rows * blocks
    assert all(where[1 + row * blocks + kb] == offset for (row, kb), offset in offsets.items())


# ----------------------------------------------------------------------------- wiring (never run here)
def _operands(recipe, m=200, n=272, k=256):
    """Quantized operands of one recipe, or ``"deepseek"``: fp8_block1x128 x fp8_block128x128 with
    power-of-two scales."""
    import torch

    import lowprec

    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
    if recipe == "deepseek":
        return (lowprec.quantize(x, "fp8_block1x128", pow2_scale=True),
                lowprec.quantize(w, "fp8_block128x128", pow2_scale=True))
    return lowprec.quantize(x, recipe), lowprec.quantize(w, recipe)


def test_constraints_state_what_the_kernel_takes():
    import torch

    import lowprec
    from lowprec.gemm.sm100.config import GemmConfig, config_for, gemm_unsupported

    bf16 = torch.bfloat16
    a, b = _operands("mxfp8")
    assert gemm_unsupported(a, b, bf16, None) is None
    assert config_for(a, b, bf16, None) == GemmConfig("mxf8", 256)
    a4, b4 = _operands("nvfp4", n=128, k=512)
    assert gemm_unsupported(a4, b4, bf16, None) is None
    assert config_for(a4, b4, bf16, None) == GemmConfig("nvf4", 128)
    assert config_for(a4, b4, torch.float32, torch.zeros(128)) == GemmConfig("nvf4", 128, out_dtype="float32",
                                                                              has_bias=True)
    m4, w4 = _operands("mxfp4", k=512)
    assert gemm_unsupported(m4, w4, torch.float16, torch.zeros(272, dtype=bf16)) is None
    cases = {
        "recipes": _operands("fp8_block1x128"),
        "recipes mxfp8 x nvfp4": (a, _operands("nvfp4", n=272, k=256)[1]),
        "K tile": _operands("mxfp8", k=160),
        "multiple of 16": _operands("mxfp8", n=200),
        "scale blocks": (a4, lowprec.quantize(torch.randn(128, 512), "nvfp4", weight_2d=True)),
    }
    for why, (x, w) in cases.items():
        reason = gemm_unsupported(x, w, bf16, None)
        assert reason and why.split()[0] in reason, (why, reason)
    assert "out_dtype" in gemm_unsupported(a, b, torch.float64, None)
    assert "bias" in gemm_unsupported(a, b, bf16, torch.zeros(1, 272))


def test_kernel_operands_are_the_codes_and_blocked_scales():
    import torch

    from lowprec.gemm.sm100.interface import kernel_operands
    from lowprec.quant.layouts import from_blocked

    for recipe in ("mxfp8", "mxfp4", "nvfp4"):
        a, b = _operands(recipe, k=512)
        a_codes, b_codes, sfa, sfb = kernel_operands(a, b)
        assert a_codes.data_ptr() == a.data.data_ptr() and b_codes.data_ptr() == b.data.data_ptr()
        assert sfa.dtype == sfb.dtype == torch.uint8
        assert torch.equal(from_blocked(sfa, *a.scale.shape), a.scale.view(torch.uint8))
        assert torch.equal(from_blocked(sfb, *b.scale.shape), b.scale.view(torch.uint8))


@pytest.mark.parametrize("recipe", ["mxfp8", "mxfp4", "nvfp4", "deepseek"])
def test_first_use_self_check_guards_the_sm100_kernel(monkeypatch, recipe):
    """On a (pretended) sm_100a device the registered kernel is proven by its own probe before it
    serves lowprec.gemm: a right kernel serves, a wrong one is caught (one warning) and the
    reference answers."""
    import torch

    import lowprec
    from lowprec.gemm.reference import gemm_reference
    from lowprec.runtime import registry

    monkeypatch.setattr(registry, "device_arch", lambda device: "sm_100a")
    monkeypatch.setattr(registry, "dsl_available", lambda: True)
    warned = []
    monkeypatch.setattr(registry, "warn_once", warned.append)
    monkeypatch.setitem(registry._registry, "gemm_cublaslt", {})  # the reference is the fallback here
    target = registry.registered("gemm")["sm_100a"].target
    a, b = _operands(recipe, m=100, k=512)
    expected = gemm_reference(a, b, torch.bfloat16, None)
    calls = []

    def right(a, b, out_dtype, bias):
        calls.append(a.shape)
        return gemm_reference(a, b, out_dtype, bias)

    def wrong(a, b, out_dtype, bias):
        calls.append(a.shape)
        return gemm_reference(a, b, out_dtype, bias) * 1.05

    for kernel, serves in ((right, True), (wrong, False)):
        for attr in ("_passed_checks", "_failed_checks", "_checked_all"):
            monkeypatch.setattr(registry, attr, set())
        monkeypatch.setattr(registry, "_loaded", {target: kernel})
        calls.clear()
        warned.clear()
        y = lowprec.gemm(a, b)
        assert calls[0][0] == 200, "the probe (200 rows) runs first"
        assert calls[1:] == ([(100, 512)] if serves else [])
        assert len(warned) == (0 if serves else 1) and (serves or "self-check" in warned[0])
        torch.testing.assert_close(y, expected, rtol=0, atol=0)


def test_cublas_fallback_answers_what_the_kernel_does_not_take(monkeypatch):
    """fp8_block1x128 x fp8_block128x128 on a (pretended) sm_100a device: the sm_100a kernel does not
    take them, cuBLASLt's block-scaled GEMM does, once its own first-use self-check passed; a wrong
    one is caught and the reference answers."""
    import torch

    import lowprec
    from lowprec.gemm.reference import gemm_reference
    from lowprec.gemm.sm100.cublas import cublas_unsupported
    from lowprec.runtime import registry

    monkeypatch.setattr(registry, "device_arch", lambda device: "sm_100a")
    monkeypatch.setattr(registry, "dsl_available", lambda: True)
    warned = []
    monkeypatch.setattr(registry, "warn_once", warned.append)
    g = torch.Generator().manual_seed(0)
    a = lowprec.quantize(torch.randn(100, 512, generator=g), "fp8_block1x128")
    b = lowprec.quantize(torch.randn(384, 512, generator=g), "fp8_block128x128")
    assert "powers of two" in registry.why_no_kernel("gemm", torch.device("cpu"), a, b, torch.bfloat16, None)
    assert cublas_unsupported(a, b, torch.bfloat16, None) is None
    assert "recipes" in cublas_unsupported(a, a, torch.bfloat16, None)
    target = registry.registered("gemm_cublaslt")["sm_100a"].target
    expected = gemm_reference(a, b, torch.bfloat16, None)
    calls = []
    for factor, serves in ((1.0, True), (1.05, False)):
        for attr in ("_passed_checks", "_failed_checks", "_checked_all"):
            monkeypatch.setattr(registry, attr, set())
        monkeypatch.setattr(registry, "_loaded", {target: lambda a, b, o, bias, f=factor: (
            calls.append(a.shape), gemm_reference(a, b, o, bias) * f)[1]})
        calls.clear()
        warned.clear()
        y = lowprec.gemm(a, b)
        assert calls[0][0] == 200 and calls[1:] == ([(100, 512)] if serves else [])
        assert len(warned) == (0 if serves else 1)
        torch.testing.assert_close(y, expected, rtol=0, atol=0)


def test_grouped_masked_runs_as_one_batched_launch(monkeypatch):
    """lowprec.grouped_gemm (masked) on a (pretended) sm_100a device: the constraints, the batched
    operands (each expert's scales blocked in turn) and the first-use self-check with a right and
    a wrong stand-in kernel; the contiguous layout is not taken (the reference answers)."""
    import torch

    import lowprec
    from lowprec.gemm.reference import grouped_gemm_masked_reference
    from lowprec.gemm.sm100.config import grouped_unsupported
    from lowprec.gemm.sm100.interface import kernel_operands
    from lowprec.quant.layouts import to_blocked
    from lowprec.runtime import registry

    g = torch.Generator().manual_seed(0)
    a = lowprec.quantize(torch.randn(3, 100, 256, generator=g), "mxfp8")
    b = lowprec.quantize(torch.randn(3, 272, 256, generator=g), "mxfp8")
    counts = torch.tensor([100, 3, 0], dtype=torch.int32)
    bf16 = torch.bfloat16
    assert grouped_unsupported(a, b, bf16, None, counts) is None
    assert "contiguous" in grouped_unsupported(a, b, bf16, torch.tensor([1, 2, 3]), None)
    _, _, sfa, _ = kernel_operands(a, b)
    assert torch.equal(sfa, torch.cat([to_blocked(a.scale[e].view(torch.uint8)) for e in range(3)]))

    monkeypatch.setattr(registry, "device_arch", lambda device: "sm_100a")
    monkeypatch.setattr(registry, "dsl_available", lambda: True)
    warned = []
    monkeypatch.setattr(registry, "warn_once", warned.append)
    target = registry.registered("grouped_gemm")["sm_100a"].target
    expected = grouped_gemm_masked_reference(a, b, counts, bf16)
    calls = []
    for factor, serves in ((1.0, True), (1.05, False)):
        for attr in ("_passed_checks", "_failed_checks", "_checked_all"):
            monkeypatch.setattr(registry, attr, set())

        def kernel(a, b, out_dtype, group_ends, masked_counts, f=factor):
            calls.append(tuple(a.shape))
            return grouped_gemm_masked_reference(a, b, masked_counts, out_dtype) * f

        monkeypatch.setattr(registry, "_loaded", {target: kernel})
        calls.clear()
        warned.clear()
        y = lowprec.grouped_gemm(a, b, masked_counts=counts)
        assert calls[0] == (3, 200, 256) and calls[1:] == ([(3, 100, 256)] if serves else [])
        assert len(warned) == (0 if serves else 1)
        torch.testing.assert_close(y, expected, rtol=0, atol=0)


def test_deepseek_fp8_with_pow2_scales_runs_as_mxfp8():
    """fp8_block1x128 x fp8_block128x128 quantized with pow2_scale=True: the kernel takes them as
    MXFP8, each power-of-two scale the E8M0 scale of its 32-wide blocks (the same dequantized
    operands); the self-check proves that pair separately from mxfp8's."""
    import torch

    import lowprec
    from lowprec.gemm.sm100.config import GemmConfig, check_config, check_configs, gemm_unsupported
    from lowprec.gemm.sm100.interface import kernel_operands
    from lowprec.quant.layouts import from_blocked

    g = torch.Generator().manual_seed(0)
    a = lowprec.quantize(torch.randn(200, 512, generator=g), "fp8_block1x128", pow2_scale=True)
    b = lowprec.quantize(torch.randn(272, 512, generator=g), "fp8_block128x128", pow2_scale=True)
    assert gemm_unsupported(a, b, torch.bfloat16, None) is None
    pair = ("fp8_block1x128", "fp8_block128x128")
    assert check_config(a, b, torch.bfloat16, None) == (pair, GemmConfig("mxf8", 256))
    assert (pair, GemmConfig("mxf8", 128)) in check_configs()
    _, _, sfa, sfb = kernel_operands(a, b)

    def e8m0(blocked, rows):
        return torch.exp2(from_blocked(blocked, rows, 512 // 32).double() - 127)

    torch.testing.assert_close(e8m0(sfa, 200), a.scale.double().repeat_interleave(4, 1), rtol=0, atol=0)
    b_scale = b.scale.double().repeat_interleave(128, 0)[:272].repeat_interleave(4, 1)
    torch.testing.assert_close(e8m0(sfb, 272), b_scale, rtol=0, atol=0)


def test_grouped_contiguous_runs_through_the_masked_launch(monkeypatch):
    """The contiguous layout on a (pretended) sm_100a device: each group's rows go into a masked
    buffer of the longest group's rows, the masked launch runs (a stand-in computing every row),
    and the rows come back to their places, rows past the last group zero; the first-use
    self-check proves the contiguous layout on its own probe."""
    import torch

    import lowprec
    from lowprec.gemm.reference import grouped_gemm_contiguous_reference, grouped_gemm_masked_reference
    from lowprec.gemm.sm100 import interface
    from lowprec.runtime import registry

    g = torch.Generator().manual_seed(1)
    for recipe in ("mxfp8", "nvfp4"):
        a = lowprec.quantize(torch.randn(150, 256, generator=g), recipe)
        b = lowprec.quantize(torch.randn(4, 144, 256, generator=g), recipe)
        ends = torch.tensor([40, 40, 133, 141], dtype=torch.int32)  # an empty group; 9 rows past the last
        launches = []

        def launch(a_masked, b, out_dtype, bias, config, counts=None, launches=launches):
            assert config.masked and config.cta_group == 1 and counts is not None
            launches.append(tuple(a_masked.shape))
            full = torch.full((a_masked.shape[0],), a_masked.shape[1], dtype=torch.int32)
            return grouped_gemm_masked_reference(a_masked, b, full, out_dtype)

        monkeypatch.setattr(interface, "_launch", launch)
        monkeypatch.setattr(registry, "device_arch", lambda device: "sm_100a")
        monkeypatch.setattr(registry, "dsl_available", lambda: True)
        for attr in ("_passed_checks", "_failed_checks", "_checked_all"):
            monkeypatch.setattr(registry, attr, set())
        warned = []
        monkeypatch.setattr(registry, "warn_once", warned.append)
        y = lowprec.grouped_gemm(a, b, group_ends=ends)
        assert launches[-1] == (4, 93, 256) and not warned  # the longest group: 93 rows; the probe's first
        expected = grouped_gemm_contiguous_reference(a, b, ends, torch.bfloat16)
        torch.testing.assert_close(y, expected, rtol=1e-2, atol=1e-2)
        assert (y[141:] == 0).all()


@pytest.fixture
def masked_reference_launch(monkeypatch):
    """The sm_100a launch stubbed by the masked reference: the host code around it runs on the CPU."""
    monkeypatch.setattr(interface, "_launch", lambda a, b, out_dtype, bias, config, counts=None:
                        grouped_gemm_masked_reference(a, b, counts, out_dtype))


def _contiguous_operands(m=10):
    torch.manual_seed(0)
    return lowprec.quantize(torch.randn(m, 256), "mxfp8"), lowprec.quantize(torch.randn(3, 32, 256), "mxfp8")


@pytest.mark.parametrize("ends", [[4, 8, 12], [6, 12, 3], [0, 0, 11], [-2, 3, 30]])
def test_contiguous_as_masked_never_reads_past_m(masked_reference_launch, ends):
    """grouped_gemm: on CUDA, group_ends breaking the contract give wrong rows, never out-of-bounds accesses."""
    a, b = _contiguous_operands()
    y = interface.grouped_gemm_quantized(a, b, torch.float32, torch.tensor(ends, dtype=torch.int32), None)
    assert y.shape == (10, 32) and bool(torch.isfinite(y).all())


@pytest.mark.parametrize("ends", [[4, 8, 10], [0, 3, 7], [0, 0, 0], [5, 5, 9]])
def test_contiguous_as_masked_valid_ends_unchanged(masked_reference_launch, ends):
    a, b = _contiguous_operands()
    ge = torch.tensor(ends, dtype=torch.int32)
    want = grouped_gemm_contiguous_reference(a, b, ge, torch.float32)
    torch.testing.assert_close(interface.grouped_gemm_quantized(a, b, torch.float32, ge, None), want)


@pytest.mark.parametrize("pair", ["mxfp8 x mxfp8", "nvfp4 x nvfp4", "fp8_block1x128 x fp8_block128x128"])
def test_cublas_fallback_calls_pass_torchs_argument_checks(pair):
    """Each cuBLASLt call on the fallback's own probe operands, on the meta device: torch's checks of
    shapes and scale layouts (what can be known here without a Blackwell GPU) accept them."""
    from lowprec.gemm.sm100.cublas import gemm_cublas, probe

    a, b, out_dtype, bias = probe(pair, torch.device("cpu"))
    a, b = a.to("meta"), b.to("meta")
    assert gemm_cublas(a, b, out_dtype, bias).shape == (a.shape[0], b.shape[0])


@pytest.mark.parametrize("pair", ["mxfp8 x mxfp8", "nvfp4 x nvfp4", "fp8_block1x128 x fp8_block128x128"])
def test_cublas_fallback_rounds_once_with_a_bias(pair, monkeypatch):
    """The bias joins the FP32 product before the one rounding to bf16, as the reference does: a
    product of 1 + 2^-8 (a bf16 tie) plus a bias of 2^-8 is 1 + 2^-7, not round(1 + 2^-8) + 2^-8 = 1."""
    from lowprec.gemm.sm100.cublas import gemm_cublas, probe

    a, b, _, _ = probe(pair, torch.device("cpu"))
    if pair == "nvfp4 x nvfp4":  # the global scales multiply the product: 1 keeps it a tie
        a.global_scale = b.global_scale = torch.tensor(1.0)
    monkeypatch.setattr(torch, "_scaled_mm", lambda *args, out_dtype, **kw: torch.full(
        (a.shape[0], b.shape[0]), 1 + 2 ** -8, dtype=out_dtype))
    y = gemm_cublas(a, b, torch.bfloat16, torch.full((b.shape[0],), 2 ** -8))
    assert y.dtype == torch.bfloat16 and (y == 1 + 2 ** -7).all()
