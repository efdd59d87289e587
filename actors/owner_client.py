"""The runtime of the process that holds a home, used from another process: ``open_runtime`` beside a server.

One process owns a home's caches (:class:`runtime.persist.owner.OwnerLock`). A program, ``kvmem chat``
or ``kvmem scenario run`` started while ``kvmem serve`` holds the home does not stop at the lock:
:func:`actors.open_runtime` yields an :class:`OwnerClient` instead of a :class:`actors.supervisor.Runtime`.
Its handles are the same :class:`actors.client.AgentHandle` s, with the same turn methods, streams,
results and errors; each turn travels, as the one :class:`actors.messages_agent.ChatTurn`, through the
holder's control socket (:mod:`actors.control`) and runs in the holder's runtime: on its caches (the
second turn of an agent is hot there), in its batch, saved by its store.

Why ``open_runtime`` falls back instead of a separate ``connect()``: a user's program then runs as
written whether or not a server runs (the README's and docs/python.md's snippets, a scenario, a chat),
with the answers it would get alone, where a second function would make every caller choose, and
choose again when a server is started or stopped. What cannot be the same is said here:

* the holder's settings apply (budgets, durability, ``kv_bits``); a turn that names no model asks for
  the model this process's settings name, so it runs on the model it would run on alone, or fails
  naming the models the holder serves;
* the runtime's introspection (``stats()``, ``running_turns()``, ``gpu_events()``) is the holder's
  to report: on its HTTP API (``/v1/status``, ``/metrics``), not here.
"""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import assert_never

import msgspec
import trio

from actors.client import AgentHandle, TurnFailedError, raise_failed
from actors.control import (
    ControlReply,
    FlushRequest,
    ForgetRequest,
    ListRequest,
    OwnerUnreachableError,
    PingRequest,
    TurnRequest,
    ask_owner,
    run_turn_at_owner,
)
from actors.mailbox import receiver_left, send_reply
from actors.messages_agent import AgentInbox, ForgetAgent, Forgot, Turn, TurnReply
from actors.messages_common import Failed
from actors.messages_gpu import StreamItem
from actors.messages_store import AgentRecord
from runtime.errors import DirectoryInUseError
from runtime.identity import check_agent_id
from runtime.persist.owner import OwnerInfo

__all__ = ["OwnerClient", "open_owner_client"]


