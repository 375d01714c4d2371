"""Expert parallelism on ``torch.distributed``: each rank holds ``E / world`` experts and its own
tokens; a token's slots travel to the ranks of their experts and back by ``all_to_all_single``.

:func:`expert_parallel_experts` computes, over the group, what :func:`lowprec.moe.experts` computes
in one process on the concatenation of the ranks' tokens (rank 0's first):

- **dispatch**: with ``recipe="fp8_block"`` the tokens are quantized once (1x128, as the one-process
  MoE quantizes them) and travel as E4M3 codes plus their FP32 scales: about half the bytes of bf16;
  the experts' GEMMs take the received codes as they are (no dequantization, no second
  quantization). Without a recipe (or with ``fp8_dispatch=False``, the same result bits) the rows
  travel in ``x``'s dtype and are quantized on arrival.
- **capacity** is global: an expert's rank ranks every slot routed to it by the one-process rule
  (:mod:`lowprec.moe.routing`: global slot number ``t·k + j`` over the concatenated batch), so the
  same slots are dropped.
- **combine**: each slot's output (already times its combine weight) returns to its token's rank,
  where a token's slots are summed.
- **backward**: autograd through all of it; the gradients of the returning all-to-all travel in
  ``x``'s dtype.

Works on any backend that has ``all_to_all_single`` (NCCL on GPUs, gloo on CPUs). Every rank must
call it (a rank with no tokens passes an empty ``x``).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..nn.functional import follow_autocast, output_as
from ..quant import quantize
from ..recipes import get_recipe
from ..tensor import QuantizedTensor
from .core import _ACT_RECIPE, _X_DTYPES, _check_experts_args, _dispatch_and_apply
from .layer import MoE, _set_config, experts
from .routing import DROP_POLICIES, _check_capacity_factor, _check_size, _check_top_k, expert_capacity, select_experts

__all__ = ["expert_parallel_experts", "ExpertParallelMoE"]

_SCALE_BLOCK = 128


def expert_parallel_experts(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, w1: torch.Tensor,
                            w2: torch.Tensor, *, num_experts: int, group: dist.ProcessGroup | None = None,
                            recipe: str | None = "fp8_block", capacity_factor: float | None = None,
                            drop_policy: str = "probs", activation: str = "swiglu",
                            fp8_dispatch: bool = True) -> torch.Tensor:
    """Routed experts spread over the ranks of ``group`` (see the module docstring).

    Args:
        x: ``[T, H]`` this rank's tokens (T may be 0; T may differ between ranks).
        topk_weights, topk_ids: ``[T, k]`` combine weights and *global* expert ids in ``[0, E)``.
        w1, w2: this rank's experts, ``[E / world, 2F, H]`` and ``[E / world, H, F]``: rank ``r``
            holds experts ``r·E/world .. (r+1)·E/world - 1``.
        num_experts: E, a multiple of the group's size.
        recipe, capacity_factor, drop_policy, activation: as :func:`lowprec.moe.experts`.
        fp8_dispatch: with a recipe, send the rows as the E4M3 codes and scales the experts
            compute on (else in ``x``'s dtype, quantized on arrival: the same codes, twice the bytes).

    Returns:
        ``[T, H]`` in ``x``'s dtype (the autocast dtype inside ``torch.autocast``, as
        :func:`lowprec.moe.experts`), differentiable in ``x``, ``topk_weights``, ``w1`` and ``w2``.
    """
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    _check_args(x, topk_weights, topk_ids, w1, num_experts, world, drop_policy)
    num_experts = int(num_experts)  # a numpy integer too
    _check_capacity_factor(capacity_factor)
    # cast here, not on arrival: the codes that travel are those the one-process MoE computes on
    x, autocast_off = follow_autocast(x)
    with autocast_off:
        return _expert_parallel(x, topk_weights, topk_ids, w1, w2, num_experts, group, world, rank, recipe,
                                capacity_factor, drop_policy, activation, fp8_dispatch)


def _expert_parallel(x, topk_weights, topk_ids, w1, w2, num_experts, group, world, rank, recipe, capacity_factor,
                     drop_policy, activation, fp8_dispatch) -> torch.Tensor:
    local_experts = num_experts // world
    tokens, k = topk_ids.shape
    device = x.device

    # every rank's token count (the global slot numbers and the global capacity), and whether any
    # rank's x / topk_weights needs a gradient: every rank's backward must then take part in the
    # exchanges that return it (a rank whose own x needs none, e.g. a plain empty x, skipped them: hang)
    grad = torch.is_grad_enabled()
    mine = [tokens, grad and x.requires_grad, grad and topk_weights.requires_grad]
    gathered = [torch.zeros(3, dtype=torch.int64, device=device) for _ in range(world)]
    dist.all_gather(gathered, torch.tensor(mine, dtype=torch.int64, device=device), group=group)
    table = torch.stack(gathered)
    counts, needs = table[:, 0], table[:, 1:].any(dim=0).tolist()
    if grad and needs[0] and not x.requires_grad:
        x = x.detach().requires_grad_()
    if grad and needs[1] and not topk_weights.requires_grad:
        topk_weights = topk_weights.detach().requires_grad_()
    offset, total = int(counts[:rank].sum()), int(counts.sum())
    capacity = expert_capacity(total, k, num_experts, capacity_factor)

    # this rank's slots, grouped by destination rank (stable: slot order inside a destination)
    ids = topk_ids.reshape(-1).long()
    if ids.numel() and bool(((ids < 0) | (ids >= num_experts)).any()):  # the splits below sync anyway
        raise ValueError(f"topk_ids: expert ids must be in [0, {num_experts}), got values in "
                         f"[{int(ids.min())}, {int(ids.max())}]")
    dest = ids // local_experts
    order = torch.argsort(dest, stable=True)
    send_counts = torch.bincount(dest, minlength=world)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=group)
    send_splits, recv_splits = send_counts.tolist(), recv_counts.tolist()

    slot_numbers = (offset * k + order).to(torch.int64)
    meta = torch.stack([ids[order] % local_experts, slot_numbers], dim=1)
    meta_recv = meta.new_empty(sum(recv_splits), 2)
    dist.all_to_all_single(meta_recv, meta, recv_splits, send_splits, group=group)
    local_ids, slot_recv = meta_recv[:, 0], meta_recv[:, 1]

    weights_recv = _AllToAll.apply(topk_weights.reshape(-1)[order], send_splits, recv_splits, group)
    # the dropped slots leave the batch before the rows travel on (as in one process: the FP8
    # weight gradient quantizes blocks of 128 rows, which must hold the same rows)
    kept = torch.nonzero(_kept(local_ids, slot_recv, weights_recv.detach(), local_experts, capacity,
                               drop_policy)).flatten()
    kept_weights, kept_ids = weights_recv[kept][:, None], local_ids[kept][:, None]
    if recipe is None or not fp8_dispatch:
        x_recv = _AllToAll.apply(_GatherSlots.apply(x, order, k), send_splits, recv_splits, group)
        y_kept = experts(x_recv[kept], kept_weights, kept_ids, w1, w2, recipe=recipe, capacity_factor=None,
                         activation=activation, check_ids=False)
    else:
        # the kept rows' codes and scales, and a stand-in for them that carries their gradient
        x_kept, codes, scales = _Dispatch.apply(x, order, k, send_splits, recv_splits, group, kept)
        x_codes = QuantizedTensor(codes.view(torch.float8_e4m3fn), scales, get_recipe(_ACT_RECIPE),
                                  tuple(codes.shape), x.dtype)
        _check_experts_args(x_kept, kept_weights, kept_ids, w1, w2, recipe, activation)
        y_kept = _dispatch_and_apply(x_kept, kept_weights, kept_ids, w1, w2, recipe, None, drop_policy, activation,
                                     False, x_codes)
    y_recv = y_kept.new_zeros(sum(recv_splits), y_kept.shape[1]).index_copy(0, kept, y_kept)
    y_rows = _AllToAll.apply(y_recv, recv_splits, send_splits, group)
    return _sum_slots(y_rows, order, tokens, k)


def _sum_slots(rows: torch.Tensor, order: torch.Tensor, tokens: int, k: int) -> torch.Tensor:
    """``rows[i]`` belongs to slot ``order[i]`` (token ``order[i] // k``): each token's k slots
    summed in slot order. Deterministic (no atomics, unlike ``index_add`` on a GPU) and
    differentiable."""
    slots = rows.new_empty(tokens * k, rows.shape[1]).index_copy(0, order, rows)
    return slots.view(tokens, k, rows.shape[1]).sum(dim=1)


def _check_args(x, topk_weights, topk_ids, w1, num_experts, world, drop_policy) -> None:
    if _check_size("num_experts", num_experts) % world:
        raise ValueError(f"num_experts: expected a positive multiple of the group size {world}, got {num_experts!r}")
    # checked here, before any collective: the experts' own checks see the received rows, not x
    if not isinstance(x, torch.Tensor) or x.dtype not in _X_DTYPES or x.dim() != 2:
        raise ValueError(f"x: expected a float32/bfloat16/float16 tensor [T, H], got "
                         f"{getattr(x, 'dtype', type(x))} {tuple(getattr(x, 'shape', ()))}")
    if not isinstance(topk_ids, torch.Tensor) or topk_ids.dtype not in (torch.int32, torch.int64) \
            or not isinstance(topk_weights, torch.Tensor) or not topk_weights.is_floating_point() \
            or topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0] or topk_weights.shape != topk_ids.shape:
        raise ValueError(f"topk_ids / topk_weights: expected int32/int64 and float [T={x.shape[0]}, k], got "
                         f"{getattr(topk_ids, 'dtype', type(topk_ids))} {tuple(getattr(topk_ids, 'shape', ()))} and "
                         f"{getattr(topk_weights, 'dtype', type(topk_weights))} "
                         f"{tuple(getattr(topk_weights, 'shape', ()))}")
    _check_top_k(topk_ids.shape[1], num_experts)  # as experts() and dispatch: k ≤ E
    # a 3-D tensor first: a 2-D w1's first size is no expert count (or, not a tensor, an AttributeError)
    if not isinstance(w1, (torch.Tensor, QuantizedTensor)) or w1.dim() != 3:
        raise ValueError(f"w1: expected this rank's experts [{num_experts // world}, 2F, H], got "
                         f"{type(w1).__name__} {tuple(getattr(w1, 'shape', ()))}")
    if w1.shape[0] != num_experts // world:
        raise ValueError(f"w1: expected this rank's {num_experts // world} experts, got {w1.shape[0]}")
    if drop_policy not in DROP_POLICIES:
        raise ValueError(f"drop_policy: expected one of {DROP_POLICIES}, got {drop_policy!r}")


def _kept(local_ids, slot_numbers, weights, local_experts: int, capacity: int | None, drop_policy: str):
    """Which received slots an expert keeps under the one-process rule (routing.dispatch):
    ``probs``: the highest combine weights, equal weights by lower slot number; ``position``: the
    lowest slot numbers; at most ``capacity`` per expert."""
    rows = local_ids.shape[0]
    if capacity is None:
        return torch.ones(rows, dtype=torch.bool, device=local_ids.device)
    order = torch.argsort(slot_numbers, stable=True)
    if drop_policy == "probs":
        # a descending sort, as dispatch's: NaN weights rank first there (argsort(-w) put them last)
        order = order[torch.sort(weights[order], descending=True, stable=True).indices]
    order = order[torch.argsort(local_ids[order], stable=True)]
    starts = torch.cumsum(torch.bincount(local_ids, minlength=local_experts), 0) - torch.bincount(
        local_ids, minlength=local_experts)
    position = torch.arange(rows, device=local_ids.device) - starts[local_ids[order]]
    kept = torch.empty(rows, dtype=torch.bool, device=local_ids.device)
    kept[order] = position < min(capacity, rows)  # a huge capacity (capacity_factor=1e30) need not fit an int64
    return kept


def _exchange(t: torch.Tensor, send_splits: list[int], recv_splits: list[int], group) -> torch.Tensor:
    """``all_to_all_single`` of rows: ``send_splits`` out, ``recv_splits`` in."""
    out = t.new_empty(sum(recv_splits), *t.shape[1:])
    dist.all_to_all_single(out, t.contiguous(), recv_splits, send_splits, group=group)
    return out


class _AllToAll(torch.autograd.Function):
    """:func:`_exchange` with autograd: the gradient takes the reverse route."""

    @staticmethod
    def forward(ctx, t, send_splits, recv_splits, group):
        ctx.splits, ctx.group = (send_splits, recv_splits), group
        return _exchange(t, send_splits, recv_splits, group)

    @staticmethod
    def backward(ctx, grad):
        send_splits, recv_splits = ctx.splits
        return _exchange(grad, recv_splits, send_splits, ctx.group), None, None, None


class _GatherSlots(torch.autograd.Function):
    """The row of each slot in ``order`` (token ``order // k``); the gradient sums each token's
    rows in slot order (:func:`_sum_slots`: the backward of plain indexing adds them with GPU
    atomics, in no fixed order)."""

    @staticmethod
    def forward(ctx, x, order, k):
        ctx.save_for_backward(order)
        ctx.tokens, ctx.k = x.shape[0], k
        return x[order // k]

    @staticmethod
    def backward(ctx, grad):
        (order,) = ctx.saved_tensors
        return _sum_slots(grad, order, ctx.tokens, ctx.k), None, None


class _Dispatch(torch.autograd.Function):
    """Token rows to the experts' ranks as E4M3 codes plus FP32 1x128 scales (each token quantized
    once, the rows gathered after), the received rows at ``kept`` only. Returns ``(stand_in, codes,
    scales)``: the experts compute on the codes and scales; ``stand_in`` (``[kept, H]`` in ``x``'s
    dtype, a broadcast zero: no memory) carries their input gradient, which comes back in ``x``'s
    dtype, summed per token."""

    @staticmethod
    def forward(ctx, x, order, k, send_splits, recv_splits, group, kept):
        ctx.save_for_backward(order, kept)
        ctx.splits, ctx.group, ctx.tokens, ctx.k = (send_splits, recv_splits), group, x.shape[0], k
        token_of_row = order // k
        if x.shape[0]:
            q = quantize(x, _ACT_RECIPE, check_finite=False)  # what the experts compute on
            codes = q.data.view(torch.uint8)[token_of_row].contiguous()
            scales = q.scale[token_of_row].contiguous()
        else:  # no tokens here: empty rows of the right widths
            codes = torch.empty(0, x.shape[1], dtype=torch.uint8, device=x.device)
            scales = torch.empty(0, -(-x.shape[1] // _SCALE_BLOCK), dtype=torch.float32, device=x.device)
        codes_kept = _exchange(codes, send_splits, recv_splits, group)[kept]
        scales_kept = _exchange(scales, send_splits, recv_splits, group)[kept]
        ctx.mark_non_differentiable(codes_kept, scales_kept)
        stand_in = x.new_zeros(()).expand(kept.shape[0], x.shape[1])
        return stand_in, codes_kept, scales_kept

    @staticmethod
    def backward(ctx, grad, _codes_grad, _scales_grad):
        order, kept = ctx.saved_tensors
        send_splits, recv_splits = ctx.splits
        received = grad.new_zeros(sum(recv_splits), grad.shape[1]).index_copy(0, kept, grad)
        back = _exchange(received, recv_splits, send_splits, ctx.group)
        return _sum_slots(back, order, ctx.tokens, ctx.k), None, None, None, None, None, None


class ExpertParallelMoE(nn.Module):
    """:class:`lowprec.moe.MoE` with its experts spread over the ranks of ``group``: rank ``r`` holds
    experts ``r·E/world .. (r+1)·E/world - 1`` (``w1``, ``w2``) and a copy of the router; tokens
    travel by :func:`expert_parallel_experts`. Every rank runs the same layer on its own tokens
    (any count, 0 included); together they compute what the one-process ``MoE`` computes on the
    concatenated batch.

    The router is replicated: its gradient on a rank comes from that rank's tokens only, so sum
    (or average) it over the group as data parallelism does (DDP / FSDP on the router, or
    ``all_reduce`` of ``router.weight.grad``). Build it with :meth:`from_moe` (this rank's share of
    a full layer) or directly (then initialise every rank's router alike). ``fp8_dispatch``: see
    :func:`expert_parallel_experts`.
    """

    def __init__(self, hidden_size: int, ffn_size: int, num_experts: int, top_k: int, *,
                 group: dist.ProcessGroup | None = None, capacity_factor: float | None = None,
                 activation: str = "swiglu", recipe: str | None = "fp8_block", score_func: str = "softmax",
                 renormalize: bool = True, drop_policy: str = "probs", fp8_dispatch: bool = True, device=None,
                 dtype=None) -> None:
        super().__init__()
        world = dist.get_world_size(group)
        _set_config(self, hidden_size, ffn_size, num_experts, top_k, capacity_factor, activation, recipe,
                    score_func, renormalize, drop_policy)
        num_experts = self.num_experts  # checked (a string would fail the % below as string formatting)
        if num_experts % world:
            raise ValueError(f"num_experts: expected a multiple of the group size {world}, got {num_experts}")
        self.recipe, self.group, self.fp8_dispatch = recipe, group, fp8_dispatch
        self.rank, self.world = dist.get_rank(group), world
        per = num_experts // world
        factory = {"device": device, "dtype": dtype}
        self.router = nn.Linear(hidden_size, num_experts, bias=False, **factory)
        self.w1 = nn.Parameter(torch.empty(per, 2 * ffn_size, hidden_size, **factory))
        self.w2 = nn.Parameter(torch.empty(per, hidden_size, ffn_size, **factory))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """As :meth:`MoE.reset_parameters <lowprec.moe.MoE.reset_parameters>`: router nn.Linear's default,
        this rank's experts uniform ±1/√fan_in (zeros would be a fixed point: no expert gradient)."""
        self.router.reset_parameters()
        nn.init.uniform_(self.w1, -1 / math.sqrt(self.hidden_size), 1 / math.sqrt(self.hidden_size))
        nn.init.uniform_(self.w2, -1 / math.sqrt(self.ffn_size), 1 / math.sqrt(self.ffn_size))

    @classmethod
    def from_moe(cls, moe: MoE, group: dist.ProcessGroup | None = None) -> ExpertParallelMoE:
        """This rank's share of ``moe`` (its router copied, its experts' weights sliced)."""
        if not isinstance(moe, MoE):  # as FP8InferenceMoE.from_moe (else an AttributeError on some attribute)
            raise TypeError(f"moe: expected a lowprec.moe.MoE, got {type(moe).__name__}")
        layer = cls(moe.hidden_size, moe.ffn_size, moe.num_experts, moe.top_k, group=group,
                    capacity_factor=moe.capacity_factor, activation=moe.activation, recipe=moe.recipe,
                    score_func=moe.score_func, renormalize=moe.renormalize, drop_policy=moe.drop_policy,
                    device=moe.w1.device, dtype=moe.w1.dtype)
        layer.router.to(moe.router.weight.dtype)  # the router keeps its own dtype (e.g. FP32 beside bf16 experts)
        per = moe.num_experts // layer.world
        mine = slice(layer.rank * per, (layer.rank + 1) * per)
        with torch.no_grad():
            layer.router.weight.copy_(moe.router.weight)
            layer.w1.copy_(moe.w1[mine])
            layer.w2.copy_(moe.w2[mine])
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., H]`` (this rank's tokens) to ``[..., H]``."""
        if not isinstance(x, torch.Tensor) or x.dim() < 1 or x.shape[-1] != self.hidden_size:  # 0-d: no shape[-1]
            raise ValueError(f"x: expected [..., H={self.hidden_size}], got {tuple(getattr(x, 'shape', ()))}")
        tokens, autocast_off = follow_autocast(x.reshape(-1, self.hidden_size))
        with autocast_off:  # the router stays FP32, as MoE's
            weights, ids = select_experts(F.linear(tokens.float(), self.router.weight.float()), self.top_k,
                                          score_func=self.score_func, renormalize=self.renormalize)
            y = expert_parallel_experts(tokens, weights, ids, self.w1, self.w2, num_experts=self.num_experts,
                                        group=self.group, recipe=self.recipe, capacity_factor=self.capacity_factor,
                                        drop_policy=self.drop_policy, activation=self.activation,
                                        fp8_dispatch=self.fp8_dispatch)
        return output_as(y, x.shape)

    def fp8_block_weights(self) -> tuple[str, ...]:
        """As :meth:`MoE.fp8_block_weights <lowprec.moe.MoE.fp8_block_weights>`: this rank's expert
        weights (:func:`lowprec.nn.enable_fp8_all_gather`)."""
        return ("w1", "w2") if self.recipe == "fp8_block" else ()

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, ffn_size={self.ffn_size}, num_experts={self.num_experts} "
                f"({self.num_experts // self.world} on rank {self.rank} of {self.world}), top_k={self.top_k}, "
                f"capacity_factor={self.capacity_factor}, recipe={self.recipe!r}")
