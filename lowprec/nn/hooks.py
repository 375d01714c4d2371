"""A module's forward and backward hooks, carried over when :func:`~lowprec.nn.convert` swaps it for
a layer with the same call and outputs (``nn.Linear`` -> FP8 layers, a SwiGLU MLP -> fused, a
transformers MoE block -> a lowprec ``MoE``, a lowprec ``MoE`` -> an inference MoE)."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

# the registries of register_forward_pre_hook / register_forward_hook / register_full_backward_(pre_)hook
_HOOK_DICTS = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks", "_forward_hooks_with_kwargs",
               "_forward_hooks_always_called", "_backward_pre_hooks", "_backward_hooks")
_CALLED_HOOKS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")


def has_hooks(module: nn.Module, ignore: Callable[[Callable], bool] | None = None) -> bool:
    """Whether ``module`` has forward or backward hooks of its own (those ``ignore`` accepts aside)."""
    if ignore is None:
        return any(getattr(module, name, None) for name in _CALLED_HOOKS)
    return any(not ignore(hook) for name in _CALLED_HOOKS for hook in getattr(module, name, {}).values())


def carry_hooks(old: nn.Module, new: nn.Module) -> nn.Module:
    """``new`` with ``old``'s hooks first, then its own; the hooks' handles keep working (their
    registries are ``old``'s, which ``new`` now holds). Returns ``new``."""
    if new is old or not has_hooks(old):
        return new
    for name in _HOOK_DICTS:
        hooks = getattr(old, name)
        hooks.update(getattr(new, name))
        setattr(new, name, hooks)
    if old._backward_hooks:
        new._is_full_backward_hook = old._is_full_backward_hook
    return new
