"""The GPU actor's mailbox: prompt rendering and generation requests, each naming its model.

Requests (:data:`GpuInbox`)::

    CountTokens(model, chat)  -> Counted(num_tokens) | Failed  (the Anthropic API's count_tokens)
    Generate(model, chat)     -> Generated(...)    | Failed    (+ text and tool calls on ``deltas``)
    Prepare(snapshot)         -> Prepared(parked)  | Failed    (a cache read at start, restored ahead)
    Forget | Flush | ListAgents | MeasureUsage                 (forwarded to the store: actors.messages_store)

The GPU actor holds the model: a request naming another configured model waits
until the turns on the loaded one are done, then the actor swaps
(:mod:`actors.model_slot`). A turn is one :class:`Generate`: the GPU actor takes
the agent's own cache from its hot tier (:mod:`actors.gpu_caches`; from the store,
:class:`actors.messages_store.Load`, when it holds none), renders its messages, plans
it against that cache with the cache manager
(:meth:`runtime.plan.kv_manager.KVCacheManager.plan`: what is reused and from where:
the agent's own cache, a prefix of another agent's, or none), generates, and keeps
the new cache hot, its host copy handed to the store (:class:`actors.messages_store.Save`)
before it answers. A template or tool error is its ``Failed`` reply, before anything
reaches the client.

The runtime's questions about every cache (:class:`actors.messages_store.Forget`,
``Flush``, ``ListAgents``, ``MeasureUsage``) come here too: the GPU actor adds what its hot
tier holds and forwards them to the store, which answers.
"""

from __future__ import annotations

from typing import Any

import msgspec
import trio

from actors.messages_common import ChatMessage, Failed, Message, ParkedView, TurnUsage
from actors.messages_store import Flush, Forget, ListAgents, MeasureUsage
from runtime.plan.engine import ModelInfo
from runtime.plan.sampling import SamplingOptions
from runtime.plan.tools import ToolCall, ToolChoice
from runtime.plan.turn_plan import Tier
from runtime.reply.logprobs import TokenLogprob
from runtime.spec import CacheSnapshot

__all__ = [
    "SamplingOptions",
    "ModelInfo",
    "Tier",
    "Chat",
    "CountTokens",
    "Generate",
    "Counted",
    "Generated",
    "TurnStarted",
    "OfSample",
    "Scores",
    "StreamItem",
    "TurnAccepted",
    "GpuInbox",
    "CountReply",
    "GenerateReply",
    "Prepare",
    "Prepared",
    "PrepareReply",
]

# -- replies -------------------------------------------------------------------


class Counted(Message, frozen=True, kw_only=True):
    """Reply to :class:`CountTokens`: the tokens of the prompt the template made."""

    num_tokens: int


class TurnAccepted(msgspec.Struct, frozen=True, kw_only=True):
    """The first item on the ``deltas`` channel of a streaming turn that waits for the batch: the turn
    passed every check a request can fail (its template rendered, its prompt tokenized and within the
    model's context and the KV budget); anything after this is the server's trouble. A turn that starts
    in the GPU actor's loop pass it was registered in sends its :class:`TurnStarted` first instead,
    which says the same (one message fewer).

    A streaming API answers its HTTP status only once it has either (or the turn's failure), so a
    request the turn refuses gets a real 4xx instead of an error event in a 200 stream.
    """

    prompt_tokens: int


class TurnStarted(msgspec.Struct, frozen=True, kw_only=True):
    """A turn's accounting once its prefill begins: the first item on a streaming turn's ``deltas`` channel, or
    the next after its :class:`TurnAccepted`.

    Known before any token is generated, so a streaming API can report it up
    front (Anthropic's ``message_start`` usage). ``tier`` and ``match`` as in
    :class:`Generated`; ``tokens_prefilled``: prompt tokens this turn runs through the model.
    """

    tokens_reused: int
    tokens_prefilled: int
    tier: Tier
    match: str


class Scores(msgspec.Struct, frozen=True, kw_only=True):
    """The log-probabilities of the reply tokens whose text comes next on a stream (a turn asking for
    ``logprobs``): sent before that text, so a client holds a text's scores when the text arrives."""

    tokens: tuple[TokenLogprob, ...]


