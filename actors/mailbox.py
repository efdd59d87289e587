"""Request/reply over trio memory channels: one-shot reply channels carried in the request.

Trio has no futures, so a request carries its reply channel (buffer 1). The
asker waits on the receive end; the actor answers with :func:`send_reply`,
which never blocks and never fails when the asker has left (closed its end:
that is also how a cancelled asker is noticed, see ``GPUActor``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import trio

__all__ = ["ask", "send_reply", "receiver_left"]

R = TypeVar("R")
M = TypeVar("M")


async def ask(mailbox: trio.MemorySendChannel[M], build: Callable[[trio.MemorySendChannel[R]], M]) -> R:
    """Send ``build(reply_channel)`` to ``mailbox`` and wait for the one reply.

    Raises:
        trio.BrokenResourceError: the actor's mailbox is closed (it stopped).
    """
    send, receive = trio.open_memory_channel[R](1)
    async with receive:
        await mailbox.send(build(send))
        return await receive.receive()


def send_reply(channel: trio.MemorySendChannel[Any], message: Any) -> None:
    """Answer on a one-shot reply channel; a requester that left is not an error."""
    try:
        channel.send_nowait(message)
    except (trio.WouldBlock, trio.BrokenResourceError, trio.ClosedResourceError):
        pass


def receiver_left(channel: trio.MemorySendChannel[Any] | None) -> bool:
    """Whether nobody can receive on ``channel`` any more (its asker left)."""
    return channel is not None and channel.statistics().open_receive_channels == 0
