"""The client side of a turn: ``AgentHandle`` and ``TurnStream`` (see :mod:`actors.supervisor`).

Handles build :class:`actors.messages_agent.Turn` messages, hand them to the
runtime's agent mailboxes and turn ``Failed`` replies back into exceptions.
"""

from __future__ import annotations

import time
from collections import defaultdict, deque
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NoReturn, Protocol

if TYPE_CHECKING:
    from typing_extensions import Unpack

import trio

from actors.messages_agent import (
    AgentInbox,
    ChatTurn,
    ForgetAgent,
    ForgetReply,
    ToolCall,
    Turn,
    TurnOptions,
    TurnReply,
    TurnResult,
)
from actors.messages_common import Failed
from actors.messages_gpu import OfSample, Scores, StreamItem, TurnAccepted, TurnStarted
from runtime.errors import (
    BudgetExceededError,
    ContextLengthExceededError,
    InvalidAgentIdError,
    KvmemError,
    ModelError,
    UnsupportedModelError,
)
from runtime.reply.logprobs import TokenLogprob

__all__ = ["AgentHandle", "TurnOptions", "TurnStream", "TurnEvents", "TurnChoices", "TurnFailedError", "raise_failed"]

TurnBuilder = Callable[[trio.MemorySendChannel[StreamItem] | None, trio.MemorySendChannel[TurnReply]], Turn]


class Dispatcher(Protocol):
    """What a handle needs from the runtime."""

    def new_request_id(self) -> int: ...

    async def deliver(self, agent_id: str, message: AgentInbox) -> None: ...


