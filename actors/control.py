"""The owner's control socket: other processes on the machine ask the running kvmem to forget or list agents.

One process owns a cache directory (:class:`runtime.persist.owner.OwnerLock`).
``kvmem forget``, ``kvmem agents`` or ``kvmem chat`` run while a server (or any other runtime)
holds it must not touch the files themselves: the holder keeps hot, unsaved
and prefetched copies the files know nothing of, and would serve and save a
forgotten agent again. So the holder listens on a Unix socket beside the lock
(``<cache dir>/control.sock``) and those commands send it their request
instead; the forget then runs through the holder's own
``Runtime.agent(id).forget()``, which reaches every copy it holds, and a chat's turn through its
``Runtime.agent(id).send(...)`` (:class:`TurnRequest`).

Who may ask is decided by the file system, as for Docker's socket: the socket
is ``0o600`` inside the ``0o700`` cache directory, so only the user who owns
the directory can connect.

Wire: one request per connection, each way a 4-byte big-endian length and a
msgpack body (:data:`ControlRequest` in, :class:`ControlReply` out).
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket as stdlib_socket
import struct
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
import trio

from actors.messages_agent import TurnResult
from actors.messages_store import AgentRecord
from runtime.persist.owner import CONTROL_NAME, OwnerInfo, OwnerLock

if TYPE_CHECKING:
    from actors.supervisor import Runtime

__all__ = ["ForgetRequest", "ListRequest", "TurnRequest", "ControlRequest", "ControlReply", "serve_control",
           "ask_owner", "OwnerUnreachableError"]

log = logging.getLogger("kvmem.control")

_MAX_FRAME = 64 * 2**20
_TIMEOUT_S = 60.0  # a forget waits for the agent's running turn to end
_TURN_TIMEOUT_S = 3600.0  # a turn: a long prompt's prefill on a CPU takes minutes


class ForgetRequest(msgspec.Struct, frozen=True, kw_only=True, tag="forget"):
    """Forget ``agent_id`` (tenant-namespaced when it names one) in every copy the owner holds."""

    agent_id: str


class ListRequest(msgspec.Struct, frozen=True, kw_only=True, tag="list"):
    """The owner's agents of ``tenant`` (None: those without a tenant), as ``Runtime.list_agents``."""

    tenant: str | None = None


class TurnRequest(msgspec.Struct, frozen=True, kw_only=True, tag="turn"):
    """One turn of ``agent_id`` run by the owner, as ``Runtime.agent(agent_id).send(messages, **options)``:
    ``kvmem chat`` beside a running server goes through the server's runtime, its caches and its batch."""

    agent_id: str
    messages: tuple[dict[str, Any], ...]
    options: dict[str, Any] = {}


ControlRequest = ForgetRequest | ListRequest | TurnRequest


class ControlReply(msgspec.Struct, frozen=True, kw_only=True):
    """The owner's answer: ``error`` (with ``kind``, an exception class name) or the result."""

    existed: bool = False
    agents: tuple[AgentRecord, ...] = ()
    result: TurnResult | None = None
    error: str | None = None
    kind: str | None = None


class OwnerUnreachableError(Exception):
    """The owner holds the lock but its control socket did not answer."""


_request_decoder = msgspec.msgpack.Decoder(ControlRequest)
_reply_decoder = msgspec.msgpack.Decoder(ControlReply)
_encoder = msgspec.msgpack.Encoder()


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


async def _receive_frame(stream: trio.SocketStream) -> bytes:
    data = b""
    size: int | None = None
    while size is None or len(data) < 4 + size:
        chunk = await stream.receive_some(65536)
        if not chunk:
            raise EOFError("the connection closed mid-frame")
        data += chunk
        if size is None and len(data) >= 4:
            size = struct.unpack(">I", data[:4])[0]
            if size > _MAX_FRAME:
                raise ValueError(f"a control frame of {size} bytes is too large")
    return data[4:]


async def _answer(rt: Runtime, request: ControlRequest) -> ControlReply:
    try:
        match request:
            case ForgetRequest(agent_id=agent_id):
                return ControlReply(existed=await rt.agent(agent_id).forget())
            case ListRequest(tenant=tenant):
                return ControlReply(agents=tuple(await rt.list_agents(tenant=tenant)))
            case TurnRequest(agent_id=agent_id, messages=messages, options=options):
                return ControlReply(result=await rt.agent(agent_id).send(list(messages), **options))
    except Exception as exc:  # noqa: BLE001 - the asking process reports it
        return ControlReply(error=str(exc), kind=type(exc).__name__)


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
                    request = _request_decoder.decode(await _receive_frame(stream))
                    if isinstance(request, TurnRequest):
                        deadline.deadline = trio.current_time() + _TURN_TIMEOUT_S
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


async def ask_owner(owner: OwnerInfo, request: ControlRequest) -> ControlReply:
    """Send ``request`` to the holder ``owner`` describes and return its reply.

    Raises:
        OwnerUnreachableError: it has no control socket, or the socket did not answer.
    """
    if owner.control is None:
        raise OwnerUnreachableError(f"{owner.describe()} has no control socket")
    timeout = _TURN_TIMEOUT_S if isinstance(request, TurnRequest) else _TIMEOUT_S
    try:
        with _reachable(Path(owner.control)) as address, trio.fail_after(timeout):
            stream = await trio.open_unix_socket(address)
            async with stream:
                await _send_frame(stream, request)
                return _reply_decoder.decode(await _receive_frame(stream))
    except (OSError, EOFError, ValueError, msgspec.DecodeError, trio.TooSlowError) as exc:
        raise OwnerUnreachableError(f"{owner.describe()} did not answer on {owner.control}: {exc}") from None
