"""Markers shared by the sm_90a kernel tests: compile tests need CuTe DSL, GPU tests an sm_90 GPU."""

import importlib.util

import pytest
import torch

HAS_CUTLASS = importlib.util.find_spec("cutlass") is not None
HAS_GPU = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
needs_cutlass = pytest.mark.skipif(not HAS_CUTLASS, reason="nvidia-cutlass-dsl not installed")
gpu = pytest.mark.gpu
needs_gpu = pytest.mark.skipif(not (HAS_GPU and HAS_CUTLASS), reason="needs an sm_90 GPU")
