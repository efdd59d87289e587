"""A turn's plan: what it reuses, from where, and what it prefills.

A :class:`TurnPlan` says what one turn reuses, from where (:data:`CacheSource`), and what it
prefills. It is decided once per turn by :class:`runtime.plan.kv_manager.KVCacheManager` (the
prefix match against the agent's own cache, else another agent's prefix) and then carried,
unchanged, to the engine: nobody downstream matches the prompt again. The engine tokenizes only
``plan.suffix(prompt)``, once (:class:`Tokenized`). Pure (msgspec and the standard library).
"""

from __future__ import annotations

from typing import Literal, Protocol

import msgspec

from runtime.plan.prefix import MatchKind
from runtime.spec import CacheSnapshot

__all__ = ["ParkedView", "Tier", "ColdStart", "FromHot", "FromWarm", "FromShared", "CacheSource", "OwnCache", "TurnPlan", "COLD", "Tokenized"]


Tier = Literal["hot", "warm", "remote", "shared", "cold"]
"""Where a turn's starting cache came from: the agent's hot (RAM) or warm (disk)
cache, its cache another node published in the shared tier (remote: Redis),
another agent's cache via a shared prefix, or nothing."""


class ParkedView(Protocol):
    """What code off the MLX thread may read of a parked cache.

    :class:`runtime.kv.kvstate.ParkedCache` satisfies it; the arrays it holds are
    MLX arrays that only the MLX thread computes with. Everything else only passes
    the object along and reads these plain attributes.
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


class ColdStart(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """No cache: prefill the whole prompt."""


class FromHot(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """The agent's own parked cache from the hot tier."""

    parked: ParkedView


class FromWarm(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """The agent's own cache read from disk (numpy); restored on the MLX thread.

    ``prepared``: the same cache already restored (:meth:`Engine.prepare`, at start), or None.
    """

    snapshot: CacheSnapshot
    prepared: ParkedView | None = None


class FromShared(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """The first ``reuse_tokens`` tokens (whole blocks) of another agent's cache.

    ``donor`` is that agent; ``parked`` its hot cache, or the prompt of its turn
    still in flight. Only text the requesting agent sent itself is covered: the
    donor's text up to ``reuse_tokens`` is a prefix of the new prompt.
    """

    parked: ParkedView
    reuse_tokens: int
    donor: str


CacheSource = ColdStart | FromHot | FromWarm | FromShared


class OwnCache(msgspec.Struct, frozen=True, kw_only=True):
    """The agent's own cache a turn may start from, as the store found it when the turn began.

    ``source``: its hot cache, or its cache read from disk; ``tier``: where it came from
    (``hot``, ``warm``, or ``remote`` when it was just pulled from the shared tier).
    The GPU actor matches the rendered prompt against it
    (:meth:`runtime.plan.kv_manager.KVCacheManager.plan`).
    """

    source: FromHot | FromWarm
    tier: Tier


class TurnPlan(msgspec.Struct, frozen=True, kw_only=True):
    """One turn's reuse decision.

    Attributes:
        tier: where the reused cache comes from (``cold`` when nothing is reused).
        source: the cache itself.
        match: how the prompt matched it (:class:`runtime.plan.prefix.MatchKind` value).
        reuse_tokens: leading tokens of ``source`` the turn keeps.
        reuse_chars: characters of the prompt those tokens cover; the rest,
            ``prompt[reuse_chars:]``, is tokenized and prefilled.
    """

    tier: Tier
    source: CacheSource
    match: str
    reuse_tokens: int
    reuse_chars: int

    def suffix(self, prompt: str) -> str:
        """The part of ``prompt`` to tokenize and prefill."""
        return prompt[self.reuse_chars :]


COLD = TurnPlan(tier="cold", source=ColdStart(), match=MatchKind.EMPTY.value, reuse_tokens=0, reuse_chars=0)
"""The plan of a turn with nothing cached."""


class Tokenized(msgspec.Struct, frozen=True, kw_only=True):
    """A plan's suffix, tokenized once: token ids and each token's end offset in the suffix."""

    ids: tuple[int, ...]
    ends: tuple[int, ...]
