"""The kernel registry: one place answers which kernel serves an op's inputs, and why not."""

import pytest
import torch

import lowprec  # noqa: F401  (registers the shipped kernels)
from lowprec.runtime import device_arch, registry

CPU = torch.device("cpu")


@pytest.fixture
def probe_op(monkeypatch):
    """A registered op ``probe`` on sm_90a whose kernel doubles its argument, unless it is negative."""
    monkeypatch.setitem(registry._registry, "probe", {})
    registry.register("probe", "sm_90a", "operator:neg", lambda x: "negative" if isinstance(x, int) and x < 0 else None)
    return "probe"


def test_every_op_has_its_hopper_kernel_registered():
    ops = {"gemm", "grouped_gemm", "grouped_gemm_wgrad", "quantize", "quantize_dual", "quantize_with_transpose",
           "quantize_t_gathered", "moe_dispatch", "moe_pack", "moe_unpack", "swiglu_quantize", "swiglu_backward",
           "moe_swiglu", "moe_topk"}
    for op in ops:
        kernel = registry.registered(op)["sm_90a"]
        assert callable(kernel.load()), op  # the target exists (importing it needs no GPU)


def test_registering_imports_no_cutlass():
    import subprocess
    import sys

    code = "import sys, lowprec; print('cutlass' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() \
        == "False"


def test_cpu_has_no_kernel_and_says_why(probe_op, monkeypatch):
    monkeypatch.setenv("LOWPREC_BACKEND", "auto")
    assert device_arch(CPU) is None
    assert registry.kernel_for(probe_op, CPU, 1) is None
    assert "no probe kernel for device cpu" in registry.why_no_kernel(probe_op, CPU, 1)
    assert registry.run(probe_op, CPU, (1,), lambda: "reference") == "reference"


def test_kernel_mode_turns_the_reason_into_an_error(probe_op, monkeypatch):
    monkeypatch.setenv("LOWPREC_BACKEND", "kernel")
    with pytest.raises(RuntimeError, match="probe cannot run a kernel: no probe kernel for device cpu"):
        registry.run(probe_op, CPU, (1,), lambda: "reference")


def test_constraints_and_policy_on_a_kernel_device(probe_op, monkeypatch):
    """Pretend the CPU is a Hopper: the kernel runs where its constraints hold, with one warning
    and the reference where it fails, never in reference mode."""
    monkeypatch.setattr(registry, "device_arch", lambda device: "sm_90a")
    monkeypatch.setattr(registry, "dsl_available", lambda: True)
    monkeypatch.setenv("LOWPREC_BACKEND", "auto")
    assert registry.run(probe_op, CPU, (3,), lambda: "reference") == -3
    assert registry.why_no_kernel(probe_op, CPU, -3) == "negative"
    assert registry.run(probe_op, CPU, (-3,), lambda: "reference") == "reference"
    assert registry.run(probe_op, CPU, (3,), lambda: "reference", lambda kernel: kernel(3) * 10) == -30
    with pytest.warns(RuntimeWarning, match="probe kernel failed"):
        assert registry.run(probe_op, CPU, ("x",), lambda: "reference") == "reference"  # neg("x"): TypeError
    monkeypatch.setenv("LOWPREC_BACKEND", "reference")
    assert registry.run(probe_op, CPU, (3,), lambda: "reference") == "reference"
    monkeypatch.setenv("LOWPREC_BACKEND", "kernel")
    with pytest.raises(RuntimeError, match="negative"):
        registry.run(probe_op, CPU, (-3,), lambda: "reference")


def test_target_must_name_a_function():
    with pytest.raises(ValueError, match="module:function"):
        registry.register("probe2", "sm_90a", "operator.neg")


