"""GPUActor: the one actor that owns MLX work, and its scheduler loop.

Every MLX call runs on one :class:`actors.mlx_thread.MlxThread`, as one
bounded job of a :class:`runtime.plan.engine.Engine`. The loop::

    receive messages (block only when there is nothing to do); a turn's prompt is rendered and
        tokenized on a worker thread meanwhile, then queued (when nothing runs, the loop waits
        for the prompts being tokenized, so turns that came together start together)
    reap requests whose client left (extract + park the partial turn)
    start the requests the scheduler admits (the block budget can hold them)
    carry out the scheduler's Step (runtime.plan.scheduler: decided as a value, before any of it runs):
        short prefills join first (one pass for those that can), each with its donor's blocks
        decode steps for every sequence in the batch  -> deliver each new token
            (several back to back on the MLX thread when no prefill is left, each step's
            tokens posted to trio as it ends; a finished row or a message ends the run)
        one prefill chunk for the admitted prefill with the least left (aged)
        last chunk -> first token; the sequence joins the batch (merge/extend)
    finished sequences leave the batch (extract/filter), are parked, and their
    updated cache goes back to the agent in the ``Generated`` reply
    one owed host copy (below), if one is wanted or overdue

Under the GPU policy (``BackendProfile.copy_after_turn``) a turn's end waits for
nothing: the engine launches the park and leaves the cache's host copy for its
save to later: the actor owes that copy (:mod:`actors.gpu_caches`, which holds the
agents' hot caches) and makes the copies it owes when the write-behind policy says
(:func:`runtime.plan.save_queue.next_copy`: once it has had no turn to run for a
moment, else one per loop pass once the store wants it or it is overdue, an overdue
one after the prefill under way, whose chunks a host copy would wait for); a copy
a newer cache superseded is never made, and the ones still owed are made before
the actor stops or swaps models. A copy made while idle goes a part at a time
(a few MB of one array: :mod:`runtime.kv.host_copy`) and stops when a message comes
(the message goes first; the copy resumes where it stopped): on a GPU a host copy
is slow (about 0.6 GB/s on an H200), and a new turn should wait for one part's,
not for a layer's or a whole cache's.

Tokens reach clients through each request's ``deltas`` channel with
``send_nowait``: a slow reader never stalls the batch (undelivered text is
coalesced into the next delta; the final reply carries the whole text).
"""

from __future__ import annotations

import gc
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, assert_never

import msgspec
import outcome
import trio

from actors.mailbox import receiver_left, send_reply
from actors.messages_common import Failed, failed_from
from actors.gpu_caches import AgentCaches, CheckedOut, OwedCopy
from actors.messages_gpu import (
    Chat,
    Counted,
    CountTokens,
    Generate,
    GenerateReply,
    GpuInbox,
    Prepare,
    OfSample,
    Prepared,
    Scores,
    TurnAccepted,
    TurnStarted,
)
from actors.gpu_turns import GpuTurn, generated_reply, running_turn, tier_of
from actors.messages_store import (
    Evict, EvictReply, Flush, Flushed, Forget, Forgotten, ListAgents, AgentsListed, MeasureUsage, ReadBlocks,
    StoreInbox, Used,
)
from actors.model_slot import ModelSlot, RegistryStats
from actors.metrics import GpuEvent, GpuStats, MemorySnapshot, RunningTurn
from actors.mlx_thread import MlxThread
from actors.text_jobs import Abandoned, TextJobs
from runtime import heap
from runtime.backend import DECODE_RUN_S
from runtime.plan import save_queue
from runtime.plan.save_queue import copy_wait, next_copy
from runtime.plan.scheduler import Scheduler, Step
from runtime.plan.engine import Engine, Finished, ModelInfo, PrefillResult, SequenceStarted, StepTiming
from runtime.plan.sampling import SamplingOptions
from runtime.plan.tools import ToolCall
from runtime.plan.turn_plan import FromShared, OwnCache, Tokenized, TurnPlan
from runtime.errors import ContextLengthExceededError, ModelError
from runtime.reply.logprobs import TokenLogprob
from runtime.plan.block_pool import PoolStats
from runtime.identity import AgentKey
from runtime.plan.hot_tier import HotEntry, HotTier, HotTierStats
from runtime.plan.disk_blocks import blocks_to_look_up, start_from_blocks
from runtime.plan.kv_manager import KVCacheManager

__all__ = ["GPUActor"]

log = logging.getLogger("kvmem.gpu")

STOP_COPIES_S = 60.0
"""At shutdown, how long the copies still owed may take before the rest are given up (their saves fail)."""

_SHUTTING_DOWN = Failed(kind="Cancelled", error="the runtime is shutting down")

LONG_TEXT_CHARS = 64 * 1024
"""A prompt longer than this (about 15K tokens of prose) is tokenized by its own worker (``_long_text_jobs``):
a 3.5 MB prompt took 5 s to tokenize on this 2-core machine, and every turn behind it waited."""


def _render_chat(engine: Engine, chat: Chat) -> str:
    """On a text worker: the messages in the template's form (plain dicts, made here), rendered."""
    return engine.render(chat.template_messages(), chat.tools, chat.tool_choice)


def _still_wanted(msg: Generate) -> bool:
    """Whether anyone still waits for ``msg``'s turn: its client (a stream's deltas) and its agent."""
    return not (receiver_left(msg.client) or receiver_left(msg.reply))


