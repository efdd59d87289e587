"""Independent references: plain mlx-lm on the model's own caches, no kvmem code."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from mlx_lm.generate import generate_step

from runtime.model.loaded import LoadedModel


def masked_greedy(limit: int):
    """A logits processor that forbids padded vocab rows (as kvmem's sampler does)."""

    def process(_tokens: mx.array, logits: mx.array) -> mx.array:
        if logits.shape[-1] <= limit:
            return logits
        pad = mx.full((*logits.shape[:-1], logits.shape[-1] - limit), -mx.inf, dtype=logits.dtype)
        return mx.concatenate([logits[..., :limit], pad], axis=-1)

    return process


def cold_generate(lm: LoadedModel, token_ids: list[int], steps: int) -> tuple[list[int], np.ndarray]:
    """Greedy tokens and per-step logprobs from ``mlx_lm.generate_step`` on a cold cache."""
    tokens, logprobs = [], []
    gen = generate_step(
        mx.array(token_ids),
        lm.model,
        max_tokens=steps,
        logits_processors=[masked_greedy(lm.vocab_limit)],
    )
    for token, lp in gen:
        tokens.append(int(token))
        logprobs.append(np.array(lp.astype(mx.float32)).reshape(-1))
    return tokens, np.stack(logprobs)


def teacher_forced_logits(lm: LoadedModel, caches: list, first_logits: mx.array, forced: list[int]) -> np.ndarray:
    """Logprobs at each step when feeding ``forced`` tokens through ``caches`` (B=1)."""
    rows = [first_logits.reshape(-1)]
    for tok in forced[:-1]:
        rows.append(lm.model(mx.array([[tok]]), cache=caches)[0, -1, :])
    out = []
    for r in rows:
        r = r.astype(mx.float32)
        lp = r - mx.logsumexp(r)
        out.append(np.array(masked_greedy(lm.vocab_limit)(None, lp)))
    return np.stack(out)


def top1_margin(logprobs: np.ndarray) -> np.ndarray:
    """Top-1 minus top-2 value per row."""
    part = np.sort(logprobs, axis=-1)
    return part[:, -1] - part[:, -2]


NEAR_TIE = 1e-3
"""Top-1 minus top-2 logit below which a reply may legitimately go either way.

Decoding in a batch computes each row's projections in a bigger matrix product
than decoding alone: logits then differ by ~2e-5 (MLX's attention and kvmem's
alike; tests/cpu/test_cpu_attention.py), which flips a greedy choice only where
the top two logits are that close. 1e-3 is 50x that noise."""


def first_split_is_a_near_tie(got: str, expected: str, tokens: list[str], margins: list[float]) -> bool:
    """Whether ``got`` equals ``expected`` or first departs from it at a step whose margin was a near tie.

    ``tokens`` are the reference reply's token texts in order, ``margins`` its
    top-1 minus top-2 logits per step.
    """
    if got == expected:
        return True
    at = next((i for i, (a, b) in enumerate(zip(got, expected, strict=False)) if a != b), min(len(got), len(expected)))
    joined = "".join(tokens)
    if joined[:1].isspace() and not expected[:1].isspace():
        at += len(joined) - len(joined.lstrip())  # a reply drops the space its first token starts with
    end = 0
    for step, text in enumerate(tokens):
        end += len(text)
        if at < end:
            return margins[step] < NEAR_TIE
    return False
