"""Server-sent events: event framing and a streaming response that notices a client leaving.

:class:`EventStreamResponse` runs a *producer* — an async function that
writes events with ``await emit(bytes)`` — in the request's task while a
sibling task waits for ``http.disconnect``. When the client leaves, the
producer is cancelled: the cancellation arrives inside it as ``trio.Cancelled``
(wherever it is waiting, usually on the next token), so a producer that holds
a turn in ``async with handle.stream(...)`` tells the GPU actor by leaving that
block. No async generator sits in between (trio cannot cancel one that is
suspended at a ``yield``), so nothing is left waiting for the garbage collector.

A stream that has been silent for :data:`KEEPALIVE_S` (a long prompt being
prefilled, a turn waiting for memory) gets an SSE comment, ``: keep-alive``,
which every SSE parser skips: proxies and SDK read timeouts keep seeing bytes.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import msgspec
import trio
from starlette.types import Receive, Scope, Send

__all__ = ["Emit", "Producer", "EventStreamResponse", "sse", "sse_data", "SSE_HEADERS", "KEEPALIVE_S"]

Emit = Callable[[bytes], Awaitable[None]]
Producer = Callable[[Emit], Awaitable[None]]

SSE_HEADERS = {
    "content-type": "text/event-stream; charset=utf-8",
    "cache-control": "no-cache",
    "x-accel-buffering": "no",
}

_encoder = msgspec.json.Encoder()

KEEPALIVE_S = 10.0
"""Seconds of silence after which a stream gets a ``: keep-alive`` comment."""

KEEPALIVE = b": keep-alive\n\n"


def sse(event: str, data: Any) -> bytes:
    """One named event (Anthropic style): ``event: NAME`` + ``data: JSON``."""
    return b"event: " + event.encode() + b"\ndata: " + _encoder.encode(data) + b"\n\n"


def sse_data(data: Any) -> bytes:
    """One unnamed event (OpenAI style): ``data: JSON``; a ``bytes`` payload is sent as is (``[DONE]``)."""
    payload = data if isinstance(data, bytes) else _encoder.encode(data)
    return b"data: " + payload + b"\n\n"


class EventStreamResponse:
    """An ASGI response streaming what ``producer`` emits; cancels it when the client disconnects.

    Args:
        producer: writes the events; returning ends the response.
        headers: extra headers (the SSE ones are added).
    """

    def __init__(self, producer: Producer, *, headers: Mapping[str, str] | None = None, status_code: int = 200):
        self.producer = producer
        self.status_code = status_code
        self.headers = {**SSE_HEADERS, **(headers or {})}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        raw_headers = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in self.headers.items()]
        async with trio.open_nursery() as nursery:

            async def watch_disconnect() -> None:
                while (await receive())["type"] != "http.disconnect":
                    pass
                nursery.cancel_scope.cancel()

            nursery.start_soon(watch_disconnect)
            sending = trio.Lock()  # the producer and the keep-alive write one stream
            last_sent = trio.current_time()

            async def emit(chunk: bytes) -> None:
                nonlocal last_sent
                async with sending:
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                    last_sent = trio.current_time()

            async def keep_alive() -> None:
                while True:
                    await trio.sleep_until(last_sent + KEEPALIVE_S)
                    if trio.current_time() >= last_sent + KEEPALIVE_S:
                        await emit(KEEPALIVE)

            await send({"type": "http.response.start", "status": self.status_code, "headers": raw_headers})
            nursery.start_soon(keep_alive)
            await self.producer(emit)
            async with sending:
                # Shielded: ending the body makes the server tell the app the request is over
                # (``http.disconnect``, which wakes watch_disconnect and cancels this nursery)
                # and then close a ``Connection: close`` connection, still inside this call.
                # Cancelled there, the connection stayed open until the client gave up.
                with trio.CancelScope(shield=True):
                    await send({"type": "http.response.body", "body": b"", "more_body": False})
            nursery.cancel_scope.cancel()