def test_arch_packages_are_found_by_name(tmp_path, monkeypatch):
    pkg = tmp_path / "fakeop"
    (pkg / "sm77").mkdir(parents=True)
    (pkg / "notes").mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "sm77" / "__init__.py").write_text(
        "from lowprec.runtime.registry import register\nregister('fake', 'sm_77', 'operator:neg')\n")
    (pkg / "notes" / "__init__.py").write_text("raise AssertionError('not an arch package')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(registry._registry, "fake", {})
    import fakeop

    registry.load_arch_packages("fakeop", fakeop.__path__)
    assert set(registry.registered("fake")) == {"sm_77"}


# --- first-use self-check --------------------------------------------------------------------------
def _double(x):
    return x * 2


def _double_wrong_for_wide(x):
    """A deliberately wrong kernel: right for rows of at most 8 values, off by one beyond."""
    return x * 2 + (1 if x.shape[-1] > 8 else 0)


def _isolated_op(monkeypatch, op: str, kernel) -> tuple[str, list]:
    """A fresh registry entry for ``op``, ``kernel`` importable as ``<module>:kernel``, no self-check
    remembered, warnings captured: ``(module name, the warnings list)``."""
    import sys
    import types

    module = types.ModuleType(f"lowprec_selfcheck_{op}")
    module.kernel = kernel
    monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setitem(registry._registry, op, {})
    for attr in ("_passed_checks", "_failed_checks", "_checked_all"):
        monkeypatch.setattr(registry, attr, set())
    warned = []
    monkeypatch.setattr(registry, "warn_once", warned.append)
    return module.__name__, warned


@pytest.fixture
def checked_op(monkeypatch):
    """An op ``checked`` on sm_90a (pretended on the CPU) whose kernel is wrong for one of its two
    configurations (the row width class), registered with a self-check; the probe calls counted."""
    import types

    module_name, warned = _isolated_op(monkeypatch, "checked", _double_wrong_for_wide)
    monkeypatch.setattr(registry, "device_arch", lambda device: "sm_90a")
    monkeypatch.setattr(registry, "dsl_available", lambda: True)
    monkeypatch.setattr(registry, "_loaded", {})
    probes = []

    def probe(config, device):
        probes.append(config)
        return (torch.randn(3, 4 if config == "narrow" else 16, device=device),)

    check = registry.SelfCheck(config=lambda x: "narrow" if x.shape[-1] <= 8 else "wide", probe=probe,
                               reference=_double, close=lambda out, ref: torch.equal(out, ref),
                               configs=lambda: ("narrow", "wide"))
    registry.register("checked", "sm_90a", f"{module_name}:kernel", self_check=check)
    monkeypatch.setenv("LOWPREC_BACKEND", "auto")
    return types.SimpleNamespace(op="checked", target=f"{module_name}:kernel", warned=warned, probes=probes)


def test_self_check_catches_a_wrong_configuration_and_falls_back(checked_op):
    narrow, wide = torch.ones(2, 4), torch.ones(2, 32)

    def call(x):
        return registry.run(checked_op.op, CPU, (x,), lambda: _double(x))

    assert torch.equal(call(narrow), narrow * 2) and checked_op.probes == ["narrow"]  # proven, then run
    assert torch.equal(call(wide), wide * 2)  # the wrong configuration is caught: the fallback answers
    assert checked_op.probes == ["narrow", "wide"] and len(checked_op.warned) == 1
    assert "configuration 'wide' failed its first-use self-check" in checked_op.warned[0]
    for _ in range(3):  # once per configuration and process: no more probes, the fallback stays
        assert torch.equal(call(wide), wide * 2) and torch.equal(call(narrow), narrow * 2)
    assert checked_op.probes == ["narrow", "wide"]
    assert "failed its first-use self-check" in registry.why_no_kernel(checked_op.op, CPU, wide)
    assert registry.why_no_kernel(checked_op.op, CPU, narrow) is None


def test_self_check_off_lets_the_wrong_kernel_run(checked_op, monkeypatch):
    """LOWPREC_SELF_CHECK=0: what the check prevents is visible."""
    monkeypatch.setenv("LOWPREC_SELF_CHECK", "0")
    wide = torch.ones(2, 32)
    assert torch.equal(registry.run(checked_op.op, CPU, (wide,), lambda: _double(wide)), wide * 2 + 1)
    assert checked_op.probes == []


def test_self_check_always_checks_every_configuration_up_front(checked_op, monkeypatch):
    monkeypatch.setenv("LOWPREC_SELF_CHECK", "always")
    narrow = torch.ones(2, 4)
    assert torch.equal(registry.run(checked_op.op, CPU, (narrow,), lambda: _double(narrow)), narrow * 2)
    assert sorted(checked_op.probes) == ["narrow", "wide"] and len(checked_op.warned) == 1


def test_self_check_in_kernel_mode_and_a_kernel_that_raises(checked_op, monkeypatch):
    monkeypatch.setenv("LOWPREC_BACKEND", "kernel")
    wide = torch.ones(2, 32)
    with pytest.raises(RuntimeError, match="configuration 'wide' failed its first-use self-check"):
        registry.run(checked_op.op, CPU, (wide,), lambda: _double(wide))
    monkeypatch.setenv("LOWPREC_BACKEND", "auto")

    def broken(x):
        raise RuntimeError("no such instruction")

    monkeypatch.setattr(registry, "_loaded", {checked_op.target: broken})
    narrow = torch.ones(2, 4)
    assert torch.equal(registry.run(checked_op.op, CPU, (narrow,), lambda: _double(narrow)), narrow * 2)
    assert "RuntimeError: no such instruction" in checked_op.warned[-1]


def test_self_check_mode_values(monkeypatch):
    from lowprec.runtime import self_check_mode

    for value, mode in (("", "auto"), ("1", "auto"), ("0", "0"), ("ALWAYS", "always")):
        monkeypatch.setenv("LOWPREC_SELF_CHECK", value)
        assert self_check_mode() == mode
    monkeypatch.setenv("LOWPREC_SELF_CHECK", "sometimes")
    with pytest.raises(ValueError, match="LOWPREC_SELF_CHECK"):
        self_check_mode()


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)),
                    reason="needs an sm_90 GPU")