def _refuse_from_length(prompt: str, info: ModelInfo | None, sampling: SamplingOptions) -> None:
    """Refuse, before it is tokenized, a prompt whose length alone shows it cannot fit the context: each token
    covers at most ``info.max_token_bytes`` bytes of its text, so it has at least bytes / that many tokens.

    Raises:
        ContextLengthExceededError: naming the bound, as the exact check after tokenizing names the count.
    """
    if info is None or info.context_length is None or not info.max_token_bytes:
        return
    size = len(prompt.encode("utf-8", "surrogatepass"))
    least = -(-size // info.max_token_bytes)
    room = 1 if sampling.fit_context else sampling.max_tokens
    if least + room > info.context_length:
        raise ContextLengthExceededError(
            f"the prompt ({size:,} bytes: at least {least:,} tokens, at most {info.max_token_bytes} bytes a token) "
            f"plus {'a reply' if sampling.fit_context else f'max_tokens ({sampling.max_tokens:,})'} exceeds the "
            f"model's context of {info.context_length:,} tokens")


@dataclass(frozen=True)
class _Tokenized:
    """A turn whose prompt was rendered, planned and tokenized off the model's thread, for the loop to register."""

    turn: GpuTurn
    need: int  # the tokens its cache will hold once prefilled (reused + new)


@dataclass
class _FirstSample:
    """The first of a turn's samples, as the others wait for it: its cache checked out, and its registration."""

    own: OwnCache | None = None
    tokenized: trio.Event = field(default_factory=trio.Event)  # set once it is tokenized, or failed


def _after(seconds: float) -> Callable[[], bool]:
    """A ``stop`` for :meth:`runtime.plan.engine.Engine.snapshot`: true once ``seconds`` went by
    from now (read on the model's thread, between two parts of the copy)."""
    deadline = time.perf_counter() + seconds
    return lambda: time.perf_counter() >= deadline


class GPUActor:
    """Runs generation for every agent, one MLX job at a time.

    Args:
        inbox: the GPU mailbox (:data:`actors.messages_gpu.GpuInbox`).
        engine: the engine its jobs call (real MLX or fake).
        manager: the reuse planner, the actor's own: turns in flight and the prefixes they share.
        budget_bytes: KV memory for running sequences (admission, batch size).
        max_batch: most sequences running at once.
        prefill_chunk: tokens per prefill chunk (None: adaptive, see ``runtime.execution.sequence``).
        decode_run_steps: decode steps that may run back to back in one MLX job (the setting).
        events: the runtime's trace, when it is on (tests, diagnostics): a :class:`GpuEvent` per unit of
            work goes in, and per run of Python's collector; the cache store adds its saves and reads.
        store: the cache store's mailbox: a turn's cache the actor does not hold (``Load``), each new cache's
            host copy (``Save``), a turn's whole blocks on disk (``ReadBlocks``), a swapped model's caches
            (``Evict``); None: RAM only (no cache is kept). The actor closes it when it stops.
        hot: the hot tier: every agent's latest parked cache (:mod:`actors.gpu_caches`; None: an empty one).
        leases: the store has a shared tier: every turn loads through it, for the agent's cluster lease.
        stored: the caches on disk at start (None: not listed, so a turn its hot tier cannot serve asks the store).
        default_model: the model of requests that name none (:mod:`actors.model_slot`).
        models: other model names requests may ask for.
        idle_unload_s: unload the model after this long without a turn (None: never).
        preload: load the default model before reporting started (False: at the first request).
    """

    def __init__(
        self,
        inbox: trio.MemoryReceiveChannel[GpuInbox],
        *,
        engine: Engine,
        manager: KVCacheManager,
        budget_bytes: int,
        max_batch: int = 32,
        prefill_chunk: int | None = None,
        decode_run_steps: int = 1,
        events: deque[GpuEvent] | None = None,
        store: trio.MemorySendChannel[StoreInbox] | None = None,
        hot: HotTier | None = None,
        leases: bool = False,
        stored: frozenset[AgentKey] | None = None,
        default_model: str,
        models: Sequence[str] = (),
        idle_unload_s: float | None = None,
        preload: bool = True,
    ) -> None:
        self._inbox = inbox
        self._caches = AgentCaches(store, hot or HotTier(hot_budget_bytes=2**62), leases=leases, stored=stored,
                                   wake=self._copy_wanted)
        self._slot = ModelSlot(default_model, models)
        self._idle_unload_s = idle_unload_s
        self._preload = preload
        self._idle_since = 0.0  # when the last message came or turn ran (idle_unload_s counts from it)
        self._engine = engine
        self._manager = manager
        self._budget_bytes = budget_bytes
        self._max_batch = max_batch
        self._prefill_chunk = prefill_chunk
        self._decode_run_steps = decode_run_steps
        profile = engine.profile
        self._thread = MlxThread(on_exit=engine.close, tune_allocator=profile is None or profile.tune_allocator)
        self._sched: Scheduler | None = None
        self._requests: dict[int, GpuTurn] = {}
        self._flushes: deque[Flush] = deque()  # waiting for the copies owed (_flush_when_copied)
        self._idle_wait: trio.CancelScope | None = None
        self._steps = 0
        # A decode run (several steps in one MLX job) ends after the step in progress once this is set:
        # a message arrived (kept in _early until the loop handles it) or a client left.
        self._doorbell = threading.Event()
        self._rang_for = ""  # why it was set (a decode run's trace event says it)
        self._early: deque[GpuInbox | _Tokenized] = deque()
        self._inbox_ended = False
        # Prompts are rendered and tokenized off the model's thread, one at a time and in arrival order
        # (_submit): the running turns go on meanwhile.
        self._texts: trio.Nursery | None = None
        self._text_jobs = TextJobs()
        self._long_text_jobs = TextJobs()  # texts past LONG_TEXT_CHARS: never ahead of a short one
        self._tokenizing: set[int] = set()
        self._first_samples: dict[int, _FirstSample] = {}  # by group: the samples after it wait for it
        self._long_texts: set[int] = set()  # of those, the ones past LONG_TEXT_CHARS: an idle loop does not wait
        self._no_texts = trio.Event()
        self._no_texts.set()
        self._no_short_texts = trio.Event()  # what an idle loop waits for before it admits (_texts_or_message)
        self._no_short_texts.set()
        self._chunks = 0
        self.events = events
        self._collection_started: float | None = None

    @property
    def thread_ident(self) -> int | None:
        return self._thread.ident

    @property
    def _info(self) -> ModelInfo | None:
        """The loaded model (None: none): every turn in flight runs on it."""
        return self._slot.current

    # -- lifecycle -------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Load the default model (with ``preload``), then serve the mailbox until it is closed (then finish
        running work) or cancelled.

        Raises:
            runtime.errors.ModelError: the default model does not load (with ``preload``).
        """
        try:
            await self._serve_until_closed(task_status)
        finally:
            if self._caches.store is not None:
                self._caches.store.close()  # the store's mailbox ends once every sender has closed its end

    async def _serve_until_closed(self, task_status: trio.TaskStatus[None]) -> None:
        async with self._thread, self._inbox:
            if self._preload:
                failure = await self._load(self._slot.default)
                if failure is not None:
                    raise ModelError(failure.error)
            self._idle_since = trio.current_time()
            task_status.started()
            if self.events is not None:
                gc.callbacks.append(self._on_collection)
            try:
                async with trio.open_nursery() as texts:
                    self._texts = texts
                    self._caches.start(texts)
                    texts.start_soon(self._text_jobs.serve, name="the GPU actor's text jobs")
                    texts.start_soon(self._long_text_jobs.serve, name="the GPU actor's long text jobs")
                    await self._loop()
                    texts.cancel_scope.cancel()  # every turn's text is done (the loop waited): the worker goes
            finally:
                self._texts = None
                self._caches.start(None)
                with trio.CancelScope(shield=True):  # the turns checked out end there; the store's last saves
                    for req in self._requests.values():  # wait for the copies below
                        self._end(req, _SHUTTING_DOWN)
                    self._requests.clear()
                    for item in self._early:
                        if isinstance(item, _Tokenized):
                            self._end(item.turn, _SHUTTING_DOWN)
                        elif isinstance(item, (Generate, CountTokens)):
                            send_reply(item.reply, _SHUTTING_DOWN)
                    for waiting in self._slot.waiting:
                        send_reply(waiting.reply, _SHUTTING_DOWN)
                    self._slot.waiting.clear()
                    with trio.move_on_after(STOP_COPIES_S):
                        await self._make_copies(every=True)
                    for owed in list(self._caches.owed):
                        self._caches.copy_failed(owed, "the GPU actor stopped before making the copy")
                    self._flush_when_copied()
                    if self._caches.store is not None:
                        await self._caches.drain()  # the last saves reach the store before its mailbox ends
                heap.thaw()  # the model goes with the thread: what it left may be collected again
                if self._on_collection in gc.callbacks:
                    gc.callbacks.remove(self._on_collection)

    async def _job(self, fn: Any, *args: Any) -> Any:
        return await self._thread.run(fn, *args)

    async def _text_job(self, fn: Any, *args: Any, wanted: Callable[[], bool] | None = None,
                        long: bool = False) -> Any:
        """Render or tokenize on a text worker's thread (:class:`actors.text_jobs.TextJobs`): no MLX there, and
        the tokenizer's Rust code lets go of the GIL, so the model's thread runs on meanwhile. A ``long`` text
        goes to a worker of its own, so a huge prompt never holds up the others' turns; a job whose turn is
        no longer ``wanted`` when its worker comes to it is dropped (:class:`actors.text_jobs.Abandoned`)."""
        return await (self._long_text_jobs if long else self._text_jobs).run(fn, *args, wanted=wanted)

    def _ring(self) -> None:
        """Something is waiting in ``_early``: end a decode run or an idle copy at its next check,
        and an idle wait at once."""
        self._ring_for("a turn tokenized")
        if self._idle_wait is not None:
            self._idle_wait.cancel()

    def _ring_for(self, why: str) -> None:
        """Set the doorbell, keeping the first reason since it was last cleared (a run's ``run`` event says it)."""
        if not self._doorbell.is_set():
            self._rang_for = why
        self._doorbell.set()

    def _on_collection(self, phase: str, info: dict[str, int]) -> None:
        """While tracing, each run of Python's collector (on whichever thread it ran: it holds the GIL, so
        the model's thread builds no graph meanwhile) becomes a ``gc`` event with its length."""
        now = time.perf_counter()
        if phase == "start":
            self._collection_started = now
        elif self.events is not None and self._collection_started is not None:
            self.events.append(GpuEvent(kind="gc", request_ids=(), at=now, generation=info["generation"],
                                        took_ms=(now - self._collection_started) * 1e3))
            self._collection_started = None

    def _event(self, kind: str, *request_ids: int, at: float | None = None, timing: StepTiming | None = None,
               took_ms: float | None = None, waited_ms: float | None = None, detail: str = "") -> None:
        if self.events is not None:
            self.events.append(GpuEvent(kind=kind, request_ids=request_ids, at=time.perf_counter() if at is None else at,
                                        timing=timing, took_ms=took_ms, waited_ms=waited_ms, detail=detail))

    async def _loop(self) -> None:
        closing = False
        while True:
            closing = closing or self._inbox_ended
            while self._early:
                item = self._early.popleft()
                if isinstance(item, _Tokenized):
                    await self._register(item.turn, item.need)
                else:
                    await self._handle(item)
            self._flush_when_copied()  # the last copy a flush waited for was made, dropped or given up
            if self._requests or self._tokenizing:
                self._idle_since = trio.current_time()
            elif self._slot.waiting:  # nothing in flight: the model they wait for may be loaded now
                await self._serve_waiting()
                continue
            if not self._requests:
                if closing:
                    if not self._tokenizing:
                        return
                    await self._no_texts.wait()  # the turns sent before the mailbox closed are served
                    continue
                message = None
                now = trio.current_time()
                try:
                    with trio.move_on_after(min(copy_wait(self._caches.copies_owed(), now=now),
                                                max(0.0, self._unload_at() - now))) as wait:
                        self._idle_wait = wait  # a copy wanted now ends it (a durable turn's)
                        message = await self._inbox.receive()
                except trio.EndOfChannel:
                    closing = True
                    continue
                finally:
                    self._idle_wait = None
                if message is None and trio.current_time() >= self._unload_at():
                    await self._unload_idle()
                    continue
                if message is None:  # nothing came while copies came due: they cost no turn now
                    await self._make_copies(idle=True)
                    continue
                await self._handle(message)
            while not closing:
                try:
                    message = self._inbox.receive_nowait()
                except trio.WouldBlock:
                    break
                except trio.EndOfChannel:
                    closing = True
                    break
                await self._handle(message)
            if self._tokenizing - self._long_texts and not self._running():
                # Nothing runs, so waiting costs nothing: turns that arrive together (a batch's
                # agents) are admitted, and prefilled, together. Not for a long prompt: its
                # tokenizing takes seconds, and the turns ready meanwhile would wait for it.
                await self._texts_or_message()
                continue
            await self._reap()
            if self._sched is None:
                continue
            admitted = self._sched.admit()
            if admitted:
                await self._start(admitted)
            await self._run_step(self._sched.step(self._manager, admitted))
            self._accept_waiting()
            await self._make_copies(prefilling=bool(self._sched.prefilling()))
            await trio.lowlevel.checkpoint()

    # -- mailbox ---------------------------------------------------------------

    async def _texts_or_message(self) -> None:
        """Until every short prompt being tokenized is, or a message comes (kept in ``_early``)."""
        async with trio.open_nursery() as nursery:
            async def texts() -> None:
                await self._no_short_texts.wait()
                nursery.cancel_scope.cancel()

            async def message() -> None:
                if not self._inbox_ended:
                    await self._ring_on_message()
                    nursery.cancel_scope.cancel()

            nursery.start_soon(texts)
            nursery.start_soon(message)

    def _in_flight(self) -> bool:
        """Whether a turn is on the loaded model: tokenizing, tokenized and handed to the loop (``_early``),
        or registered. The model stays until none is (no swap, no idle unload)."""
        return bool(self._requests or self._tokenizing
                    or any(isinstance(item, _Tokenized) for item in self._early))

    def _running(self) -> bool:
        """Whether a turn is decoding or prefilling."""
        return self._sched is not None and bool(self._sched.decoding() or self._sched.prefilling())

    async def _handle(self, message: GpuInbox) -> None:
        self._idle_since = trio.current_time()
        match message:
            case CountTokens() | Generate():
                refusal = self._slot.refusal(message.model)
                if refusal is not None:
                    send_reply(message.reply, refusal)
                elif self._slot.serves_now(message.model):
                    await self._serve(message)
                else:  # another model, or behind a request for one: after the swap (actors.model_slot)
                    self._slot.waiting.append(message)
            case Prepare(snapshot=snapshot, reply=reply):
                try:
                    send_reply(reply, Prepared(parked=await self._job(self._engine.prepare, snapshot)))
                except Exception as exc:  # noqa: BLE001 - the turn then restores it itself
                    send_reply(reply, failed_from(exc))
            case Flush():
                # Every copy owed is wanted now, made one a loop pass while turns run (all at once when idle),
                # and the flush goes to the store once the last is sent (_flush_when_copied).
                self._caches.want_every()
                self._flushes.append(message)
                self._flush_when_copied()
            case Forget() | ListAgents() | MeasureUsage():
                self._forward(message)
            case _:
                assert_never(message)

    def _flush_when_copied(self) -> None:
        """Forward the flushes waiting for the copies owed, once none is owed (the Saves went first)."""
        if not self._caches.owed:
            while self._flushes:
                self._forward(self._flushes.popleft())

    def _forward(self, message: Flush | Forget | ListAgents | MeasureUsage) -> None:
        """A question about every cache: to the store with what the hot tier knows; without a store, answered
        here (nothing is kept)."""
        if self._caches.store is not None:
            self._caches.forward(message)
            return
        match message:
            case Flush(reply=reply):
                send_reply(reply, Flushed(written=0))
            case Forget(reply=reply):
                send_reply(reply, Forgotten(existed=False))
            case ListAgents(reply=reply):
                send_reply(reply, AgentsListed(agents=()))
            case MeasureUsage(reply=reply):
                send_reply(reply, Used(agent_dirs=frozenset(), disk_bytes=0))

    async def _serve(self, message: CountTokens | Generate) -> None:
        """A request for the loaded model."""
        match message:
            case CountTokens(chat=chat, reply=reply):
                try:
                    count = await self._text_job(self._engine.count_tokens, await self._render(chat))
                except Exception as exc:  # noqa: BLE001 - a bad message list is the client's error
                    send_reply(reply, failed_from(exc))
                    return
                send_reply(reply, Counted(num_tokens=count))
            case Generate():
                if self._accept(message):
                    assert self._texts is not None
                    self._texts.start_soon(self._submit, message)

    async def _serve_waiting(self) -> None:
        """No turn is in flight: load the model the first waiting request needs, then serve the waiting
        requests for it in order, up to the first for yet another model (:mod:`actors.model_slot`)."""
        slot = self._slot
        while slot.waiting and not self._in_flight():
            head = slot.waiting[0]
            if receiver_left(head.reply):  # nobody waits for it
                slot.waiting.popleft()
                continue
            if isinstance(head, Generate) and receiver_left(head.client):  # its agent still waits: it is told
                send_reply(slot.waiting.popleft().reply,
                           Failed(kind="Cancelled", error="the client left while the turn waited for its model"))
                continue
            name = slot.next_model()
            assert name is not None
            if slot.current is None or slot.current.name != name:
                if slot.current is not None:
                    log.info("swapping model %s -> %s", slot.current.name, name)
                    slot.swaps += 1
                failure = await self._load(name)
                if failure is not None:
                    send_reply(slot.waiting.popleft().reply, failure)
                    continue
            while slot.waiting and slot.next_model() == name:
                await self._serve(slot.waiting.popleft())

    async def _evict(self) -> None:
        """Before the loaded model goes: the host copies owed, the model's hot caches dropped, then the store
        writes what it queued (caches are tagged with their model: they load from disk when it returns)."""
        info = self._info
        if info is None:
            return
        await self._make_copies(every=True)  # before the model they were made with goes
        self._slot.current, self._sched = None, None
        self._caches.drop_model(info.tag)
        if self._caches.store is None:
            return
        evicted: EvictReply = await self._caches.ask(lambda r: Evict(model_tag=info.tag, reply=r))
        if isinstance(evicted, Failed):
            log.warning("evicting caches of %s failed: %s", info.tag, evicted.error)

    async def _load(self, name: str) -> Failed | None:
        """Load ``name`` in place of the loaded model (whose caches go to disk first)."""
        await self._evict()
        heap.thaw()  # a model loaded before goes: what it leaves may be collected
        try:
            info: ModelInfo = await self._job(self._engine.load, name)
        except Exception as exc:  # noqa: BLE001 - the request that asked for it fails
            log.warning("loading %s failed: %s", name, exc)
            return failed_from(exc)
        if info.model_bytes:  # what the load left stays for good: no full collection walks it again (a
            heap.settle()     # load that brought no weights, a test's fake engine, left nothing of its own)
        self._slot.loaded(info)
        self._sched = Scheduler(
            budget_bytes=self._budget_bytes,
            token_bytes=info.active_token_bytes,
            sequence_bytes=info.sequence_bytes,
            max_batch=self._max_batch,
            prefill_chunk=self._prefill_chunk,
            decode_run_steps=self._decode_run_steps,
        )
        self._idle_since = trio.current_time()
        return None

    def _unload_at(self) -> float:
        """When the loaded model is unloaded for want of turns (inf: never; ``idle_unload_s``). Never while a
        turn is in flight anywhere: tokenizing, tokenized and handed to the loop (``_early``; the idle wait
        it ends may have lasted past the timeout), registered, or waiting for its model."""
        if self._idle_unload_s is None or self._info is None or self._in_flight() or self._slot.waiting:
            return math.inf
        return self._idle_since + self._idle_unload_s

    async def _unload_idle(self) -> None:
        log.info("unloading idle model %s", self._info.name if self._info else None)
        self._slot.idle_unloads += 1
        await self._evict()
        heap.thaw()
        await self._job(self._engine.unload)

    def _accept(self, msg: Generate) -> bool:
        """Whether ``msg`` goes on to be tokenized (else it was answered); counted as tokenizing from here,
        so the loop knows of it before :meth:`_submit` first runs."""
        if self._texts is None:
            send_reply(msg.reply, _SHUTTING_DOWN)
            return False
        if msg.request_id in self._requests or msg.request_id in self._tokenizing:
            send_reply(msg.reply, Failed(kind="ValueError", error=f"duplicate request id {msg.request_id}"))
            return False
        self._event("submit", msg.request_id)
        if msg.group == msg.request_id:
            self._first_samples[msg.request_id] = _FirstSample()
        if not self._tokenizing:
            self._no_texts = trio.Event()
        if not self._tokenizing - self._long_texts:
            self._no_short_texts = trio.Event()
        self._tokenizing.add(msg.request_id)
        return True

    async def _check_out(self, msg: Generate, tag: str) -> CheckedOut | Failed | None:
        """The agent's own cache (its hot one, else the store's) and a sharing turn's donors: a turn's first
        sample only (the others start from its prompt and keep no cache); None: no cache is kept."""
        if msg.sample or self._caches.store is None:
            return None
        asked = time.perf_counter()
        opened = await self._caches.check_out(msg.agent_id, tag, share_prefix=msg.share_prefix)
        # From the client's send: waited to reach this actor, then took to check out.
        self._event("checkout", msg.request_id, waited_ms=(asked - msg.submitted_at) * 1e3,
                    took_ms=(time.perf_counter() - asked) * 1e3)
        return opened

    async def _submit(self, msg: Generate) -> None:
        """Check the agent's cache out, then render, plan and tokenize a turn's prompt off the model's thread
        (:meth:`_text_job`), and hand it to the loop (``_early``) to register. An H200's host tokenized about
        4 ms per 1K tokens on the model's thread (run 4: a 32K prompt waited 120-206 ms before admission), and
        every running turn waited for it too. A turn that fails here keeps its cache as it was."""
        checked_out = leased = False
        try:
            assert self._info is not None  # loaded until every turn in flight ends (actors.model_slot)
            tag = self._info.tag
            own, donors = None, ()
            if msg.sample and (first := self._first_samples.get(msg.group or 0)) is not None:
                # The first sample is registered first, and the others plan against its cache: they start
                # from its prompt (KVCacheManager.held_back), whose tokens its plan decides.
                await first.tokenized.wait()
                own = first.own
            opened = await self._check_out(msg, tag)
            if isinstance(opened, Failed):
                send_reply(msg.reply, opened)  # nothing checked out (a bad agent id, another node's lease)
                return
            if opened is not None:
                checked_out, leased, own, donors = True, opened.leased, opened.own, opened.donors
                if (group := self._first_samples.get(msg.request_id)) is not None:
                    group.own = own
            prompt = await self._render(msg.prompt, wanted=partial(_still_wanted, msg))
            self._event("rendered", msg.request_id)
            _refuse_from_length(prompt, self._info, msg.sampling)
            long = len(prompt) > LONG_TEXT_CHARS
            if long:
                self._long_texts.add(msg.request_id)
                self._texts_changed()
            plan = self._manager.plan(msg.agent_id, tag, prompt, share_prefix=msg.share_prefix, own=own, hot=donors)
            self._event("planned", msg.request_id)
            tokens: Tokenized = await self._text_job(self._engine.tokenize, prompt, plan,
                                                     wanted=partial(_still_wanted, msg), long=long)
            plan, tokens = await self._from_disk_blocks(msg, tag, prompt, plan, tokens)
            need = plan.reuse_tokens + len(tokens.ids)
            context = self._info.context_length if self._info is not None else None
            if context is not None and need + msg.sampling.max_tokens > context:  # before any prefill
                if not msg.sampling.fit_context:
                    raise ContextLengthExceededError(
                        f"the prompt ({need:,} tokens) plus max_tokens ({msg.sampling.max_tokens:,}) exceeds "
                        f"the model's context of {context:,} tokens")
                if need >= context:
                    raise ContextLengthExceededError(
                        f"the prompt ({need:,} tokens) fills the model's context of {context:,} tokens: "
                        f"no room is left for a reply")
                # No limit named: the reply gets the room the context leaves.
                fitted = msgspec.structs.replace(msg.sampling, max_tokens=context - need)
                msg = msgspec.structs.replace(msg, sampling=fitted)
            self._event("tokenized", msg.request_id)
            self._early.append(_Tokenized(GpuTurn(msg, prompt, plan, tokens, checked_out=checked_out,
                                                  leased=leased, donors=donors), need))
            self._ring()
        except Abandoned:
            self._answer(msg, leased, Failed(kind="Cancelled",
                                             error="the client left before its prompt was tokenized"))
        except Exception as exc:  # noqa: BLE001 - template, tokenizer or context errors go back to the agent
            self._answer(msg, leased, failed_from(exc))
        except BaseException:  # cancelled: the actor stops
            self._answer(msg, leased, _SHUTTING_DOWN)
            raise
        finally:
            if (first := self._first_samples.pop(msg.request_id, None)) is not None:
                first.tokenized.set()
            self._tokenizing.discard(msg.request_id)
            self._long_texts.discard(msg.request_id)
            self._texts_changed()

    def _texts_changed(self) -> None:
        """Set the events of the prompts being tokenized: none at all, none short."""
        if not self._tokenizing:
            self._no_texts.set()
        if not self._tokenizing - self._long_texts:
            self._no_short_texts.set()

    async def _from_disk_blocks(self, msg: Generate, tag: str, prompt: str, plan: TurnPlan,
                                tokens: Tokenized) -> tuple[TurnPlan, Tokenized]:
        """The turn's plan, or one that starts from more of its prompt's whole blocks, read from its tenant's
        disk by their hash chain (:mod:`runtime.plan.disk_blocks`): a sibling's system prompt after a
        restart, an earlier branch of the agent's own. One round trip to the store, only for a turn whose
        plan leaves a whole block of its prompt to prefill."""
        kinds = self._info.layer_kinds if self._info is not None else ()
        wanted = blocks_to_look_up(plan, tokens, share_prefix=msg.share_prefix, layer_kinds=kinds)
        if wanted is None or self._caches.store is None:
            return plan, tokens
        read = await self._caches.ask(lambda reply: ReadBlocks(
            agent_id=msg.agent_id, model_tag=tag, token_ids=wanted, layer_kinds=kinds, reply=reply))
        if isinstance(read, Failed):  # the store stopped: the plan stands
            return plan, tokens
        started = start_from_blocks(plan, tokens, prompt, model_tag=tag, reused=read.tokens,
                                    layers=read.layers)
        if started is None:
            return plan, tokens
        self._event("blocks", msg.request_id)
        return started

    async def _register(self, turn: GpuTurn, need: int) -> None:
        """A tokenized turn joins the scheduler's queue."""
        msg = turn.msg
        assert self._sched is not None  # the model stays while a turn is in flight (actors.model_slot)
        try:
            self._sched.submit(msg.request_id, need + msg.sampling.max_tokens)
        except Exception as exc:  # noqa: BLE001 - a request the budget can never hold
            self._end(turn, failed_from(exc))
            return
        self._requests[msg.request_id] = turn
        # The client may answer its status now (nothing it asked for is refused): with its TurnStarted when
        # its prefill begins in this loop pass, else with a TurnAccepted at the pass's end (_accept_waiting).
        turn.accept_due = msg.deltas is not None and not msg.sample
        turn.prompt_tokens = need

    async def _render(self, prompt: Chat | str, *, wanted: Callable[[], bool] | None = None) -> str:
        """The prompt text: chat messages rendered with the loaded model's template, a raw prompt as is."""
        if isinstance(prompt, str):
            return prompt
        return await self._text_job(_render_chat, self._engine, prompt, wanted=wanted)

    # -- work ------------------------------------------------------------------

    async def _reap(self) -> None:
        """Cancel requests whose client or agent stopped listening."""
        assert self._sched is not None or not self._requests
        for request_id, req in list(self._requests.items()):
            if not (req.client_gone or receiver_left(req.msg.client) or receiver_left(req.msg.reply)):
                continue
            if self._sched is not None and self._sched.is_waiting(request_id):
                self._sched.finished(request_id)
                self._manager.end(request_id)
                del self._requests[request_id]
                self._end(req, self._generated(req, None, cancelled=True))
                continue
            await self._complete(request_id, cancelled=True)

    async def _start(self, request_ids: tuple[int, ...]) -> None:
        """Start the admitted turns on the model's thread, all in one job: a hop each cost a batch's joins
        0.45 ms apiece before their joint pass (H200 run 5: 8 admitted over 3.3 ms)."""
        reqs = [(request_id, self._requests[request_id]) for request_id in request_ids]
        admitted_at = time.perf_counter()
        for _, req in reqs:
            req.admitted_at = admitted_at

        def start_each() -> list[SequenceStarted | Exception]:
            out: list[SequenceStarted | Exception] = []
            for request_id, req in reqs:
                try:
                    out.append(self._engine.start(request_id, req.prompt, req.plan, req.tokens, req.msg.sampling))
                except Exception as exc:  # noqa: BLE001 - that turn fails, the others start
                    out.append(exc)
            return out

        assert self._sched is not None and self._info is not None
        for (request_id, req), started in zip(reqs, await self._job(start_each), strict=True):
            if isinstance(started, Exception):
                await self._fail(request_id, started)
                continue
            self._manager.begin(request_id, agent_id=req.msg.agent_id, model_tag=self._info.tag,
                                token_ids=started.token_ids, tokens_reused=started.stats.tokens_reused,
                                share_prefix=req.msg.share_prefix, group=req.msg.group, hot=req.donors)
            req.started = started
            self._sched.to_prefill(request_id, started.stats.tokens_prefilled)
            self._event("admit", request_id)

    async def _park_for_others(self, donor: int) -> None:
        """A decoding turn's prompt a new turn would start from, parked now (a step's ``park``: see
        :meth:`runtime.plan.kv_manager.KVCacheManager.late_donor`); the new turn's first prefill chunk adopts it."""
        try:
            self._manager.add_donor(donor, await self._job(self._engine.park_prompt, donor))
        except Exception:  # noqa: BLE001 - the new turn prefills the prompt itself; the donor's turn goes on
            log.exception("parking a decoding turn's prompt for another turn failed")
            self._manager.add_donor(donor, None)  # not asked again

    async def _run_step(self, step: Step) -> None:
        """Carry out one :class:`runtime.plan.scheduler.Step`: the joining prefills (in one pass where
        the engine can, :meth:`runtime.plan.engine.Engine.prefill_together`, the rest one by one), the
        decode step, then one prefill chunk. A request that ended meanwhile is skipped."""
        assert self._sched is not None
        for donor in step.park:
            await self._park_for_others(donor)
        for request_id in step.starts:  # the scheduler decided; the planner records it
            self._manager.start_prefill(request_id, step.adopt.get(request_id))
        if step.together:
            await self._prefill_together(list(step.together))
        for request_id in step.join:
            if self._prefilling(request_id):
                await self._prefill(request_id, step.chunk, step.adopt.get(request_id), request_id in step.donate)
        if step.decode and self._sched.decoding():  # a row may have finished in its first token
            await self._step(step.decode_steps)
        if step.prefill is not None and self._prefilling(step.prefill):
            await self._prefill(step.prefill, step.chunk, step.adopt.get(step.prefill), step.prefill in step.donate)

    def _prefilling(self, request_id: int) -> bool:
        assert self._sched is not None
        return request_id in self._requests and request_id in self._sched.prefilling()

    async def _prefill_together(self, request_ids: list[int]) -> None:
        assert self._sched is not None
        try:
            results = await self._job(self._engine.prefill_together, request_ids)
        except Exception as exc:  # noqa: BLE001 - the rows' state is unknown: fail them all
            log.exception("prefilling %d turns together failed", len(request_ids))
            for request_id in request_ids:
                await self._fail(request_id, exc)
            return
        if not results:
            return
        self._chunks += 1
        self._event("chunk", *results, timing=next(iter(results.values())).timing)
        for request_id, result in results.items():
            self._announce(request_id, None)
            if await self._prefilled(request_id, result):
                self._sched.prefilled(request_id)  # the engine joined it to the batch

    async def _prefilled(self, request_id: int, result: PrefillResult) -> bool:
        """Record a prefill result and deliver the first token if it came; True when the
        turn goes on to decode (False: prefill goes on, or the first token finished it)."""
        assert self._sched is not None
        req = self._requests[request_id]
        assert req.announced is not None  # before its first chunk
        req.prefilled = req.announced.tokens_prefilled - result.remaining
        self._sched.to_prefill(request_id, result.remaining)
        if result.text is None:
            return False
        self._deliver(request_id, result.text, result.tool_calls, result.logprobs)
        if result.finished:
            await self._complete(request_id)
            return False
        return True

    async def _prefill(self, request_id: int, chunk: int | None, adopt: FromShared | None, donate: bool) -> None:
        assert self._sched is not None
        if adopt is not None:
            self._requests[request_id].adopted = True
        self._announce(request_id, adopt)
        try:
            result = await self._job(partial(self._engine.prefill, adopt=adopt), request_id, chunk)
        except Exception as exc:  # noqa: BLE001
            await self._fail(request_id, exc)
            return
        self._chunks += 1
        self._event("chunk", request_id, timing=result.timing)
        if not await self._prefilled(request_id, result):
            return
        try:
            if donate:
                # Turns waiting to prefill share this prompt's blocks: park it for them while it decodes.
                self._manager.add_donor(request_id, await self._job(self._engine.park_prompt, request_id))
            await self._job(self._engine.join, request_id)
        except Exception as exc:  # noqa: BLE001
            await self._fail(request_id, exc)
            return
        self._sched.prefilled(request_id)

    async def _step(self, steps: int = 1) -> None:
        """Decode ``steps`` steps at most (a finished row or a message ends a run early), then
        let the rows that finished in the last one leave."""
        assert self._sched is not None
        members = self._sched.decoding()
        try:
            if steps > 1:
                tokens = await self._decode_run(steps)
            else:
                tokens = await self._job(self._engine.step)
                self._stepped(tokens, self._engine.last_step_timing)
        except Exception as exc:  # noqa: BLE001 - the batch is unusable: fail its members
            log.exception("decode step failed")
            for request_id in members:
                await self._fail(request_id, exc)
            return
        # Last row first: dropping a batch's last row is a view, any other row a copy of the rest.
        for token in reversed(tokens):
            if token.finished:
                await self._complete(token.request_id)

    async def _decode_run(self, steps: int) -> list[Any]:
        """Up to ``steps`` decode steps in one MLX job; returns the last step's tokens.

        Each step's tokens are posted to trio as the step ends (:meth:`_stepped`), so clients get
        them as they would one job per step; the MLX thread does not wait for trio between steps.
        The run ends after the step in progress once a row finishes or the doorbell rings (a
        message for this actor, a client that left), so a new turn joins one step later at most,
        and once it has run :data:`runtime.backend.DECODE_RUN_S`: the loop between
        runs makes a slice of any overdue save copy.
        """
        engine, post, doorbell = self._engine, self._thread.post, self._doorbell

        began: list[float] = []

        def run() -> tuple[list[Any], int, str]:  # on the MLX thread
            began.append(time.perf_counter())
            tokens: list[Any] = []
            ends = began[0] + DECODE_RUN_S
            for done in range(1, steps + 1):
                tokens = engine.step()
                now = time.perf_counter()
                post(self._stepped, tokens, engine.last_step_timing, now)
                if not tokens:
                    return tokens, done, "no rows"
                if any(t.finished for t in tokens):
                    return tokens, done, "a row finished"
                if doorbell.is_set():
                    return tokens, done, "rang"
                if now >= ends and done < steps:
                    return tokens, done, "its time done"
            return tokens, steps, "its steps done"

        started = time.perf_counter()
        tokens, done, why = await self._until_message(run)
        self._event("run", *(t.request_id for t in tokens), took_ms=(time.perf_counter() - started) * 1e3,
                    waited_ms=(began[0] - started) * 1e3 if began else None,
                    detail=f"{done} steps; {self._rang_for if why == 'rang' else why}")
        return tokens

    async def _until_message(self, fn: Any) -> Any:
        """Run ``fn`` as one MLX job that watches the doorbell: a message that comes meanwhile is
        kept for the loop (``_early``) and rings it, and so does cancellation; ``fn`` stops at its
        next check (a decode run after its step in flight, a copy after its layer)."""
        doorbell = self._doorbell
        doorbell.clear()
        if self._early:  # a tokenized turn is waiting already: fn stops at its first check
            self._ring_for("a message or turn waiting")
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._ring_on_message)
                result = await outcome.acapture(self._job, fn)  # an engine error is the job's, not the nursery's
                nursery.cancel_scope.cancel()
        finally:
            doorbell.set()  # cancelled (the actor stops): fn ends at its next check
        return result.unwrap()

    async def _ring_on_message(self) -> None:
        """During a job that watches the doorbell: keep the next message for the loop and ring it."""
        try:
            message = await self._inbox.receive()
            self._early.append(message)
            self._ring_for(f"a message ({type(message).__name__})")
        except trio.EndOfChannel:
            self._inbox_ended = True
            self._ring_for("the mailbox closed")

    def _stepped(self, tokens: list[Any], timing: StepTiming | None = None, at: float | None = None) -> None:
        """One decode step's tokens, on trio: counted, traced and delivered (a run posts this per step,
        with the time it ended on the model's thread)."""
        try:
            self._steps += 1
            self._event("step", *(t.request_id for t in tokens), at=at, timing=timing)
            for token in tokens:
                req = self._requests.get(token.request_id)
                if req is None:  # the actor stopped and answered its requests while the run went on
                    self._ring_for("the actor stopping")
                    continue
                self._deliver(token.request_id, token.text, token.tool_calls, token.logprobs)
                if req.client_gone or receiver_left(req.msg.client) or receiver_left(req.msg.reply):
                    self._ring_for("a client left")  # the run ends; the loop reaps it
        except Exception:  # noqa: BLE001 - posted to trio, which cannot report it: end the run instead
            log.exception("delivering a decode step failed")
            self._ring_for("a delivery failed")

    def _accept_waiting(self) -> None:
        """Tell each streaming client whose turn registered and did not start in this loop pass that it waits
        for the batch (:class:`TurnAccepted`); one that started got its :class:`TurnStarted` instead."""
        for req in self._requests.values():
            if not req.accept_due:
                continue
            req.accept_due = False
            assert req.msg.deltas is not None
            try:
                req.msg.deltas.send_nowait(TurnAccepted(prompt_tokens=req.prompt_tokens))
            except trio.WouldBlock:
                pass  # not possible: it is the first item on the channel
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                req.client_gone = True

    def _announce(self, request_id: int, adopt: FromShared | None) -> None:
        """Before the first prefill chunk: what the turn reuses and prefills (:class:`TurnStarted`), kept as the
        turn's and sent to its streaming client."""
        req = self._requests[request_id]
        if req.announced is not None or req.started is None:
            return
        stats = req.started.stats
        reused = adopt.reuse_tokens if adopt is not None else stats.tokens_reused
        req.announced = announcement = TurnStarted(
            tokens_reused=reused, tokens_prefilled=len(req.started.token_ids) - reused, tier=tier_of(req, reused),
            match="extend" if adopt is not None else stats.match)
        if req.msg.deltas is None or req.msg.sample:  # the first sample announces the turn
            return
        req.accept_due = False  # started: accepted too
        try:
            req.msg.deltas.send_nowait(announcement)
        except trio.WouldBlock:
            pass  # not possible: the second item on a channel of 64
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            req.client_gone = True

    def _deliver(self, request_id: int, text: str, tool_calls: tuple[ToolCall, ...] = (),
                 logprobs: tuple[TokenLogprob, ...] = ()) -> None:
        """One sampled token's streamable text (possibly empty), after the scores of the tokens it completes (a
        turn asking for logprobs), then the tool calls it completed, go to the client."""
        req = self._requests[request_id]
        req.generated += 1
        if req.first_token_at is None:
            req.first_token_at = time.perf_counter()
        deltas = req.msg.deltas
        if deltas is None:
            return
        pending = req.pending
        if logprobs:
            pending.append(Scores(tokens=logprobs))
        if text:
            if pending and isinstance(pending[-1], str):
                pending[-1] += text  # coalesced with the text the channel had no room for
            else:
                pending.append(text)
        pending.extend(tool_calls)
        sample = req.msg.sample
        while pending:
            try:
                deltas.send_nowait(pending[0] if not sample else OfSample.of(sample, pending[0]))
            except trio.WouldBlock:
                return  # the rest waits for the next token (the final reply carries everything)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                req.client_gone = True
                return
            del pending[0]

    async def _complete(self, request_id: int, *, cancelled: bool = False) -> None:
        assert self._sched is not None
        req = self._requests[request_id]
        try:
            finished: Finished | None = await self._job(self._engine.finish, request_id)
        except Exception as exc:  # noqa: BLE001
            await self._fail(request_id, exc)
            return
        self._sched.finished(request_id)
        self._manager.end(request_id)
        del self._requests[request_id]
        self._event("finish", request_id)
        answer = self._generated(req, finished, cancelled=cancelled)
        if finished is None or finished.parked is None or not req.checked_out:  # a sample's cache is not kept
            self._end(req, answer)
            return
        assert self._info is not None
        if req.msg.share_prefix:  # the turns waiting to prefill may start from it, as from a hot cache
            self._manager.left(req.msg.agent_id, self._info.tag, finished.parked)
        req.checked_out = False
        durable = req.msg.durable
        self._caches.keep(request_id, req.msg.agent_id, finished.parked, finished.snapshot,
                          block_bytes=self._info.block_bytes, share_prefix=req.msg.share_prefix, leased=req.leased,
                          now=trio.current_time(), reply=req.msg.reply if durable else None,
                          answer=answer if durable else None)
        if not durable:  # a durable turn is answered by the store, once its cache is on disk
            send_reply(req.msg.reply, answer)

    def _generated(self, req: GpuTurn, finished: Finished | None, *, cancelled: bool) -> GenerateReply:
        assert self._info is not None
        return generated_reply(req, finished, model=self._info.name, cancelled=cancelled)

    def _end(self, turn: GpuTurn, answer: GenerateReply) -> None:
        """The turn is over with nothing new to keep (failed, cancelled, or a sample): the lease it took goes
        (its cache stays as it was), then the answer."""
        checked_out, turn.checked_out = turn.checked_out, False
        self._answer(turn.msg, checked_out and turn.leased, answer)

    def _answer(self, msg: Generate, leased: bool, answer: GenerateReply) -> None:
        """Answer a turn that keeps no new cache, after the Save that gives its lease back (``leased``)."""
        self._caches.ended(msg.agent_id, leased=leased)
        send_reply(msg.reply, answer)

    def _copy_wanted(self) -> None:
        if self._idle_wait is not None:
            self._idle_wait.cancel()

    async def _make_copies(self, *, idle: bool = False, every: bool = False, prefilling: bool = False) -> None:
        """Make the host copies :func:`~runtime.plan.save_queue.next_copy` picks (at most one while
        turns run, none merely overdue while a prefill is under way; all that are due when ``idle``),
        or ``every`` one (a model swap, stopping); each goes to the store once made."""
        caches = self._caches
        while caches.owed:
            pick = 0 if every else next_copy(caches.copies_owed(), now=trio.current_time(), idle=idle,
                                             prefilling=prefilling)
            if pick is None:
                return
            owed: OwedCopy = caches.owed[pick]
            if idle:  # nothing runs: a message that comes stops the copy between two parts
                run, stop = self._until_message, self._doorbell.is_set
            elif owed.wanted or every:  # someone waits for it (a durable turn, a flush, stopping): whole
                run, stop = self._job, None
            else:  # overdue while turns run: a slice of parts a pass, so the batch waits for a slice, and a
                # message that comes meanwhile (a new turn) for the part under way, not the rest of the slice
                slice_over, rung = _after(save_queue.COPY_SLICE_S), self._doorbell.is_set
                run, stop = self._until_message, lambda: slice_over() or rung()
            try:
                snapshot = await run(partial(self._engine.snapshot, owed.parked, stop=stop, done=owed.done))
                if snapshot is None:
                    return  # stopped: a message goes first, or the next pass resumes it from owed.done
            except Exception as exc:  # noqa: BLE001 - the save fails, the cache stays hot
                log.exception("copying the cache of request %d for its save failed: %s; it stays in RAM, unsaved",
                              owed.request_id, exc)
                caches.copy_failed(owed, f"the copy for the save failed: {type(exc).__name__}: {exc}")
                continue
            except BaseException:
                caches.copy_failed(owed, "the GPU actor stopped before making the copy")
                raise
            if caches.copy_made(owed, snapshot):  # not superseded or forgotten while it was being made
                self._event("copy", owed.request_id)
            if not (idle or every):
                return

    async def _fail(self, request_id: int, exc: BaseException) -> None:
        log.warning("request %d failed: %s: %s", request_id, type(exc).__name__, exc)
        req = self._requests.pop(request_id, None)
        self._manager.end(request_id)
        if self._sched is not None:
            self._sched.finished(request_id)
        try:
            await self._job(self._engine.discard, request_id)
        except Exception:  # noqa: BLE001
            log.exception("discarding request %d failed", request_id)
        if req is not None:
            self._end(req, failed_from(exc))

    # -- statistics ------------------------------------------------------------

    def statistics(self) -> GpuStats:
        sched = self._sched.stats() if self._sched is not None else None
        mem = self._engine.memory
        return GpuStats(
            model=self._info.name if self._info else None,
            model_tag=self._info.tag if self._info else None,
            batch_size=sched.decoding if sched else 0,
            prefilling=sched.prefilling if sched else 0,
            waiting=sched.waiting if sched else 0,
            waiting_for_memory=sched.waiting_for_memory if sched else 0,
            admitted_total=sched.admitted_total if sched else 0,
            memory_waits_total=sched.memory_waits_total if sched else 0,
            steps=self._steps,
            prefill_chunks=self._chunks,
            pool=sched.pool if sched else PoolStats(),
            memory=MemorySnapshot(active=mem.active, peak=mem.peak, baseline=mem.baseline, model=mem.model),
            turns=tuple(self.running_turns()),
            prefix_hits=self._manager.prefix_hits,
        )

    def hot_stats(self) -> HotTierStats:
        """The hot tier's accounting (``Runtime.stats().store`` reports it beside the store's counters)."""
        return self._caches.hot_stats()

    def owed_copies(self) -> frozenset[AgentKey]:
        """The caches whose host copy the actor still owes the store (a read for the runtime's reports)."""
        return frozenset(owed.key for owed in self._caches.owed)

    def hot_entries(self) -> list[HotEntry]:
        """Every cache in the hot tier, least recently used first (a read for the runtime's reports)."""
        return self._caches.entries()

    def model_statistics(self) -> RegistryStats:
        """Which model is loaded, and the turns on it or waiting for another (``Runtime.stats().registry``)."""
        return self._slot.statistics(in_flight=len(self._requests) + len(self._tokenizing))

    def running_turns(self) -> list[RunningTurn]:
        """The turns on the GPU right now, each with its phase and progress."""
        return [running_turn(rid, req) for rid, req in self._requests.items()]
