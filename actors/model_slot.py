"""ModelSlot: which model the GPU actor serves, and the requests waiting for another one.

One model is loaded at a time, and the GPU actor holds it; this is its book of
that (no trio, no MLX: the actor carries out what it says). A request (a turn's
:class:`actors.messages_gpu.Generate`, a :class:`actors.messages_gpu.CountTokens`)
names a configured model or none (the default). One for the loaded model, with
nothing waiting, is served at once; any other waits here, in arrival order. Once
no turn is in flight, the actor serves the first waiting request's model:

1. it makes the host copies it owes, then the cache store writes the loaded
   model's dirty caches to disk and drops its hot caches
   (:class:`actors.messages_store.Evict`);
2. it unloads that model and loads the new one;
3. it serves the waiting requests in order, up to the first for yet another model.

So a swap is never starved by a stream of requests for the loaded model (they
wait behind it), and no turn ever sees its model change under it: a turn is
*in flight* from its request to its reply, which is the whole of its lease.
Caches are tagged with their model, so when a model returns its agents' caches
load from disk again (warm). With ``idle_unload_s`` set, a model with no turn for
that long is unloaded the same way (the next request loads it again).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Any

import msgspec

from actors.messages_common import Failed
from runtime.backend import BackendProfile
from runtime.plan.engine import ModelInfo

__all__ = ["ModelSlot", "RegistryStats"]


class RegistryStats(msgspec.Struct, frozen=True, kw_only=True):
    """Which model is loaded, and its counters (``Runtime.stats().registry``).

    Attributes:
        model: the loaded model's name (None: none loaded).
        model_tag: its tag (model + KV format; None: none loaded).
        default_model: the model of requests that name none.
        configured: every model requests may ask for, the default first.
        leases: turns on the loaded model now (from their request to their reply).
        queued: requests waiting for another model (and those behind them).
        loads: models loaded since start.
        swaps: loads that replaced another loaded model.
        idle_unloads: unloads after ``idle_unload_s`` without a turn.
        profile: the backend profile the loaded model runs under (:mod:`runtime.backend`; None: none loaded
            or an engine without one).
    """

    model: str | None
    model_tag: str | None
    default_model: str
    configured: tuple[str, ...]
    leases: int
    queued: int
    loads: int
    swaps: int
    idle_unloads: int
    profile: BackendProfile | None = None


class ModelSlot:
    """The GPU actor's book of the loaded model and the requests waiting for another (module docstring).

    Args:
        default_model: the model of requests that name none (loaded at start with ``preload``).
        models: other model names requests may ask for.
    """

    def __init__(self, default_model: str, models: Sequence[str] = ()) -> None:
        self.default = default_model
        self.configured = tuple(dict.fromkeys([default_model, *models]))
        self.current: ModelInfo | None = None
        self.waiting: deque[Any] = deque()  # requests (each with a ``model``) in arrival order
        self.loads = self.swaps = self.idle_unloads = 0

    def name_of(self, model: str | None) -> str:
        return model or self.default

    def refusal(self, model: str | None) -> Failed | None:
        """Why a request for ``model`` can never be served (None: it can)."""
        name = self.name_of(model)
        if name in self.configured:
            return None
        return Failed(kind="ValueError", error=f"model {name!r} is not configured; known: {list(self.configured)}")

    def serves_now(self, model: str | None) -> bool:
        """Whether a request for ``model`` goes ahead now: its model is loaded and nothing waits before it."""
        return not self.waiting and self.current is not None and self.current.name == self.name_of(model)

    def next_model(self) -> str | None:
        """The model the first waiting request needs (None: nothing waits)."""
        return self.name_of(self.waiting[0].model) if self.waiting else None

    def loaded(self, info: ModelInfo) -> None:
        self.current = info
        self.loads += 1

    def statistics(self, in_flight: int) -> RegistryStats:
        current = self.current
        return RegistryStats(
            model=current.name if current else None,
            model_tag=current.tag if current else None,
            default_model=self.default,
            configured=self.configured,
            leases=in_flight,
            queued=len(self.waiting),
            loads=self.loads,
            swaps=self.swaps,
            idle_unloads=self.idle_unloads,
            profile=current.profile if current else None,
        )
