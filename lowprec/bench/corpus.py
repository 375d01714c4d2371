"""Real text for the training benchmarks: the Python standard library's own source files, as bytes."""

from __future__ import annotations

import glob
import os

import torch

__all__ = ["stdlib_bytes", "random_windows"]


def stdlib_bytes(device="cpu", held_out: float = 0.05) -> tuple[torch.Tensor, torch.Tensor]:
    """The standard library's top-level ``.py`` files (sorted by name) as one int64 token stream
    (a byte is a token): ``(train, held_out)``, the last ``held_out`` fraction held out."""
    root = os.path.dirname(os.__file__)
    paths = sorted(glob.glob(os.path.join(root, "*.py")))
    if not paths:
        raise RuntimeError(f"no .py files under {root}: the standard library sources are needed")
    data = b"".join(open(p, "rb").read() for p in paths)
    tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device=device, dtype=torch.long)
    cut = int(len(tokens) * (1 - held_out))
    return tokens[:cut], tokens[cut:]


def random_windows(data: torch.Tensor, batch: int, length: int, generator: torch.Generator
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """``batch`` windows of ``length + 1`` tokens at random offsets (drawn on the CPU from
    ``generator``): ``(inputs [batch, length], next-token targets [batch, length])``."""
    if len(data) <= length + 1:
        raise ValueError(f"data: {len(data)} tokens, need more than {length + 1}")
    starts = torch.randint(0, len(data) - length - 1, (batch,), generator=generator).tolist()
    x = torch.stack([data[s:s + length + 1] for s in starts])
    return x[:, :-1], x[:, 1:]