def test_self_check_on_the_gpu_catches_a_wrong_kernel_and_falls_back(monkeypatch):
    """On a Hopper GPU, with a real CuTe DSL kernel: the sm_90a dense GEMM registered again as an
    op ``gemm_checked`` behind a wrapper that is deliberately wrong for FP32 output, with a
    self-check. The first call of each output dtype proves it on a small random problem of that
    configuration (the real kernel launched, compared with the reference); bf16 passes and then
    serves the call; FP32 fails, warns once, and the reference answers every FP32 call."""
    from lowprec.gemm.reference import gemm_reference
    from lowprec.gemm.sm90 import config
    from lowprec.gemm.sm90.interface import gemm_quantized

    calls = []

    def kernel(a, b, out_dtype, bias):
        calls.append(out_dtype)
        out = gemm_quantized(a, b, out_dtype, bias)
        return out + 1 if out_dtype == torch.float32 else out

    module_name, warned = _isolated_op(monkeypatch, "gemm_checked", kernel)
    monkeypatch.setenv("LOWPREC_BACKEND", "auto")
    monkeypatch.delenv("LOWPREC_SELF_CHECK", raising=False)

    def operands(m, n, k, device, seed):
        g = torch.Generator(device=device).manual_seed(seed)
        x = torch.randn(m, k, device=device, generator=g, dtype=torch.bfloat16)
        w = torch.randn(n, k, device=device, generator=g, dtype=torch.bfloat16)
        return lowprec.quantize(x, "fp8_block1x128"), lowprec.quantize(w, "fp8_block128x128")

    def probe(out_dtype, device):
        return (*operands(64, 256, 256, device, 0), out_dtype, None)

    def close(out, ref):
        return torch.allclose(out.float(), ref.float(), rtol=2e-2, atol=2e-2)

    check = registry.SelfCheck(config=lambda a, b, out_dtype, bias: out_dtype, probe=probe, reference=gemm_reference,
                               close=close, configs=lambda: (torch.bfloat16, torch.float32))
    registry.register("gemm_checked", "sm_90a", f"{module_name}:kernel", config.gemm_unsupported, check)
    dev = torch.device("cuda")
    a, b = operands(300, 512, 1024, dev, 1)

    def call(out_dtype):
        return registry.run("gemm_checked", dev, (a, b, out_dtype, None), lambda: gemm_reference(a, b, out_dtype, None))

    out = call(torch.bfloat16)
    assert calls == [torch.bfloat16, torch.bfloat16] and not warned  # the probe, then the real call
    assert torch.equal(out, gemm_quantized(a, b, torch.bfloat16, None))
    out = call(torch.float32)
    assert calls[2:] == [torch.float32] and len(warned) == 1  # the probe only: it failed
    assert "configuration torch.float32 failed its first-use self-check" in warned[0]
    assert torch.equal(out, gemm_reference(a, b, torch.float32, None))
    for _ in range(2):  # remembered for the process: no more probes, each dtype keeps its path
        call(torch.float32)
        call(torch.bfloat16)
    assert calls[3:] == [torch.bfloat16, torch.bfloat16] and len(warned) == 1


def test_a_failing_kernel_warns_once_not_once_per_shape(monkeypatch):
    """A kernel whose error names the shape warns once for its op, not once per shape."""
    import warnings

    def kernel(x):
        raise RuntimeError(f"launch failed for M={x.shape[0]}")

    monkeypatch.setitem(registry._registry, "failing_per_shape", {})
    monkeypatch.setitem(registry._loaded, "fake_mod:failing_per_shape", kernel)
    registry.register("failing_per_shape", "sm_90a", "fake_mod:failing_per_shape")
    monkeypatch.setattr(registry, "device_arch", lambda device: "sm_90a")
    monkeypatch.setattr(registry, "dsl_available", lambda: True)
    monkeypatch.setenv("LOWPREC_BACKEND", "auto")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for m in (3, 5, 7):
            result = registry.run("failing_per_shape", CPU, (torch.zeros(m, 4),), lambda: "reference")
            assert result == "reference"
    assert len([w for w in caught if "failing_per_shape kernel failed" in str(w.message)]) == 1