class OwnerClient:
    """The holder's runtime, reached through its control socket (see the module docstring).

    Created by :func:`actors.open_runtime` when another process holds the home; offers the part
    of :class:`actors.supervisor.Runtime` a program drives agents with: :meth:`agent`,
    :meth:`list_agents`, :meth:`flush`, :meth:`wait_idle`.

    Attributes:
        owner: who holds the home (pid, command, control socket).
    """

    def __init__(self, held: DirectoryInUseError, *, nursery: trio.Nursery, model: str | None) -> None:
        if held.holder is None:
            raise held
        self.owner: OwnerInfo = held.holder
        self._held = held
        self._nursery = nursery
        self._model = model
        self._request_ids = itertools.count(1)
        self._closed = False
        self._busy = 0  # turns handed to the holder and not yet answered
        self._idle = trio.Event()
        self._idle.set()

    def agent(self, agent_id: str, *, share_prefix: bool = True) -> AgentHandle:
        """A handle on agent ``agent_id``, as :meth:`actors.supervisor.Runtime.agent` gives one.

        Raises:
            InvalidAgentIdError: ``agent_id`` cannot name a cache.
        """
        return AgentHandle(self, check_agent_id(agent_id), share_prefix=share_prefix)

    async def list_agents(self, agent_id: str | None = None, *, tenant: str | None = None) -> list[AgentRecord]:
        """The holder's caches (hot ones included), as :meth:`actors.supervisor.Runtime.list_agents`."""
        return list((await self._ask(ListRequest(agent_id=agent_id, tenant=tenant))).agents)

    async def flush(self) -> int:
        """Have the holder write every dirty hot cache to disk now; how many it wrote."""
        return (await self._ask(FlushRequest())).written

    async def wait_idle(self) -> None:
        """Wait until every turn handed to the holder has been answered (or left)."""
        while self._busy:
            await self._idle.wait()

    # -- what handles call ----------------------------------------------------------

    def new_request_id(self) -> int:
        """A fresh request id (handles number their turns with it; the holder numbers them again)."""
        return next(self._request_ids)

    async def deliver(self, agent_id: str, message: AgentInbox) -> None:
        """Send ``message`` to the holder's agent; its answer arrives on the message's own reply channel."""
        if self._closed:
            raise TurnFailedError("Closed", "the runtime is closed")
        match message:
            case Turn():
                turn = message.turn
                if turn.model is None and self._model is not None:
                    turn = msgspec.structs.replace(turn, model=self._model)
                self._busy += 1
                self._idle = trio.Event() if self._idle.is_set() else self._idle
                self._nursery.start_soon(self._relay, message, TurnRequest(turn=turn, stream=True))
            case ForgetAgent(reply=reply):
                try:
                    send_reply(reply, Forgot(existed=(await self._ask(ForgetRequest(agent_id=agent_id))).existed))
                except Exception as exc:  # noqa: BLE001 - the handle raises it from the reply
                    send_reply(reply, Failed(kind=type(exc).__name__, error=str(exc)))
            case _:
                assert_never(message)

    async def _relay(self, message: Turn, request: TurnRequest) -> None:
        """Run one turn at the holder, passing its stream items and reply on to the caller's channels.

        The holder always streams: a caller that left (closed its channels) is noticed at the next
        item, and the connection closed, which cancels the turn there.
        """
        deltas = message.deltas

        async def on_item(item: StreamItem) -> bool:
            if deltas is None:
                return not receiver_left(message.reply)
            try:
                await deltas.send(item)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                return False
            return True

        reply: TurnReply | None
        try:
            reply = await run_turn_at_owner(self.owner, request, on_item)
        except OwnerUnreachableError as exc:
            reply = Failed(kind="DirectoryInUseError", error=f"{self._held} ({exc})")
        finally:
            if deltas is not None:
                deltas.close()  # the stream ends before the reply, as an agent actor ends it
            self._busy -= 1
            if not self._busy:
                self._idle.set()
        if reply is not None:
            send_reply(message.reply, reply)

    async def _ask(self, request: ForgetRequest | ListRequest | FlushRequest | PingRequest) -> ControlReply:
        if self._closed:
            raise TurnFailedError("Closed", "the runtime is closed")
        try:
            reply = await ask_owner(self.owner, request)
        except OwnerUnreachableError as unreachable:
            raise self._held from unreachable  # refused, naming the holder's pid
        if reply.error is not None:
            raise_failed(Failed(kind=reply.kind or "Failed", error=reply.error))
        return reply

    def _close(self) -> None:
        self._closed = True


@asynccontextmanager
async def open_owner_client(held: DirectoryInUseError, *, model: str | None) -> AsyncIterator[OwnerClient]:
    """An :class:`OwnerClient` of the holder ``held`` names, once it has answered; turns still running
    when the block is left are cancelled (at the holder too), as :func:`actors.open_runtime` does.

    Raises:
        DirectoryInUseError: ``held`` itself, when the holder has no control socket or does not answer.
    """
    from actors.supervisor import single_exception

    try:
        async with trio.open_nursery() as nursery:
            client = OwnerClient(held, nursery=nursery, model=model)
            await client._ask(PingRequest())
            try:
                yield client
            finally:
                client._close()
                nursery.cancel_scope.cancel()
    except BaseExceptionGroup as group:
        # The caller's body runs inside our nursery: give its error back unwrapped.
        only = single_exception(group)
        if only is None:
            raise
        raise only from None
