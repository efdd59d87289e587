"""Character-level prefix matching between a cached text and a new prompt.

A cache remembers the text it covers (prompt *and* generated reply) and, for
every token, the end offset of that token in the text. Tokens whose bytes form
one character share that character's end offset, so a cut between them is never
chosen. Matching on text rather than token ids survives re-tokenization: a reply
that contained byte-fallback tokens comes back as "\ufffd" and still matches, and
a template that renders an earlier turn differently costs only the changed tail.

Any common prefix is reused, whatever fraction of the cache it is: an agent CLI that
compacts its history keeps its system prompt, a client that edits a message three turns
back keeps everything before it. Trimming a cache is a slice, and the tokens it keeps
are tokens the turn does not prefill, so no fraction is worth declining (the seeds'
80% rule was never measured; ARCHITECTURE.md's decisions table has the measurement).

Where the texts part inside a word, the cut backs off to the start of that word
(:func:`word_start`): BPE and SentencePiece tokenizers begin a token at a word's
leading space, so the suffix then tokenizes as a cold prefill of the whole prompt
does, where a cut inside the word would prefill its tail as unusual tokens.
"""

from __future__ import annotations

import enum
from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["MatchKind", "PrefixMatch", "match_prefix", "common_prefix_length", "word_start", "WORD_BACKOFF"]


class MatchKind(str, enum.Enum):
    """How a prompt relates to a cached text."""

    EXACT = "exact"  # same text: reuse all but the last token (its logits are recomputed)
    EXTEND = "extend"  # prompt continues the cached text: reuse everything
    PARTIAL = "partial"  # the texts part: reuse up to the last whole token before the word where they do
    DIVERGE = "diverge"  # not one whole token in common: start cold
    EMPTY = "empty"  # nothing cached


@dataclass(frozen=True)
class PrefixMatch:
    """The result of matching: how many cached tokens to keep and where the new text starts."""

    kind: MatchKind
    reuse_tokens: int
    reuse_chars: int
    common_chars: int

    def suffix(self, prompt: str) -> str:
        """The part of ``prompt`` that must be tokenized and prefilled."""
        return prompt[self.reuse_chars :]


PREFIX_BLOCK = 4096
"""Items compared at once by :func:`common_prefix_length` before it halves the block that differs."""


def common_prefix_length(a: str | Sequence[int], b: str | Sequence[int]) -> int:
    """Length of the longest common prefix of two strings or two token-id sequences.

    Why not ``os.path.commonprefix``: it walks the items one by one in Python, about 3 ms for a
    16K-token conversation's text, on every turn's plan (on the trio thread, before the turn
    reaches the model). Here slices are compared a block at a time (C's comparison), then the
    first block that differs is halved until one item is left.
    """
    if type(a) is not type(b):
        a, b = list(a), list(b)  # a tuple never equals a list: compare like with like
    n = min(len(a), len(b))
    lo = 0  # a[:lo] == b[:lo]
    while lo < n:
        hi = min(lo + PREFIX_BLOCK, n)
        if a[lo:hi] != b[lo:hi]:
            break
        lo = hi
    else:
        return n
    while hi - lo > 1:  # the first difference is in [lo, hi)
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def _tokens_within(offsets: Sequence[int], chars: int) -> int:
    """How many leading tokens end at or before ``chars``."""
    return bisect_right(offsets, chars)


WORD_BACKOFF = 64
"""How far back :func:`word_start` looks for whitespace (a longer run, such as CJK text or a long
identifier, is cut where the texts part)."""


def word_start(text: str, cut: int) -> int:
    """Where the word holding position ``cut`` of ``text`` begins: the whitespace before it, or ``cut``.

    The whitespace itself is left to the suffix, since tokenizers attach a word's leading space to
    the word. ``cut`` itself when it is whitespace or no whitespace is within :data:`WORD_BACKOFF`.
    """
    for i in range(cut, max(cut - WORD_BACKOFF, 0) - 1, -1):
        if i < len(text) and text[i].isspace():
            return i
    return cut


def match_prefix(cached_text: str, offsets: Sequence[int], prompt: str) -> PrefixMatch:
    """Decide how much of a cache a prompt can reuse: every whole token of the common prefix.

    Args:
        cached_text: the text the cache covers.
        offsets: end offset in ``cached_text`` of each cached token (non-decreasing).
        prompt: the new prompt text.

    Returns:
        A :class:`PrefixMatch`. ``reuse_tokens`` always leaves at least one
        character of the prompt to prefill, since the next token's logits come
        from the last prefilled position. Where the texts part, only tokens that end
        before the word they part in are kept (:func:`word_start`).
    """
    if not offsets or not cached_text:
        return PrefixMatch(MatchKind.EMPTY, 0, 0, 0)
    common = common_prefix_length(cached_text, prompt)
    if common == len(cached_text) == len(prompt):
        kind = MatchKind.EXACT
    elif common == len(cached_text):
        kind = MatchKind.EXTEND
    else:
        kind = MatchKind.PARTIAL
    # Keep tokens that end strictly inside the prompt so at least one token is prefilled.
    budget = min(common, len(prompt) - 1)
    if kind is MatchKind.PARTIAL and common < len(prompt):
        budget = min(budget, word_start(prompt, common))
    keep = _tokens_within(offsets, budget)
    if keep == 0:
        return PrefixMatch(MatchKind.DIVERGE, 0, 0, common)
    if kind is MatchKind.EXTEND and keep < len(offsets):
        kind = MatchKind.PARTIAL
    return PrefixMatch(kind, keep, offsets[keep - 1], common)
