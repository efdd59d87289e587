"""AgentActor: one per agent id; serializes the agent's turns and knows its cache.

A turn, in order (the next turn of the same agent starts only after this one
ends, so turn 2 always sees turn 1's cache):

1. one request to the GPU actor (:class:`Generate`, naming the model), which holds
   the model (swapping first when the turn names another one: :mod:`actors.model_slot`)
   and the agents' hot caches (:mod:`actors.gpu_caches`; the store's copy when it holds
   none of the agent), renders the messages, plans what of the prompt is reused and from where
   (that cache, else another agent's prefix, else nothing: the cache manager,
   :meth:`runtime.plan.kv_manager.KVCacheManager.plan`), generates — deltas go
   straight to the client's stream — and keeps the updated cache hot, handing its host
   copy to the store for its write *before* the turn is answered (or owing it: under the
   GPU policy the copy is made after the turn), so every turn a client saw complete is
   saved or owed and is flushed on shutdown;
2. a *durable* turn (``ChatTurn.durable``, else the runtime's ``durable`` setting)
   is answered by the store, once its cache is on disk (the GPU actor hands the
   reply over with the cache), so a turn answered is a turn kept even if the
   process is killed a moment later; any other by the GPU actor at once;
3. answer the client with a :class:`TurnResult`.

The actor stops after ``idle_timeout_s`` without messages (its hot cache
stays with the GPU actor); the runtime starts a new one on the agent's next request.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable
from functools import partial
from typing import assert_never

import msgspec
import trio

from actors.mailbox import ask, receiver_left, send_reply
from actors.messages_agent import (
    AgentInbox,
    ForgetAgent,
    Forgot,
    Turn,
    TurnDone,
    TurnReply,
    TurnResult,
)
from actors.messages_common import Failed, ParkedView
from actors.messages_gpu import Chat, Generate, Generated, GenerateReply, GpuInbox
from actors.messages_store import Forget, ForgetReply
from actors.metrics import RuntimeMetrics

__all__ = ["AgentActor", "CacheHandle"]

log = logging.getLogger("kvmem.agent")


class CacheHandle(msgspec.Struct, frozen=True, kw_only=True):
    """What an agent knows of its cache after its last turn: what it holds, where it was left, which branch.

    The data itself is the GPU actor's (its hot tier, :mod:`actors.gpu_caches`) and the store's (a copy
    queued for its write, the disk); the GPU actor may demote the hot copy later, and the agent's next
    turn is then served from the store's.

    Attributes:
        model_tag, num_tokens, text_chars: what it holds: that model's cache of that many tokens and
            characters of text (the prompt and the reply as generated).
        on_disk: the turn was durable, so this cache was on disk when the turn was answered; else its
            copy was queued or owed then (written behind).
        branch: a digest of the text it holds: a conversation that comes back edited or rewound leaves
            its branch (its next turn reuses the cache to where the two part, :mod:`runtime.plan.prefix`),
            one that goes on extends it.
    """

    model_tag: str
    num_tokens: int
    text_chars: int
    on_disk: bool
    branch: str

    @classmethod
    def of(cls, parked: ParkedView, *, on_disk: bool) -> CacheHandle:
        return cls(model_tag=parked.model_tag, num_tokens=parked.num_tokens, text_chars=len(parked.text),
                   on_disk=on_disk, branch=hashlib.blake2b(parked.text.encode(), digest_size=8).hexdigest())


class AgentActor:
    """Serializes one agent's requests (see the module docstring).

    Args:
        agent_id: the agent.
        inbox: its mailbox.
        gpu: a clone of the GPU actor's mailbox (closed on exit): the agent's one peer.
        metrics: runtime counters, updated as turns end.
        idle_timeout_s: stop after this long without a message.
        durable: whether turns that do not say wait for their save (the ``durable`` setting).
        retire: called on idle timeout; returns True when the runtime removed
            this agent's mailbox (nothing was queued) and the actor may stop.
        handled: called once per message after it was handled (``Runtime.wait_idle``).
    """

    def __init__(
        self,
        agent_id: str,
        inbox: trio.MemoryReceiveChannel[AgentInbox],
        *,
        gpu: trio.MemorySendChannel[GpuInbox],
        metrics: RuntimeMetrics,
        idle_timeout_s: float,
        retire: Callable[[AgentActor], bool],
        handled: Callable[[], None] = lambda: None,
        durable: bool = True,
    ) -> None:
        self.agent_id = agent_id
        self.inbox = inbox
        self._gpu = gpu
        self._metrics = metrics
        self._idle_timeout_s = idle_timeout_s
        self._retire = retire
        self._handled = handled
        self._durable = durable
        self.handle: CacheHandle | None = None
        self.turns = 0

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with self.inbox, self._gpu:
            task_status.started()
            while True:
                message: AgentInbox | None = None
                with trio.move_on_after(self._idle_timeout_s):
                    try:
                        message = await self.inbox.receive()
                    except trio.EndOfChannel:
                        return
                if message is None:
                    if self._retire(self):
                        log.debug("agent %s idle: stopping", self.agent_id)
                        return
                    continue
                try:
                    await self._handle(message)
                finally:
                    self._handled()
                # A forgotten agent has nothing left to keep: its actor stops (it no longer counts
                # as live, e.g. against a tenant's agent limit) unless messages are waiting.
                if isinstance(message, ForgetAgent) and self.handle is None and self._retire(self):
                    log.debug("agent %s forgotten: stopping", self.agent_id)
                    return

    async def _handle(self, message: AgentInbox) -> None:
        match message:
            case Turn():
                try:
                    if receiver_left(message.reply):
                        return  # the client left while the turn was queued
                    self._metrics.request_started()
                    try:
                        reply = await self._turn(message)
                    except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                        reply = Failed(kind="Cancelled", error=f"the runtime is shutting down ({exc!r})")
                finally:
                    if message.deltas is not None:
                        message.deltas.close()
                if isinstance(reply, Failed):
                    self._metrics.request_failed()
                send_reply(message.reply, reply)
            case ForgetAgent(reply=reply):
                # The GPU actor drops the agent's hot caches and asks the store to delete the rest.
                answer: ForgetReply = await ask(self._gpu, lambda r: Forget(agent_id=self.agent_id, reply=r))
                if not isinstance(answer, Failed):
                    self.handle = None
                    send_reply(reply, Forgot(existed=answer.existed))
                else:
                    send_reply(reply, answer)
            case _:
                assert_never(message)

    async def _turn(self, turn: Turn) -> TurnReply:
        durable = self._durable if turn.turn.durable is None else turn.turn.durable
        generated = await self._generate(turn, durable)
        if isinstance(generated, Failed):
            if generated.kind == "NotSaved":
                log.warning("durable turn of %s not answered: %s", self.agent_id, generated.error)
            return generated
        main = generated[0]
        if main.parked is not None:
            self.handle = CacheHandle.of(main.parked, on_disk=durable)
        return self._done(generated)

    async def _generate(self, turn: Turn, durable: bool) -> list[Generated] | Failed:
        """The turn's reply from the GPU actor (from the store, for a durable turn: once its cache is on disk);
        with ``n`` > 1 its samples too, asked together (one group: they start from one prefill of the prompt
        and decode in one batch), the first being the agent's own."""
        request = turn.turn
        ids = (turn.request_id, *turn.sample_ids)
        prompt = request.prompt if request.prompt is not None else Chat(
            messages=request.messages, tools=request.tool_list(), tool_choice=request.tool_choice if request.tools else None)

        def generate(sample: int, reply: trio.MemorySendChannel[GenerateReply]) -> Generate:
            return Generate(request_id=ids[sample], agent_id=self.agent_id, model=request.model, prompt=prompt,
                            sampling=request.engine_sampling(sample), submitted_at=turn.submitted_at,
                            deltas=turn.deltas, client=turn.reply, reply=reply, share_prefix=request.share_prefix,
                            group=turn.request_id if len(ids) > 1 else None, sample=sample,
                            durable=durable)

        if len(ids) == 1:
            alone: GenerateReply = await ask(self._gpu, partial(generate, 0))
            return alone if isinstance(alone, Failed) else [alone]
        # Sent in order, the first first: the GPU actor tokenizes and queues them in order, so the first
        # sample starts first and the others start from its prompt (``KVCacheManager.held_back``).
        receivers = []
        for sample in range(len(ids)):
            send, receive = trio.open_memory_channel[GenerateReply](1)
            receivers.append(receive)
            await self._gpu.send(generate(sample, send))
        replies: list[GenerateReply | None] = [None] * len(ids)
        async with trio.open_nursery() as nursery:
            async def wait_for(sample: int) -> None:
                async with receivers[sample]:
                    try:
                        replies[sample] = reply = await receivers[sample].receive()
                    except trio.EndOfChannel:  # the GPU actor stopped without answering
                        replies[sample] = reply = Failed(kind="Cancelled", error="the runtime is shutting down")
                if isinstance(reply, Failed):
                    nursery.cancel_scope.cancel()  # the others are cancelled: the turn fails

            for sample in range(len(ids)):
                nursery.start_soon(wait_for, sample)
        for receive in receivers:
            receive.close()  # a sample cancelled above: its reply channel closed tells the GPU actor
        failed = next((r for r in replies if isinstance(r, Failed)), None)
        if failed is not None:
            return failed
        return [r for r in replies if r is not None]

    def _done(self, generated: list[Generated]) -> TurnDone:
        self.turns += 1
        main = generated[0]
        self._metrics.turn_done(agent_id=self.agent_id, finish_reason=main.finish_reason, usage=main.usage)
        results = [
            TurnResult(
                agent_id=self.agent_id,
                request_id=g.request_id,
                model=g.model,
                reply=g.reply,
                finish_reason=g.finish_reason,
                usage=g.usage,
                stop_sequence=g.stop_sequence,
                content=g.content,
                tool_calls=g.tool_calls,
                logprobs=g.logprobs,
            )
            for g in generated
        ]
        return TurnDone(result=msgspec.structs.replace(results[0], samples=tuple(results[1:])))
