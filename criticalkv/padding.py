"""The one check of a left-padded prompt batch, shared by the PyTorch path and the runtime.

Every path pads a batch of prompts of different lengths on the left (padding first, then the tokens), so
that every sequence's observation window is the last positions of the batch.
"""

from __future__ import annotations

import numpy as np

LEFT_PADDING_ERROR = "attention_mask: prompts must be left-padded (padding first, then the tokens)"


def left_padded_lengths(mask) -> np.ndarray:
    """Lengths [B] int64 of the [B, n] attention mask (1 = token); ValueError when it is not left-padded."""
    mask = np.asarray(mask).astype(np.int64)
    if mask.ndim != 2:
        raise ValueError(f"attention_mask: expected [batch, n], got shape {mask.shape}")
    lengths = mask.sum(1)
    expected = np.arange(mask.shape[1])[None, :] >= (mask.shape[1] - lengths)[:, None]
    if not np.array_equal(mask.astype(bool), expected):
        raise ValueError(LEFT_PADDING_ERROR)
    return lengths
