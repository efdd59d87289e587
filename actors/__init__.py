"""kvmem's Trio actors and the in-process API.

::

    from actors import open_runtime

    async with open_runtime(model="kvmem-default") as rt:
        result = await rt.agent("alice").send([{"role": "user", "content": "Hi"}])

See :mod:`actors.supervisor` for the API (streaming, cancellation, shutdown) and
each actor's module for its mailbox. Beside a running ``kvmem serve`` on the same
home, ``open_runtime`` yields an :class:`OwnerClient` whose turns run in the server
(:mod:`actors.owner_client`). Exports are loaded lazily, so importing a
submodule such as :mod:`runtime.plan.scheduler` (plain Python) pulls in neither trio
nor MLX.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from actors.client import AgentHandle, TurnFailedError, TurnStream
    from actors.messages_agent import TurnResult, TurnUsage
    from actors.owner_client import OwnerClient
    from actors.supervisor import Runtime, RuntimeStats, open_runtime

__all__ = [
    "open_runtime",
    "Runtime",
    "OwnerClient",
    "AgentHandle",
    "TurnStream",
    "TurnResult",
    "TurnUsage",
    "RuntimeStats",
    "TurnFailedError",
]

_EXPORTS = {
    "open_runtime": "actors.supervisor",
    "Runtime": "actors.supervisor",
    "OwnerClient": "actors.owner_client",
    "AgentHandle": "actors.client",
    "TurnStream": "actors.client",
    "RuntimeStats": "actors.supervisor",
    "TurnFailedError": "actors.client",
    "TurnResult": "actors.messages_agent",
    "TurnUsage": "actors.messages_agent",
}


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'actors' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
