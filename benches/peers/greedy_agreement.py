"""Greedy agreement between kvmem and llama.cpp: kvmem's side of ``benches.peers.vs_llama_cpp``.

kvmem runs its loaded mlx-lm model with a float KV cache (mlx-lm's
``make_prompt_cache``) and argmax, greedily and teacher-forced along
llama.cpp's continuations; :class:`Comparison` holds one kvmem variant against
one llama.cpp configuration. |d| (:meth:`Comparison.pair_noise`,
:func:`gap_differences`, :func:`llama_vs_llama`) is how much two runs disagree
on the logit gap between llama.cpp's two top tokens at a step (steps whose
probabilities the server does not report are left out).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from benches.peers.llama_cpp import LlamaRun

__all__ = ["KvmemStep", "Comparison", "kvmem_greedy", "kvmem_forced", "first_divergence", "gap_differences",
           "perturbed_embeddings", "llama_vs_llama"]


@dataclass
class KvmemStep:
    """kvmem's next-token distribution at one step, reduced to what the report needs."""

    token: int  # argmax
    margin: float  # logit(top-1) - logit(top-2)
    logprobs: np.ndarray = field(repr=False)


def _step(logits: Any, vocab: int) -> KvmemStep:
    x = np.asarray(logits, dtype=np.float32)[:vocab].astype(np.float64)
    first, second = sorted(np.argpartition(-x, 2)[:2].tolist(), key=lambda i: (-x[i], i))
    lp = x - (x.max() + np.log(np.exp(x - x.max()).sum()))
    return KvmemStep(token=int(first), margin=float(x[first] - x[second]), logprobs=lp)


def kvmem_greedy(lm: Any, ids: list[int], n: int) -> list[KvmemStep]:
    """Greedy continuation with a float KV cache; stops after an end-of-sequence token or ``n`` tokens."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(lm.model)
    logits = lm.model(mx.array([ids]), cache=cache)[0, -1].astype(mx.float32)
    steps: list[KvmemStep] = []
    while True:
        mx.eval(logits)
        steps.append(_step(logits, lm.vocab_limit))
        if len(steps) == n or steps[-1].token in lm.eos_token_ids:
            return steps
        logits = lm.model(mx.array([[steps[-1].token]]), cache=cache)[0, -1].astype(mx.float32)


def kvmem_forced(lm: Any, ids: list[int], continuation: list[int]) -> list[KvmemStep]:
    """kvmem's distribution at every step of ``continuation`` (teacher-forced, one forward pass)."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    seq = ids + continuation[:-1]
    logits = lm.model(mx.array([seq]), cache=make_prompt_cache(lm.model))[0, len(ids) - 1:].astype(mx.float32)
    mx.eval(logits)
    return [_step(logits[i], lm.vocab_limit) for i in range(len(continuation))]


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """First index where ``a`` and ``b`` differ (the shorter length if one is a prefix), None if equal."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


@dataclass
class Comparison:
    """Greedy continuations of one kvmem variant against one llama.cpp configuration.

    ``forced`` holds kvmem's distributions teacher-forced along llama.cpp's
    continuations, so every llama.cpp step has a kvmem counterpart on the same prefix.
    """

    variant: str
    config: str
    runs: list[LlamaRun]
    greedy: list[list[KvmemStep]]
    forced: list[list[KvmemStep]]

    @property
    def label(self) -> str:
        return f"{self.variant} vs {self.config}"

    def agree(self) -> list[int]:
        """Per prompt, how many tokens match before the first divergence."""
        out: list[int] = []
        for run, mine in zip(self.runs, self.greedy, strict=True):
            div = first_divergence([s.token for s in mine], run.tokens)
            out.append(len(run.tokens) if div is None else div)
        return out

    def identical(self) -> int:
        """How many continuations match in full."""
        return sum(first_divergence([s.token for s in m], r.tokens) is None
                   for r, m in zip(self.runs, self.greedy, strict=True))

    def top1(self) -> tuple[int, int]:
        """Teacher-forced steps where kvmem's argmax is llama.cpp's token, and all steps."""
        pairs = [(s.token, run.tokens[i]) for run, fs in zip(self.runs, self.forced, strict=True)
                 for i, s in enumerate(fs)]
        return sum(a == b for a, b in pairs), len(pairs)

    def pair_noise(self) -> np.ndarray:
        """|d| at every teacher-forced step: how much the engines disagree on llama.cpp's top-2 logit gap."""
        out: list[float] = []
        for run, fs in zip(self.runs, self.forced, strict=True):
            for i, s in enumerate(fs):
                if not run.top[i]:
                    continue
                (a, _), (b, _) = run.top[i][:2]
                out.append(abs(float(s.logprobs[a] - s.logprobs[b]) - run.margin(i)))
        return np.array(out)


def gap_differences(runs: list[LlamaRun], a: list[list[KvmemStep]], b: list[list[KvmemStep]]) -> np.ndarray:
    """|d| between two kvmem runs over the same steps, on llama.cpp's top-2 tokens of each step."""
    out: list[float] = []
    for run, fa, fb in zip(runs, a, b, strict=True):
        for i, (sa, sb) in enumerate(zip(fa, fb, strict=True)):
            if not run.top[i]:
                continue
            (x, _), (y, _) = run.top[i][:2]
            out.append(abs(float(sa.logprobs[x] - sa.logprobs[y]) - float(sb.logprobs[x] - sb.logprobs[y])))
    return np.array(out)


@contextmanager
def perturbed_embeddings(lm: Any, relative: float) -> Iterator[None]:
    """Add Gaussian noise of ``relative`` times each entry's size to the embedding table, then undo it.

    The table is also the tied output layer; the seed is fixed, so runs repeat.
    """
    import mlx.core as mx

    emb = lm.model.model.embed_tokens
    weight = emb.weight
    noise = np.random.default_rng(0).standard_normal(weight.shape).astype(np.float32)
    emb.weight = weight + mx.array(noise) * relative * mx.abs(weight)
    try:
        yield
    finally:
        emb.weight = weight


def llama_vs_llama(a: list[LlamaRun], b: list[LlamaRun]) -> tuple[list[int], int, np.ndarray]:
    """Agreeing prefixes, identical count and |d| (on each shared prefix) between two llama.cpp configurations."""
    agree: list[int] = []
    noise: list[float] = []
    identical = 0
    for ra, rb in zip(a, b, strict=True):
        div = first_divergence(ra.tokens, rb.tokens)
        identical += div is None
        agree.append(len(ra.tokens) if div is None else div)
        for i in range(min(agree[-1] + 1, len(ra.tokens), len(rb.tokens))):
            if not ra.top[i] or not rb.top[i]:
                continue
            (x, lx), (y, ly) = ra.top[i][:2]
            other = dict(rb.top[i])
            if x in other and y in other:
                noise.append(abs((other[x] - other[y]) - (lx - ly)))
    return agree, identical, np.array(noise)
