"""Constrained decoding: a reply sampled under a grammar, with llguidance.

kvmem does not parse or check JSON itself while sampling. A turn that needs its reply to
have a shape (a tool call in :mod:`runtime.reply.generic_tools`' format, OpenAI's
``response_format``) carries a Lark grammar (with ``%json`` for JSON Schemas, as
llguidance extends Lark; written by :mod:`runtime.reply.reply_format`); each of its sequences gets a :class:`ReplyGrammar`, an
llguidance ``LLMatcher`` over the model's vocabulary. Why llguidance and not
outlines-core or xgrammar: ``benches/results/grammar_engines.md``.

* Before each token, :func:`mask_rows` asks every constrained row of a batch for its
  mask at once (llguidance's ``LLExecutor``, in parallel threads) and sets what the
  grammar forbids to ``-inf``; rows without a grammar pass unchanged, so constrained and
  free rows decode in one batch and one argmax.
* :meth:`ReplyGrammar.consume` follows each accepted token. When the grammar is
  complete only the end-of-sequence tokens are allowed, so the reply ends there.
* :class:`ReplyGrammar` is also an mlx-lm logits processor (``processor(tokens, logits)``),
  so ``mlx_lm.generate`` can decode one sequence under the same grammar (the tests
  compare both).

Everything here runs on the MLX thread.
"""

from __future__ import annotations

import logging
from typing import Any

import llguidance
import llguidance.hf
import llguidance.numpy
import mlx.core as mx
import numpy as np

__all__ = ["GrammarVocabulary", "ReplyGrammar", "mask_rows"]

log = logging.getLogger("kvmem.grammar")

_EXECUTOR: llguidance.LLExecutor | None = None


def _executor() -> llguidance.LLExecutor:
    global _EXECUTOR
    if _EXECUTOR is None:
        _EXECUTOR = llguidance.LLExecutor()
    return _EXECUTOR


class GrammarVocabulary:
    """A model's vocabulary as llguidance sees it (built once per model: ~0.5 s for 49K tokens).

    Args:
        hf_tokenizer: the model's Hugging Face fast tokenizer.
        n_vocab: the width of the model's logits (embedding rows past the tokenizer's
            last id are never allowed).
        eos_token_ids: the tokens that end a reply; a complete grammar allows only these.
    """

    def __init__(self, hf_tokenizer: Any, n_vocab: int, eos_token_ids: list[int]) -> None:
        self.n_vocab = n_vocab
        self.tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=n_vocab, eos_token=eos_token_ids)


class ReplyGrammar:
    """One sequence's reply under a grammar: the llguidance matcher that follows its tokens.

    Raises:
        ValueError: the grammar does not compile (llguidance's message).
    """

    def __init__(self, vocabulary: GrammarVocabulary, grammar: str) -> None:
        self.vocabulary = vocabulary
        self.matcher = llguidance.LLMatcher(vocabulary.tokenizer, grammar, log_level=0)
        if self.matcher.is_error():
            raise ValueError(self.matcher.get_error())
        self._fed = False  # as an mlx-lm logits processor: whether a call came before (its token is new)

    def consume(self, token: int) -> None:
        """Advance past ``token``, a token the mask allowed (one it did not is logged and ends the grammar)."""
        if not self.matcher.is_stopped() and not self.matcher.consume_token(token):
            log.warning("token %d broke the reply's grammar: %s", token, self.matcher.get_error())

    @property
    def complete(self) -> bool:
        """Whether the reply so far is a whole sentence of the grammar."""
        return self.matcher.is_accepting()

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        """mlx-lm's logits-processor interface: ``tokens`` so far (the last one new), ``logits`` ``(1, V)``.

        mlx-lm calls a processor before sampling each token, with every token so far
        (prompt included); the grammar follows the generated ones, so this consumes the
        last token from the second call on.
        """
        if self._fed:
            self.consume(int(tokens[-1].item()))
        self._fed = True
        return mask_rows([self], logits)


def mask_rows(grammars: list[ReplyGrammar | None], logits: mx.array) -> mx.array:
    """``logits`` ``(B, V)`` with each constrained row's forbidden tokens at ``-inf`` (row i: ``grammars[i]``).

    One mask computation for the batch: llguidance fills every constrained row's bitmask in
    parallel, the bits are unpacked on the host (``B x V`` bytes) and applied with one
    ``mx.where``. Rows whose grammar is None are left as they are.
    """
    rows = [(g.matcher, i) for i, g in enumerate(grammars) if g is not None]
    if not rows:
        return logits
    vocabulary = next(g for g in grammars if g is not None).vocabulary
    bitmask = llguidance.numpy.allocate_token_bitmask(len(grammars), vocabulary.n_vocab)
    llguidance.numpy.fill_next_token_bitmask_par(_executor(), rows, bitmask)
    allowed = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little")
    width = logits.shape[-1]
    if allowed.shape[1] < width:
        allowed = np.pad(allowed, ((0, 0), (0, width - allowed.shape[1])))
    return mx.where(mx.array(allowed[:, :width].astype(np.bool_)), logits, mx.array(-float("inf"), logits.dtype))
