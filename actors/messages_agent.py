"""An agent's mailbox (:data:`AgentInbox`), the turn a client asks for, and the turn's result.

Requests and their replies::

    Turn(ChatTurn, ...)  -> TurnDone(result) | Failed   (+ text deltas on ``deltas``)
    ForgetAgent()        -> Forgot(existed)  | Failed

:class:`ChatTurn` is the one typed contract between clients (the HTTP gateway,
the CLI, orchestration code through ``AgentHandle``) and the actors: the
conversation or a raw prompt, sampling, tools, model and agent, checked once
when it is built. :class:`TurnResult` and :class:`TurnUsage` are what
``AgentHandle.send`` returns; they encode to JSON with ``msgspec.json.encode``
unchanged.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypedDict

import msgspec
import trio

from actors.messages_common import ChatMessage, Failed, Message, TurnUsage
from actors.messages_gpu import SamplingOptions, StreamItem
from runtime.plan.sampling import SEED_RANGE
from runtime.plan.tools import ResponseFormat, ToolCall, ToolChoice, ToolUse
from runtime.reply.logprobs import TokenLogprob
from runtime.reply.reply_format import schema_error

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = [
    "TurnOptions",
    "MAX_SAMPLES",
    "ChatMessage",
    "ChatTurn",
    "ResponseFormat",
    "ToolCall",
    "ToolChoice",
    "chat_messages",
    "check_tool_definitions",
    "TurnUsage",
    "TurnResult",
    "Turn",
    "TurnDone",
    "ForgetAgent",
    "Forgot",
    "TurnReply",
    "ForgetReply",
    "AgentInbox",
]


MAX_SAMPLES = 16
"""The most replies one turn samples from its prompt (``n``): each is a row of the batch."""


class TurnResult(msgspec.Struct, frozen=True, kw_only=True):
    """A finished turn: the reply, its tool calls, why it stopped, usage.

    Attributes:
        reply: the text as the model generated it (tool-call markup included):
            what the agent's cache now holds.
        content: the reply without its tool calls (in a turn without tools, or
            without calls, the reply itself).
        tool_calls: the calls the model's mlx-lm tool parser read out of the reply.
        finish_reason: ``stop``, ``tool_calls`` (stopped after calling tools),
            ``length`` or ``cancelled``.
        stop_sequence: the caller's stop string that ended the reply (not part
            of ``reply``); None when the turn stopped at end-of-sequence or for another reason.
        logprobs: each reply token's log-probability and most likely alternatives, when the turn
            asked for them (``logprobs``; :mod:`runtime.reply.logprobs`); empty otherwise.
        samples: the other replies to the same prompt, when the turn asked for ``n`` > 1 (each a result
            of its own, with its own usage; none of them is in the agent's cache, this one is).
    """

    agent_id: str
    request_id: int
    model: str
    reply: str
    finish_reason: str
    usage: TurnUsage
    stop_sequence: str | None = None
    content: str
    tool_calls: tuple[ToolCall, ...] = ()
    logprobs: tuple[TokenLogprob, ...] = ()
    samples: tuple[TurnResult, ...] = ()

    def assistant_message(self) -> dict[str, Any]:
        """The reply as the next turn's assistant message: its content and, if any, its tool calls.

        Rendered by the chat template, it is the text the model generated (when the
        model wrote its call as the template writes one), so the next turn extends the cache.
        """
        message: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.tool_calls:
            message["tool_calls"] = [call.for_template() for call in self.tool_calls]
        return message


class TurnDone(Message, frozen=True, kw_only=True):
    """Reply to a :class:`Turn`: the finished turn's :class:`TurnResult` (reply, stop reason, usage)."""

    result: TurnResult


class Forgot(Message, frozen=True, kw_only=True):
    """Reply to :class:`ForgetAgent`: the agent's caches are deleted; ``existed``: whether it had any."""

    existed: bool


TurnReply = TurnDone | Failed
ForgetReply = Forgot | Failed


class TurnOptions(TypedDict, total=False):
    """The keyword arguments every ``AgentHandle`` turn method and :meth:`ChatTurn.of` take: the one list of a
    turn's options (a sampling option's meaning and range: :class:`runtime.plan.sampling.SamplingOptions`).

    Attributes:
        max_tokens: new tokens at most (256).
        temperature: 0 is greedy (the default); top_p, top_k: mlx-lm's sampler.
        seed: the turn's own random stream: a sampled reply repeats for the same seed, prompt
            and parameters, whatever else runs (it draws what mlx-lm's sampler draws after
            ``mx.random.seed(seed)``); None draws from the process's.
        presence_penalty, frequency_penalty (OpenAI's, in [-2, 2]), repetition_penalty
            (multiplicative, > 0; 1 is none): mlx-lm's repeat penalties over the last 20 tokens.
        logit_bias: token id to a bias in [-100, 100] added to its logit (OpenAI's).
        logprobs: report each reply token's log-probability and this many most likely alternatives
            (0 to 20; None: none): ``TurnResult.logprobs``, streamed through ``TurnStream.take_logprobs``.
        n: sample this many replies from the prompt (one prefill, one batch); the first is the agent's
            own, the others come back in ``TurnResult.samples`` (streamed: ``TurnStream.choices``).
        fit_context: max_tokens is a default, not a limit the caller named: a prompt that leaves
            less room in the model's context gets what is left instead of ``ContextLengthExceededError``.
        stop: a string or strings that end the reply (not part of it).
        system: a system prompt put first unless the messages begin with one.
        model: a configured model name (None: the runtime's default); another
            model than the loaded one makes the runtime swap.
        tools: tool definitions (OpenAI ``{"type": "function", "function": ...}``
            dicts) rendered by the model's chat template, or in kvmem's generic
            format when it has no tool syntax (``runtime.reply.generic_tools``); messages
            may then carry ``tool_calls`` (assistant) and ``role: "tool"`` results.
            The reply's tool calls come back in ``TurnResult.tool_calls``.
        tool_choice: ``"auto"`` (default), ``"none"``, ``"required"`` or
            ``{"name": f}``; one the model cannot honour fails with ``ValueError``.
        response_format: the reply is JSON: ``{"type": "json_object"}`` (any object) or
            ``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}``
            (valid against the schema), as OpenAI takes it; decoded under the schema's
            grammar on every model.
        parallel_tool_calls: False: one call at most (where the model writes
            kvmem's generic tool-call format).
        sampling: every sampling option at once, as an API's request decodes them, instead of
            ``max_tokens``, ``temperature``, ``top_p`` ... one by one.
        durable: return only once the turn's cache is saved on disk (None: the
            runtime's ``durable`` setting); a failed save raises ``TurnFailedError``
            of kind ``NotSaved`` (the cache stays in memory and is saved later).
    """

    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    stop: str | Sequence[str]
    seed: int | None
    presence_penalty: float | None
    frequency_penalty: float | None
    repetition_penalty: float | None
    logit_bias: Mapping[int, float] | None
    logprobs: int | None
    n: int
    fit_context: bool
    system: str | None
    model: str | None
    tools: Sequence[Mapping[str, Any]] | None
    tool_choice: str | Mapping[str, Any] | ToolChoice | None
    response_format: Mapping[str, Any] | ResponseFormat | None
    parallel_tool_calls: bool
    sampling: SamplingOptions
    durable: bool | None


class ChatTurn(msgspec.Struct, frozen=True, kw_only=True):
    """One turn as a client asks for it; checked when built (a bad value raises ``ValueError``).

    Attributes:
        agent_id: whose turn it is (checked by ``Runtime.agent``, which hands out handles).
        messages: the whole conversation, rendered with the model's template; or
        prompt: raw prompt text instead (exactly one of the two).
        tools: tool definitions (OpenAI ``{"type": "function", "function": ...}``),
            rendered by the template (``messages`` only); tool calls in the reply
            are parsed out of it (``TurnResult.tool_calls``).
        tool_choice: what the model may do with them (``auto``; ``none``;
            ``required``, optionally naming the one function to call).
        response_format: the reply (its answer, with tools) is JSON, valid against a
            schema when it gives one; decoded under the schema's grammar on every model.
        parallel_tool_calls: False: one call at most (where the model writes kvmem's
            generic tool-call format).
        model: a configured model name (None: the runtime's default).
        sampling: length, randomness and stop strings.
        share_prefix: start from another agent's cached prefix when this agent's
            cache has nothing reusable, and let others start from this one's.
        durable: answer only once the turn's cache is saved on disk (fsynced): a turn
            answered is a turn kept, even if the process is killed right after. None:
            the runtime's ``durable`` setting (on by default; off: the save is write-behind).
        n: how many replies to sample from the prompt (OpenAI's ``n``, 1 to :data:`MAX_SAMPLES`): they
            start from one prefill of it and decode as rows of one batch; the first is the agent's own
            (its cache is kept), the others come back in ``TurnResult.samples``. A ``seed`` gives sample
            ``i`` the seed + ``i``.
    """

    agent_id: str
    messages: tuple[ChatMessage, ...] = ()
    prompt: str | None = None
    tools: tuple[dict[str, Any], ...] = ()
    tool_choice: ToolChoice = ToolChoice()
    response_format: ResponseFormat | None = None
    parallel_tool_calls: bool = True
    model: str | None = None
    sampling: SamplingOptions = msgspec.field(default_factory=SamplingOptions)
    share_prefix: bool = True
    durable: bool | None = None
    n: int = 1

    def __post_init__(self) -> None:
        if not 1 <= self.n <= MAX_SAMPLES:
            raise ValueError(f"n must be in [1, {MAX_SAMPLES}], not {self.n}")
        if self.prompt is None and not self.messages:
            raise ValueError("no messages")
        if self.prompt is not None and self.messages:
            raise ValueError("give messages or a prompt, not both")
        if self.prompt == "":
            raise ValueError("empty prompt")
        if self.prompt is not None and self.tools:
            raise ValueError("tools need messages, not a raw prompt")
        choice = self.tool_choice
        if choice.mode == "required" and not self.tools:
            raise ValueError("tool_choice requires a tool call, but no tools were given")
        names = {(t.get("function") or t).get("name") for t in self.tools}
        if choice.name is not None and choice.name not in names:
            raise ValueError(f"tool_choice names {choice.name!r}, which is not one of the tools given")
        check_tool_definitions(self.tools)

    @classmethod
    def of(cls, agent_id: str, *, messages: Sequence[Mapping[str, Any] | ChatMessage] | None = None,
           prompt: str | None = None, share_prefix: bool = True, **options: Unpack[TurnOptions]) -> ChatTurn:
        """Build a turn from plain values: chat dicts (``role``, ``content``, ...) or a prompt, and the options
        of :class:`TurnOptions` (``system`` is put first unless the messages begin with a system message).
        The sampling options go to :meth:`runtime.plan.sampling.SamplingOptions.of` by name (or come
        whole, as ``sampling``).

        Raises:
            TypeError: an unknown option, or ``sampling`` beside single sampling options.
            ValueError: a bad value.
        """
        rest = dict(options)
        system = rest.pop("system", None)
        # The turn's own fields (ours by name); what is left is sampling options.
        turn = {name: rest.pop(name) for name in cls.__struct_fields__ if name in rest}
        sampling = turn.pop("sampling", None)
        if sampling is not None and rest:
            raise TypeError(f"give sampling or single sampling options ({', '.join(sorted(rest))}), not both")
        return cls(agent_id=agent_id, messages=chat_messages(messages or (), system if prompt is None else None),
                   prompt=prompt, tools=tuple(dict(t) for t in turn.pop("tools", None) or ()),
                   tool_choice=ToolChoice.of(turn.pop("tool_choice", None)),
                   response_format=ResponseFormat.of(turn.pop("response_format", None)),
                   sampling=sampling or SamplingOptions.of(**rest), share_prefix=share_prefix, **turn)

    def tool_list(self) -> list[dict[str, Any]] | None:
        """The tool definitions for the template (None: no tools)."""
        return [dict(t) for t in self.tools] or None

    def engine_sampling(self, sample: int = 0) -> SamplingOptions:
        """The sampling options as the engine takes them: with the tools and ``tool_choice`` when there are
        tools, and the ``response_format``; for sample ``sample`` of ``n``, the seed + ``sample``."""
        sampling = msgspec.structs.replace(self.sampling, response_format=self.response_format)
        if sample and sampling.seed is not None:
            low, high = SEED_RANGE
            sampling = msgspec.structs.replace(sampling, seed=(sampling.seed + sample - low) % (high - low + 1) + low)
        if not self.tools or self.prompt is not None:
            return sampling
        use = ToolUse(tools=self.tools, choice=self.tool_choice, parallel=self.parallel_tool_calls)
        return msgspec.structs.replace(sampling, tool_use=use)


def chat_messages(
    messages: Sequence[Mapping[str, Any] | ChatMessage], system: str | None = None
) -> tuple[ChatMessage, ...]:
    """Chat dicts (``role``, ``content``, ...) as messages; ``system`` first unless they begin with one."""
    chat = [_chat_message(m) for m in messages]
    if system is not None and (not chat or chat[0].role != "system"):
        chat.insert(0, ChatMessage(role="system", content=system))
    return tuple(chat)


def _chat_message(m: Mapping[str, Any] | ChatMessage) -> ChatMessage:
    if isinstance(m, ChatMessage):
        return m
    if not isinstance(m.get("role"), str) or "content" not in m:
        raise ValueError("every message needs a 'role' and a 'content'")
    try:
        return msgspec.convert(dict(m), ChatMessage)
    except msgspec.ValidationError as exc:
        raise ValueError(f"bad message: {exc}") from None


class Turn(Message, frozen=True, kw_only=True):
    """Run ``turn`` for this agent.

    Attributes:
        request_id: the runtime's id for this request.
        submitted_at: ``time.perf_counter()`` at submission (queue wait, TTFT).
        deltas: a :class:`actors.messages_gpu.TurnStarted` when prefill begins, then
            the streamed text and tool calls (None: not streaming); the agent closes
            it when the generation is over, then answers on ``reply``.
        reply: the one-shot reply. Closing its receive end cancels the turn.
        sample_ids: the runtime's ids for the turn's other samples (``n`` - 1 of them).
    """

    request_id: int
    turn: ChatTurn
    submitted_at: float
    deltas: trio.MemorySendChannel[StreamItem] | None
    reply: trio.MemorySendChannel[TurnReply]
    sample_ids: tuple[int, ...] = ()


class ForgetAgent(Message, frozen=True, kw_only=True):
    """Delete the agent's cache, hot and on disk."""

    reply: trio.MemorySendChannel[ForgetReply]


AgentInbox = Turn | ForgetAgent


def check_tool_definitions(tools: Sequence[Mapping[str, Any]]) -> None:
    """Raise ``ValueError`` naming the first tool without a name or with a parameters schema
    that cannot constrain a call (``tools[i]...``)."""
    for i, tool in enumerate(tools):
        inner = tool.get("function")
        function = inner if isinstance(inner, Mapping) else tool
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise ValueError(f"tools[{i}]: a function name is required")
        params = function.get("parameters")
        if params is not None and (error := schema_error(params)):
            raise ValueError(f"tools[{i}] ({name}): parameters: {error}")