class TurnFailedError(KvmemError):
    """A turn failed for a reason without a more specific exception (``kind`` names it)."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(f"{kind}: {message}")
        self.kind = kind


_ERRORS: dict[str, type[Exception]] = {
    "BudgetExceededError": BudgetExceededError,
    "ContextLengthExceededError": ContextLengthExceededError,
    "ModelError": ModelError,
    "UnsupportedModelError": UnsupportedModelError,
    "InvalidAgentIdError": InvalidAgentIdError,
    "ValueError": ValueError,
}


def raise_failed(failed: Failed) -> NoReturn:
    """Raise the exception a :class:`Failed` reply stands for."""
    cls = _ERRORS.get(failed.kind)
    if cls is not None:
        raise cls(failed.error)
    raise TurnFailedError(failed.kind, failed.error)


class TurnStream:
    """One streaming turn: an async context manager and an async iterator of text deltas.

    ``await stream.accepted()`` (optional, first) waits until the turn has passed
    every check a request can fail (template, tools, context, KV budget) and raises
    the turn's error if it did not: an HTTP route answers its status after it.
    ``await stream.start_info()`` (optional, before iterating) waits until the
    turn's prefill begins and gives its :class:`actors.messages_gpu.TurnStarted`
    accounting (tokens reused and prefilled, tier), also kept as :attr:`started`.

    Iterating yields the reply's content text; in a turn with tools,
    ``async for item in stream.events()`` yields the text and each
    :class:`ToolCall` once complete, in order (iterate one or the other).

    After iteration ends, :attr:`result` is the turn's :class:`TurnResult`.
    Failures raise from the iteration (``BudgetExceededError``, ``ModelError``, ...).

    A turn of ``n`` > 1 samples: ``async for index, item in stream.choices()`` yields every sample's
    text and tool calls as they come, each with its sample's index (0: the agent's own, which
    iterating the stream itself yields alone).
    """

    def __init__(self, runtime: Dispatcher, agent_id: str, build: TurnBuilder) -> None:
        self._runtime = runtime
        self._agent_id = agent_id
        self._build = build
        self._deltas: trio.MemoryReceiveChannel[StreamItem] | None = None
        self._reply: trio.MemoryReceiveChannel[TurnReply] | None = None
        # Per sample (0: the agent's own): content characters and tool calls delivered, logprobs received.
        self._streamed: dict[int, int] = defaultdict(int)
        self._calls: dict[int, int] = defaultdict(int)
        self._scores: dict[int, list[TokenLogprob]] = defaultdict(list)
        self._scores_taken: dict[int, int] = defaultdict(int)
        self._tail: deque[tuple[int, str | ToolCall]] = deque()  # what the final reply has and the deltas did not
        self._held: deque[OfSample] = deque()  # other samples' items read while waiting for the turn's own
        self._done = False
        self.result: TurnResult | None = None
        self.started: TurnStarted | None = None
        self._accepted = False
        self._early_reply: TurnReply | None = None  # a reply accepted() read (a turn that never ran)

    async def __aenter__(self) -> TurnStream:
        await self._open()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def __aiter__(self) -> TurnStream:
        return self

    async def _open(self) -> None:
        if self._reply is not None:
            return
        deltas_send, self._deltas = trio.open_memory_channel[StreamItem](64)
        reply_send, self._reply = trio.open_memory_channel[TurnReply](1)
        try:
            await self._runtime.deliver(self._agent_id, self._build(deltas_send, reply_send))
        except BaseException:
            await self.aclose()
            raise

    async def accepted(self) -> None:
        """Wait until the turn is accepted (see the class docstring).

        Raises:
            the turn's error (``ValueError``, ``ContextLengthExceededError``,
            ``BudgetExceededError``, ``TurnFailedError``, ...) when it was refused.
        """
        await self._open()
        assert self._deltas is not None and self._reply is not None
        if self._accepted:
            return
        try:
            item = await self._deltas.receive()
            while isinstance(item, OfSample):  # another sample's, before the turn's own acceptance
                self._held.append(item)
                item = await self._deltas.receive()
        except trio.EndOfChannel:
            self._early_reply = reply = await self._reply.receive()
            if isinstance(reply, Failed):
                self._done = True
                raise_failed(reply)
            return  # ended without running (nothing to accept): iterating reads the reply
        except BaseException:
            await self.aclose()
            raise
        assert isinstance(item, (TurnAccepted, TurnStarted)), "the GPU actor accepts a turn before anything else"
        if isinstance(item, TurnStarted):  # it started at once: accepted and announced in one
            self.started = item
        self._accepted = True

    async def start_info(self) -> TurnStarted | None:
        """Wait until the turn's prefill begins and return what it reuses and prefills.

        None when the turn ended before that (it failed, or was cancelled while
        queued): iterating then raises or ends as usual.
        """
        await self._open()
        assert self._deltas is not None
        while self.started is None:
            try:
                item = await self._receive()
            except (trio.EndOfChannel, trio.ClosedResourceError):
                return None
            if isinstance(item, TurnAccepted):
                self._accepted = True
                continue
            if isinstance(item, OfSample):  # another sample's, before the turn's own announcement
                self._held.append(item)
                continue
            assert isinstance(item, TurnStarted), "the GPU actor announces a turn before any text"
            self.started = item
        return self.started

    async def __anext__(self) -> str:
        while True:
            item = await self.next_event()
            if isinstance(item, str):
                return item

    def events(self) -> TurnEvents:
        """The turn's text deltas and tool calls, in order (see the class docstring)."""
        return TurnEvents(self)

    def choices(self) -> TurnChoices:
        """Every sample's text deltas and tool calls with its index, in order (see the class docstring)."""
        return TurnChoices(self)

    async def next_event(self) -> str | ToolCall:
        """The next text delta or completed tool call of the agent's own reply; ``StopAsyncIteration`` at the end."""
        while True:
            index, item = await self.next_choice()
            if index == 0:
                return item

    async def next_choice(self) -> tuple[int, str | ToolCall]:
        """The next text delta or completed tool call of any sample, with its index; ``StopAsyncIteration`` at
        the end."""
        if self._tail:
            return self._tail.popleft()
        if self._done:
            raise StopAsyncIteration
        try:
            await self._open()
            assert self._deltas is not None and self._reply is not None
            try:
                while True:
                    received = await self._receive()
                    index, item = (received.index, received.item) if isinstance(received, OfSample) else (0, received)
                    if isinstance(item, Scores):
                        self._scores[index].extend(item.tokens)
                    elif isinstance(item, (TurnAccepted, TurnStarted)):
                        self.started = item if isinstance(item, TurnStarted) else self.started
                        self._accepted = True
                    else:
                        break
            except trio.EndOfChannel:
                reply = self._early_reply or await self._reply.receive()
                self._done = True
                if isinstance(reply, Failed):
                    raise_failed(reply)
                self.result = result = reply.result
                for index, sample in enumerate((result, *result.samples)):
                    self._finish_sample(index, sample)
                if self._tail:
                    return self._tail.popleft()
                raise StopAsyncIteration from None
        except BaseException:
            await self.aclose()  # when the turn is still running, this tells the GPU actor: the client left
            raise
        if isinstance(item, ToolCall):
            self._calls[index] += 1
        else:
            self._streamed[index] += len(item)
        return index, item

    async def _receive(self) -> StreamItem:
        """The next item: one read early and held (another sample's), else the channel's next."""
        if self._held:
            return self._held.popleft()
        assert self._deltas is not None
        return await self._deltas.receive()

    def _finish_sample(self, index: int, result: TurnResult) -> None:
        """What sample ``index``'s result has and the deltas did not carry (a full channel, or content after a
        call at the very end) goes to the tail; its logprobs are every token's."""
        self._scores[index] = list(result.logprobs)
        rest = result.content[self._streamed[index] :]
        self._streamed[index] += len(rest)
        self._tail.extend([(index, rest)] if rest else [])
        self._tail.extend((index, call) for call in result.tool_calls[self._calls[index] :])
        self._calls[index] = len(result.tool_calls)

    def take_logprobs(self, index: int = 0) -> tuple[TokenLogprob, ...]:
        """The logprobs of sample ``index``'s reply tokens received since the last call: after a text of it came,
        they include the scores of its tokens (a turn asking for ``logprobs``; else always empty)."""
        scores = self._scores[index]
        new = tuple(scores[self._scores_taken[index] :])
        self._scores_taken[index] = len(scores)
        return new

    async def aclose(self) -> None:
        """Stop the turn if it is still running (closing our ends is the signal)."""
        self._done = True
        for channel in (self._deltas, self._reply):
            if channel is not None:
                channel.close()


