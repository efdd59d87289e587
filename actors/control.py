"""The owner's control socket: other processes on the machine ask the running kvmem to forget or list agents.

One process owns a cache directory (:class:`runtime.persist.owner.OwnerLock`).
``kvmem forget``, ``kvmem agents`` or ``kvmem chat`` run while a server (or any other runtime)
holds it must not touch the files themselves: the holder keeps hot, unsaved
and prefetched copies the files know nothing of, and would serve and save a
forgotten agent again. So the holder listens on a Unix socket beside the lock
(``<cache dir>/control.sock``) and those commands send it their request
instead; the forget then runs through the holder's own
``Runtime.agent(id).forget()``, which reaches every copy it holds, and a turn (``kvmem chat``,
``kvmem scenario``, Python's ``open_runtime`` beside a server: :class:`actors.owner_client.OwnerClient`)
through its agents (:class:`TurnRequest`), streamed back item by item.

Who may ask is decided by the file system, as for Docker's socket: the socket
is ``0o600`` inside the ``0o700`` cache directory, so only the user who owns
the directory can connect.

Wire: one request per connection, each way a 4-byte big-endian length and a
msgpack body (:data:`ControlRequest` in, :class:`ControlReply` out). A turn's
connection carries, before its reply, one :class:`TurnItem` per item of the
turn's stream; a client that closes it cancels the turn, as a client leaving an
HTTP stream does.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket as stdlib_socket
import struct
import sys
import time
import typing
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec
import trio

from actors.messages_agent import ChatTurn, Turn, TurnDone, TurnReply, TurnResult
from actors.messages_common import Failed, failed_from
from actors.messages_gpu import StreamItem
from actors.messages_store import AgentRecord
from runtime.persist.owner import CONTROL_NAME, OwnerInfo, OwnerLock

if TYPE_CHECKING:
    from actors.supervisor import Runtime

__all__ = ["ForgetRequest", "ListRequest", "FlushRequest", "PingRequest", "TurnRequest", "ControlRequest",
           "ControlReply", "TurnItem", "serve_control", "ask_owner", "run_turn_at_owner", "OwnerUnreachableError"]

log = logging.getLogger("kvmem.control")

_MAX_FRAME = 64 * 2**20
_TIMEOUT_S = 60.0  # a forget waits for the agent's running turn to end
_TURN_TIMEOUT_S = 3600.0  # a turn: a long prompt's prefill on a CPU takes minutes


class ForgetRequest(msgspec.Struct, frozen=True, kw_only=True, tag="forget"):
    """Forget ``agent_id`` (tenant-namespaced when it names one) in every copy the owner holds."""

    agent_id: str


class ListRequest(msgspec.Struct, frozen=True, kw_only=True, tag="list"):
    """The owner's agents of ``tenant`` (None: those without a tenant), or only ``agent_id``'s caches,
    as ``Runtime.list_agents``."""

    agent_id: str | None = None
    tenant: str | None = None


class FlushRequest(msgspec.Struct, frozen=True, kw_only=True, tag="flush"):
    """Write every dirty hot cache to disk now, as ``Runtime.flush`` (``written`` in the reply)."""


class PingRequest(msgspec.Struct, frozen=True, kw_only=True, tag="ping"):
    """Whether the owner answers (an empty reply): a client checks before it hands out handles."""


class TurnRequest(msgspec.Struct, frozen=True, kw_only=True, tag="turn"):
    """``turn`` run by the owner's runtime, on its caches and in its batch, as ``AgentHandle.run`` /
    ``open_stream`` run it there (``stream``: each item of the turn's stream comes back as a
    :class:`TurnItem` before the reply). The one :class:`actors.messages_agent.ChatTurn` travels as it is."""

    turn: ChatTurn
    stream: bool = False


ControlRequest = ForgetRequest | ListRequest | FlushRequest | PingRequest | TurnRequest


class ControlReply(msgspec.Struct, frozen=True, kw_only=True, tag="reply"):
    """The owner's answer: ``error`` (with ``kind``, an exception class name) or the result."""

    existed: bool = False
    agents: tuple[AgentRecord, ...] = ()
    written: int = 0
    result: TurnResult | None = None
    error: str | None = None
    kind: str | None = None

    @classmethod
    def of_turn(cls, reply: TurnReply) -> ControlReply:
        """A turn's reply (finished or ``Failed``) as it goes back."""
        if isinstance(reply, Failed):
            return cls(error=reply.error, kind=reply.kind)
        return cls(result=reply.result)

    def turn_reply(self) -> TurnReply:
        """The reply a turn's caller reads (what :meth:`of_turn` sent)."""
        if self.result is None:
            return Failed(kind=self.kind or "Failed", error=self.error or "the owner sent no result")
        return TurnDone(result=self.result)


_STREAM_TYPES: dict[str, type] = {t.__name__: t for t in typing.get_args(StreamItem)}


