"""Token batches for language-model training, as ``loom-run --data`` reads them."""

from __future__ import annotations

import numpy as np


def token_batch(data: np.ndarray, step: int, batch: int, seq: int) -> tuple[np.ndarray, np.ndarray]:
    """The tokens and targets of training step ``step`` (from 1) in ``data``.

    Example ``j`` reads ids ``[o, o + seq)`` as tokens and ``[o + 1, o + seq + 1)``
    as targets, with ``o = ((step - 1) * batch + j) * seq mod (len(data) - seq)``:
    the windows ``loom-run BUNDLE --data FILE`` trains on (docs/training.md), so
    a Python loop and ``loom-run`` see the same batches. Returns two int32 arrays
    of shape ``(batch, seq)``.
    """
    data = np.asarray(data)
    if data.ndim != 1:
        raise ValueError(f"token data must be one-dimensional, got shape {data.shape}")
    if step < 1 or batch < 1 or seq < 1:
        raise ValueError(f"step, batch and seq must be positive, got {step}, {batch}, {seq}")
    if len(data) < batch * seq + 1:
        raise ValueError(
            f"{len(data)} tokens are fewer than one batch of {batch} x {seq} plus one target")
    span = len(data) - seq
    offsets = ((step - 1) * batch + np.arange(batch, dtype=object)) * seq % span
    index = offsets.astype(np.int64)[:, None] + np.arange(seq)
    return data[index].astype(np.int32), data[index + 1].astype(np.int32)
