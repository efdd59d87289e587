"""The client side of a turn: ``AgentHandle`` and ``TurnStream`` (see :mod:`actors.runtime`).

Handles build :class:`actors.messages_agent.Turn` messages, hand them to the
runtime's agent mailboxes and turn ``Failed`` replies back into exceptions.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NoReturn, Protocol

import trio

from actors.messages_agent import (
    AgentInbox,
    ForgetAgent,
    ForgetReply,
    Turn,
    TurnReply,
    TurnResult,
)
from actors.messages_common import Failed
from actors.messages_gpu import SamplingOptions
from runtime.errors import (
    BudgetExceededError,
    InvalidAgentIdError,
    KvmemError,
    ModelError,
    UnsupportedModelError,
)

__all__ = ["AgentHandle", "TurnStream", "TurnFailedError", "raise_failed"]

TurnBuilder = Callable[[trio.MemorySendChannel[str] | None, trio.MemorySendChannel[TurnReply]], Turn]


class Dispatcher(Protocol):
    """What a handle needs from the runtime."""

    def _new_request_id(self) -> int: ...

    async def _deliver(self, agent_id: str, message: AgentInbox) -> None: ...


class TurnFailedError(KvmemError):
    """A turn failed for a reason without a more specific exception (``kind`` names it)."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(f"{kind}: {message}")
        self.kind = kind


_ERRORS: dict[str, type[Exception]] = {
    "BudgetExceededError": BudgetExceededError,
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


def _sampling(max_tokens: int, temperature: float, top_p: float, top_k: int, stop: Sequence[str]) -> SamplingOptions:
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, not {max_tokens}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, not {temperature}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], not {top_p}")
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0, not {top_k}")
    if isinstance(stop, str):
        stop = (stop,)
    return SamplingOptions(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, stop=tuple(stop))


def _chat(messages: Sequence[Mapping[str, Any]], system: str | None) -> list[dict[str, Any]]:
    out = [dict(m) for m in messages]
    for m in out:
        if not isinstance(m.get("role"), str) or "content" not in m:
            raise ValueError("every message needs a 'role' and a 'content'")
    if system is not None and (not out or out[0]["role"] != "system"):
        out.insert(0, {"role": "system", "content": system})
    if not out:
        raise ValueError("no messages")
    return out


def _tools(tools: Sequence[Mapping[str, Any]] | None) -> list[dict[str, Any]] | None:
    return [dict(t) for t in tools] if tools else None


class TurnStream:
    """One streaming turn: an async context manager and an async iterator of text deltas.

    After iteration ends, :attr:`result` is the turn's :class:`TurnResult`.
    Failures raise from the iteration (``BudgetExceededError``, ``ModelError``, ...).
    """

    def __init__(self, runtime: Dispatcher, agent_id: str, build: TurnBuilder) -> None:
        self._runtime = runtime
        self._agent_id = agent_id
        self._build = build
        self._deltas: trio.MemoryReceiveChannel[str] | None = None
        self._reply: trio.MemoryReceiveChannel[TurnReply] | None = None
        self._streamed = 0
        self._done = False
        self.result: TurnResult | None = None

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
        deltas_send, self._deltas = trio.open_memory_channel[str](64)
        reply_send, self._reply = trio.open_memory_channel[TurnReply](1)
        try:
            await self._runtime._deliver(self._agent_id, self._build(deltas_send, reply_send))
        except BaseException:
            await self.aclose()
            raise

    async def __anext__(self) -> str:
        if self._done:
            raise StopAsyncIteration
        try:
            await self._open()
            assert self._deltas is not None and self._reply is not None
            try:
                delta = await self._deltas.receive()
            except trio.EndOfChannel:
                reply = await self._reply.receive()
                self._done = True
                if isinstance(reply, Failed):
                    raise_failed(reply)
                self.result = reply.result
                rest = reply.result.reply[self._streamed :]
                if rest:
                    self._streamed += len(rest)
                    return rest
                raise StopAsyncIteration from None
        except BaseException:
            await self.aclose()  # when the turn is still running, this tells the GPU actor: the client left
            raise
        self._streamed += len(delta)
        return delta

    async def aclose(self) -> None:
        """Stop the turn if it is still running (closing our ends is the signal)."""
        self._done = True
        for channel in (self._deltas, self._reply):
            if channel is not None:
                channel.close()


