"""What one turn reuses, from where, and what it prefills: the plan every layer executes.

A :class:`TurnPlan` is decided once per turn by :class:`runtime.kv_manager.KVCacheManager`
(prefix match against the agent's own cache, else a whole-block prefix of another
agent's) and then carried, unchanged, by the agent actor to the GPU actor and the
engine: nobody downstream matches the prompt again. The engine tokenizes only
``plan.suffix(prompt)``, once (:class:`Tokenized`).

Pure data (msgspec and the standard library): the actors and the engine both
import it, and it imports neither trio nor mlx.
"""

from __future__ import annotations

from typing import Literal, Protocol

import msgspec

from runtime.prefix import MatchKind
from runtime.snapshot import CacheSnapshot

__all__ = [
    "HotCache",
    "SamplingOptions",
    "Tier",
    "ColdStart",
    "FromHot",
    "FromWarm",
    "FromShared",
    "CacheSource",
    "TurnPlan",
    "Tokenized",
    "COLD",
]

Tier = Literal["hot", "warm", "shared", "cold"]
"""Where a turn's starting cache came from: the agent's hot (RAM) or warm (disk)
cache, another agent's cache via a shared prefix, or nothing."""


class HotCache(Protocol):
    """What code off the MLX thread may read of a parked cache.

    :class:`runtime.kvstate.ParkedCache` satisfies it; the arrays it holds are
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


class SamplingOptions(msgspec.Struct, frozen=True, kw_only=True):
    """Sampling parameters as they travel to the engine (see ``runtime.sampling``); checked on construction.

    ``temperature == 0`` is greedy; ``top_p`` / ``top_k`` follow mlx-lm's sampler;
    ``stop`` strings end the reply (they are not part of it).

    Raises:
        ValueError: a value out of range (the message names it).
    """

    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    stop: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, not {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, not {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], not {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, not {self.top_k}")


# -- where a turn's cache comes from ----------------------------------------------


class ColdStart(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """No cache: prefill the whole prompt."""


class FromHot(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """The agent's own parked cache from the hot tier."""

    parked: HotCache


class FromWarm(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """The agent's own cache read from disk (numpy); restored on the MLX thread."""

    snapshot: CacheSnapshot


class FromShared(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """The first ``keep_tokens`` tokens (whole blocks) of another agent's cache.

    ``donor`` is that agent; ``parked`` its hot cache, or the prompt of its turn
    still in flight. Only text the requesting agent sent itself is covered: the
    donor's text up to ``keep_tokens`` is a prefix of the new prompt.
    """

    parked: HotCache
    keep_tokens: int
    donor: str


CacheSource = ColdStart | FromHot | FromWarm | FromShared


class TurnPlan(msgspec.Struct, frozen=True, kw_only=True):
    """One turn's reuse decision.

    Attributes:
        tier: where the reused cache comes from (``cold`` when nothing is reused).
        source: the cache itself.
        match: how the prompt matched it (:class:`runtime.prefix.MatchKind` value).
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
