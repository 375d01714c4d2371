"""Blackwell (sm_100a) block-scaled GEMM kernels (MXFP8, NVFP4), and cuBLASLt's block-scaled GEMM
(``cublas``) as the fallback before the reference.

Compiled and their SASS checked for sm_100a on CPU-only machines, but never run here (no
Blackwell GPU). Registered for ``gemm`` and ``grouped_gemm`` (masked layout: one batched launch)
on sm_100a behind a first-use self-check: on a real
device each configuration first proves itself on a small random problem against the reference
(``interface.probe``, ``interface.close_enough``) and otherwise steps aside, with one warning,
for the fallback: ``gemm_cublaslt`` (cuBLASLt through ``torch._scaled_mm``, also self-checked),
then the reference. Importing this package does not import cutlass.
"""

from ...runtime.registry import SelfCheck, register
from . import config
from .cublas import PAIRS as _PAIRS
from .cublas import cublas_unsupported as _cublas_unsupported
from .cublas import pair_of as _pair_of


def _reference(a, b, out_dtype, bias):
    from ..reference import gemm_reference

    return gemm_reference(a, b, out_dtype, bias)


def _grouped_reference(a, b, out_dtype, group_ends, masked_counts):
    from ..reference import grouped_gemm_contiguous_reference, grouped_gemm_masked_reference

    if group_ends is not None:
        return grouped_gemm_contiguous_reference(a, b, group_ends, out_dtype)
    return grouped_gemm_masked_reference(a, b, masked_counts, out_dtype)


def _grouped_probe(cfg, device):
    from .interface import grouped_probe

    return grouped_probe(cfg, device)


def _probe_cublas(pair, device):
    from .cublas import probe

    return probe(pair, device)


def _probe(cfg, device):
    from .interface import probe

    return probe(cfg, device)


def _close(result, expected):
    from .interface import close_enough

    return close_enough(result, expected)


register("gemm", "sm_100a", f"{__name__}.interface:gemm_quantized", config.gemm_unsupported,
         self_check=SelfCheck(config.check_config, _probe, _reference, _close, config.check_configs))
register("grouped_gemm", "sm_100a", f"{__name__}.interface:grouped_gemm_quantized", config.grouped_unsupported,
         self_check=SelfCheck(config.grouped_check_config, _grouped_probe, _grouped_reference, _close,
                              config.grouped_check_configs))
register("gemm_cublaslt", "sm_100a", f"{__name__}.cublas:gemm_cublas", _cublas_unsupported,
         self_check=SelfCheck(_pair_of, _probe_cublas, _reference, _close, lambda: _PAIRS))
