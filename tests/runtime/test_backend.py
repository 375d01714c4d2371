import pytest
import torch

from lowprec.runtime import backend_mode, device_arch, kernel_failed


def test_modes(monkeypatch):
    monkeypatch.delenv("LOWPREC_BACKEND", raising=False)
    assert backend_mode() == "auto"
    monkeypatch.setenv("LOWPREC_BACKEND", "Reference")
    assert backend_mode() == "reference"
    monkeypatch.setenv("LOWPREC_BACKEND", "fast")
    with pytest.raises(ValueError, match="LOWPREC_BACKEND"):
        backend_mode()


def test_kernel_failure_warns_once_in_auto_and_raises_in_kernel_mode(monkeypatch):
    monkeypatch.setenv("LOWPREC_BACKEND", "auto")
    with pytest.warns(RuntimeWarning, match="falling back"):
        kernel_failed("probe-op", ValueError("boom-unique-1"))
    monkeypatch.setenv("LOWPREC_BACKEND", "kernel")
    with pytest.raises(ValueError, match="boom"):
        kernel_failed("probe-op", ValueError("boom"))


@pytest.mark.gpu
def test_device_arch_on_gpu():
    arch = device_arch(torch.device("cuda"))
    major, _ = torch.cuda.get_device_capability()
    assert arch == {9: "sm_90a", 10: "sm_100a"}.get(major)