class AgentHandle:
    """A client's view of one agent; cheap to create, safe to share between tasks.

    Args:
        share_prefix: start this agent from another agent's cached prefix when
            its own cache has nothing reusable, and let other agents start from
            this agent's cache (False opts out both ways).
    """

    def __init__(self, runtime: Dispatcher, agent_id: str, *, share_prefix: bool = True) -> None:
        self._runtime = runtime
        self.agent_id = agent_id
        self.share_prefix = share_prefix

    def _builder(
        self,
        *,
        messages: list[dict[str, Any]] | None,
        prompt: str | None,
        model: str | None,
        sampling: SamplingOptions,
        tools: list[dict[str, Any]] | None = None,
    ) -> TurnBuilder:
        request_id = self._runtime._new_request_id()
        submitted_at = time.perf_counter()

        def build(deltas: trio.MemorySendChannel[str] | None, reply: trio.MemorySendChannel[TurnReply]) -> Turn:
            return Turn(
                request_id=request_id,
                messages=messages,
                prompt=prompt,
                model=model,
                sampling=sampling,
                share_prefix=self.share_prefix,
                submitted_at=submitted_at,
                deltas=deltas,
                reply=reply,
                tools=tools,
            )

        return build

    async def _send(self, build: TurnBuilder) -> TurnResult:
        reply_send, reply_receive = trio.open_memory_channel[TurnReply](1)
        async with reply_receive:
            await self._runtime._deliver(self.agent_id, build(None, reply_send))
            reply = await reply_receive.receive()
        if isinstance(reply, Failed):
            raise_failed(reply)
        return reply.result

    async def send(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        max_tokens: int = 256,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        stop: Sequence[str] = (),
        system: str | None = None,
        model: str | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> TurnResult:
        """Send the whole conversation (chat messages) and wait for the reply.

        Args:
            messages: ``{"role", "content"}`` dicts, rendered with the model's template.
            system: a system prompt put first unless the messages begin with one.
            model: a configured model name (None: the runtime's default); another
                model than the loaded one makes the runtime swap.
            tools: tool definitions (OpenAI ``{"type": "function", "function": ...}``
                dicts) rendered by the model's chat template; messages may then
                carry ``tool_calls`` (assistant) and ``role: "tool"`` results.
                A template without tool support fails the turn with ``ValueError``.

        Raises:
            BudgetExceededError: the turn cannot fit the KV budget even alone.
            ModelError: the model cannot be loaded.
            ValueError: bad arguments or an unconfigured model.
            TurnFailedError: anything else that went wrong.
        """
        sampling = _sampling(max_tokens, temperature, top_p, top_k, stop)
        build = self._builder(
            messages=_chat(messages, system), prompt=None, model=model, sampling=sampling, tools=_tools(tools)
        )
        return await self._send(build)

    async def send_prompt(
        self,
        prompt: str,
        *,
        max_tokens: int = 256,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        stop: Sequence[str] = (),
        model: str | None = None,
    ) -> TurnResult:
        """Like :meth:`send` with raw prompt text (benchmarks, scenarios)."""
        if not prompt:
            raise ValueError("empty prompt")
        sampling = _sampling(max_tokens, temperature, top_p, top_k, stop)
        return await self._send(self._builder(messages=None, prompt=prompt, model=model, sampling=sampling))

    def stream(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        max_tokens: int = 256,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        stop: Sequence[str] = (),
        system: str | None = None,
        model: str | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> TurnStream:
        """Like :meth:`send`, yielding text deltas (see :class:`TurnStream`)."""
        sampling = _sampling(max_tokens, temperature, top_p, top_k, stop)
        build = self._builder(
            messages=_chat(messages, system), prompt=None, model=model, sampling=sampling, tools=_tools(tools)
        )
        return TurnStream(self._runtime, self.agent_id, build)

    def stream_prompt(
        self,
        prompt: str,
        *,
        max_tokens: int = 256,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        stop: Sequence[str] = (),
        model: str | None = None,
    ) -> TurnStream:
        """Like :meth:`stream` with raw prompt text."""
        if not prompt:
            raise ValueError("empty prompt")
        sampling = _sampling(max_tokens, temperature, top_p, top_k, stop)
        build = self._builder(messages=None, prompt=prompt, model=model, sampling=sampling)
        return TurnStream(self._runtime, self.agent_id, build)

    async def forget(self) -> bool:
        """Delete the agent's cache (hot and on disk); True if there was one."""
        reply_send, reply_receive = trio.open_memory_channel[ForgetReply](1)
        async with reply_receive:
            await self._runtime._deliver(self.agent_id, ForgetAgent(reply=reply_send))
            reply = await reply_receive.receive()
        if isinstance(reply, Failed):
            raise_failed(reply)
        return reply.existed


