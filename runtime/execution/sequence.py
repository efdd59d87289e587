"""One generation request on the MLX thread: its sampling and stop strings, chunked prefill, decoding state.

A :class:`Sequence` is created from a prompt and its starting cache: the one the
cache manager planned (:func:`start_from` makes it a :class:`StartFrom`) or,
standalone, the agent's parked cache, matched against the prompt by the same
matcher (:func:`runtime.plan.kv_manager.own_plan`) and started by the same
:func:`start_from`: the warm-up and ``runtime.execution.generate`` take a real turn's path. It prefills the rest in chunks, and then produces one token
per :meth:`accept` call, whether it decodes alone (``runtime.execution.generate``) or
inside a batch (:class:`runtime.execution.decode_batch.DecodeBatch`).

What it generates is set by its :class:`~runtime.execution.sampling.SequenceSampling` (length,
temperature, top-p / top-k through mlx-lm's sampler, a seed, repeat penalties, logit bias, stop strings);
:class:`StopMatcher` finds stop strings in the growing reply and holds back
text that could still become one.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import mlx.core as mx

from runtime.backend import CPU_CHUNKS
from runtime.execution.pass_clock import PassClock
from runtime.execution.sampling import Scored, SequenceSampling, build_sampler, penalty_processors, score, token_logprob
from runtime.plan.engine import StepTiming, TurnStats
from runtime.plan.sampling import PENALTY_CONTEXT
from runtime.plan.tools import ToolCall
from runtime.plan.turn_plan import COLD, ColdStart, FromHot, FromShared, FromWarm, OwnCache, Tokenized, TurnPlan
from runtime.reply.grammar import ReplyGrammar, mask_rows
from runtime.reply.logprobs import TokenLogprob
from runtime.kv.kvstate import ActiveKV, ParkedCache, AttentionMode
from runtime.model.loaded import LoadedModel
from runtime.plan.kv_manager import own_plan
from runtime.plan.prefix import MatchKind
from runtime.reply.tool_calls import ToolCallSplitter

__all__ = ["SequenceSampling", "StopMatcher", "Sequence", "StartFrom", "prefill_chunk_size", "start_from"]


# -- stop strings ----------------------------------------------------------------


class StopMatcher:
    """Finds stop strings in a growing text and says how much is safe to stream.

    Text that could still become the start of a stop string is held back.
    """

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = tuple(s for s in stops if s)
        self._hold = max((len(s) - 1 for s in self.stops), default=0)

    def find(self, text: str, start: int = 0) -> int | None:
        """Index where the earliest stop string begins, searching from ``start``."""
        hits = [i for s in self.stops if (i := text.find(s, max(0, start - len(s)))) >= 0]
        return min(hits) if hits else None

    def safe_length(self, text: str) -> int:
        """How many leading characters of ``text`` cannot be part of a stop string."""
        if not self._hold:
            return len(text)
        for cut in range(max(0, len(text) - self._hold), len(text)):
            tail = text[cut:]
            if any(s.startswith(tail) for s in self.stops):
                return cut
        return len(text)


# -- the sequence --------------------------------------------------------------


def prefill_chunk_size(context: int) -> int:
    """Prefill chunk for a sequence already holding ``context`` tokens.

    The CPU policy's schedule (:data:`runtime.backend.CPU_CHUNKS`): attention cost per
    token grows with context, so chunks shrink to keep each chunk's latency (and the
    decode stall it causes for other agents) bounded. The engine asks its backend
    profile instead; this is the default of a sequence stepped on its own.
    """
    return next(chunk for below, chunk in CPU_CHUNKS if context < below)


def start_from(lm: LoadedModel, prompt: str, plan: TurnPlan, tokens: Tokenized | None = None) -> StartFrom:
    """Where a sequence for ``prompt`` starts, as ``plan`` says: its cache truncated to what the turn reuses.

    ``tokens``: the plan's suffix, tokenized (tokenized here when not given). A plan whose
    cache cannot be used after all (another model's, or a sliding window too short to trim
    that far back) starts cold, with the whole prompt tokenized.
    """
    base = _base(lm, plan) if plan.reuse_tokens else None
    if base is None and plan.reuse_tokens:
        ids, ends = lm.tokenize(prompt)
        return StartFrom(ParkedCache.empty(lm.spec), MatchKind.DIVERGE.value, 0, ids, ends)
    if tokens is None:
        ids, ends = lm.tokenize(plan.suffix(prompt))
    else:
        ids, ends = list(tokens.ids), list(tokens.ends)
    if base is None:
        return StartFrom(ParkedCache.empty(lm.spec), plan.match, 0, ids, ends)
    return StartFrom(base, plan.match, plan.reuse_chars, ids, ends)


def _base(lm: LoadedModel, plan: TurnPlan) -> ParkedCache | None:
    """The plan's cache truncated to what the turn reuses (None: it cannot be used)."""
    match plan.source:
        case ColdStart():
            return None
        case FromHot(parked=parked) | FromShared(parked=parked):
            assert isinstance(parked, ParkedCache)
            cache = parked
        case FromWarm(snapshot=snapshot, prepared=prepared):
            if snapshot.model_tag != lm.spec.tag:
                return None
            cache = prepared if isinstance(prepared, ParkedCache) else \
                ParkedCache.from_snapshot(snapshot, float_dtype=lm.float_dtype, by_copy=lm.upload_by_copy)
    if cache.model_tag != lm.spec.tag:
        return None
    base = cache.truncated(plan.reuse_tokens, lm.spec)
    if base is not None and isinstance(plan.source, FromShared):
        base = replace(base, meta={}, resident=None)  # a shared prefix starts the new agent's own history
    return base