class TurnItem(msgspec.Struct, frozen=True, kw_only=True, tag="item"):
    """One item of a streamed turn (:data:`actors.messages_gpu.StreamItem`), named by its type.

    Carried as its type's name and its own msgpack body: the stream's items are structs without
    tags beside plain text, which one msgspec union cannot tell apart.
    """

    kind: str
    body: msgspec.Raw

    @classmethod
    def of(cls, item: StreamItem) -> TurnItem:
        return cls(kind=type(item).__name__, body=msgspec.Raw(_encoder.encode(item)))

    def item(self) -> StreamItem:
        """The item as the turn's stream gave it."""
        kind = _STREAM_TYPES.get(self.kind)
        if kind is None:
            raise ValueError(f"a turn item of unknown kind {self.kind!r}")
        decoded: StreamItem = msgspec.msgpack.decode(self.body, type=kind)
        return decoded


class OwnerUnreachableError(Exception):
    """The owner holds the lock but its control socket did not answer."""


_encoder = msgspec.msgpack.Encoder()
_request_decoder = msgspec.msgpack.Decoder(ControlRequest)
_reply_decoder = msgspec.msgpack.Decoder(ControlReply)
_turn_frame_decoder = msgspec.msgpack.Decoder(TurnItem | ControlReply)


@contextlib.contextmanager
def _reachable(path: Path) -> Iterator[str]:
    """A name for ``path`` that fits a Unix socket address (at most 107 bytes).

    A long path is reached through ``/proc/self/fd/<its folder>/`` on Linux.
    """
    name = os.fsencode(path)
    if len(name) < 100 or not sys.platform.startswith("linux"):
        yield str(path)
        return
    fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        yield f"/proc/self/fd/{fd}/{path.name}"
    finally:
        os.close(fd)


async def _send_frame(stream: trio.abc.Stream, message: object) -> None:
    body = _encoder.encode(message)
    await stream.send_all(struct.pack(">I", len(body)) + body)