class TurnEvents:
    """``stream.events()``: an async iterator of a turn's text deltas and :class:`ToolCall` s."""

    def __init__(self, stream: TurnStream) -> None:
        self._stream = stream

    def __aiter__(self) -> TurnEvents:
        return self

    async def __anext__(self) -> str | ToolCall:
        return await self._stream.next_event()


class TurnChoices:
    """``stream.choices()``: an async iterator of every sample's (index, text delta or :class:`ToolCall`)."""

    def __init__(self, stream: TurnStream) -> None:
        self._stream = stream

    def __aiter__(self) -> TurnChoices:
        return self

    async def __anext__(self) -> tuple[int, str | ToolCall]:
        return await self._stream.next_choice()


class AgentHandle:
    """A client's view of one agent; cheap to create, safe to share between tasks.

    Every turn is a :class:`actors.messages_agent.ChatTurn`: :meth:`run` and
    :meth:`open_stream` take one (the HTTP gateway builds them), and
    :meth:`send` / :meth:`stream` (chat messages) and :meth:`send_prompt` /
    :meth:`stream_prompt` (raw prompt text) build one from :class:`TurnOptions`.

    Args:
        share_prefix: start this agent from another agent's cached prefix when
            its own cache has nothing reusable, and let other agents start from
            this agent's cache (False opts out both ways).

    Raises (from every turn method):
        BudgetExceededError: the turn cannot fit the KV budget even alone.
        ModelError: the model cannot be loaded.
        ValueError: bad arguments (a tool or schema that cannot be used), or an unconfigured model.
        TurnFailedError: anything else that went wrong.
    """

    def __init__(self, runtime: Dispatcher, agent_id: str, *, share_prefix: bool = True) -> None:
        self._runtime = runtime
        self.agent_id = agent_id
        self.share_prefix = share_prefix

    def turn(
        self, *, messages: Sequence[Mapping[str, Any]] | None = None, prompt: str | None = None,
        **options: Unpack[TurnOptions],
    ) -> ChatTurn:
        """This agent's :class:`ChatTurn` for chat ``messages`` or a raw ``prompt``."""
        return ChatTurn.of(self.agent_id, messages=messages, prompt=prompt, share_prefix=self.share_prefix, **options)

    def _builder(self, turn: ChatTurn) -> TurnBuilder:
        if turn.agent_id != self.agent_id:
            raise ValueError(f"a turn of agent {turn.agent_id!r} sent to agent {self.agent_id!r}")
        request_id = self._runtime.new_request_id()
        submitted_at = time.perf_counter()

        sample_ids = tuple(self._runtime.new_request_id() for _ in range(turn.n - 1))

        def build(deltas: trio.MemorySendChannel[StreamItem] | None, reply: trio.MemorySendChannel[TurnReply]) -> Turn:
            return Turn(request_id=request_id, turn=turn, submitted_at=submitted_at, deltas=deltas, reply=reply,
                        sample_ids=sample_ids)

        return build

    async def run(self, turn: ChatTurn) -> TurnResult:
        """Run ``turn`` and wait for the reply."""
        build = self._builder(turn)
        reply_send, reply_receive = trio.open_memory_channel[TurnReply](1)
        async with reply_receive:
            await self._runtime.deliver(self.agent_id, build(None, reply_send))
            reply = await reply_receive.receive()
        if isinstance(reply, Failed):
            raise_failed(reply)
        return reply.result

    def open_stream(self, turn: ChatTurn) -> TurnStream:
        """Run ``turn``, yielding text deltas (see :class:`TurnStream`)."""
        return TurnStream(self._runtime, self.agent_id, self._builder(turn))

    async def send(self, messages: Sequence[Mapping[str, Any]], **options: Unpack[TurnOptions]) -> TurnResult:
        """Send the whole conversation (``{"role", "content"}`` dicts) and wait for the reply."""
        return await self.run(self.turn(messages=messages, **options))

    async def send_prompt(self, prompt: str, **options: Unpack[TurnOptions]) -> TurnResult:
        """Like :meth:`send` with raw prompt text (benchmarks, scenarios)."""
        return await self.run(self.turn(prompt=prompt, **options))

    def stream(self, messages: Sequence[Mapping[str, Any]], **options: Unpack[TurnOptions]) -> TurnStream:
        """Like :meth:`send`, yielding text deltas (see :class:`TurnStream`)."""
        return self.open_stream(self.turn(messages=messages, **options))

    def stream_prompt(self, prompt: str, **options: Unpack[TurnOptions]) -> TurnStream:
        """Like :meth:`stream` with raw prompt text."""
        return self.open_stream(self.turn(prompt=prompt, **options))

    async def forget(self) -> bool:
        """Delete the agent's cache (hot and on disk); True if there was one."""
        reply_send, reply_receive = trio.open_memory_channel[ForgetReply](1)
        async with reply_receive:
            await self._runtime.deliver(self.agent_id, ForgetAgent(reply=reply_send))
            reply = await reply_receive.receive()
        if isinstance(reply, Failed):
            raise_failed(reply)
        return reply.existed
