"""Token routing for mixture-of-experts: top-k expert choice, capacity limits, the dispatch plan.

Every backend reproduces these rules exactly, so results are deterministic and bit-identical:

- **top-k** (:func:`select_experts`): experts by descending score; equal scores go to the lower
  expert id first.
- **capacity** (:func:`dispatch`): expert ``e`` keeps at most ``C = ceil(T·k/E · capacity_factor)``
  of the slots routed to it (:func:`expert_capacity`). A *slot* is one (token ``t``, top-k column
  ``j``) pair, numbered ``t·k + j``. Drop policy ``"probs"`` keeps the slots with the highest combine
  weight, equal weights going to the lower slot number first; ``"position"`` keeps the lowest slot
  numbers (the earliest tokens). ``capacity_factor=None`` drops nothing.
- **packed order**: kept slots grouped by expert id ascending, inside an expert by slot number
  ascending. The buffer has ``T·k`` rows whatever the routing (no device-to-host sync to size it);
  rows from ``group_ends[-1]`` on are padding.

On CUDA, :func:`route`, :func:`select_experts` and :func:`dispatch` with ``check_ids=False`` never
wait for the device (CUDA-graph capturable); only the id check and :meth:`Routing.stats` read back.
On Hopper the plan of a dropless or ``"position"`` dispatch (E ≤ 512, T·k ≤ 131072) comes from two
kernels (``lowprec/moe/sm90/dispatch.py``) instead of ~16 torch ops, with the same result.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from fractions import Fraction

import torch

from ..runtime import eager_under_compile

__all__ = ["Routing", "dispatch", "expert_capacity", "route", "select_experts", "DROP_POLICIES", "SCORE_FUNCS"]

DROP_POLICIES = ("probs", "position")
SCORE_FUNCS = ("softmax", "sigmoid")


@dataclass(frozen=True)
class Routing:
    """Where every token goes: the output of :func:`dispatch` (or :func:`route`).

    Attributes:
        topk_weights: ``[T, k]`` combine weights as given (autograd graph kept).
        topk_ids: ``[T, k]`` int64 expert ids.
        kept: ``[T, k]`` bool, False where the capacity limit dropped the slot.
        slot_rows: ``[T, k]`` int64, the packed row of each slot, -1 where dropped.
        row_slots: ``[T·k]`` int64, the slot (``t·k + j``) in each packed row, -1 on padding rows.
        counts: ``[E]`` int32, kept slots per expert.
        group_ends: ``[E]`` int32 cumulative ``counts``: expert ``e`` owns packed rows
            ``group_ends[e-1]:group_ends[e]`` (the ``group_ends`` of :func:`lowprec.grouped_gemm`).
        capacity: ``C`` per expert, or None (dropless).
    """

    topk_weights: torch.Tensor
    topk_ids: torch.Tensor
    kept: torch.Tensor
    slot_rows: torch.Tensor
    row_slots: torch.Tensor
    counts: torch.Tensor
    group_ends: torch.Tensor
    capacity: int | None

    @property
    def num_tokens(self) -> int:
        return self.topk_ids.shape[0]

    @property
    def top_k(self) -> int:
        return self.topk_ids.shape[1]

    @property
    def num_experts(self) -> int:
        return self.counts.shape[0]

    @property
    def num_rows(self) -> int:
        """Rows of a packed buffer, ``T·k`` (routed rows first, then padding)."""
        return self.row_slots.shape[0]

    @property
    def combine_weights(self) -> torch.Tensor:
        """``topk_weights`` with dropped slots set to 0 (differentiable)."""
        return torch.where(self.kept, self.topk_weights, torch.zeros_like(self.topk_weights))

    def stats(self) -> dict[str, float]:
        """Load statistics as Python numbers (this reads back from the device):

        ``dropped`` slots dropped by the capacity limit, ``dropped_tokens`` tokens that lost all
        their experts, ``padding_rows`` packed rows beyond the routed ones (``T·k − routed``: the
        buffer holds ``T·k`` rows, so this equals ``dropped``), ``max_load`` / ``mean_load`` kept
        slots per expert, ``capacity`` (``inf`` when dropless).
        """
        routed = int(self.counts.sum())
        counts = self.counts.double()
        return {
            "dropped": float(self.num_rows - routed),
            "dropped_tokens": float((~self.kept).all(dim=1).sum()),
            "padding_rows": float(self.num_rows - routed),
            "max_load": float(counts.max()),
            "mean_load": float(counts.mean()),
            "capacity": math.inf if self.capacity is None else _as_float(self.capacity),
        }


def _as_float(n: int) -> float:
    """``n`` as the nearest float: ``inf`` past the largest (``float(n)`` raises there)."""
    try:
        return float(n)
    except OverflowError:
        return math.inf


def _check_capacity_factor(capacity_factor: float | None) -> None:
    if capacity_factor is None:
        return
    # a rational (int, Fraction) is finite: math.isfinite would convert it to a float, which
    # overflows past 1.8e308 (expert_capacity reads it exactly)
    if isinstance(capacity_factor, bool) or not isinstance(capacity_factor, numbers.Real) \
            or not (isinstance(capacity_factor, numbers.Rational) or math.isfinite(capacity_factor)) \
            or capacity_factor <= 0:
        raise ValueError(f"capacity_factor: expected a finite number > 0 or None (dropless), got {capacity_factor!r}")


def _factor_fraction(capacity_factor: float) -> Fraction:
    """``capacity_factor`` as the decimal it prints as (numpy's float32 1.2 prints as 1.2; float()
    would give 1.2000000476837158)."""
    try:
        return Fraction(str(capacity_factor))
    except ValueError:
        return Fraction(repr(float(capacity_factor)))


def _plain_capacity_factor(capacity_factor: float | None) -> float | None:
    """A valid ``capacity_factor`` as a Python float where :func:`expert_capacity` reads both as
    the same number (numpy scalars, ``Fraction(3, 4)``): torch.compile turns numpy
    scalars into tensors, which the custom ops' float argument refuses. Others stay as they are."""
    if capacity_factor is None or type(capacity_factor) in (int, float):
        return capacity_factor
    exact = _factor_fraction(capacity_factor)
    try:
        plain = float(exact)  # the float nearest the number: the one whose decimal is it, where one is
    except OverflowError:  # past any float: kept as it is (expert_capacity reads it exactly)
        return capacity_factor
    return plain if _factor_fraction(plain) == exact else capacity_factor


