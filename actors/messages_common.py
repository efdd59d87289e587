"""Message types every mailbox shares: the tagged ``Failed`` reply and the hot-cache protocol.

Every request/reply in kvmem is a frozen, keyword-only, tagged
:class:`msgspec.Struct`. A request carries its own one-shot reply channel; an
actor that cannot serve a request answers :class:`Failed` on it instead of
raising across actors.
"""

from __future__ import annotations

from typing import Protocol

import msgspec

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


class HotCache(Protocol):
    """What actors other than the GPU actor may read of a parked cache.

    :class:`runtime.kvstate.ParkedCache` satisfies it; the arrays it holds are
    MLX arrays that only the MLX thread computes with. Other actors only pass
    the object along and read these plain attributes.
    """

    @property
    def model_tag(self) -> str: ...

    @property
    def text(self) -> str: ...

    @property
    def token_ids(self) -> tuple[int, ...]: ...

    @property
    def offsets(self) -> tuple[int, ...]: ...

    @property
    def num_tokens(self) -> int: ...

    @property
    def nbytes(self) -> int: ...
