"""The training benchmarks' real text: the standard library's sources as bytes."""

import pytest
import torch

from lowprec.bench.corpus import random_windows, stdlib_bytes


def test_stdlib_bytes_split_and_windows():
    train, held = stdlib_bytes()
    assert train.dtype == torch.long and len(train) > 1_000_000 and 0 < len(held) < len(train) / 10
    assert int(train.max()) < 256 and bytes(train[:1000].tolist()).isascii()
    x, y = random_windows(train, 3, 64, torch.Generator().manual_seed(0))
    assert x.shape == y.shape == (3, 64)
    assert torch.equal(x[:, 1:], y[:, :-1])  # targets are the next tokens
    with pytest.raises(ValueError, match="data"):
        random_windows(train[:10], 1, 64, torch.Generator())