class _Frames:
    """The length-prefixed frames arriving on one connection, in order (one read may hold several)."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self._stream = stream
        self._buffer = b""

    async def receive(self) -> bytes:
        """The next frame's body.

        Raises:
            EOFError: the connection closed mid-frame (or before one).
            ValueError: a frame larger than the limit.
        """
        size: int | None = None
        while size is None or len(self._buffer) < 4 + size:
            if size is None and len(self._buffer) >= 4:
                size = struct.unpack(">I", self._buffer[:4])[0]
                if size > _MAX_FRAME:
                    raise ValueError(f"a control frame of {size} bytes is too large")
                continue
            chunk = await self._stream.receive_some(65536)
            if not chunk:
                raise EOFError("the connection closed mid-frame")
            self._buffer += chunk
        body, self._buffer = self._buffer[4 : 4 + size], self._buffer[4 + size :]
        return body


async def _answer(rt: Runtime, request: ControlRequest) -> ControlReply:
    try:
        match request:
            case ForgetRequest(agent_id=agent_id):
                return ControlReply(existed=await rt.agent(agent_id).forget())
            case ListRequest(agent_id=agent_id, tenant=tenant):
                return ControlReply(agents=tuple(await rt.list_agents(agent_id, tenant=tenant)))
            case FlushRequest():
                return ControlReply(written=await rt.flush())
            case PingRequest():
                return ControlReply()
            case TurnRequest():
                raise AssertionError("a turn is served by _serve_turn")
            case _:
                typing.assert_never(request)
    except Exception as exc:  # noqa: BLE001 - the asking process reports it
        return ControlReply(error=str(exc), kind=type(exc).__name__)


def _failed(exc: Exception) -> Failed:
    from actors.client import TurnFailedError

    if isinstance(exc, TurnFailedError):  # its kind, and its message without the kind in front
        return Failed(kind=exc.kind, error=str(exc).removeprefix(f"{exc.kind}: "))
    return failed_from(exc)


async def _serve_turn(rt: Runtime, request: TurnRequest, stream: trio.SocketStream) -> None:
    """Run ``request``'s turn through the runtime's agent, sending each stream item, then the reply.

    The client closing the connection cancels the turn (closing our ends of its channels is how
    a turn's caller says so, as the HTTP gateway's does when a client leaves).
    """
    try:
        handle = rt.agent(request.turn.agent_id, share_prefix=request.turn.share_prefix)
    except Exception as exc:  # noqa: BLE001 - an invalid id: the asking process reports it
        await _send_frame(stream, ControlReply.of_turn(_failed(exc)))
        return
    turn = request.turn if request.turn.agent_id == handle.agent_id else msgspec.structs.replace(
        request.turn, agent_id=handle.agent_id)  # the id as checked (NFC)
    deltas_send, deltas = trio.open_memory_channel[StreamItem](64) if request.stream else (None, None)
    reply_send, reply = trio.open_memory_channel[TurnReply](1)
    outcome: TurnReply | None = None
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_cancel_on_hangup, stream, nursery.cancel_scope)
        try:
            await rt.deliver(handle.agent_id, Turn(request_id=rt.new_request_id(), turn=turn,
                                                   submitted_at=time.perf_counter(), deltas=deltas_send,
                                                   reply=reply_send,
                                                   sample_ids=tuple(rt.new_request_id() for _ in range(turn.n - 1))))
            if deltas is not None:
                async for item in deltas:
                    await _send_frame(stream, TurnItem.of(item))
            outcome = await reply.receive()
        except Exception as exc:  # noqa: BLE001 - the runtime closed: the asking process reports it
            outcome = _failed(exc)
        finally:
            for channel in (deltas, reply):
                if channel is not None:
                    channel.close()
        nursery.cancel_scope.cancel()
    if outcome is not None:  # None: the client left, and the turn was cancelled
        await _send_frame(stream, ControlReply.of_turn(outcome))


async def _cancel_on_hangup(stream: trio.SocketStream, scope: trio.CancelScope) -> None:
    """Cancel ``scope`` when the client closes the connection (it sends nothing after its request)."""
    try:
        await stream.receive_some(1)
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        pass
    scope.cancel()


async def serve_control(rt: Runtime, lock: OwnerLock, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
                        ) -> None:
    """Answer control requests for ``rt`` on ``<lock.root>/control.sock`` until cancelled.

    A socket that cannot be bound (an unusual file system) is logged: the runtime
    runs without one, and other processes are refused with its pid instead.
    """
    path = lock.root / CONTROL_NAME
    # Bound here, not with trio's bind: that one takes a worker thread for a path, and a test's
    # autojump clock would jump to the next deadline meanwhile (a local bind does not block).
    raw = stdlib_socket.socket(stdlib_socket.AF_UNIX, stdlib_socket.SOCK_STREAM)
    try:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()  # a socket left by a holder that was killed: we hold the lock now
        with _reachable(path) as address:
            old_umask = os.umask(0o177)  # the socket file is created 0o600
            try:
                raw.bind(address)
            finally:
                os.umask(old_umask)
        raw.listen(16)
    except OSError as exc:
        raw.close()
        log.warning("no control socket at %s (%s): other kvmem commands on this home will be refused", path, exc)
        task_status.started()
        return
    lock.announce_control(path)
    listener = trio.SocketListener(trio.socket.from_stdlib_socket(raw))

    async def handle(stream: trio.SocketStream) -> None:
        async with stream:
            try:
                with trio.fail_after(_TIMEOUT_S) as deadline:
                    request = _request_decoder.decode(await _Frames(stream).receive())
                    if isinstance(request, TurnRequest):
                        deadline.deadline = trio.current_time() + _TURN_TIMEOUT_S
                        await _serve_turn(rt, request, stream)
                    else:
                        await _send_frame(stream, await _answer(rt, request))
            except (OSError, EOFError, ValueError, msgspec.DecodeError, trio.TooSlowError,
                    trio.BrokenResourceError) as exc:
                log.warning("a control request failed: %s", exc)

    try:
        task_status.started()
        await trio.serve_listeners(handle, [listener])
    finally:
        if lock.held:
            lock.announce_control(None)
        with contextlib.suppress(OSError):
            path.unlink()
        await listener.aclose()


async def ask_owner(owner: OwnerInfo, request: ForgetRequest | ListRequest | FlushRequest | PingRequest
                    ) -> ControlReply:
    """Send ``request`` to the holder ``owner`` describes and return its reply.

    Raises:
        OwnerUnreachableError: it has no control socket, or the socket did not answer.
    """
    try:
        with trio.fail_after(_TIMEOUT_S):
            async with _connected(owner, request) as stream:
                return _reply_decoder.decode(await _Frames(stream).receive())
    except (OSError, EOFError, ValueError, msgspec.DecodeError, trio.TooSlowError, trio.BrokenResourceError) as exc:
        raise OwnerUnreachableError(f"{owner.describe()} did not answer on {owner.control}: {exc}") from None


@contextlib.asynccontextmanager
async def _connected(owner: OwnerInfo, request: ControlRequest) -> AsyncIterator[trio.SocketStream]:
    """A connection to the owner's control socket with ``request`` sent on it."""
    if owner.control is None:
        raise OwnerUnreachableError(f"{owner.describe()} has no control socket")
    with _reachable(Path(owner.control)) as address:
        stream = await trio.open_unix_socket(address)
    async with stream:
        await _send_frame(stream, request)
        yield stream


async def run_turn_at_owner(owner: OwnerInfo, request: TurnRequest,
                            on_item: Callable[[StreamItem], Awaitable[bool]]) -> TurnReply | None:
    """Run ``request``'s turn in the owner's runtime: ``on_item`` gets each stream item; returns the turn's reply.

    ``on_item`` returning False (its caller left) closes the connection, which cancels the turn
    there; None is returned then.

    Raises:
        OwnerUnreachableError: no control socket, or the connection failed before the reply.
    """
    try:
        with trio.fail_after(_TURN_TIMEOUT_S):
            async with _connected(owner, request) as stream:
                frames = _Frames(stream)
                while True:
                    frame = _turn_frame_decoder.decode(await frames.receive())
                    if isinstance(frame, ControlReply):
                        return frame.turn_reply()
                    if not await on_item(frame.item()):
                        return None
    except (OSError, EOFError, ValueError, msgspec.DecodeError, trio.TooSlowError, trio.BrokenResourceError) as exc:
        raise OwnerUnreachableError(f"{owner.describe()} did not answer on {owner.control}: {exc}") from None
