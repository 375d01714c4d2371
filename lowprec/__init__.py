"""lowprec: low-precision (FP8 / MX / NVFP4) kernels for PyTorch on a block-scaled GEMM core."""

from . import metrics, moe, nn
from .attention import attention, attention_varlen
from .formats import E2M1, E4M3, E5M2
from .gemm import gemm, grouped_gemm
from .io import load, save
from .moe import MoE
from .nn import convert, reuse_quantized_weights
from .quant import dequantize, quantize
from .recipes import RECIPE_NAMES, ScaleRecipe, get_recipe
from .tensor import QuantizedTensor

__version__ = "0.1.0"

__all__ = [
    "E2M1", "E4M3", "E5M2", "MoE", "QuantizedTensor", "RECIPE_NAMES", "ScaleRecipe", "attention", "attention_varlen",
    "convert",
    "dequantize", "gemm", "get_recipe", "grouped_gemm", "load", "metrics", "moe", "nn", "quantize",
    "reuse_quantized_weights", "save",
]