class OfSample(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """Text, a tool call or scores of another sample of the turn's prompt (``n`` > 1: sample ``index``, from 1;
    the first sample's come bare), on the stream they share. One field holds it (a union of untagged structs
    would not decode over the control socket)."""

    index: int
    text: str = ""
    call: ToolCall | None = None
    scores: Scores | None = None

    @classmethod
    def of(cls, index: int, item: str | ToolCall | Scores) -> OfSample:
        if isinstance(item, str):
            return cls(index=index, text=item)
        return cls(index=index, call=item) if isinstance(item, ToolCall) else cls(index=index, scores=item)

    @property
    def item(self) -> str | ToolCall | Scores:
        return self.call if self.call is not None else self.scores if self.scores is not None else self.text


StreamItem = str | TurnAccepted | TurnStarted | ToolCall | Scores | OfSample
"""What a streaming turn's ``deltas`` channel carries: a :class:`TurnAccepted` (a turn that waits), a :class:`TurnStarted`,
then reply text (each piece after its :class:`Scores` when the turn asked for logprobs) and, in a turn with
tools, each :class:`runtime.plan.tools.ToolCall` once complete; a turn with several samples, the others'
as :class:`OfSample`."""


class Generated(Message, frozen=True, kw_only=True):
    """A finished (or cancelled) generation and the agent's updated cache.

    Attributes:
        reply: the text as generated (tool-call markup included): what the cache holds.
        content: the reply without its tool calls (the reply itself when the turn has no tools).
        tool_calls: the calls parsed out of the reply (``runtime.reply.tool_calls``).
        finish_reason: ``stop``, ``tool_calls``, ``length`` or ``cancelled``.
        tier: where the reused cache came from: the plan's tier, ``shared`` when the
            turn adopted a prefix of another agent's turn in flight, ``cold`` when
            nothing was reused.
        match: how the prompt matched the starting cache (``runtime.plan.prefix.MatchKind``).
        queue_wait_s: submission to admission (agent queue, cache fetch, memory wait).
        ttft_s: submission to the first token.
        parked: the updated cache (None when nothing new was computed or a
            sliding window could not be kept): the agent's hot cache now, held by the GPU actor.
        model: the name of the model that generated it.
    """

    request_id: int
    model: str
    reply: str
    finish_reason: str
    usage: TurnUsage
    parked: ParkedView | None
    stop_sequence: str | None = None
    content: str = ""
    tool_calls: tuple[ToolCall, ...] = ()
    logprobs: tuple[TokenLogprob, ...] = ()


class Prepared(Message, frozen=True, kw_only=True):
    """The snapshot restored on the MLX thread (None: not the loaded model's)."""

    parked: ParkedView | None


CountReply = Counted | Failed
GenerateReply = Generated | Failed
PrepareReply = Prepared | Failed

# -- requests ------------------------------------------------------------------


class Chat(msgspec.Struct, frozen=True, kw_only=True):
    """Chat messages for the loaded model's template to render (tokenizer work: MLX thread).

    Attributes:
        tools: tool definitions (a template without tool syntax gets kvmem's generic format).
        tool_choice: what the turn lets the model do with them; one the model
            cannot honour makes the render fail with ``ValueError``.
    """

    messages: tuple[ChatMessage, ...]
    tools: list[dict[str, Any]] | None = None
    tool_choice: ToolChoice | None = None

    def template_messages(self) -> list[dict[str, Any]]:
        """The messages as the chat template takes them (plain dicts), made at the render."""
        return [msgspec.to_builtins(m) for m in self.messages]


class CountTokens(Message, frozen=True, kw_only=True):
    """Count the tokens ``chat`` renders to with ``model``'s template (what a cold turn prefills; None: the
    default model)."""

    model: str | None
    chat: Chat
    reply: trio.MemorySendChannel[CountReply]


class Generate(Message, frozen=True, kw_only=True):
    """Render ``prompt`` (chat messages, or a raw prompt as is) with ``model`` (None: the default), plan it
    against the agent's own cache (its hot one, else the store's copy), and generate a reply.

    Attributes:
        durable: the turn is answered once its new cache is on disk: the GPU actor hands this reply to
            the store with the cache, and the store sends it (or ``Failed(kind="NotSaved")``) then;
            otherwise the save is write-behind and the GPU actor answers at once.
        deltas: where a :class:`TurnStarted` goes when prefill begins, then the
            streamable text and tool calls (:data:`StreamItem`; ``send_nowait``: what
            does not fit waits for the next token, text coalesced). The GPU actor never closes it.
        client: the caller's own reply channel. When its receive end is closed
            (the client left), the generation is cancelled; nothing is sent on it.
        submitted_at: ``time.perf_counter()`` when the client submitted the turn.
        share_prefix: this turn's prompt prefix may be shared with other agents'
            sequences in flight, both ways (the agent's ``share_prefix`` setting).
        group: the request id of the first of several samples of one prompt (``n`` > 1) this is one of: the
            samples start from one prefill of it (:class:`runtime.plan.kv_manager.KVCacheManager`); None: alone.
        sample: which of them this is (0: the first, the agent's own; the others stream as :class:`OfSample`,
            announce nothing and keep no cache).
    """

    request_id: int
    agent_id: str
    model: str | None
    prompt: Chat | str
    sampling: SamplingOptions
    submitted_at: float
    deltas: trio.MemorySendChannel[StreamItem] | None
    client: trio.MemorySendChannel[Any] | None
    reply: trio.MemorySendChannel[GenerateReply]
    share_prefix: bool = False
    group: int | None = None
    sample: int = 0
    durable: bool = False


class Prepare(Message, frozen=True, kw_only=True):
    """Restore a cache read from disk at start ahead of its turn (:meth:`runtime.plan.engine.Engine.prepare`)."""

    snapshot: CacheSnapshot
    reply: trio.MemorySendChannel[PrepareReply]


GpuInbox = CountTokens | Generate | Prepare | Forget | Flush | ListAgents | MeasureUsage
"""The GPU actor's mailbox: its own requests, and the questions about every cache it answers with the store
(:mod:`actors.gpu_caches`)."""