def _check_renormalize(renormalize: bool) -> bool:
    """``renormalize`` as a Python bool (numpy's too: under torch.compile the custom ops take a
    plain bool). Anything else is refused: the string ``"false"``, say, is truthy."""
    if isinstance(renormalize, (str, bytes, torch.Tensor)) or renormalize not in (True, False):
        raise ValueError(f"renormalize: expected a bool, got {renormalize!r}")
    return bool(renormalize)


def _check_size(name: str, value: int, least: int = 1) -> int:
    """``value`` as a Python int ≥ ``least``: numpy integers too (as :func:`expert_capacity` takes
    them; torch.compile would make them tensors), bools refused."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < least:
        raise ValueError(f"{name}: expected an int ≥ {least}, got {value!r}")
    return int(value)


def _check_top_k(top_k: int, num_experts: int) -> int:
    top_k = _check_size("top_k", top_k)
    if top_k > num_experts:
        raise ValueError(f"top_k: {top_k} is more than num_experts={num_experts}")
    return top_k


def expert_capacity(num_tokens: int, top_k: int, num_experts: int, capacity_factor: float | None) -> int | None:
    """``C = ceil(T·k/E · capacity_factor)`` slots per expert, or None when ``capacity_factor`` is None.

    Computed exactly, with ``capacity_factor`` read as the decimal it prints as (1.2 is 6/5), so
    ``T=10, k=1, E=4, capacity_factor=1.2`` gives 3, not the 4 that float rounding would give.
    """
    # Python ints: numpy's int32 product T·k would wrap around
    num_tokens, top_k, num_experts = (_check_size(name, value, least) for name, value, least in (
        ("num_tokens", num_tokens, 0), ("top_k", top_k, 1), ("num_experts", num_experts, 1)))
    _check_capacity_factor(capacity_factor)
    if capacity_factor is None:
        return None
    return math.ceil(Fraction(num_tokens * top_k, num_experts) * _factor_fraction(capacity_factor))


def select_experts(logits: torch.Tensor, top_k: int, *, score_func: str = "softmax",
                   renormalize: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k experts per token from router logits.

    Args:
        logits: ``[T, E]`` float router outputs.
        top_k: experts per token, ``1 ≤ top_k ≤ E``.
        score_func: ``"softmax"`` (over all E experts) or ``"sigmoid"`` (per expert), in FP32.
        renormalize: divide the k selected scores by their sum (so they add up to 1). With
            ``top_k=1`` this makes every weight 1 (softmax and sigmoid alike), and the router gets
            no gradient.

    Returns:
        ``(topk_weights, topk_ids)``: FP32 ``[T, k]`` scores of the chosen experts (differentiable
        with respect to ``logits``) and int64 ``[T, k]`` ids, by descending score, equal scores
        lower id first.
    """
    if not isinstance(logits, torch.Tensor) or not logits.is_floating_point() or logits.dim() != 2:
        raise ValueError(f"logits: expected a 2-D float tensor [T, E], got "
                         f"{getattr(logits, 'dtype', type(logits))} {tuple(getattr(logits, 'shape', ()))}")
    top_k = _check_top_k(top_k, logits.shape[1])
    if score_func not in SCORE_FUNCS:
        raise ValueError(f"score_func: expected one of {SCORE_FUNCS}, got {score_func!r}")
    renormalize = _check_renormalize(renormalize)
    scores = logits.float().softmax(dim=-1) if score_func == "softmax" else logits.float().sigmoid()
    ids = _topk_ids(scores.detach(), top_k)
    weights = scores.gather(-1, ids)
    if renormalize:
        # sigmoid scores may all underflow to 0: keep the weights finite
        weights = weights / weights.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
    return weights, ids


