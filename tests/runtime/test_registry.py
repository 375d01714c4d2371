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
           "quantize_t_gathered", "moe_dispatch", "moe_pack", "moe_unpack", "swiglu_quantize", "swiglu_backward"}
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
