"""Weights that reuse a freed weight's address, made on purpose rather than hoped for from the allocator."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch


def tensors_at_one_address(rows: int, cols: int, count: int, seed: int = 0) -> Iterator[torch.Tensor]:
    """Yield ``count`` float32 ``(rows, cols)`` tensors, each with new random values, the same address
    (``data_ptr``), the same shape and strides and version counter 0, and each on a storage of its own.

    This is what the allocator does when it hands a freed weight's block straight to the next weight of that size,
    which it does only some of the time. Each tensor must be dropped by the caller before the next is asked for:
    its values are overwritten (through numpy, so no version counter moves) when the next one is made."""
    buffer = bytearray(rows * cols * 4)
    values = np.frombuffer(buffer, dtype=np.float32)
    rng = np.random.default_rng(seed)
    for _ in range(count):
        values[:] = rng.standard_normal(rows * cols, dtype=np.float32)
        yield torch.frombuffer(buffer, dtype=torch.float32).view(rows, cols)
