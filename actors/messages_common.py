"""Message types every mailbox shares: the tagged ``Failed`` reply (and ``HotCache``, re-exported).

Every request/reply in kvmem is a frozen, keyword-only, tagged
:class:`msgspec.Struct`. A request carries its own one-shot reply channel; an
actor that cannot serve a request answers :class:`Failed` on it instead of
raising across actors.
"""

from __future__ import annotations

import msgspec

from runtime.plan.contract import HotCache

__all__ = ["Failed", "HotCache", "failed_from", "Message"]


class Message(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """Base of every actor message: frozen, keyword-only, tagged with its class name."""


class Failed(Message, frozen=True, kw_only=True):
    """A request could not be served.

    Attributes:
        kind: the exception class name (``BudgetExceededError``, ``ModelError``,
            ``ValueError``, ...), so the API can re-raise the right type.
        error: a human-readable message.
    """

    kind: str
    error: str


def failed_from(exc: BaseException) -> Failed:
    """A :class:`Failed` reply describing ``exc``."""
    return Failed(kind=type(exc).__name__, error=str(exc) or type(exc).__name__)
