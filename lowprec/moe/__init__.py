"""Mixture-of-experts: routing, token packing, the MoE layer on FP8 grouped GEMMs, NVFP4 experts for
inference on the grouped weight-only GEMM, and transformers' sparse MoE blocks as these layers."""

from ..runtime import registry
from .hf import moe_from_hf, register_transformers_experts
from .layer import ACTIVATIONS, RECIPES, FP8InferenceMoE, MoE, experts
from .nvfp4 import NVFP4InferenceMoE
from .packing import gather_rows, pack, pack_tokens, unpack
from .parallel import ExpertParallelMoE, expert_parallel_experts
from .routing import DROP_POLICIES, SCORE_FUNCS, Routing, dispatch, expert_capacity, route, select_experts
from .wgrad import grouped_gemm_wgrad, quantize_k_grouped

__all__ = [
    "ACTIVATIONS", "DROP_POLICIES", "ExpertParallelMoE", "FP8InferenceMoE", "MoE", "NVFP4InferenceMoE", "RECIPES",
    "Routing", "SCORE_FUNCS", "dispatch", "expert_capacity", "expert_parallel_experts", "experts", "gather_rows",
    "grouped_gemm_wgrad", "moe_from_hf", "pack", "pack_tokens", "quantize_k_grouped", "register_transformers_experts",
    "route", "select_experts", "unpack",
]

registry.load_arch_packages(__name__, __path__)