@dataclass(frozen=True)
class StartFrom:
    """Where a sequence starts when its turn was planned elsewhere (the runtime's path).

    ``base`` is the cache already truncated to the tokens the turn reuses;
    ``suffix_ids`` / ``suffix_ends`` tokenize ``prompt[reuse_chars:]`` (end offsets
    relative to that suffix).
    """

    base: ParkedCache
    match: str
    reuse_chars: int
    suffix_ids: list[int]
    suffix_ends: list[int]


class Sequence:
    """Prompt → reply state machine for one request.

    Args:
        lm: the loaded model.
        prompt: full prompt text (the whole conversation, rendered).
        parked: the agent's parked cache, or None: the sequence matches the prompt
            against it itself (standalone use: ``runtime.execution.generate``, tests, benches).
        params: sampling parameters.
        attention: ``at-rest`` or ``native``: how the active cache attends (:mod:`runtime.kv.kvstate`).
        start: a turn planned by :class:`runtime.plan.kv_manager.KVCacheManager`
            (``parked`` must then be None): no matching, no tokenizing here.
        tool_calls: splits the reply into content and tool calls (a turn with
            tools): :meth:`accept` then returns content only, and the calls
            collect in :attr:`tool_calls`.
    """

    def __init__(
        self,
        lm: LoadedModel,
        prompt: str,
        parked: ParkedCache | None,
        params: SequenceSampling,
        *,
        attention: AttentionMode = "at-rest",
        start: StartFrom | None = None,
        tool_calls: ToolCallSplitter | None = None,
    ) -> None:
        self.lm = lm
        self.prompt = prompt
        self.params = params
        self.started = time.perf_counter()
        self.stats = TurnStats()
        if start is None:  # standalone: the runtime's matcher, as a real turn is planned
            plan = COLD
            if parked is not None:
                own = OwnCache(source=FromHot(parked=parked), tier="hot")
                plan = own_plan(own, prompt) or COLD
            start = start_from(lm, prompt, plan)
        elif parked is not None:
            raise ValueError("a planned sequence takes its cache from `start`, not `parked`")
        base, shift = start.base, start.reuse_chars
        suffix_ids, suffix_ends = start.suffix_ids, start.suffix_ends
        self.stats.match = start.match
        self.pending: list[int] = suffix_ids
        self.kv = ActiveKV(base, lm.spec, attention)
        self.token_ids: list[int] = list(base.token_ids) + suffix_ids
        self.offsets: list[int] = list(base.offsets) + [shift + e for e in suffix_ends]
        self.stats.tokens_reused = base.num_tokens
        self.stats.tokens_prefilled = len(suffix_ids)
        self._prefilled = 0
        self._sampler = build_sampler(params, width=lm.logits_width)
        self._processors = penalty_processors(params.penalties)
        self._stops = StopMatcher(tuple(params.stop) + lm.default_stop)
        self._detok = lm.tokenizer.detokenizer
        self.generated: list[int] = []
        self._gen_ends: list[int] = []  # reply-text end offset per generated token (-1: pending)
        self.reply = ""
        self._lead: str | None = None  # see _restored_space
        self._stop_cut: int | None = None
        self.stop_sequence: str | None = None  # the caller's stop string that ended the reply
        self._streamed = 0
        self.finish_reason: str | None = None
        self.next_input: int | None = None
        self.logits_trace: list[mx.array] | None = None  # set to [] to record each step's logits
        self.sync_chunks = True  # wait for each prefill chunk (the engine's profile: not when running ahead)
        # Set when a prefill of several chunks has its first token, until the engine reads it: the cache grew
        # by concatenation, a chunk at a time, and the engine's profile may empty MLX's buffer cache of the
        # longer buffers each chunk freed (``BackendProfile.clear_cache_after_prefill``).
        self.chunked_prefill_done = False
        self._chunks_run = 0
        self.last_chunk_timing: StepTiming | None = None  # where the last prefill chunk's time went
        self._splitter = tool_calls
        self.tool_calls: list[ToolCall] = []
        self._calls_taken = 0
        # The reply's grammar, if it has one (raises ValueError for one that does not compile).
        self.grammar = ReplyGrammar(lm.grammar_vocabulary, params.grammar) if params.grammar else None
        self._scored: Scored | None = None  # the scores of the token being sampled (a turn asking for logprobs)
        self._logprobs: list[TokenLogprob | None] = []  # per generated token (None: an end-of-reply token)
        self._logprobs_released = 0  # how many of them have their text streamed
        self._logprobs_taken = 0

    def adopt(self, base: ParkedCache) -> None:
        """Start from ``base`` instead: a cache whose tokens are this prompt's first tokens.

        Only before prefill has started. The prompt keeps its own tokenization, so
        the result is exactly what a prefill of those tokens would have computed.
        """
        n = base.num_tokens
        if self._prefilled or not 0 < n < len(self.token_ids) or tuple(self.token_ids[:n]) != tuple(base.token_ids):
            raise ValueError("a sequence can only adopt a proper prefix of its own tokens before prefill")
        self.kv = ActiveKV(base, self.lm.spec, self.kv.attention)
        self.pending = self.token_ids[n:]
        self.stats.tokens_reused, self.stats.tokens_prefilled = n, len(self.pending)
        self.stats.match = MatchKind.EXTEND.value

    # -- prefill ----------------------------------------------------------------
    @property
    def prefill_done(self) -> bool:
        return self._prefilled >= len(self.pending)

    @property
    def prefill_started(self) -> bool:
        return self._prefilled > 0

    @property
    def to_prefill(self) -> int:
        """Prompt tokens still to prefill."""
        return len(self.pending) - self._prefilled

    @property
    def context(self) -> int:
        return self.stats.tokens_reused + self._prefilled

    def prefill_step(self, chunk: int | None = None) -> str | None:
        """Run one prefill chunk; on the last one, sample the first token.

        Returns None while prefill goes on, then the first streamable text
        (possibly empty) once the first token has been produced.
        """
        t0 = time.perf_counter()
        clock = PassClock()
        size = chunk or prefill_chunk_size(self.context)
        piece = self.pending[self._prefilled : self._prefilled + size]
        self._prefilled += len(piece)
        self._chunks_run += 1
        if not self.prefill_done:
            with clock.building():
                self.lm.forward(mx.array([piece]), self.kv.caches)  # logits never evaluated: only the caches
            # The chunk is computed before the next one is built (bounding the graph); the host waits
            # for it only in lockstep: run ahead (the GPU policy) it goes on to the next job meanwhile.
            states = [c.state for c in self.kv.caches]
            mx.async_eval(states)
            clock.launched()
            if self.sync_chunks:
                mx.eval(states)
            clock.read()
            self.last_chunk_timing = clock.timing()
            self.stats.prefill_s += time.perf_counter() - t0
            return None
        with clock.building():
            logits = self.lm.forward_last(mx.array([piece]), self.kv.caches)
            self.observe(logits)
            token = self.sample(logits if self.grammar is None else mask_rows([self.grammar], logits))
        mx.async_eval(token)
        clock.launched()
        first = int(token.item())
        self.chunked_prefill_done = self._chunks_run > 1
        clock.read()
        text = self.first_token(first, prefill_started_at=t0)
        self.last_chunk_timing = clock.timing()
        return text

    def first_token(self, token: int, *, prefill_started_at: float) -> str:
        """The prompt is in the cache and ``token`` sampled from its last position: record both.

        Called by :meth:`prefill_step`, and by :mod:`runtime.execution.batch_prefill` for a
        row of a group prefilled in one pass. Returns the first streamable text.
        """
        self._prefilled = len(self.pending)
        self.stats.prefill_s += time.perf_counter() - prefill_started_at
        self.stats.ttft_s = time.perf_counter() - self.started
        return self.accept(token)

    @property
    def remaining_ids(self) -> list[int]:
        """The prompt tokens still to prefill."""
        return self.pending[self._prefilled :]

    # -- decoding ---------------------------------------------------------------
    def observe(self, logits: mx.array) -> None:
        """Record one step's logits ``(1, V)`` when tracing (tests compare them)."""
        if self.logits_trace is not None:
            self.logits_trace.append(logits.astype(mx.float32))

    @property
    def samples_alone(self) -> bool:
        """Whether this sequence's next token cannot come from a batch's shared greedy argmax."""
        return (not self.params.greedy or bool(self.params.logit_bias) or self.penalizes_repeats
                or self.params.logprobs is not None or len(self.generated) < len(self.params.forced))

    @property
    def penalizes_repeats(self) -> bool:
        """Whether its sampling reads its latest tokens (repeat penalties): the host must know the last one."""
        return bool(self._processors)

    def sample(self, logits: mx.array) -> mx.array:
        """Sample one token per row from last-position logits ``(B, V)``, already masked by the grammars
        (:func:`runtime.reply.grammar.mask_rows`). A sequence that reports logprobs samples alone (one row)
        and scores the row first (:func:`runtime.execution.sampling.score`)."""
        step = len(self.generated)
        limit = self.lm.vocab_limit
        if logits.shape[-1] > limit:
            logits = logits[..., :limit]
        if self.params.logprobs is not None:
            self._scored = score(logits, self.params.logprobs)
        if step < len(self.params.forced):
            return mx.array([self.params.forced[step]] * logits.shape[0])
        if self.params.logit_bias:
            ids = [i for i in self.params.logit_bias if 0 <= i < limit]
            bias = mx.zeros((limit,), dtype=logits.dtype)
            bias[mx.array(ids)] = mx.array([self.params.logit_bias[i] for i in ids], dtype=logits.dtype)
            logits = logits + bias
        if self._processors:
            # As generate_step applies them: to the logits, given the prompt's and the reply's tokens so far.
            # mlx-lm's processors assign into the array they are given: a slice keeps the caller's out of it.
            latest = mx.array((self.token_ids[-PENALTY_CONTEXT:] + self.generated)[-PENALTY_CONTEXT:])
            logits = logits[..., :limit]
            for process in self._processors:
                logits = process(latest, logits)
        if self.params.greedy:
            # Normalizing would not move the argmax, and a full-vocab exp per row is costly on CPU.
            return mx.argmax(logits, axis=-1)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        return self._sampler(logprobs)

    def accept(self, token: int) -> str:
        """Record a sampled token; return the newly streamable reply text."""
        if self.finish_reason is not None:
            return ""
        self.stats.tokens_generated += 1
        self.generated.append(token)
        if self._scored is not None:
            eos = token in self.lm.eos_token_ids  # an end of reply is no token of it: not reported
            self._logprobs.append(None if eos else token_logprob(self._scored, token, self.lm.spell))
            self._scored = None
        if self.grammar is not None:
            self.grammar.consume(token)
        if token in self.lm.eos_token_ids:
            self._gen_ends.append(len(self.reply))
            self._finish("stop")
            return self._flush(final=True)
        self._detok.add_token(token)
        self._gen_ends.append(-1)
        self._update_reply()
        cut = self._stops.find(self.reply, self._streamed)
        if cut is not None:
            self._stop_cut = cut
            self.stop_sequence = next((s for s in self.params.stop if s and self.reply.startswith(s, cut)), None)
            self._finish("stop")
            return self._flush(final=True)
        if len(self.generated) >= self.params.max_tokens:
            self._finish("length")
            return self._flush(final=True)
        self.next_input = token
        return self._flush(final=False)

    def _update_reply(self) -> None:
        # Detokenizers hold back bytes of unfinished characters; a token gets its
        # end offset once the text containing all of its bytes has been emitted.
        text = self._text()
        if len(text) > len(self.reply):
            self.reply = text
            for i in range(len(self._gen_ends) - 1, -1, -1):
                if self._gen_ends[i] != -1:
                    break
                self._gen_ends[i] = len(text)

    def _finish(self, reason: str) -> None:
        self.finish_reason = reason
        self.next_input = None
        self.stop_clock()

    def stop_clock(self) -> None:
        """The reply's decode time ends now: when it finished, or when a turn cancelled mid-reply leaves."""
        if self.stats.tokens_generated:
            self.stats.decode_s = time.perf_counter() - self.started - self.stats.ttft_s

    def _flush(self, *, final: bool) -> str:
        if final:
            self._detok.finalize()
            full = self._text()
            self._gen_ends = [len(full) if e == -1 else e for e in self._gen_ends]
            self.reply = full if self._stop_cut is None else full[: self._stop_cut]
            safe = len(self.reply)
        else:
            safe = self._stops.safe_length(self.reply)
        delta = self.reply[self._streamed : safe]
        self._streamed = max(self._streamed, safe)
        if self.params.logprobs is not None:
            self._release_logprobs(final=final)
        return delta if self._splitter is None else self._split(delta, final=final)

    # -- logprobs -----------------------------------------------------------------
    def _release_logprobs(self, *, final: bool) -> None:
        """Make the scores of the tokens whose text has streamed takeable: a token's once all its text
        is out (at the end: every token of the reply; one that only spells a stop string is not)."""
        while self._logprobs_released < len(self._logprobs):
            i = self._logprobs_released
            start = self._gen_ends[i - 1] if i else 0
            if final:
                if self._stop_cut is not None and start >= self._stop_cut:
                    break
            elif self._gen_ends[i] == -1 or self._gen_ends[i] > self._streamed:
                break
            self._logprobs_released += 1
        if final:
            del self._logprobs[self._logprobs_released :]

    def take_logprobs(self) -> tuple[TokenLogprob, ...]:
        """The scores of the tokens whose text streamed since the last call, in order (end-of-reply
        tokens left out); empty when the turn asked for none."""
        new = tuple(p for p in self._logprobs[self._logprobs_taken : self._logprobs_released] if p is not None)
        self._logprobs_taken = self._logprobs_released
        return new

    @property
    def logprobs(self) -> tuple[TokenLogprob, ...]:
        """Every reply token's scores so far (end-of-reply tokens left out)."""
        return tuple(p for p in self._logprobs[: self._logprobs_released] if p is not None)

    # -- tool calls ---------------------------------------------------------------
    @property
    def content(self) -> str | None:
        """The reply without its tool calls (None: this turn does not parse them)."""
        return self._splitter.content if self._splitter is not None else None

    def take_tool_calls(self) -> tuple[ToolCall, ...]:
        """The tool calls completed since the last call, in order (after the text :meth:`accept` returned)."""
        new = tuple(self.tool_calls[self._calls_taken :])
        self._calls_taken = len(self.tool_calls)
        return new

    def _split(self, delta: str, *, final: bool) -> str:
        assert self._splitter is not None
        text, calls = self._splitter.feed(delta)
        if final:
            rest, more = self._splitter.finish()
            if not calls:
                text += rest
            # else: ``rest`` follows a call; it is in ``content``, which a stream's end delivers after the calls
            calls += more
            if (calls or self.tool_calls) and self.finish_reason == "stop":
                self.finish_reason = "tool_calls"
        self.tool_calls.extend(calls)
        return text

    # -- parking ----------------------------------------------------------------
    def park(self, *, keep_float: bool = False, wait: bool = True) -> ParkedCache | None:
        """Freeze the cache over the prompt and the reply tokens whose KV exists.

        ``keep_float``: keep the float buffers with it (:mod:`runtime.kv.float_resident`);
        the sequence is done with them then. ``wait``: see :meth:`runtime.kv.kvstate.ActiveKV.park`.

        The last sampled token never went through the model, and tokens past a
        stop string are not part of the reply, so both are left out. Returns None
        when the cache cannot be kept (a sliding window could not be trimmed).
        """
        fed = self.generated[:-1] if self.generated else []
        ends = self._gen_ends[: len(fed)]
        keep = 0
        while keep < len(fed) and 0 <= ends[keep] <= len(self.reply):
            keep += 1
        token_ids = self.token_ids + fed[:keep]
        offsets = self.offsets + [len(self.prompt) + e for e in ends[:keep]]
        text = self.prompt + self.reply[: ends[keep - 1]] if keep else self.prompt
        return self.kv.park(text=text, token_ids=token_ids, offsets=offsets, keep_float=keep_float, wait=wait)

    def _text(self) -> str:
        raw = self._detok.text
        if self._lead is None and raw:
            self._lead = self._restored_space(raw)
        return (self._lead or "") + raw

    def _restored_space(self, raw: str) -> str:
        """The leading space mlx-lm's detokenizers drop from a reply's first token.

        After a prompt that ends in whitespace (ChatML's ``assistant\\n``) the space
        stays dropped, as mlx-lm returns it. After one that does not (a raw
        prompt, or ``Assistant:``) it is put back, so ``prompt + reply`` is exactly
        the text the model produced and a client that appends the reply to its
        prompt extends the cache instead of diverging from it.
        """
        if raw.startswith(" ") or not self.prompt or self.prompt[-1:].isspace():
            return ""
        piece = self.lm.tokenizer._tokenizer.convert_ids_to_tokens(self.generated[0])
        return " " if isinstance(piece, str) and piece[:1] in ("\u2581", "\u0120", " ") else ""
