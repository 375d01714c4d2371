"""FP8 layers for training and inference, and ``convert`` to swap them into a model."""

from .fsdp import FP8AllGatherWeight, FP8GatheredWeight
from .functional import LINEAR_RECIPES, LinearRecipe, fp8_linear
from .linear import MIN_TRAIN_WEIGHT_NUMEL, FP8InferenceLinear, FP8Linear, convert, enable_fp8_all_gather
from .nvfp4 import NVFP4InferenceLinear
from .swiglu import FP8SwiGLUMLP, SwiGLUMLP, fp8_swiglu_mlp
from .weight_cache import reuse_quantized_weights

__all__ = ["LINEAR_RECIPES", "LinearRecipe", "fp8_linear", "FP8InferenceLinear", "FP8Linear", "convert",
           "MIN_TRAIN_WEIGHT_NUMEL", "NVFP4InferenceLinear", "FP8SwiGLUMLP", "SwiGLUMLP", "fp8_swiglu_mlp",
           "reuse_quantized_weights", "enable_fp8_all_gather", "FP8AllGatherWeight", "FP8GatheredWeight"]
