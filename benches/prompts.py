"""Prompts of a given token length for the default model, from the corpus kvmem ships.

Each prompt starts with a unique label so that two agents never share a cached
256-token block by accident (kvmem shares identical prefixes across agents).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path

from benches.harness import ROOT

CORPUS = ROOT / "runtime" / "corpus"


@lru_cache(maxsize=4)
def _tokenizer(model_folder: str):  # type: ignore[no-untyped-def]
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(Path(model_folder) / "tokenizer.json"))


@lru_cache(maxsize=1)
def _corpus() -> str:
    names = ("stories.txt", "dialogue.txt", "essays.txt", "data.txt", "code.txt")
    return "\n\n".join((CORPUS / n).read_text() for n in names)


def count_tokens(model_folder: Path, text: str) -> int:
    return len(_tokenizer(str(model_folder)).encode(text, add_special_tokens=False).ids)


def context_text(model_folder: Path, tokens: int, *, label: str, offset: int = 0) -> str:
    """About ``tokens`` tokens of corpus text after a unique ``label`` line (cut on a token boundary)."""
    tok = _tokenizer(str(model_folder))
    corpus = _corpus()
    body = corpus[offset % len(corpus):] + corpus
    head = f"Session {label}. Read the notes below, then answer.\n\n"
    enc = tok.encode(head + body[: tokens * 8], add_special_tokens=False)
    end = enc.offsets[min(tokens, len(enc.offsets)) - 1][1]
    return (head + body)[:end]


def sized_text(count: Callable[[str], int], tokens: int, *, label: str, offset: int = 0) -> str:
    """About ``tokens`` tokens of corpus text after a unique ``label`` line, as ``count`` tokenizes it.

    ``count`` is any tokenizer's token count (a server's own ``/tokenize``, a
    Hugging Face tokenizer), so that servers with different tokenizers each get
    a conversation of the same size in their own tokens. The text is cut at a
    word boundary: the longest prefix (binary search over the boundaries) that
    ``count`` puts at ``tokens`` or fewer. Tokenizers that agree give the same text.
    """
    corpus = _corpus()
    head = f"Session {label}. Read the notes below, then answer.\n\n"
    body = (corpus[offset % len(corpus):] + corpus)[: tokens * 8]
    bounds = [m.start() for m in re.finditer(r"\s+", body)] + [len(body)]
    lo, hi = 0, len(bounds) - 1  # invariant: the cut at bounds[lo] fits (or lo == 0)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if count(head + body[: bounds[mid]]) <= tokens:
            lo = mid
        else:
            hi = mid - 1
    return head + body[: bounds[lo]]
