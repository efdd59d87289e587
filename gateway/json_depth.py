"""How deeply a JSON body nests, measured on its bytes before anything decodes it.

msgspec (and the json module, Jinja, the grammar engines after it) recurse once per level
of nesting: 100,000 levels in a field typed ``Any`` (Anthropic ``metadata``, a tool's
schema, a ``response_format``) raise ``RecursionError`` deep inside a decoder. The
gateway measures the depth first and refuses a body deeper than :data:`MAX_JSON_DEPTH`
with a 400, so no decoder ever sees one.

The count runs at C speed over the bytes: strings are cut out by one regular expression
(brackets inside them do not nest), then the brackets left are summed as +1 / -1.
A malformed body (an unclosed string, unbalanced brackets) is measured as well as it
can be and left for the decoder to refuse.
"""

from __future__ import annotations

import re

import numpy as np

__all__ = ["MAX_JSON_DEPTH", "json_depth"]

MAX_JSON_DEPTH = 64
"""Deepest nesting of objects and arrays a request body may have. Real requests stay far
below it: a chat body nests about 6 levels, a tool's JSON schema a dozen more."""

_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)  # unrolled: runs of plain bytes in one step
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_OPENING = (ord("["), ord("{"))


def json_depth(body: bytes) -> int:
    """The deepest nesting of objects and arrays in ``body`` (0 for a scalar)."""
    brackets = _STRING.sub(b"", body).translate(None, _NOT_BRACKETS)
    if not brackets:
        return 0
    codes = np.frombuffer(brackets, dtype=np.uint8)
    steps = np.where(np.isin(codes, _OPENING), 1, -1).astype(np.int32)
    return int(np.cumsum(steps).max())
