"""Character-level prefix matching between a cached text and a new prompt.

A cache remembers the text it covers (prompt *and* generated reply) and, for
every token, the end offset of that token in the text. Tokens whose bytes form
one character share that character's end offset, so a cut between them is never
chosen. Matching on text rather than token ids survives re-tokenization: a reply
that contained byte-fallback tokens comes back as "\ufffd" and still matches, and
a template that renders an earlier turn differently costs only the changed tail.
"""

from __future__ import annotations

import enum
from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["MatchKind", "PrefixMatch", "match_prefix", "common_prefix_length"]


class MatchKind(str, enum.Enum):
    """How a prompt relates to a cached text."""

    EXACT = "exact"  # same text: reuse all but the last token (its logits are recomputed)
    EXTEND = "extend"  # prompt continues the cached text: reuse everything
    PARTIAL = "partial"  # ≥ threshold of the cached text in common: reuse up to the last whole token
    DIVERGE = "diverge"  # too little in common: start cold
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


def match_prefix(
    cached_text: str,
    offsets: Sequence[int],
    prompt: str,
    *,
    partial_threshold: float = 0.8,
) -> PrefixMatch:
    """Decide how much of a cache a prompt can reuse.

    Args:
        cached_text: the text the cache covers.
        offsets: end offset in ``cached_text`` of each cached token (non-decreasing).
        prompt: the new prompt text.
        partial_threshold: minimum fraction of ``cached_text`` that must be common
            for a PARTIAL reuse.

    Returns:
        A :class:`PrefixMatch`. ``reuse_tokens`` always leaves at least one
        character of the prompt to prefill, since the next token's logits come
        from the last prefilled position.
    """
    if not offsets or not cached_text:
        return PrefixMatch(MatchKind.EMPTY, 0, 0, 0)
    common = common_prefix_length(cached_text, prompt)
    if common == len(cached_text) == len(prompt):
        kind = MatchKind.EXACT
    elif common == len(cached_text):
        kind = MatchKind.EXTEND
    elif common >= partial_threshold * len(cached_text):
        kind = MatchKind.PARTIAL
    else:
        return PrefixMatch(MatchKind.DIVERGE, 0, 0, common)
    # Keep tokens that end strictly inside the prompt so at least one token is prefilled.
    budget = min(common, len(prompt) - 1)
    keep = _tokens_within(offsets, budget)
    if kind is MatchKind.EXTEND and keep < len(offsets):
        kind = MatchKind.PARTIAL
    chars = offsets[keep - 1] if keep else 0
    return PrefixMatch(kind, keep, chars, common)
