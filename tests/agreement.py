"""One turn decoded two ways (alone, and batched or grouped) compared: logits, tokens, parked caches."""

from __future__ import annotations

import numpy as np

from reference import top1_margin


def logprobs_of(trace, limit: int) -> np.ndarray:
    """A sequence's ``logits_trace`` as log-probabilities over the first ``limit`` ids, one row per step."""
    rows = [np.array(t.reshape(-1))[:limit] for t in trace]
    rows = [r - np.logaddexp.reduce(r) for r in rows]
    return np.stack(rows)


def assert_decoded_alike(alone, other, limit: int, atol: float) -> None:
    """``other`` decoded ``alone``'s turn: log-probs within ``atol``, the same tokens up to the
    first near tie (top-1 margin 0.1), the same parked tokens and text, and Q4 data alike."""
    la, lb = logprobs_of(alone.logits_trace, limit), logprobs_of(other.logits_trace, limit)
    n = min(len(la), len(lb))
    np.testing.assert_allclose(lb[:n], la[:n], atol=atol)
    confident = top1_margin(la[:n]) > 0.1
    first_tie = int(np.argmin(confident)) if not confident.all() else n
    assert other.generated[:first_tie] == alone.generated[:first_tie]
    pa, pb = alone.park(), other.park()
    assert pa is not None and pb is not None and pa.token_ids == pb.token_ids and pa.text == pb.text
    for x_layer, y_layer in zip(pa.layers, pb.layers, strict=True):
        for key in x_layer.arrays:
            x = np.array(x_layer.arrays[key]).astype(np.float64)
            y = np.array(y_layer.arrays[key]).astype(np.float64)
            if key.endswith("_w"):
                assert (x != y).mean() < 0.02  # packed nibbles: rare flips from float reordering
            else:
                np.testing.assert_allclose(y, x, atol=5e-3)