def _topk_ids(scores: torch.Tensor, top_k: int) -> torch.Tensor:
    """Each row's ``top_k`` expert ids by descending score, equal scores lower id first (on Hopper
    one kernel, the same ids)."""
    from ..runtime import registry

    # torch.topk leaves the order of equal scores unspecified; a stable sort fixes it: lower id first
    return registry.run("moe_topk", scores.device, (scores, top_k),
                        lambda: torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :top_k])


@eager_under_compile
def dispatch(topk_weights: torch.Tensor, topk_ids: torch.Tensor, num_experts: int, *,
             capacity_factor: float | None = None, drop_policy: str = "probs", check_ids: bool = True) -> Routing:
    """The dispatch plan for given top-k choices: capacity drops and the packed (expert-contiguous) order.

    Args:
        topk_weights: ``[T, k]`` float combine weights (ranks slots for ``drop_policy="probs"``).
        topk_ids: ``[T, k]`` int32/int64 expert ids in ``[0, num_experts)``, ``k ≤ num_experts``
            (a token listing an expert twice gets two rows).
        num_experts: E.
        capacity_factor: None (dropless) or > 0; see :func:`expert_capacity`.
        drop_policy: ``"probs"`` or ``"position"`` (module docstring: which slots stay).
        check_ids: check the ids' range (reads a flag back from the device; pass False when the
            ids come from :func:`select_experts`).
    """
    num_experts = _check_size("num_experts", num_experts)
    if not isinstance(topk_ids, torch.Tensor) or topk_ids.dtype not in (torch.int32, torch.int64) \
            or topk_ids.dim() != 2:
        raise ValueError(f"topk_ids: expected an int32/int64 tensor [T, k], got "
                         f"{getattr(topk_ids, 'dtype', type(topk_ids))} {tuple(getattr(topk_ids, 'shape', ()))}")
    if not isinstance(topk_weights, torch.Tensor) or not topk_weights.is_floating_point() \
            or topk_weights.shape != topk_ids.shape:
        raise ValueError(f"topk_weights: expected a float tensor of topk_ids' shape {tuple(topk_ids.shape)}, got "
                         f"{getattr(topk_weights, 'dtype', type(topk_weights))} "
                         f"{tuple(getattr(topk_weights, 'shape', ()))}")
    if topk_weights.device != topk_ids.device:
        raise ValueError(f"topk_weights: on {topk_weights.device}, but topk_ids is on {topk_ids.device}")
    num_tokens, top_k = topk_ids.shape
    _check_top_k(top_k, num_experts)
    if drop_policy not in DROP_POLICIES:
        raise ValueError(f"drop_policy: expected one of {DROP_POLICIES}, got {drop_policy!r}")
    ids = topk_ids.reshape(-1).long()
    if check_ids and ids.numel() and bool(((ids < 0) | (ids >= num_experts)).any()):
        raise ValueError(f"topk_ids: expert ids must be in [0, {num_experts}), got values in "
                         f"[{int(ids.min())}, {int(ids.max())}]")
    capacity = expert_capacity(num_tokens, top_k, num_experts, capacity_factor)
    if capacity is None or drop_policy == "position":
        planned = _plan_kernel(ids, num_experts, capacity)
        if planned is not None:
            kept, slot_rows, row_slots, counts, group_ends = planned
            return Routing(topk_weights=topk_weights, topk_ids=topk_ids.long(), kept=kept.reshape(num_tokens, top_k),
                           slot_rows=slot_rows.reshape(num_tokens, top_k), row_slots=row_slots, counts=counts,
                           group_ends=group_ends, capacity=capacity)
    device = ids.device
    n = ids.numel()
    slots = torch.arange(n, device=device)
    ones = torch.ones(n, dtype=torch.int64, device=device)

    if capacity is None:
        kept = torch.ones(n, dtype=torch.bool, device=device)
    else:
        if drop_policy == "probs":
            # stable sorts: by weight (descending, lower slot first on ties), then by expert
            by_weight = torch.sort(topk_weights.detach().reshape(-1), descending=True, stable=True).indices
            order = by_weight[torch.sort(ids[by_weight], stable=True).indices]
        else:
            order = torch.sort(ids, stable=True).indices
        # `order` lists every expert's slots in keep-priority order; rank = place within the expert
        demand = torch.zeros(num_experts, dtype=torch.int64, device=device).scatter_add_(0, ids, ones)
        first = torch.cumsum(demand, 0) - demand
        rank = slots - first[ids[order]]
        # a capacity of T·k or more keeps every slot (and may not fit an int64 comparison: capacity_factor=1e30)
        kept = torch.empty(n, dtype=torch.bool, device=device).scatter_(0, order, rank < min(capacity, n))

    # packed order: kept slots by expert, then slot number; dropped slots sort last (as expert E)
    perm = torch.sort(torch.where(kept, ids, num_experts), stable=True).indices
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device).scatter_add_(0, ids, kept.long())
    group_ends = torch.cumsum(counts, 0)
    routed = group_ends[-1]
    row_slots = torch.where(slots < routed, perm, -1)
    slot_rows = torch.where(kept, torch.empty_like(perm).scatter_(0, perm, slots), -1)
    return Routing(
        topk_weights=topk_weights,
        topk_ids=topk_ids.long(),
        kept=kept.reshape(num_tokens, top_k),
        slot_rows=slot_rows.reshape(num_tokens, top_k),
        row_slots=row_slots,
        counts=counts.int(),
        group_ends=group_ends.int(),
        capacity=capacity,
    )


def _plan_kernel(ids: torch.Tensor, num_experts: int, capacity: int | None):
    """The plan (dropless, or ``"position"`` drops) from the dispatch kernels (two launches instead
    of ~16 torch ops), or None where the torch form runs."""
    from ..runtime import registry

    if ids.device.type != "cuda":  # the torch form is the CPU path, in every backend mode
        return None
    return registry.run("moe_dispatch", ids.device, (ids, num_experts, capacity), lambda: None)


@eager_under_compile
def route(logits: torch.Tensor, top_k: int, *, score_func: str = "softmax", renormalize: bool = True,
          capacity_factor: float | None = None, drop_policy: str = "probs") -> Routing:
    """Router logits ``[T, E]`` to a :class:`Routing`: :func:`select_experts` then :func:`dispatch`.

    ``Routing.topk_weights`` stays differentiable with respect to ``logits``, so the router trains.
    """
    weights, ids = select_experts(logits, top_k, score_func=score_func, renormalize=renormalize)
    return dispatch(weights, ids, logits.shape[1], capacity_factor=capacity_factor, drop_policy=drop_policy,
                    check_ids=False)
